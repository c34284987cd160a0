"""Storage codecs of ragged token keys: what is stored for a key, and the logical tensor read back.

A codec turns a ragged key's tokens ``x`` (``[T, *per_token]``) into one or more
stored tensors, each ``[T, ...]`` and named ``"<key>@<role>"`` in the shard
(:func:`stored_parts`; ``role`` ``"tokens"`` first). The checksums cover the stored
bytes of every one, and a reader returns the logical dtype and shape.

``fp8_e4m3``: each token's vector ``x`` (a float dtype) is stored as
``float8_e4m3fn`` ``q = x / s`` (role ``tokens``) with one float32 scale per token
(role ``scale``), ``s = max|x| / 448`` (448 is e4m3's largest finite value; an
all-zero token has ``s = 1``), the recipe vLLM ``speculators`` ships for hidden
states. A reader returns ``(q.float() * s).to(logical dtype)``: zeros stay exactly
zero. What the codec lost is measured at write time per token, as the relative L2
error ``|x - decode(encode(x))| / |x|`` (0 for a zero token), and recorded per shard
(max and mean) in the shard header and the manifest.

``topk_index:<V>``: a lossless codec of integer indices (int32 or int64) into a
vocabulary of ``V`` tokens, e.g. the vocabulary ids of each token's top-k
log-probs. Every index must be in ``[0, V)``. ``V`` is part of the codec's name,
so the manifest and every shard header record it and a reader needs nothing
else. It stores the narrowest width that holds ``V`` (:func:`index_bits`): up to
65,536 the low 16 bits (role ``tokens``: int16, the bits of ``x mod 2**16`` -- a signed
type because torch indexes uint16 tensors on few paths); up to 131,072 those plus the
17th bit of each index, packed 8 to a byte per token (uint8 ``[T, ceil(n / 8)]``,
role ``high``; ``n`` indices per token, bit ``j % 8`` of byte ``j // 8``); above
that, int32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

FP8 = "fp8_e4m3"
INDEX = "topk_index"
#: the codecs, by name (an index codec's full name carries its vocabulary: ``"topk_index:151936"``)
CODECS = (FP8, INDEX)
#: how a codec is spelled, for messages
CODEC_FORMS = f"{FP8!r} or '{INDEX}:<vocabulary size>'"
FP8_MAX = 448.0
#: the largest vocabulary an index codec holds (its widest form is int32)
MAX_VOCAB = 2**31
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_BITS = torch.arange(8, dtype=torch.uint8)


def index_vocab(codec: str) -> int | None:
    """``V`` of an index codec ``"topk_index:<V>"``; ``None`` for another name. ``ValueError`` when ``V``
    is not a decimal int in ``[1, 2**31]``."""
    name, sep, vocab = codec.partition(":")
    if name != INDEX:
        return None
    if not sep or not vocab.isdecimal() or not 1 <= int(vocab) <= MAX_VOCAB:
        raise ValueError(f"the vocabulary size must be an int in [1, {MAX_VOCAB}], e.g. '{INDEX}:151936'")
    return int(vocab)


def full_name(codec: str, vocab_size: int | None) -> str | None:
    """The name a cache records for codec ``codec`` of :data:`CODECS`: an index codec carries the
    vocabulary (``"topk_index:<vocab_size>"``; ``None`` when no ``vocab_size`` is known), another its
    own name."""
    if codec != INDEX:
        return codec
    return None if vocab_size is None else f"{INDEX}:{vocab_size}"


def check_codec(key: str, codec: object) -> None:
    """``ValueError`` naming ``key`` when ``codec`` is not a storage codec."""
    try:
        if codec == FP8 or (isinstance(codec, str) and index_vocab(codec) is not None):
            return
        why = ""
    except ValueError as exc:
        why = f" ({exc})"
    raise ValueError(f"codecs[{key!r}]={codec!r} is not a storage codec{why}; use {CODEC_FORMS}")


def is_codec(codec: object) -> bool:
    try:
        check_codec("", codec)
    except ValueError:
        return False
    return True


def check_codec_dtype(key: str, dtype: torch.dtype, codec: str | None) -> None:
    """``ValueError`` naming ``key`` when ``codec`` cannot store ``dtype``."""
    if codec is None:
        return
    index = index_vocab(codec) is not None
    if dtype not in (_INDEX_DTYPES if index else _FLOATS):
        what = "int32 or int64 index keys" if index else "float keys"
        raise ValueError(
            f"codecs[{key!r}]={codec!r} stores {what}; {key!r} is {str(dtype).removeprefix('torch.')}. "
            f"Drop the codec for it, or store it as {'int64' if index else 'a float'}"
        )


def index_bits(vocab: int) -> int:
    """Bits stored per index of a vocabulary of ``vocab`` tokens: 16, 17 or 32."""
    return 16 if vocab <= 1 << 16 else 17 if vocab <= 1 << 17 else 32


def stored_parts(
    codec: str | None, dtype: torch.dtype, shape: tuple[int, ...]
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``[(role, stored dtype, per-token shape)]`` of a ragged key of logical ``dtype`` and per-token ``shape``."""
    if codec is None:
        return [("tokens", dtype, shape)]
    vocab = index_vocab(codec)
    if vocab is None:
        return [("tokens", torch.float8_e4m3fn, shape), ("scale", torch.float32, ())]
    bits = index_bits(vocab)
    if bits == 32:
        return [("tokens", torch.int32, shape)]
    high_bytes = -(-math.prod(shape) // 8)
    high = [("high", torch.uint8, (high_bytes,))] if bits == 17 and high_bytes else []
    return [("tokens", torch.int16, shape), *high]


def is_lossy(codec: str) -> bool:
    """Whether ``codec`` loses precision (what it lost is then recorded per shard)."""
    return codec == FP8


def describe(codec: str, dtype: torch.dtype) -> str:
    """How ``codec`` stores a key, for ``te-thd cache info``."""
    logical = str(dtype).removeprefix("torch.")
    vocab = index_vocab(codec)
    if vocab is None:
        return f"{codec} + float32 scale per token (logical {logical})"
    bits = index_bits(vocab)
    form = {16: "", 17: ": 16 + 1 packed high bit", 32: ": int32"}[bits]
    return f"{codec}, {bits} bits per index{form} (logical {logical})"


def out_of_range(x: torch.Tensor, codec: str) -> tuple[int, int] | None:
    """``(token, value)`` of the first index of ``x`` (``[T, *per_token]``) outside what ``codec`` stores, or None."""
    vocab = index_vocab(codec)
    if vocab is None or x.numel() == 0:
        return None
    flat = x.reshape(x.shape[0], -1)
    bad = flat < 0
    if vocab <= torch.iinfo(flat.dtype).max:  # (a Python int past the dtype's range would wrap)
        bad |= flat >= vocab
    rows = torch.nonzero(bad.any(dim=1)).view(-1)
    if rows.numel() == 0:
        return None
    t = int(rows[0])
    return t, int(flat[t][bad[t]][0])


def range_problem(key: str, codec: str, value: int) -> str:
    """What is wrong with index ``value`` of ``key`` under index codec ``codec``, and the fix."""
    vocab = index_vocab(codec)
    if value < 0:
        fix = "an index is a vocabulary id: store a real id in its place (e.g. 0, masked by the log-prob), or drop the codec"
    else:
        fix = f"give the codec the vocabulary size of the model that produced it, codecs={{{key!r}: '{INDEX}:<vocabulary size>'}}"
    return f"key {key!r} holds index {value}, outside [0, {vocab}) of codecs[{key!r}]={codec!r}: {fix}"


def encode(codec: str, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``({role: stored tensor [T, ...]}, rel_err)`` of tokens ``x`` (``[T, *per_token]``): ``rel_err`` float32
    ``[T]`` for a lossy codec, None for a lossless one. An index codec's indices must be in range (:func:`out_of_range`)."""
    vocab = index_vocab(codec)
    if vocab is None:
        q, scale, err = encode_fp8(x)
        return {"tokens": q, "scale": scale}, err
    return encode_index(x, vocab), None


def decode(codec: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The logical tokens ``[T, *per_token]`` of ``dtype`` from a codec's stored tensors ``{role: [T, ...]}``."""
    if index_vocab(codec) is None:
        return decode_fp8(parts["tokens"], parts["scale"], dtype)
    return decode_index(parts, dtype)


def encode_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, rel_err)`` of tokens ``x`` (``[T, *per_token]`` float): ``q`` float8_e4m3fn
    ``[T, *per_token]``, ``scale`` float32 ``[T]``, ``rel_err`` float32 ``[T]`` (relative L2 error)."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:])).to(torch.float32)  # (-1 is ambiguous for 0 tokens)
    amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(flat.shape[0])
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (flat / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    back = q.to(torch.float32) * scale[:, None]
    norm = flat.norm(dim=1)
    err = torch.where(norm > 0, (flat - back).norm(dim=1) / norm.clamp_min(1e-30), torch.zeros_like(norm))
    return q.reshape(x.shape), scale.contiguous(), err


def decode_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logical tokens ``[T, *per_token]`` of ``dtype`` from stored ``q`` and ``scale`` (float32 ``[T]``)."""
    view = (-1,) + (1,) * (q.dim() - 1)
    return (q.to(torch.float32) * scale.view(view)).to(dtype)


def encode_index(x: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    """``{role: stored tensor}`` of indices ``x`` (``[T, *per_token]`` int32/int64, each in ``[0, vocab)``):
    ``tokens`` ``[T, *per_token]`` (int16, or int32 above 131,072) and, for 17 bits, ``high`` uint8
    ``[T, ceil(n / 8)]`` (``n`` indices per token), as :func:`stored_parts` says."""
    x32 = x.to(torch.int32)
    bits = index_bits(vocab)
    if bits == 32:
        return {"tokens": x32.contiguous()}
    low = x32 & 0xFFFF
    out = {"tokens": (low - ((low & 0x8000) << 1)).to(torch.int16)}  # the same 16 bits, as a signed int
    n = math.prod(x.shape[1:])
    if bits == 17 and n:
        t, nbytes = x.shape[0], -(-n // 8)
        high = torch.zeros(t, nbytes * 8, dtype=torch.uint8)
        high[:, :n] = (x32.reshape(t, n) >> 16).to(torch.uint8)
        out["high"] = (high.view(t, nbytes, 8) << _BITS).sum(dim=2).to(torch.uint8)
    return out


def decode_index(parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Indices ``[T, *per_token]`` of ``dtype`` from :func:`encode_index`'s ``{role: stored tensor}``."""
    low = parts["tokens"]
    if low.dtype == torch.int32:
        return low.to(dtype)
    x = low.to(torch.int32) & 0xFFFF
    high = parts.get("high")
    if high is not None:
        t, n = low.shape[0], math.prod(low.shape[1:])
        bits = ((high.unsqueeze(2) >> _BITS) & 1).reshape(t, 8 * high.shape[1])[:, :n].to(torch.int32)
        x = x | (bits << 16).reshape(low.shape)
    return x.to(dtype)
