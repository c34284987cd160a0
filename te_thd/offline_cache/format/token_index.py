"""A token shard's ragged index: where each stored tensor's tokens and block checksums sit in the
file, parsed once from its checked header, and the block sums read and checked on first use.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from te_thd.offline_cache.format.integrity import (
    HASH_NAME,
    ShardHeader,
    checksum_mismatch,
    damaged_fields,
    hash64,
)
from te_thd.offline_cache.format.ragged import (
    BLOCK_SUMS,
    BlockTable,
    StoredTensor,
    TokenLayout,
    block_table,
)
from te_thd.offline_cache.format.schema import CacheIntegrityError, TensorSpec


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
    sums: dict[str, np.ndarray] | None = field(default=None)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def sums_bytes(self) -> int:
        """Bytes of the block sums tensor (8 per block of every stored tensor)."""
        return 8 * sum(t.blocks for t in self.tables.values())


def token_index(path: str, header: ShardHeader) -> TokenIndex:
    """Parse and check a token shard's ragged fields against its tensor entries."""
    t = header.tokens
    assert t is not None
    bad = functools.partial(damaged_fields, path, "token fields")
    try:
        layout, logical, offsets = t.layout, t.logical, t.offsets
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"are malformed ({exc})") from None
    stored = {s.name: s for s in layout.stored(logical)}
    if set(stored) != set(t.stored) or any(
        t.stored[n].get("block_tokens") != s.block_tokens for n, s in stored.items()
    ):
        raise bad("disagree with the layout they record")
    start: dict[str, int] = {}
    tables: dict[str, BlockTable] = {}
    blocks = 0
    for name, s in stored.items():
        e = header.entries.get(name)
        if e is None or e.dtype != s.dtype or e.shape != (int(offsets[-1]), *s.shape):
            raise bad(
                f"say {name!r} holds {int(offsets[-1])} tokens of {s.shape}, the entry is {e}"
            )
        start[name] = e.start
        tables[name] = block_table(offsets, s.block_tokens)
        blocks += tables[name].blocks
    e = header.entries.get(BLOCK_SUMS)
    if e is None or e.dtype != torch.uint64 or e.shape != (blocks,):
        raise bad(f"need {blocks} block sums, the entry is {e}")
    return TokenIndex(path, layout, logical, offsets, stored, start, tables, e.start, t.sums_digest)


def load_block_sums(index: TokenIndex, fd: int, repair: str) -> dict[str, np.ndarray]:
    """``{stored name: uint64 [blocks]}`` of the shard, read once and checked against the header's
    digest."""
    if index.sums is None:
        raw = os.pread(fd, index.sums_bytes, index.sums_start)
        actual = f"{hash64(raw):016x}"
        if len(raw) != index.sums_bytes or actual != index.sums_digest:
            raise CacheIntegrityError(
                f"shard {index.path}: its block checksums hash to {HASH_NAME}:{actual}, "
                "the header records "
                f"{HASH_NAME}:{index.sums_digest}: the file is damaged. {repair}",
                path=index.path,
            )
        sums = np.frombuffer(raw, dtype="<u8")
        # one run per stored tensor, in the order the writer appended them in
        ends = np.cumsum([index.tables[name].blocks for name in index.stored])
        index.sums = dict(zip(index.stored, np.split(sums, ends[:-1]), strict=False))
    return index.sums


def check_token_blocks(path: str, header: ShardHeader, first_sample: int | None) -> None:
    """Hash every block of every ragged tensor of shard ``path`` (a local file) and compare with
    its block sums (``verify --deep``, a producer's resume).

    Raises :class:`CacheIntegrityError` naming the shard, the key and the sample (``first_sample``:
    the global index of the shard's row 0) on a mismatch.
    """
    index = token_index(path, header)
    with open(path, "rb", buffering=0) as f:
        sums = load_block_sums(index, f.fileno(), "")
    data = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
    for name, s in index.stored.items():
        table = index.tables[name]
        bounds = (index.start[name] + table.start * s.token_bytes).tolist()
        want = sums[name].tolist()
        for g in range(table.blocks):
            got = hash64(data[bounds[g] : bounds[g + 1]], g)
            if got != want[g]:
                raise block_mismatch(index, name, g, want[g], got, first_sample)


def block_mismatch(
    index: TokenIndex,
    name: str,
    block: int,
    want: int,
    got: int,
    first_sample: int | None,
    repair: str = "",
) -> CacheIntegrityError:
    """The error of block ``block`` of stored tensor ``name`` whose bytes hash to ``got``, not
    ``want``: it names the shard row the block belongs to and that row's tokens it holds."""
    table, s = index.tables[name], index.stored[name]
    row = int(np.searchsorted(table.row_first, block, side="right") - 1)
    base = int(index.offsets[row])
    lo, hi = int(table.start[block]) - base, int(table.start[block + 1]) - base - 1
    return checksum_mismatch(
        index.path, row, first_sample, s.key, want, got, tokens=(lo, hi, s.name), repair=repair
    )
