"""Ragged token keys: which keys a cache stores without padding, where their tokens sit in a
shard, and the codecs that may store them (the format: docs/offline_cache.md, "Ragged token
keys and fp8 storage"; its checksums: docs/integrity.md, "Ragged shards: block checksums").

A ragged key ``hidden`` is stored as every sample's real tokens back to back, shard tensor
``"hidden@tokens"`` ``[T, *per_token]``, plus a codec's ``"<key>@<role>"`` tensors
(:func:`stored_parts`). The names differ from the logical key on purpose: a reader that does not
know the layout finds no tensor called ``hidden`` and fails, instead of reading token ``i`` as
sample ``i`` (so too ``format_version`` ``"<version>+tokens"``). Row ``i`` is tokens
``[offsets[i], offsets[i+1])``; each row is cut into checksum blocks of ``block_tokens``, so a
read of a few tokens (one CP rank's share) fetches and verifies only the blocks that hold them.

Everything here is pure: layout math on numpy arrays and codecs on tensors, used by the shard
serialiser and the read planner.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from te_thd.args import check_names
from te_thd.offline_cache.format.fp8 import decode_fp8_into
from te_thd.offline_cache.format.schema import TensorSpec, tensor_nbytes

# -- codecs ---------------------------------------------------------------------------

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
    """``V`` of an index codec ``"topk_index:<V>"``; ``None`` for another name. ``ValueError`` when
    ``V`` is not a decimal int in ``[1, 2**31]``."""
    name, sep, vocab = codec.partition(":")
    if name != INDEX:
        return None
    if not sep or not vocab.isdecimal() or not 1 <= int(vocab) <= MAX_VOCAB:
        raise ValueError(
            f"the vocabulary size must be an int in [1, {MAX_VOCAB}], e.g. '{INDEX}:151936'"
        )
    return int(vocab)


def full_name(codec: str, vocab_size: int | None) -> str | None:
    """The name a cache records for codec ``codec`` of :data:`CODECS`: an index codec carries the
    vocabulary (``"topk_index:<vocab_size>"``; ``None`` when no ``vocab_size`` is known), another
    its own name."""
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
            f"codecs[{key!r}]={codec!r} stores {what}; {key!r} is "
            f"{str(dtype).removeprefix('torch.')}. "
            f"Drop the codec for it, or store it as {'int64' if index else 'a float'}"
        )


def index_bits(vocab: int) -> int:
    """Bits stored per index of a vocabulary of ``vocab`` tokens: 16, 17 or 32."""
    return 16 if vocab <= 1 << 16 else 17 if vocab <= 1 << 17 else 32


def stored_parts(
    codec: str | None, dtype: torch.dtype, shape: tuple[int, ...]
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``[(role, stored dtype, per-token shape)]`` of a ragged key of logical ``dtype`` and
    per-token ``shape``."""
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
    """``(token, value)`` of the first index of ``x`` (``[T, *per_token]``) outside what ``codec``
    stores, or None."""
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
        fix = (
            "an index is a vocabulary id: store a real id in its place (e.g. 0, masked by "
            "the log-prob), or drop the codec"
        )
    else:
        fix = (
            "give the codec the vocabulary size of the model that produced it, "
            f"codecs={{{key!r}: '{INDEX}:<vocabulary size>'}}"
        )
    return (
        f"key {key!r} holds index {value}, outside [0, {vocab}) of codecs[{key!r}]={codec!r}: {fix}"
    )


def encode(codec: str, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``({role: stored tensor [T, ...]}, rel_err)`` of tokens ``x`` (``[T, *per_token]``):
    ``rel_err`` float32 ``[T]`` for a lossy codec, None for a lossless one. An index codec's indices
    must be in range (:func:`out_of_range`)."""
    vocab = index_vocab(codec)
    if vocab is None:
        q, scale, err = encode_fp8(x)
        return {"tokens": q, "scale": scale}, err
    return encode_index(x, vocab), None


def decode(codec: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The logical tokens ``[T, *per_token]`` of ``dtype`` from a codec's stored tensors ``{role:
    [T, ...]}``."""
    if index_vocab(codec) is None:
        return decode_fp8(parts["tokens"], parts["scale"], dtype)
    return decode_index(parts, dtype)


def encode_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, rel_err)`` of tokens ``x`` (``[T, *per_token]`` float): ``q`` float8_e4m3fn
    ``[T, *per_token]`` (``x / scale``), ``scale`` float32 ``[T]`` (``max|x| / 448``, 1 for an
    all-zero token), ``rel_err`` float32 ``[T]`` (``|x - decoded| / |x|``, 0 for an all-zero
    token)."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:])).to(
        torch.float32
    )  # (-1 is ambiguous for 0 tokens)
    amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(flat.shape[0])
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (flat / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    back = q.to(torch.float32) * scale[:, None]
    norm = flat.norm(dim=1)
    err = torch.where(
        norm > 0, (flat - back).norm(dim=1) / norm.clamp_min(1e-30), torch.zeros_like(norm)
    )
    return q.reshape(x.shape), scale.contiguous(), err


def decode_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logical tokens ``[T, *per_token]`` of ``dtype`` from stored ``q`` and ``scale`` (float32
    ``[T]``)."""
    return decode_fp8_into(q, scale, torch.empty(q.shape, dtype=dtype))


def encode_index(x: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    """``{role: stored tensor}`` of indices ``x`` (``[T, *per_token]`` int32/int64, each in ``[0,
    vocab)``): ``tokens`` ``[T, *per_token]`` (int16, or int32 above 131,072) and, for 17 bits,
    ``high`` uint8 ``[T, ceil(n / 8)]`` (``n`` indices per token, bit ``j % 8`` of byte ``j // 8``).
    The low 16 bits are kept as a signed type because torch indexes uint16 tensors on few paths."""
    x32 = x.to(torch.int32)
    bits = index_bits(vocab)
    if bits == 32:
        return {"tokens": x32.contiguous()}
    low = x32 & 0xFFFF
    out = {
        "tokens": (low - ((low & 0x8000) << 1)).to(torch.int16)
    }  # the same 16 bits, as a signed int
    n = math.prod(x.shape[1:])
    if bits == 17 and n:
        t, nbytes = x.shape[0], -(-n // 8)
        high = torch.zeros(t, nbytes * 8, dtype=torch.uint8)
        high[:, :n] = (x32.reshape(t, n) >> 16).to(torch.uint8)
        out["high"] = (high.view(t, nbytes, 8) << _BITS).sum(dim=2).to(torch.uint8)
    return out


def decode_index(parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Indices ``[T, *per_token]`` of ``dtype`` from :func:`encode_index`'s ``{role: stored
    tensor}``."""
    low = parts["tokens"]
    if low.dtype == torch.int32:
        return low.to(dtype)
    x = low.to(torch.int32) & 0xFFFF
    high = parts.get("high")
    if high is not None:
        t, n = low.shape[0], math.prod(low.shape[1:])
        bits = (
            ((high.unsqueeze(2) >> _BITS) & 1).reshape(t, 8 * high.shape[1])[:, :n].to(torch.int32)
        )
        x = x | (bits << 16).reshape(low.shape)
    return x.to(dtype)


# -- the token layout -------------------------------------------------------------------

#: suffix of a ragged key's tensor of tokens (a codec's other tensors are ``@<role>``)
TOKENS_SUFFIX = "@tokens"
#: the tensor holding every ragged tensor's block checksums (uint64), stored last
BLOCK_SUMS = "__te_thd_block_sums__"
#: target bytes of one checksum block: about a page, the unit storage reads anyway
BLOCK_BYTES = 4096
#: the manifest field recording the layout (``manifest.FORMAT_TAG`` tags its ``format_version``)
TOKEN_LAYOUT_KEY = "token_layout"


@dataclass(frozen=True)
class StoredTensor:
    """One ragged tensor of a shard: ``name`` holds ``[T, *shape]`` of ``dtype`` for logical
    ``key``."""

    name: str
    key: str
    role: str  # "tokens", or a codec's other part ("scale", "high")
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def token_bytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def block_tokens(self) -> int:
        return max(1, BLOCK_BYTES // max(1, self.token_bytes))


@dataclass(frozen=True)
class TokenLayout:
    """The keys a cache stores ragged, and the codec of each (``None``: stored as is)."""

    keys: tuple[str, ...]
    codecs: tuple[tuple[str, str], ...] = ()

    def codec(self, key: str) -> str | None:
        return dict(self.codecs).get(key)

    def to_json(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "codecs": dict(self.codecs)}

    @classmethod
    def from_json(cls, obj: Any) -> TokenLayout:
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("keys"), list)
            or not obj["keys"]
            or not all(isinstance(k, str) for k in obj["keys"])
            or not isinstance(obj.get("codecs", {}), dict)
            or not all(is_codec(v) for v in obj.get("codecs", {}).values())
            or not set(obj.get("codecs", {})) <= set(obj["keys"])
        ):
            raise ValueError(
                f"token layout {obj!r} is not {{'keys': [str, ...], 'codecs': {{key: "
                f"{CODEC_FORMS}}}}}"
            )
        return cls(tuple(obj["keys"]), tuple(sorted(obj.get("codecs", {}).items())))

    def stored(self, schema: Mapping[str, TensorSpec]) -> list[StoredTensor]:
        """The ragged tensors of a shard, in file order: the key with the most bytes per token first
        (the writer streams it straight into the shard), then the others by name."""
        out = []
        for key in self.keys:
            spec = schema[key]
            for role, dtype, shape in stored_parts(self.codec(key), spec.dtype, spec.shape[1:]):
                out.append(StoredTensor(f"{key}@{role}", key, role, dtype, shape))
        return sorted(out, key=lambda s: (-s.token_bytes, s.name))


def check_token_keys(
    token_keys: Sequence[str], codecs: Mapping[str, str] | None, keys: Sequence[str]
) -> TokenLayout | None:
    """The :class:`TokenLayout` of a producer's ``token_keys`` / ``codecs`` (``None``: none ragged).

    ``ValueError`` naming the argument when a token key is not stored, a name holds
    ``@`` (reserved for the ragged tensors' names), or a codec is unknown or names a
    key that is not a token key.
    """
    token_keys = check_names("token_keys", token_keys)
    codecs = dict(codecs or {})
    unknown = [k for k in token_keys if k not in keys]
    if unknown:
        raise ValueError(
            f"token_keys {unknown} are not stored keys {list(keys)}; name keys shaped [n, "
            "L, ...] from keys"
        )
    for k in keys:
        if "@" in k:
            raise ValueError(
                f"key {k!r} holds '@', which ragged caches reserve for their tensor "
                "names; rename the key"
            )
    for k, c in codecs.items():
        check_codec(k, c)
        if k not in token_keys:
            raise ValueError(
                f"codecs names {k!r}, which is not in token_keys={token_keys}; a codec "
                "applies to a ragged "
                f"token key: add {k!r} to token_keys"
            )
    if not token_keys:
        return None
    return TokenLayout(tuple(dict.fromkeys(token_keys)), tuple(sorted(codecs.items())))


def check_token_schema(layout: TokenLayout, schema: Mapping[str, TensorSpec]) -> int:
    """``L``, the shared padded length of every token key (``[n, L, ...]``); ``ValueError``
    otherwise."""
    widths = {}
    for key in layout.keys:
        spec = schema[key]
        if not spec.shape:
            raise ValueError(
                f"token key {key!r} is {spec.describe()}; a token key is [n, L, ...] (one "
                "row per token)"
            )
        check_codec_dtype(key, spec.dtype, layout.codec(key))
        widths[key] = spec.shape[0]
    if len(set(widths.values())) > 1:
        raise ValueError(
            f"token keys have different padded lengths {widths}; every token key is [n, "
            "L, ...] with one L"
        )
    return next(iter(widths.values()))


# -- offsets and blocks -----------------------------------------------------------------


def row_offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 ``[rows + 1]``: row ``i``'s tokens are ``[out[i], out[i+1])``."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def encode_offsets(offsets: np.ndarray) -> str:
    return base64.b64encode(np.asarray(offsets, dtype="<i8").tobytes()).decode("ascii")


def decode_offsets(text: str, rows: int) -> np.ndarray:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    out = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    if out.size != rows + 1 or out[0] != 0 or np.any(np.diff(out) < 0):
        raise ValueError(f"token offsets must be {rows + 1} non-decreasing ints from 0")
    return out


@dataclass(frozen=True)
class BlockTable:
    """The checksum blocks of one ragged tensor.

    ``row_first``: int64 ``[rows + 1]``, row ``i``'s blocks are ``[row_first[i], row_first[i+1])``;
    ``start``: int64 ``[blocks + 1]``, block ``g`` is tokens ``[start[g], start[g+1])``.
    """

    block_tokens: int
    row_first: np.ndarray
    start: np.ndarray

    @property
    def blocks(self) -> int:
        return int(self.row_first[-1])


def block_table(offsets: np.ndarray, block_tokens: int) -> BlockTable:
    """The blocks of a tensor whose rows are ``offsets`` (:func:`row_offsets`), ``block_tokens``
    each."""
    lengths = np.diff(offsets)
    counts = -(-lengths // block_tokens)
    row_first = row_offsets(counts)
    total = int(row_first[-1])
    within = np.arange(total, dtype=np.int64) - np.repeat(row_first[:-1], counts)
    start = np.empty(total + 1, dtype=np.int64)
    start[:-1] = np.repeat(offsets[:-1], counts) + within * block_tokens
    start[-1] = offsets[-1]
    return BlockTable(block_tokens, row_first, start)


@dataclass(frozen=True)
class TokenReadPlan:
    """How to fetch tokens of one ragged tensor: block ``runs`` ``[(g0, g1), ...]`` (each one
    contiguous read of tokens ``[start[g0], start[g1])``, back to back in the read buffer) and
    ``where``: int64 ``[M]``, each wanted token's position in that buffer."""

    runs: list[tuple[int, int]]
    where: np.ndarray
    tokens: int  # tokens the runs read


def plan_token_reads(
    table: BlockTable,
    offsets: np.ndarray,
    rows: np.ndarray,
    pos: np.ndarray,
    max_gap_tokens: int = 0,
) -> TokenReadPlan:
    """The blocks to read for tokens ``pos`` (int64 ``[M]``, each < its row's length) of rows
    ``rows``.

    Blocks are whole (that is what is verified), each read once. Adjacent blocks are one run, and
    so are blocks whose gap holds at most ``max_gap_tokens`` tokens (the gap is read too: below
    a page it costs no more storage reads than two requests would, and saves one).
    """
    rows = np.asarray(rows, dtype=np.int64)
    pos = np.asarray(pos, dtype=np.int64)
    if rows.size == 0:
        return TokenReadPlan([], np.zeros(0, np.int64), 0)
    g = table.row_first[rows] + pos // table.block_tokens
    blocks, inverse = np.unique(g, return_inverse=True)
    gap = (
        table.start[blocks[1:]] - table.start[blocks[:-1] + 1]
    )  # tokens between consecutive wanted blocks
    breaks = np.flatnonzero(gap > max_gap_tokens) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks, [blocks.size])) - 1
    run_first, run_last = blocks[firsts], blocks[lasts]
    runs = list(zip(run_first.tolist(), (run_last + 1).tolist(), strict=True))
    # a run reads tokens [start[first], start[last + 1]); runs are laid out back to back in the
    # buffer
    sizes = table.start[run_last + 1] - table.start[run_first]
    buf_start = np.zeros(len(runs), dtype=np.int64)
    np.cumsum(sizes[:-1], out=buf_start[1:])
    run_of = np.repeat(np.arange(len(runs)), lasts - firsts + 1)[inverse]
    where = buf_start[run_of] + (offsets[rows] + pos - table.start[run_first[run_of]])
    return TokenReadPlan(runs, where, int(sizes.sum()))


def plan_row_reads(
    table: BlockTable, offsets: np.ndarray, rows: np.ndarray, max_gap_tokens: int = 0
) -> TokenReadPlan:
    """:func:`plan_token_reads` of every token of rows ``rows`` (int64 ``[n]``; the wanted tokens
    are row ``rows[0]``'s, then ``rows[1]``'s, ...), planned per row: row ``r``'s blocks are
    ``row_first[r:r + 2]``."""
    rows = np.asarray(rows, dtype=np.int64)
    lens = offsets[rows + 1] - offsets[rows]
    u = np.unique(rows[lens > 0])
    if u.size == 0:
        return TokenReadPlan([], np.zeros(0, np.int64), 0)
    first, end = offsets[u], offsets[u + 1]
    breaks = np.flatnonzero(first[1:] - end[:-1] > max_gap_tokens) + 1
    firsts, lasts = np.concatenate(([0], breaks)), np.concatenate((breaks, [u.size])) - 1
    runs = list(
        zip(
            table.row_first[u[firsts]].tolist(), table.row_first[u[lasts] + 1].tolist(), strict=True
        )
    )
    sizes = end[lasts] - first[firsts]
    run_of = np.repeat(np.arange(len(runs)), lasts - firsts + 1)
    base = ((np.cumsum(sizes) - sizes)[run_of] + first - first[firsts][run_of])[
        np.minimum(np.searchsorted(u, rows), u.size - 1)
    ]
    return TokenReadPlan(runs, token_places(base, lens), int(sizes.sum()))


def token_places(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """int64 ``[sum(lens)]``: the place of every token of rows of ``lens`` tokens, row ``i``'s from
    ``starts[i]`` on."""
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(
        int(lens.sum()), dtype=np.int64
    )


#: bytes of storage read in one request at least: gaps below it are read rather than skipped
PAGE_BYTES = 4096


def describe_stored(layout: TokenLayout, schema: Mapping[str, TensorSpec], key: str) -> str:
    """How ``key`` is stored, for ``te-thd cache info``: ``"ragged"`` or ``"ragged, fp8_e4m3 +
    float32 scale"``."""
    codec = layout.codec(key)
    return "ragged" if codec is None else f"ragged, {describe(codec, schema[key].dtype)}"


class TokenFields:
    """The ragged fields of a token shard's header (the ``tokens`` JSON object of its te_thd
    fields), read here and nowhere else; ``rows``: the shard's rows.

    Each field is parsed when first asked for (a reader of the lengths needs only the offsets)
    and raises ``KeyError``, ``TypeError`` or ``ValueError`` when it is malformed.
    """

    def __init__(self, raw: Mapping[str, Any], rows: int) -> None:
        self.raw, self.rows = raw, rows

    @property
    def stored(self) -> dict[str, dict[str, Any]]:
        """``{stored tensor name: {"key", "role", "block_tokens"}}``."""
        return self.raw["stored"]

    @property
    def ragged(self) -> set[str]:
        """The header entries these fields cover: every stored tensor and the block sums."""
        return set(self.stored) | {self.raw.get("block_sums")}

    @cached_property
    def logical(self) -> dict[str, TensorSpec]:
        """``{key: TensorSpec}`` (logical, ``[L, ...]`` per sample) of the ragged keys."""
        logical = self.raw.get("logical")
        if not isinstance(logical, dict) or not logical:
            raise ValueError("the token fields name no logical keys")
        return {k: TensorSpec.from_json(v) for k, v in logical.items()}

    @cached_property
    def layout(self) -> TokenLayout:
        return TokenLayout.from_json(self.raw["layout"])

    @cached_property
    def offsets(self) -> np.ndarray:
        """int64 ``[rows + 1]``: row ``i``'s tokens are ``[offsets[i], offsets[i + 1])``."""
        return decode_offsets(self.raw["offsets"], self.rows)

    @property
    def length_rule(self) -> Any:
        """The JSON of the length rule that cut the rows (``LengthRule.from_json`` reads it)."""
        return self.raw.get("length_rule")

    @property
    def sums_digest(self) -> str:
        """The recorded digest of the block sums tensor."""
        return str(self.raw.get("block_sums_digest"))

    @property
    def fidelity(self) -> dict[str, dict[str, float]] | None:
        """The recorded codec losses, as the manifest records them (None: none)."""
        fid = self.raw.get("fidelity") or {}
        return {k: {m: float(v) for m, v in d.items()} for k, d in fid.items()} or None
