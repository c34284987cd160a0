"""Ragged token keys: which keys a cache stores without padding, where their tokens sit in a
shard, and which codec of :mod:`~te_thd.offline_cache.format.codecs` stores each (the format:
docs/offline_cache.md, "Ragged token keys and fp8 storage"; its checksums: docs/integrity.md,
"Ragged shards: block checksums").

A ragged key ``hidden`` is stored as every sample's real tokens back to back, shard tensor
``"hidden@tokens"`` ``[T, *per_token]``, plus a codec's ``"<key>@<role>"`` tensors
(:meth:`~te_thd.offline_cache.format.codecs.Codec.stored_parts`). The names differ from the
logical key on purpose: a reader that does not know the layout finds no tensor called ``hidden``
and fails, instead of reading token ``i`` as sample ``i`` (so too ``format_version``
``"<version>+tokens"``). Row ``i`` is tokens ``[offsets[i], offsets[i+1])``; each row is cut into
checksum blocks of ``block_tokens``, so a read of a few tokens (one CP rank's share) fetches and
verifies only the blocks that hold them.

Everything here is pure layout math on numpy arrays, used by the shard serialiser and the read
planner.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from te_thd.args import check_names
from te_thd.offline_cache.format.codecs import CODEC_FORMS, Codec, check_codec, is_codec
from te_thd.offline_cache.format.schema import TensorSpec, tensor_nbytes

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

    def codec(self, key: str) -> Codec | None:
        name = dict(self.codecs).get(key)
        return None if name is None else check_codec(key, name)

    @property
    def lossy_keys(self) -> list[str]:
        """The keys whose codec loses precision (what it lost is recorded per shard)."""
        return [k for k, name in self.codecs if check_codec(k, name).lossy]

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
            dtype, shape, codec = schema[key].dtype, schema[key].shape[1:], self.codec(key)
            parts = (
                [("tokens", dtype, shape)] if codec is None else codec.stored_parts(dtype, shape)
            )
            out += [StoredTensor(f"{key}@{r}", key, r, d, s) for r, d, s in parts]
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
        if (codec := layout.codec(key)) is not None:
            codec.check_dtype(key, spec.dtype)
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
    return "ragged" if codec is None else f"ragged, {codec.describe(schema[key].dtype)}"


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
