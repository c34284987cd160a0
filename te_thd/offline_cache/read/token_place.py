"""Read whole checksum blocks of a ragged tensor straight into their place in a batch tensor.

A *segment* is tokens ``[t0, t1)`` of one shard row, bound for tokens ``d0, d0 + 1, ...`` of
the destination. When ``t0`` starts a checksum block and ``t1`` ends one (or the row), the
segment is whole blocks: it is read with one iovec of a ``preadv`` straight into the
destination (segments adjacent in the file share one call), and each block is hashed there
right after, by the thread that read it. One copy per byte, no staging buffer, no gather
afterwards. The plan is numpy over the segments; Python loops only to make the iovecs and the
pieces, and the check hashes a piece's blocks with one ``map``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from te_thd.offline_cache.format.integrity import hash64
from te_thd.offline_cache.format.ragged import BlockTable
from te_thd.offline_cache.read.executor import IOV_MAX, Piece

#: A piece of a read holds about this many bytes at most when its blocks are verified or read
#: threads share it, so the hash finds them in cache right after the copy (whole blocks, at least
#: one). Looked up per plan: a test cutting pieces smaller patches it.
PIECE_BYTES = 512 << 10


def piece_bytes(verify: bool, threads: int) -> int:
    """The ``chunk`` of :func:`plan_placed` for a read verified or not, on ``threads`` threads: a
    share of :data:`PIECE_BYTES` per thread, or no limit for one unverified thread."""
    return PIECE_BYTES // threads if verify or threads > 1 else 0


#: ``(row, first token, last token, expected, actual)`` -> the error a failed block check raises
Mismatch = Callable[[int, int, int, int, int], Exception]


def whole_blocks(
    table: BlockTable, offsets: np.ndarray, rows: np.ndarray, t0: np.ndarray, t1: np.ndarray
) -> np.ndarray:
    """bool ``[n]``: segment ``i`` (tokens ``[t0[i], t1[i])`` of row ``rows[i]``, int64 ``[n]``
    each) is whole checksum blocks of its row (its blocks start every ``block_tokens`` from the
    row's start)."""
    bt = table.block_tokens
    lens = offsets[rows + 1] - offsets[rows]
    return (t0 % bt == 0) & ((t1 % bt == 0) | (t1 == lens))


def _runs(n: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, k)`` int64 ``[sum(counts)]``: item ``owner`` (of ``n``) repeated ``counts`` times,
    ``k`` counting from 0 within each."""
    owner = np.repeat(np.arange(n, dtype=np.int64), counts)
    k = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, k


def plan_placed(
    fd: int,
    path: str,
    base: int,
    table: BlockTable,
    offsets: np.ndarray,
    token_bytes: int,
    segments: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    dst: memoryview,
    chunk: int,
    pieces: list[Piece],
    sums: np.ndarray | None = None,
    mismatch: Mismatch | None = None,
    owner: object = None,
) -> int:
    """Plan reading whole-block segments of one ragged tensor into ``dst``; returns the pieces
    added.

    Args:
        fd, path: the shard's descriptor and its name in messages.
        base: file offset of the tensor's token 0; ``token_bytes``: bytes per token.
        table, offsets: the tensor's block table and the shard's row offsets (int64 ``[rows + 1]``).
        segments: ``(rows, t0, t1, d0)``, int64 ``[n]`` each: tokens ``[t0, t1)`` of row ``rows[i]``
            go to tokens ``d0[i]..`` of ``dst``; every segment whole blocks (:func:`whole_blocks`).
        dst: the destination's bytes (a contiguous ``[N, *per_token]`` tensor's).
        chunk: bytes per piece at most, cut at block boundaries (0: no limit), so a piece's
            hash finds its bytes in cache and read threads can share a large row.
        pieces: the ``preadv`` pieces are appended here.
        sums: uint64 ``[blocks]``, the tensor's block checksums (None: no check); a failed
            block raises ``mismatch(row, first token, last token, expected, actual)``.
        owner: kept by every piece (what keeps ``fd`` open until it is read).
    """
    rows, t0, t1, d0 = (np.asarray(a, dtype=np.int64) for a in segments)
    keep = t1 > t0
    if not keep.all():
        rows, t0, t1, d0 = rows[keep], t0[keep], t1[keep], d0[keep]
    if rows.size == 0:
        return 0
    bt, tb = table.block_tokens, token_bytes
    if chunk:  # cut long segments at block boundaries, about ``chunk`` bytes each
        cap = max(1, chunk // max(1, bt * tb)) * bt
        at, k = _runs(rows.size, -(-(t1 - t0) // cap))
        rows, d0 = rows[at], d0[at] + k * cap
        t0 = t0[at] + k * cap
        t1 = np.minimum(t0 + cap, t1[at])
    fstart = offsets[rows] + t0  # file token of each segment's first token
    order = np.lexsort((d0, fstart))  # file order: adjacent segments share a preadv
    rows, t0, t1, d0, fstart = rows[order], t0[order], t1[order], d0[order], fstart[order]
    n = rows.size
    seg_tokens = t1 - t0
    fend = fstart + seg_tokens
    # a piece: segments adjacent in the file, at most ``chunk`` bytes (from its group's
    # start) and IOV_MAX iovecs
    new = np.ones(n, dtype=bool)
    new[1:] = fstart[1:] != fend[:-1]
    group_first = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    within = np.arange(n, dtype=np.int64) - group_first[group]
    cut = within // IOV_MAX
    if chunk:
        before = np.cumsum(seg_tokens) - seg_tokens
        cut = cut * (1 << 32) + (before - before[group_first][group]) * tb // chunk
    new[1:] |= cut[1:] != cut[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], n)
    dbytes = d0 * tb
    views = list(
        map(dst.__getitem__, map(slice, dbytes.tolist(), (dbytes + seg_tokens * tb).tolist()))
    )
    after = None
    bounds = [0] * (first.size + 1)
    if sums is not None and bt == 1:
        # a block per token: a segment's blocks are consecutive rows of dst and consecutive
        # global blocks, hashed by segment with no per-block index arrays
        bounds = first.tolist() + [n]
        g0 = table.row_first[rows] + t0
        after = _token_checker(dst, tb, d0, g0, seg_tokens, sums, rows, offsets, table, mismatch)
    elif sums is not None:
        # every block of every segment, in segment order: its global index, its bytes in dst
        row_block = table.row_first[rows]
        g0 = row_block + t0 // bt
        seg, k = _runs(n, row_block + -(-t1 // bt) - g0)
        g = g0[seg] + k
        shift = (d0 - t0 - offsets[rows])[seg]  # dst token = file token + shift
        lo = (table.start[g] + shift) * tb
        hi = (table.start[g + 1] + shift) * tb
        bounds = np.searchsorted(seg, first).tolist() + [g.size]
        after = _checker(dst, lo, hi, g, sums, rows[seg], offsets, table, mismatch)
    out = first.size
    offs = (base + fstart[first] * tb).tolist()
    sizes = np.add.reduceat(seg_tokens, first) * tb
    for j, (a, b, off, nb) in enumerate(
        zip(first.tolist(), last.tolist(), offs, sizes.tolist(), strict=True)
    ):
        pieces.append(
            Piece(
                fd,
                off,
                views[a:b],
                nb,
                path,
                after,
                (bounds[j], range(bounds[j], bounds[j + 1])),
                owner,
            )
        )
    return out


def _token_checker(
    dst: memoryview,
    token_bytes: int,
    d0: np.ndarray,
    g0: np.ndarray,
    count: np.ndarray,
    sums: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    table: BlockTable,
    mismatch: Mismatch | None,
) -> Callable[[int, Sequence[int]], None]:
    """The check of a piece's segments ``segs`` (indices into ``d0``/``g0``/``count``, int64 ``[n]``
    each: segment ``s`` is ``count[s]`` tokens from token ``d0[s]`` of ``dst``, global blocks
    ``g0[s]``.. on) once read, for a tensor whose every block is one token of ``token_bytes``.
    Each token is a row of a ``[N, token_bytes]`` uint8 view of ``dst``: one hash call per
    block and no other object made per block."""
    grid = np.frombuffer(dst, dtype=np.uint8).reshape(-1, token_bytes)
    starts, firsts, counts = d0.tolist(), g0.tolist(), count.tolist()

    def after(s0: int, segs: Sequence[int]) -> None:
        for s in segs:
            d, g, k = starts[s], firsts[s], counts[s]
            got = list(map(hash64, grid[d : d + k], range(g, g + k)))
            want = sums[g : g + k].tolist()
            if got == want:
                continue
            j = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
            row = int(rows[s])
            first = int(table.start[g + j] - offsets[row])
            assert mismatch is not None
            raise mismatch(row, first, first, want[j], got[j])

    return after


def _checker(
    dst: memoryview,
    lo: np.ndarray,
    hi: np.ndarray,
    g: np.ndarray,
    sums: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    table: BlockTable,
    mismatch: Mismatch | None,
) -> Callable[[int, Sequence[int]], None]:
    """The check of a piece's blocks ``blocks`` (indices into ``lo``/``hi``/``g``: their bytes in
    ``dst`` and global block numbers, the hash's seed) once read."""
    los, his, seeds, want = lo.tolist(), hi.tolist(), g.tolist(), sums[g].tolist()

    def after(b0: int, blocks: Sequence[int]) -> None:
        b1 = b0 + len(blocks)
        got = list(
            map(hash64, map(dst.__getitem__, map(slice, los[b0:b1], his[b0:b1])), seeds[b0:b1])
        )
        if got == want[b0:b1]:
            return
        j = b0 + next(i for i, (x, y) in enumerate(zip(got, want[b0:b1], strict=True)) if x != y)
        row, block = int(rows[j]), seeds[j]
        first = int(table.start[block] - offsets[row])
        last = int(table.start[block + 1] - offsets[row]) - 1
        assert mismatch is not None
        raise mismatch(row, first, last, want[j], got[j - b0])

    return after
