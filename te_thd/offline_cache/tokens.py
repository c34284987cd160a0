"""Ragged token keys: which keys a cache stores without padding, and where their tokens sit in a shard.

A cache produced with ``token_keys=("hidden", ...)`` stores each of those keys
(logically ``[n, L, *per_token]``, right-padded) as only every sample's first
``length`` tokens, back to back: shard tensor ``"hidden@tokens"`` is
``[T, *per_token]``, ``T`` the shard's real tokens. A key stored with a codec
(:mod:`~te_thd.offline_cache.codecs`) may have more, ``"<key>@<role>"`` (``@scale``:
one float32 per token of ``fp8_e4m3``; ``@high``: the packed 17th bits of ``topk_index``). The names differ from the logical key on purpose: a reader that does not
know the layout finds no tensor called ``hidden`` and fails, instead of reading
token ``i`` as sample ``i``. For the same reason the manifest's ``format_version``
is written as ``"<version>+tokens"``, which the reference implementation's
``read_manifest`` refuses.

Where each sample's tokens are: the shard header's ``te_thd`` fields hold
``tokens.offsets``, int64 ``[rows + 1]`` (row ``i`` is tokens
``[offsets[i], offsets[i+1])`` of every ragged tensor). The checksums: each
ragged tensor is cut into blocks -- every row into runs of ``block_tokens``
tokens (the last one short), ``block_tokens = max(1, BLOCK_BYTES // token bytes)``
-- and block ``g`` (counted over the tensor) hashes to ``sums[g]`` with seed
``g``. All block sums are one ``uint64`` tensor, :data:`BLOCK_SUMS`, stored last;
its own xxh3 digest is in the header, which the header digest covers, which the
manifest records. So a read of a few tokens (one CP rank's share of a document)
fetches and verifies only the blocks that hold them.

Everything here is pure layout math on numpy arrays, used by the shard writer
(:mod:`~te_thd.offline_cache.shardfile`) and the reader (:mod:`~te_thd.offline_cache.token_read`).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd.args import check_int, check_names
from te_thd.offline_cache.codecs import (
    CODEC_FORMS,
    check_codec,
    check_codec_dtype,
    describe,
    is_codec,
    stored_parts,
)
from te_thd.offline_cache.format import TensorSpec, tensor_nbytes

#: suffix of a ragged key's tensor of tokens (a codec's other tensors are ``@<role>``)
TOKENS_SUFFIX = "@tokens"
#: the tensor holding every ragged tensor's block checksums (uint64), stored last
BLOCK_SUMS = "__te_thd_block_sums__"
#: target bytes of one checksum block: about a page, the unit storage reads anyway
BLOCK_BYTES = 4096
#: the manifest field recording the layout, and the tag on its ``format_version``
TOKEN_LAYOUT_KEY = "token_layout"
FORMAT_TAG = "+tokens"
_TAGGED = re.compile(r"^(\d+)\+tokens$")


@dataclass(frozen=True)
class StoredTensor:
    """One ragged tensor of a shard: ``name`` holds ``[T, *shape]`` of ``dtype`` for logical ``key``."""

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
            raise ValueError(f"token layout {obj!r} is not {{'keys': [str, ...], 'codecs': {{key: {CODEC_FORMS}}}}}")
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
        raise ValueError(f"token_keys {unknown} are not stored keys {list(keys)}; name keys shaped [n, L, ...] from keys")
    for k in keys:
        if "@" in k:
            raise ValueError(f"key {k!r} holds '@', which ragged caches reserve for their tensor names; rename the key")
    for k, c in codecs.items():
        check_codec(k, c)
        if k not in token_keys:
            raise ValueError(
                f"codecs names {k!r}, which is not in token_keys={token_keys}; a codec applies to a ragged "
                f"token key: add {k!r} to token_keys"
            )
    if not token_keys:
        return None
    return TokenLayout(tuple(dict.fromkeys(token_keys)), tuple(sorted(codecs.items())))


def check_token_schema(layout: TokenLayout, schema: Mapping[str, TensorSpec]) -> int:
    """``L``, the shared padded length of every token key (``[n, L, ...]``); ``ValueError`` otherwise."""
    widths = {}
    for key in layout.keys:
        spec = schema[key]
        if not spec.shape:
            raise ValueError(f"token key {key!r} is {spec.describe()}; a token key is [n, L, ...] (one row per token)")
        check_codec_dtype(key, spec.dtype, layout.codec(key))
        widths[key] = spec.shape[0]
    if len(set(widths.values())) > 1:
        raise ValueError(f"token keys have different padded lengths {widths}; every token key is [n, L, ...] with one L")
    return next(iter(widths.values()))


# -- format_version -------------------------------------------------------------------


def stored_format_version(version: int, tagged: bool) -> int | str:
    """What the manifest file records: ``version``, or ``"<version>+tokens"`` for a ragged cache."""
    return f"{version}{FORMAT_TAG}" if tagged else version


def check_format_version_arg(value: Any) -> None:
    """Refuse a reader's ``format_version`` argument that is not an int, saying what to pass: a
    digit string or the manifest's tagged spelling (``"1+tokens"``) never equals the recorded int."""
    version, tagged = parse_format_version(value)
    if tagged:
        raise ValueError(f"format_version={value!r} is how manifest.json records version {version} of a cache with "
                         f"ragged token keys: pass format_version={version}")  # fmt: skip
    if isinstance(value, str) and value.strip().isdigit():
        raise ValueError(f"format_version={value!r} is a str, but the version is an int (the types differ, so it never "
                         f"matches): pass format_version={int(value)}")  # fmt: skip
    check_int("format_version", value, numpy_ints=True, meaning=": the version of what the cached tensors mean, e.g. 1")


def parse_format_version(value: Any) -> tuple[Any, bool]:
    """``(version, tagged)`` of a manifest's recorded ``format_version``."""
    if isinstance(value, str):
        m = _TAGGED.match(value)
        if m:
            return int(m.group(1)), True
    return value, False


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
    """The blocks of a tensor whose rows are ``offsets`` (:func:`row_offsets`), ``block_tokens`` each."""
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
    table: BlockTable, offsets: np.ndarray, rows: np.ndarray, pos: np.ndarray, max_gap_tokens: int = 0
) -> TokenReadPlan:
    """The blocks to read for tokens ``pos`` (int64 ``[M]``, each < its row's length) of rows ``rows``.

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
    gap = table.start[blocks[1:]] - table.start[blocks[:-1] + 1]  # tokens between consecutive wanted blocks
    breaks = np.flatnonzero(gap > max_gap_tokens) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks, [blocks.size])) - 1
    run_first, run_last = blocks[firsts], blocks[lasts]
    runs = list(zip(run_first.tolist(), (run_last + 1).tolist(), strict=True))
    # a run reads tokens [start[first], start[last + 1]); runs are laid out back to back in the buffer
    sizes = table.start[run_last + 1] - table.start[run_first]
    buf_start = np.zeros(len(runs), dtype=np.int64)
    np.cumsum(sizes[:-1], out=buf_start[1:])
    run_of = np.repeat(np.arange(len(runs)), lasts - firsts + 1)[inverse]
    where = buf_start[run_of] + (offsets[rows] + pos - table.start[run_first[run_of]])
    return TokenReadPlan(runs, where, int(sizes.sum()))


#: bytes of storage read in one request at least: gaps below it are read rather than skipped
PAGE_BYTES = 4096


def describe_stored(layout: TokenLayout, schema: Mapping[str, TensorSpec], key: str) -> str:
    """How ``key`` is stored, for ``te-thd cache info``: ``"ragged"`` or ``"ragged, fp8_e4m3 + float32 scale"``."""
    codec = layout.codec(key)
    return "ragged" if codec is None else f"ragged, {describe(codec, schema[key].dtype)}"


def logical_specs(tokens: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """``{key: TensorSpec}`` (logical, ``[L, ...]`` per sample) of a token shard's ragged keys, from its
    header's ``tokens`` fields; ``ValueError`` when they are malformed."""
    logical = tokens.get("logical")
    if not isinstance(logical, dict) or not logical:
        raise ValueError("the token fields name no logical keys")
    return {k: TensorSpec.from_json(v) for k, v in logical.items()}


def shard_fidelity(tokens: Mapping[str, Any]) -> dict[str, dict[str, float]] | None:
    """A token shard's recorded codec losses (its header's ``tokens.fidelity``), as the manifest records them."""
    fid = tokens.get("fidelity") or {}
    return {k: {m: float(v) for m, v in d.items()} for k, d in fid.items()} or None
