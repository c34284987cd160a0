"""Read ragged token keys: exactly the checksum blocks that hold the tokens asked for, verified.

Layout and block math: :mod:`~te_thd.offline_cache.tokens`. A shard's
:class:`TokenIndex` is parsed from its checked header when the reader opens it;
its block sums (one small tensor) are read and checked against the digest in
the header on first use. :func:`read_key` fetches tokens ``pos`` of rows
``rows`` of one key: one ``preadv`` per run of adjacent blocks, each block
hashed right after it is read, then the wanted tokens picked out and decoded to
the logical dtype (:mod:`~te_thd.offline_cache.codecs`). :class:`TokenRows` is a
batch's handle on its samples' ragged keys: whole samples, zero-padded to
``[B, L, ...]`` as the padded cache returns them (:meth:`TokenRows.padded`), or
any tokens of them (:meth:`TokenRows.gather`: one CP rank's share).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from te_thd.offline_cache.codecs import decode_fp8
from te_thd.offline_cache.copyread import tensor_memoryview
from te_thd.offline_cache.errors import CacheIntegrityError
from te_thd.offline_cache.format import TensorSpec
from te_thd.offline_cache.integrity import HASH_NAME
from te_thd.offline_cache.shardfile import ShardHeader
from te_thd.offline_cache.tokens import (
    BLOCK_SUMS,
    SCALE_SUFFIX,
    TOKENS_SUFFIX,
    BlockTable,
    StoredTensor,
    TokenLayout,
    block_table,
    decode_offsets,
    logical_specs,
    plan_token_reads,
)

_hash = xxhash.xxh3_64_intdigest


@dataclass
class TokenIndex:
    """Where one shard's ragged tensors are: ``offsets`` int64 ``[rows + 1]``, each stored tensor's
    file offset and block table; ``sums`` (uint64 per block) once :func:`load_block_sums` ran."""

    path: str
    layout: TokenLayout
    logical: dict[str, TensorSpec]
    offsets: np.ndarray
    stored: dict[str, StoredTensor]
    start: dict[str, int]
    tables: dict[str, BlockTable]
    sums_start: int
    sums_digest: str
    fidelity: dict[str, Any]
    sums: dict[str, np.ndarray] | None = field(default=None)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def token_index(path: str, header: ShardHeader) -> TokenIndex:
    """Parse and check a token shard's ragged fields against its tensor entries."""
    assert header.sums is not None and header.sums.tokens is not None
    t = header.sums.tokens
    rows = header.sums.rows

    def bad(what: str) -> CacheIntegrityError:
        return CacheIntegrityError(f"shard {path}: its token fields {what}: the header is damaged", path=path)

    try:
        layout = TokenLayout.from_json(t["layout"])
        logical = logical_specs(t)
        offsets = decode_offsets(t["offsets"], rows)
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"are malformed ({exc})") from None
    stored = {s.name: s for s in layout.stored(logical)}
    if set(stored) != set(t["stored"]) or any(t["stored"][n].get("block_tokens") != s.block_tokens for n, s in stored.items()):
        raise bad("disagree with the layout they record")
    start: dict[str, int] = {}
    tables: dict[str, BlockTable] = {}
    blocks = 0
    for name, s in stored.items():
        e = header.entries.get(name)
        if e is None or e.dtype != s.dtype or e.shape != (int(offsets[-1]), *s.shape):
            raise bad(f"say {name!r} holds {int(offsets[-1])} tokens of {s.shape}, the entry is {e}")
        start[name] = e.start
        tables[name] = block_table(offsets, s.block_tokens)
        blocks += tables[name].blocks
    e = header.entries.get(BLOCK_SUMS)
    if e is None or e.dtype != torch.uint64 or e.shape != (blocks,):
        raise bad(f"need {blocks} block sums, the entry is {e}")
    return TokenIndex(path, layout, logical, offsets, stored, start, tables, e.start, str(t.get("block_sums_digest")),
                      dict(t.get("fidelity") or {}))  # fmt: skip


def load_block_sums(index: TokenIndex, fd: int, repair: str) -> dict[str, np.ndarray]:
    """``{stored name: uint64 [blocks]}`` of the shard, read once and checked against the header's digest."""
    if index.sums is None:
        total = sum(t.blocks for t in index.tables.values())
        raw = os.pread(fd, total * 8, index.sums_start)
        actual = f"{_hash(raw):016x}"
        if len(raw) != total * 8 or actual != index.sums_digest:
            raise CacheIntegrityError(
                f"shard {index.path}: its block checksums hash to {HASH_NAME}:{actual}, the header records "
                f"{HASH_NAME}:{index.sums_digest}: the file is damaged. {repair}",
                path=index.path,
            )
        sums = np.frombuffer(raw, dtype="<u8")
        out, g = {}, 0
        for name in index.stored:  # the order the writer appended them in
            n = index.tables[name].blocks
            out[name] = sums[g : g + n]
            g += n
        index.sums = out
    return index.sums


@dataclass(frozen=True)
class ReadContext:
    """What a read needs besides the shard: ``verify``, the shard's first sample (for messages), the
    repair sentence."""

    verify: bool
    first_sample: int
    repair: str


def read_stored(fd: int, index: TokenIndex, name: str, rows: np.ndarray, pos: np.ndarray, ctx: ReadContext) -> torch.Tensor:
    """Tokens ``pos`` of rows ``rows`` of stored tensor ``name``: ``[M, *shape]`` of its stored dtype."""
    s, table = index.stored[name], index.tables[name]
    plan = plan_token_reads(table, index.offsets, rows, pos)
    buf = torch.empty((plan.tokens, *s.shape), dtype=s.dtype)
    raw = tensor_memoryview(buf)
    tb = s.token_bytes
    sums = load_block_sums(index, fd, ctx.repair)[name] if ctx.verify else None
    cur = 0
    for g0, g1 in plan.runs:
        a, b = int(table.start[g0]), int(table.start[g1])
        view = raw[cur * tb : (cur + b - a) * tb]
        _pread_into(fd, view, index.start[name] + a * tb, index.path)
        if sums is not None:
            starts = table.start[g0 : g1 + 1].tolist()
            for g, (x, y) in enumerate(zip(starts[:-1], starts[1:], strict=True), start=g0):
                got = _hash(view[(x - a) * tb : (y - a) * tb], g)
                if got != int(sums[g]):
                    row = int(np.searchsorted(table.row_first, g, side="right") - 1)
                    raise CacheIntegrityError(
                        f"shard {index.path}: sample {ctx.first_sample + row} (row {row} of the shard), key "
                        f"{s.key!r} ({name}, tokens {x - int(index.offsets[row])}..{y - int(index.offsets[row]) - 1}): "
                        f"checksum mismatch (expected {HASH_NAME}:{int(sums[g]):016x}, the bytes read hash to "
                        f"{HASH_NAME}:{got:016x}): the file is damaged; the batch was not returned. {ctx.repair}",
                        path=index.path, sample=ctx.first_sample + row, key=s.key,
                        expected=f"{HASH_NAME}:{int(sums[g]):016x}", actual=f"{HASH_NAME}:{got:016x}",
                    )  # fmt: skip
        cur += b - a
    if plan.where.size == plan.tokens and np.array_equal(plan.where, np.arange(plan.tokens)):
        return buf
    return buf.index_select(0, torch.from_numpy(plan.where))


def read_key(fd: int, index: TokenIndex, key: str, rows: np.ndarray, pos: np.ndarray, ctx: ReadContext) -> torch.Tensor:
    """Tokens ``pos`` of rows ``rows`` of ragged key ``key``, decoded: ``[M, *per_token]`` of its logical dtype."""
    spec = index.logical[key]
    q = read_stored(fd, index, key + TOKENS_SUFFIX, rows, pos, ctx)
    if index.layout.codec(key) is None:
        return q
    scale = read_stored(fd, index, key + SCALE_SUFFIX, rows, pos, ctx)
    return decode_fp8(q, scale, spec.dtype)


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise CacheIntegrityError(f"shard {path} ended early (truncated after it was opened?)", path=path)
        view = view[n:]
        offset += n


def whole_rows(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sample, pos)`` int64 of every real token of samples with ``lengths``, in sample order."""
    total = int(lengths.sum())
    sample = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    first = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=first[1:])
    return sample, np.arange(total, dtype=np.int64) - first[sample]


#: (shard) -> (fd, index, read context): how a batch reaches its shards (the dataset's open files)
Opener = Callable[[int], tuple[int, TokenIndex, ReadContext]]


class TokenRows:
    """A batch's ragged keys, not yet read: ``B`` samples at ``(shard, row)`` ``places``.

    ``lengths``: int64 ``[B]`` (from the shard offsets, no data read); ``specs``: each key's logical
    ``[L, ...]`` spec. Reads go through ``opener`` (the dataset's open shards).
    """

    def __init__(self, opener: Opener, places: Sequence[tuple[int, int]], specs: Mapping[str, TensorSpec]) -> None:
        self._opener = opener
        self.shards = np.asarray([p[0] for p in places], dtype=np.int64)
        self.rows = np.asarray([p[1] for p in places], dtype=np.int64)
        self.specs = dict(specs)
        lengths = np.empty(len(places), dtype=np.int64)
        for shard in np.unique(self.shards).tolist():
            at = self.shards == shard
            lengths[at] = opener(shard)[1].lengths[self.rows[at]]
        self.lengths = lengths

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.specs)

    def subset(self, keys: Sequence[str]) -> TokenRows | None:
        """The same samples, only ``keys`` (None when there are none)."""
        if not keys:
            return None
        out = object.__new__(TokenRows)
        out._opener, out.shards, out.rows, out.lengths = self._opener, self.shards, self.rows, self.lengths
        out.specs = {k: self.specs[k] for k in keys}
        return out

    def gather(self, key: str, sample: np.ndarray, pos: np.ndarray) -> torch.Tensor:
        """Tokens ``pos`` of batch samples ``sample`` (int64 ``[M]``, each ``pos < length``) of ``key``:
        ``[M, *per_token]``, logical dtype, in the order asked."""
        spec = self.specs[key]
        sample = np.asarray(sample, dtype=np.int64)
        pos = np.asarray(pos, dtype=np.int64)
        out = torch.empty((sample.size, *spec.shape[1:]), dtype=spec.dtype)
        if sample.size == 0:
            return out
        if np.any(pos >= self.lengths[sample]) or np.any(pos < 0):
            raise IndexError(f"token positions past their samples' lengths requested from key {key!r}")
        shard_of = self.shards[sample]
        for shard in np.unique(shard_of).tolist():
            at = np.flatnonzero(shard_of == shard)
            fd, index, ctx = self._opener(shard)
            part = read_key(fd, index, key, self.rows[sample[at]], pos[at], ctx)
            if at.size == sample.size:
                return part
            out[torch.from_numpy(at)] = part
        return out

    def padded(self, key: str) -> torch.Tensor:
        """``key`` of every sample, zero-padded: ``[B, L, *per_token]`` (what the padded cache returns)."""
        spec = self.specs[key]
        width = spec.shape[0]
        sample, pos = whole_rows(self.lengths)
        out = torch.zeros((self.lengths.size, *spec.shape), dtype=spec.dtype)
        data = self.gather(key, sample, pos)
        out.view(self.lengths.size * width, *spec.shape[1:])[torch.from_numpy(sample * width + pos)] = data
        return out


def check_token_blocks(path: str, header: ShardHeader) -> None:
    """Read every block of every ragged tensor of shard ``path`` and check it (``verify --deep``).

    Raises :class:`CacheIntegrityError` naming the shard, the key and the sample on a mismatch.
    """
    index = token_index(path, header)
    fd = os.open(path, os.O_RDONLY)
    try:
        ctx = ReadContext(True, 0, "")
        for name, s in index.stored.items():
            table = index.tables[name]
            step = max(1, (64 << 20) // max(1, s.token_bytes))  # 64 MiB at a time
            lengths = index.lengths
            sample, pos = whole_rows(lengths)
            for a in range(0, sample.size, step):
                read_stored(fd, index, name, sample[a : a + step], pos[a : a + step], ctx)
            del table
    finally:
        os.close(fd)
