"""The storage codecs of ragged token keys, in one table: :data:`CODECS` maps a codec's name to its
class, and :func:`check_codec` parses the name a cache records (``"fp8_e4m3"``,
``"topk_index:151936"``) into a :class:`Codec`, once per process. A codec says what it stores per
token, how it encodes and decodes, and what it checks; nothing outside this module branches on a
codec's name (the format: docs/offline_cache.md, "Ragged token keys and fp8 storage").
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch

from te_thd.offline_cache.format.fp8 import decode_fp8_into
from te_thd.offline_cache.format.schema import dtype_name

#: ``(role, stored dtype, per-token shape)`` of one tensor a codec stores
Part = tuple[str, torch.dtype, tuple[int, ...]]
_BITS = torch.arange(8, dtype=torch.uint8)


class Codec(ABC):
    """How a ragged key is stored. ``name``: the name a cache records. Class attributes: ``BASE``,
    the name :data:`CODECS` files it under; ``FORM``, how it is spelled in messages; ``DTYPES``,
    the logical dtypes it stores, and ``STORES`` / ``STORE_AS``, the same in words; ``lossy``,
    whether it loses precision (what it lost is then recorded per shard)."""

    name: str
    BASE: ClassVar[str]
    FORM: ClassVar[str]
    DTYPES: ClassVar[tuple[torch.dtype, ...]]
    STORES: ClassVar[str]
    STORE_AS: ClassVar[str]
    lossy: ClassVar[bool] = False

    @classmethod
    def parse(cls, sep: str, arg: str) -> Codec | None:
        """The codec of name ``BASE + sep + arg``; None when the name is not this codec's form,
        ``ValueError`` (the reason) when its argument is wrong. A codec takes none by default."""
        return None if sep else cls()

    @classmethod
    def full_name(cls, vocab_size: int | None) -> str | None:
        """The name a cache records for this codec of a model of ``vocab_size`` tokens (None:
        none without it)."""
        return cls.BASE

    @abstractmethod
    def stored_parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Part]:
        """The tensors stored for a key of logical ``dtype`` and per-token ``shape``."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``({role: stored tensor [T, ...]}, rel_err)`` of tokens ``x`` (``[T, *per_token]``):
        ``rel_err`` float32 ``[T]`` for a lossy codec, None for a lossless one. Values
        :meth:`out_of_range` finds must not reach it."""

    @abstractmethod
    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The logical tokens ``[T, *per_token]`` of ``dtype`` from the stored tensors ``{role:
        [T, ...]}`` (any tokens of them: a CP rank reads a few)."""

    @abstractmethod
    def describe(self, dtype: torch.dtype) -> str:
        """How this codec stores a key of logical ``dtype``, for ``te-thd cache info``."""

    def check_dtype(self, key: str, dtype: torch.dtype) -> None:
        """``ValueError`` naming ``key`` when this codec cannot store ``dtype``."""
        if dtype not in self.DTYPES:
            raise ValueError(
                f"codecs[{key!r}]={self.name!r} stores {self.STORES}; {key!r} is "
                f"{dtype_name(dtype)}. Drop the codec for it, or store it as {self.STORE_AS}"
            )

    def out_of_range(self, x: torch.Tensor) -> tuple[int, int] | None:
        """``(token, value)`` of the first value of ``x`` (``[T, *per_token]``) this codec cannot
        store, or None."""
        return None

    def range_problem(self, key: str, value: int) -> str:
        """What is wrong with ``value`` of ``key`` (one :meth:`out_of_range` found), and the fix."""
        raise NotImplementedError(self.name)


class Fp8E4M3(Codec):
    """Float tokens as float8_e4m3fn ``x / scale``, with one float32 scale per token
    (``max|x| / 448``, 1 for an all-zero token)."""

    BASE = FORM = name = "fp8_e4m3"
    DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    STORES, STORE_AS = "float keys", "a float"
    lossy = True
    MAX = 448.0

    def stored_parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Part]:
        return [("tokens", torch.float8_e4m3fn, shape), ("scale", torch.float32, ())]

    def encode(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``tokens`` float8_e4m3fn ``[T, *per_token]``, ``scale`` float32 ``[T]``; ``rel_err``
        ``|x - decoded| / |x|`` per token, 0 for an all-zero token."""
        # (a reshape to -1 would be ambiguous for 0 tokens)
        flat = x.reshape(x.shape[0], math.prod(x.shape[1:])).to(torch.float32)
        amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(flat.shape[0])
        scale = torch.where(amax > 0, amax / self.MAX, torch.ones_like(amax))
        q = (flat / scale[:, None]).clamp_(-self.MAX, self.MAX).to(torch.float8_e4m3fn)
        back = q.to(torch.float32) * scale[:, None]
        norm = flat.norm(dim=1)
        err = torch.where(
            norm > 0, (flat - back).norm(dim=1) / norm.clamp_min(1e-30), torch.zeros_like(norm)
        )
        return {"tokens": q.reshape(x.shape), "scale": scale.contiguous()}, err

    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q = parts["tokens"]
        return decode_fp8_into(q, parts["scale"], torch.empty(q.shape, dtype=dtype))

    def describe(self, dtype: torch.dtype) -> str:
        return f"{self.name} + float32 scale per token (logical {dtype_name(dtype)})"


class TopkIndex(Codec):
    """Indices (int32/int64, each in ``[0, vocab)``) in the bits the vocabulary needs: int16 up to
    65,536 tokens; int16 plus role ``high``, uint8 ``[T, ceil(n / 8)]`` holding bit 16 of each of
    the ``n`` indices of a token (bit ``j % 8`` of byte ``j // 8``), up to 131,072; int32 above.
    The low 16 bits are kept as a signed type because torch indexes uint16 tensors on few paths."""

    BASE, FORM = "topk_index", "topk_index:<vocabulary size>"
    DTYPES = (torch.int32, torch.int64)
    STORES, STORE_AS = "int32 or int64 index keys", "int64"
    #: the largest vocabulary it holds (its widest form is int32)
    MAX_VOCAB = 2**31

    @classmethod
    def parse(cls, sep: str, arg: str) -> Codec | None:
        if not sep or not arg.isdecimal() or not 1 <= int(arg) <= cls.MAX_VOCAB:
            raise ValueError(
                f"the vocabulary size must be an int in [1, {cls.MAX_VOCAB}], "
                f"e.g. '{cls.BASE}:151936'"
            )
        return cls(int(arg))

    @classmethod
    def full_name(cls, vocab_size: int | None) -> str | None:
        return None if vocab_size is None else f"{cls.BASE}:{vocab_size}"

    def __init__(self, vocab: int) -> None:
        self.vocab, self.name = vocab, f"{self.BASE}:{vocab}"
        #: bits stored per index
        self.bits = 16 if vocab <= 1 << 16 else 17 if vocab <= 1 << 17 else 32

    def stored_parts(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Part]:
        if self.bits == 32:
            return [("tokens", torch.int32, shape)]
        high_bytes = -(-math.prod(shape) // 8)
        high = [("high", torch.uint8, (high_bytes,))] if self.bits == 17 and high_bytes else []
        return [("tokens", torch.int16, shape), *high]

    def encode(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        x32 = x.to(torch.int32)
        if self.bits == 32:
            return {"tokens": x32.contiguous()}, None
        low = x32 & 0xFFFF
        # the same 16 bits, as a signed int
        out = {"tokens": (low - ((low & 0x8000) << 1)).to(torch.int16)}
        n = math.prod(x.shape[1:])
        if self.bits == 17 and n:
            t, nbytes = x.shape[0], -(-n // 8)
            high = torch.zeros(t, nbytes * 8, dtype=torch.uint8)
            high[:, :n] = (x32.reshape(t, n) >> 16).to(torch.uint8)
            out["high"] = (high.view(t, nbytes, 8) << _BITS).sum(dim=2).to(torch.uint8)
        return out, None

    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        low = parts["tokens"]
        if low.dtype == torch.int32:
            return low.to(dtype)
        x = low.to(torch.int32) & 0xFFFF
        high = parts.get("high")
        if high is not None:
            t, n = low.shape[0], math.prod(low.shape[1:])
            bits = ((high.unsqueeze(2) >> _BITS) & 1).reshape(t, 8 * high.shape[1])[:, :n]
            x = x | (bits.to(torch.int32) << 16).reshape(low.shape)
        return x.to(dtype)

    def describe(self, dtype: torch.dtype) -> str:
        form = {16: "", 17: ": 16 + 1 packed high bit", 32: ": int32"}[self.bits]
        return f"{self.name}, {self.bits} bits per index{form} (logical {dtype_name(dtype)})"

    def out_of_range(self, x: torch.Tensor) -> tuple[int, int] | None:
        if x.numel() == 0:
            return None
        flat = x.reshape(x.shape[0], -1)
        bad = flat < 0
        if self.vocab <= torch.iinfo(flat.dtype).max:  # (a Python int past the dtype would wrap)
            bad |= flat >= self.vocab
        rows = torch.nonzero(bad.any(dim=1)).view(-1)
        if rows.numel() == 0:
            return None
        t = int(rows[0])
        return t, int(flat[t][bad[t]][0])

    def range_problem(self, key: str, value: int) -> str:
        fix = (
            "an index is a vocabulary id: store a real id in its place (e.g. 0, masked by the "
            "log-prob), or drop the codec"
            if value < 0
            else "give the codec the vocabulary size of the model that produced it, "
            f"codecs={{{key!r}: {self.FORM!r}}}"
        )
        return (
            f"key {key!r} holds index {value}, outside [0, {self.vocab}) of "
            f"codecs[{key!r}]={self.name!r}: {fix}"
        )


#: the codecs, by the name before a ``:`` (an index codec's full name carries its vocabulary)
CODECS: dict[str, type[Codec]] = {c.BASE: c for c in (Fp8E4M3, TopkIndex)}
#: how a codec is spelled, for messages
CODEC_FORMS = " or ".join(repr(c.FORM) for c in CODECS.values())


@functools.cache
def _parse(name: str) -> Codec | None:
    base, sep, arg = name.partition(":")
    kind = CODECS.get(base)
    return None if kind is None else kind.parse(sep, arg)


def check_codec(key: str, name: object) -> Codec:
    """The codec a cache records as ``name``, parsed once per process; ``ValueError`` naming
    ``key`` when ``name`` is not one."""
    why = ""
    try:
        codec = _parse(name) if isinstance(name, str) else None
    except ValueError as exc:
        codec, why = None, f" ({exc})"
    if codec is None:
        raise ValueError(f"codecs[{key!r}]={name!r} is not a storage codec{why}; use {CODEC_FORMS}")
    return codec


def is_codec(name: object) -> bool:
    """Whether ``name`` is a codec's recorded name (:func:`check_codec` accepts it)."""
    try:
        check_codec("", name)
    except ValueError:
        return False
    return True
