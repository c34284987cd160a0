"""Plan a batch read: which shard rows go where, read by which copy, as pieces for ``executor``.

A batch becomes, per shard it touches, one *part*: the shard's rows (``local``) and
the batch rows they fill (``pos``). :func:`plan_shard_rows` turns every key's part into
pieces, each checked right after it is read by the thread that read it, and copied one
of two ways, chosen per (key, shard) by :func:`choose_engines`:

* ``preadv``: :func:`plan_runs` cuts the rows into runs of consecutive file rows and
  :func:`plan_pieces` makes each run one ``os.preadv`` whose iovecs point straight at
  the batch rows: one kernel copy per byte, no page faults on the source, and a shard
  that shrinks under the reader is a clean error. For large runs.
* gather: rows copied from the memory-mapped shard with one ``index_select``, for
  smaller scattered rows, where a system call per row costs more than its bytes.

The shards a process holds open (descriptor, mapping, ``safe_open`` handle) are
:class:`OpenShards`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from te_thd.args import check_index
from te_thd.offline_cache.format.integrity import (
    HeaderEntry,
    ShardHeader,
    ShardSums,
    byte_view,
    cut_rows,
    verify_row_views,
)
from te_thd.offline_cache.format.schema import CacheIntegrityError, advise, tensor_nbytes
from te_thd.offline_cache.format.token_index import TokenIndex
from te_thd.offline_cache.read.executor import IOV_MAX, AfterRead, GatherPiece, Piece
from te_thd.offline_cache.storage.base import Fetch

__all__ = [
    "COPY_ENGINE",
    "PREADV_MIN_RUN_BYTES",
    "OpenShard",
    "OpenShards",
    "Part",
    "RunPlan",
    "Scattered",
    "batch_groups",
    "batch_places",
    "choose_engines",
    "plan_pieces",
    "plan_runs",
    "plan_shard_rows",
    "row_nbytes",
    "row_ranges",
]


class RunPlan(NamedTuple):
    """How to read rows of one shard tensor into rows of a batch tensor.

    ``rows`` / ``dst_rows`` (int64 ``[n]``): the file rows and the batch rows they fill, sorted
    by file row, then by batch row; ``new`` (bool ``[n]``): a row starts a run (it is not the
    previous file row plus one); ``simple``: one run into consecutive batch rows (a sequential
    read). The list views: run ``k`` fills ``dst[starts[k]:starts[k+1]]`` (``starts``: ``runs +
    1`` ints) from file rows ``first_row[k] + 0, 1, ...``; ``dst_contiguous[k]``: those batch
    rows are consecutive too.
    """

    rows: np.ndarray
    dst_rows: np.ndarray
    new: np.ndarray
    simple: bool = False

    @property
    def num_runs(self) -> int:
        return int(np.count_nonzero(self.new))

    @property
    def dst(self) -> list[int]:
        return self.dst_rows.tolist()

    @property
    def starts(self) -> list[int]:
        return [*np.flatnonzero(self.new).tolist(), self.rows.size]

    @property
    def first_row(self) -> list[int]:
        return self.rows[self.new].tolist()

    @property
    def dst_contiguous(self) -> list[bool]:
        if not self.rows.size:
            return []
        jump = np.zeros(self.rows.size, dtype=bool)
        jump[1:] = (np.diff(self.dst_rows) != 1) & ~self.new[1:]
        return (~np.logical_or.reduceat(jump, np.flatnonzero(self.new))).tolist()


def plan_runs(
    local: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray | None = None
) -> RunPlan:
    """Cut the file rows ``local`` (``n`` ints, any order, repeats allowed) into runs.

    ``dst`` (``n`` ints, default ``0..n-1``): the batch row each of ``local`` goes to. A run
    is a maximal stretch of the rows sorted by file position where each row is the previous
    plus one; a repeated row (wrap-around padding) starts a new run, so the runs partition the
    batch rows. Numpy: one sort, unless the rows are one run in batch order.
    """
    rows = np.asarray(local, dtype=np.int64).reshape(-1)
    n = rows.size
    targets = np.arange(n, dtype=np.int64) if dst is None else np.asarray(dst, dtype=np.int64)
    if targets.size != n:
        raise ValueError(f"dst has {targets.size} rows, local {n}; pass one batch row per file row")
    new = np.zeros(n, dtype=bool)
    new[:1] = True
    if dst is None and n and rows[-1] - rows[0] == n - 1 and (rows[1:] - rows[:-1] == 1).all():
        return RunPlan(rows, targets, new, True)  # a sequential read: one run
    # by file row, then batch row (``targets`` ascends already when ``dst`` is None)
    order = rows.argsort(kind="stable") if dst is None else np.lexsort((targets, rows))
    rows, targets = rows[order], targets[order]
    np.not_equal(rows[1:], rows[:-1] + 1, out=new[1:])
    plan = RunPlan(rows, targets, new)
    if n and not new[1:].any():  # one run: into consecutive batch rows?
        plan = plan._replace(simple=plan.dst_contiguous[0])
    return plan


def plan_pieces(
    fd: int,
    base: int,
    row_bytes: int,
    plan: RunPlan,
    dst: memoryview,
    path: str,
    after: AfterRead | None = None,
    chunk_bytes: int = 0,
    owner: object = None,
) -> list[Piece]:
    """The reads that put the planned rows of one tensor into ``dst`` (the bytes of the batch tensor
    ``[B, row]``).

    ``base``: file offset of row 0 of the tensor. An iovec is a stretch of a run whose batch rows
    are consecutive too; a piece is one ``preadv`` of a run's iovecs, of at most ``chunk_bytes``
    (whole rows; 0: no limit) so a checksum finds them in cache and threads can share them, and
    at most ``IOV_MAX`` iovecs. With ``after`` (called once per piece: ``after(batch row of its
    first row, its file rows)``), a piece is one iovec. ``owner``: kept by every piece (whatever
    keeps ``fd`` open until the pieces are read). Planned with numpy over the rows (a sequential
    read or rows of a chunk each need none); Python loops only to make the pieces.
    """
    r, d, new = plan.rows, plan.dst_rows, plan.new
    n, rb = r.size, row_bytes
    if not n:
        return []
    step = max(1, chunk_bytes // rb) if chunk_bytes and rb else n
    if plan.simple:  # one run into consecutive batch rows: pieces of ``step`` rows
        p, q = int(d[0]), int(r[0])
        return [
            Piece(
                fd,
                base + (q + c) * rb,
                [dst[(p + c) * rb : (p + c + min(step, n - c)) * rb]],
                min(step, n - c) * rb,
                path,
                after,
                (p + c, range(q + c, q + c + min(step, n - c))),
                owner,
            )
            for c in range(0, n, step)
        ]
    if step == 1:  # a row a piece
        return [
            Piece(
                fd,
                base + q * rb,
                [dst[p * rb : p * rb + rb]],
                rb,
                path,
                after,
                (p, range(q, q + 1)),
                owner,
            )
            for p, q in zip(d.tolist(), r.tolist(), strict=True)
        ]
    at = np.arange(n)
    within = at - np.maximum.accumulate(at * new)  # a row's place in its run
    group = new | (within % step == 0)  # a row that starts a chunk: no piece crosses one
    seg = group.copy()  # a row that starts an iovec
    seg[1:] |= d[1:] != d[:-1] + 1
    first = seg.nonzero()[0]
    size = np.empty_like(first)
    size[:-1] = first[1:] - first[:-1]
    size[-1] = n - first[-1]
    lo = d[first] * rb
    views = list(map(dst.__getitem__, map(slice, lo.tolist(), (lo + size * rb).tolist())))
    if after is not None or first.size == 1:  # an iovec a piece
        starts = np.arange(first.size)
    else:  # a chunk's iovecs, IOV_MAX a piece at most
        k = np.arange(first.size)
        nth = k - np.maximum.accumulate(k * group[first])
        starts = (nth % IOV_MAX == 0).nonzero()[0]
    rows_in = np.add.reduceat(size, starts)
    bounds = [*starts.tolist(), first.size]
    heads = first[starts]
    return [
        Piece(fd, off, views[a:b], m * rb, path, after, (p, range(q, q + m)), owner)
        for off, a, b, m, p, q in zip(
            (base + r[heads] * rb).tolist(),
            bounds[:-1],
            bounds[1:],
            rows_in.tolist(),
            d[heads].tolist(),
            r[heads].tolist(),
            strict=True,
        )
    ]


#: A (key, shard) part of a batch is read with ``preadv`` when its runs of consecutive file
#: rows average at least this many bytes, else gathered from the mapped shard (the crossover
#: ``perf/measure_read_crossover.py`` measures: docs/performance-io.md).
PREADV_MIN_RUN_BYTES = 256 * 1024

#: How every (key, shard) part of a batch is copied: ``"auto"`` (:func:`choose_engines`),
#: or ``"preadv"`` / ``"mapped"`` for all of them. Looked up per batch, so a bench that
#: measures one engine patches this constant.
COPY_ENGINE = "auto"

#: One shard's part of a batch: ``(shard, local rows int64 [m], batch rows int64 [m] or None for
#: 0..m-1)``.
Part = tuple[int, np.ndarray, "np.ndarray | None"]

#: Gathered rows whose batch rows interleave with another shard's: ``(batch tensor, batch rows,
#: rows)``, moved into place by the batch's last step.
Scattered = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def batch_groups(
    indices: Sequence[int], shard_size: int, total: int, where: str = "the cache"
) -> list[Part]:
    """The parts of a batch of ``total``-sample cache indices ``indices`` (negative ones count from
    the end), one per shard; ``TypeError`` / ``IndexError`` for an index that is not an int or is
    out of range, naming it as given and ``where`` (the cache). Numpy over the indices."""
    if set(map(type, indices)) != {int}:  # a float or str would pass the range test below
        indices = [check_index(f"indices[{i}]", v, total, where) for i, v in enumerate(indices)]
    idx = np.asarray(indices, dtype=np.int64)
    lo, hi = min(indices), max(indices)  # builtins over a list: no array calls
    if lo < 0 or hi >= total:
        idx[idx < 0] += total
        bad = np.flatnonzero((idx < 0) | (idx >= total))
        if bad.size:
            check_index(f"indices[{bad[0]}]", indices[bad[0]], total, where)
        lo, hi = int(idx.min()), int(idx.max())
    if lo // shard_size == hi // shard_size:  # the common case (shard-block order): one shard
        shard = lo // shard_size
        return [(shard, idx - shard * shard_size, None)]
    shards = idx // shard_size
    order = np.argsort(shards, kind="stable")  # batch positions, grouped by shard
    sorted_shards = shards[order]
    bounds = [0, *(np.flatnonzero(np.diff(sorted_shards)) + 1).tolist(), idx.size]
    out: list[Part] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # one part per shard
        shard, pos = int(sorted_shards[a]), order[a:b]
        out.append((shard, idx[pos] - shard * shard_size, pos))
    return out


def batch_places(groups: Sequence[Part], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, row)`` of each of the ``n`` batch rows (int64 ``[n]`` each), from the batch's
    shard groups."""
    shards, rows = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for shard, local, pos in groups:
        at = slice(None) if pos is None else pos
        shards[at], rows[at] = shard, local
    return shards, rows


def row_nbytes(e: HeaderEntry) -> int:
    """Bytes of one row of the stored tensor ``e`` (``[rows, *sample_shape]``)."""
    return tensor_nbytes(e.dtype, e.shape[1:])


def row_ranges(
    entries: dict[str, HeaderEntry], keys: Sequence[str], rows: np.ndarray
) -> list[tuple[int, int]]:
    """``(file offset, bytes)`` of rows ``rows`` of every key in ``keys``: one range per run of
    consecutive rows."""
    rows = np.unique(rows)
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    out = []
    for key in keys:
        e = entries[key]
        rb = row_nbytes(e)
        out += [(e.start + int(run[0]) * rb, int(run.size) * rb) for run in runs if run.size]
    return out


def choose_engines(
    keys: Sequence[str],
    local: np.ndarray,
    pos: np.ndarray | None,
    entries: dict[str, HeaderEntry],
) -> tuple[dict[str, bool], RunPlan | None]:
    """``{key: read with preadv}`` for rows ``local`` -> batch rows ``pos`` of one shard,
    and their run plan (the pieces reuse it).

    :data:`COPY_ENGINE` ``"preadv"`` / ``"mapped"`` decides alone. ``"auto"``: a key goes
    through ``preadv`` when its runs average at least :data:`PREADV_MIN_RUN_BYTES`; then
    every key whose rows are one run joins it (one more system call costs less than a
    gather's fixed cost), while a part with no such key gathers throughout.
    """
    plan = plan_runs(local, pos)  # the same row pattern for every key: planned once
    if COPY_ENGINE != "auto":
        return dict.fromkeys(keys, COPY_ENGINE == "preadv"), plan
    min_run_bytes = PREADV_MIN_RUN_BYTES
    runs = plan.num_runs
    out = {k: row_nbytes(entries[k]) * local.size >= min_run_bytes * runs for k in keys}
    if plan.simple and any(out.values()):
        return dict.fromkeys(keys, True), plan
    return out, plan


def plan_shard_rows(
    f: OpenShard,
    fd: int,
    keys: Sequence[str],
    local: np.ndarray,
    pos: np.ndarray | None,
    out: dict[str, torch.Tensor],
    raw: dict[str, memoryview],
    chunk: int,
    sums: ShardSums | None,
    first_sample: int,
    repair: str,
    pieces: list[Piece | GatherPiece],
    scattered: list[Scattered],
) -> None:
    """Plan copying rows ``local`` (int64 ``[m]``) of the open shard ``f`` into batch rows ``pos``
    (int64 ``[m]``; None: ``0..m-1``) of every key's batch tensor ``out[key]`` (whose bytes
    are ``raw[key]``).

    Every key's rows become pieces of at most ``chunk`` bytes (0: no limit; at least one
    row), appended to ``pieces``; with ``sums`` (the shard's checksums; None: no check), each
    is verified right after it is read, by the thread that read it (a mismatch names sample
    ``first_sample + row`` and says ``repair``). A key is read by ``preadv`` pieces from ``fd``
    or gathered from ``f``'s mapping (:func:`choose_engines`). Gathered rows whose batch rows
    are not one stretch go to a scratch tensor, moved into place by the batch's last step
    (appended to ``scattered``).
    """
    engines, plan = choose_engines(keys, local, pos, f.header.entries)
    if f.tokens is not None:
        # a token shard's per-sample keys are small: preadv them. A mapping's page faults would
        # read around them and leave read-ahead marks that make the kernel prefetch the ragged
        # tensors behind them too, which a CP rank reads only a share of
        engines = dict.fromkeys(keys, True)
    path, entries = f.name, f.header.entries  # messages name the shard as its storage does

    def verifier(key: str, dst: memoryview, n: int) -> Callable[[int, Sequence[int]], None] | None:
        """The check of a piece's rows once they are in ``dst`` (the bytes of ``n`` rows; None:
        nothing to check). The row views are cut from the bytes: no tensor call."""
        if sums is None:
            return None
        expected, views = sums.sums[key], cut_rows(dst, n)

        def after(p: int, rows: Sequence[int]) -> None:
            verify_row_views(
                views[p : p + len(rows)],
                rows,
                expected,
                path=path,
                key=key,
                first_sample=first_sample,
                repair=repair,
            )

        return after

    views: dict[str, torch.Tensor] | None = None
    m = local.size
    # one run into consecutive batch rows: a slice copy; else an index, in batch order
    first, start = (int(plan.rows[0]), int(plan.dst_rows[0])) if plan.simple else (0, 0)
    for key in keys:
        e = entries[key]
        row_bytes = row_nbytes(e)
        if engines[key]:
            after = verifier(key, raw[key], out[key].shape[0])
            pieces += plan_pieces(
                fd, e.start, row_bytes, plan, raw[key], path, after, chunk, owner=f
            )
            continue
        if views is None:  # the first gathered key: the mapping and the rows' index
            views = f.mapped(keys, repair)
            rows_t = None if plan.simple else torch.from_numpy(local)
            all_rows = range(first, first + m) if plan.simple else local.tolist()
        dst = out[key]
        # a part's batch rows ascend (``batch_groups``): a run when they span ``m`` rows
        if plan.simple or pos is None or pos[-1] - pos[0] == m - 1:
            if pos is not None and not plan.simple:
                start = int(pos[0])
            whole = start == 0 and m == dst.shape[0]
            target = dst if whole else dst[start : start + m]
            tb = raw[key] if whole else raw[key][start * row_bytes : (start + m) * row_bytes]
        else:
            target = torch.empty((m, *dst.shape[1:]), dtype=dst.dtype)
            scattered.append((dst, torch.from_numpy(pos), target))
            tb = byte_view(target)
        after = verifier(key, tb, m)
        step = max(1, chunk // row_bytes) if chunk and row_bytes else m
        if step >= m:  # the common case: one copy, nothing cut
            pieces.append(
                GatherPiece(
                    views[key], rows_t, first, target, m * row_bytes, path, after, (0, all_rows)
                )
            )
            continue
        pieces += [
            GatherPiece(
                views[key],
                None if rows_t is None else rows_t[a : a + step],
                first + a if rows_t is None else 0,
                target[a : a + step],
                min(step, m - a) * row_bytes,
                path,
                after,
                (a, all_rows[a : a + step]),
            )
            for a in range(0, m, step)
        ]


def _missing(path: str, repair: str) -> CacheIntegrityError:
    return CacheIntegrityError(
        f"shard {path} is missing (removed after the cache was opened?). {repair}", path=path
    )


class OpenShard:
    """One open shard: the local ``path`` it is read from and the ``name`` messages give it (an
    s3:// cache's object URL; the path for a local cache), its checked ``header``, a read-only
    descriptor ``fd``, and, once a read needs them, its memory mapping ``views`` (``{key: [rows,
    ...]}``) and ``safe_open`` ``handle``.

    The descriptor is closed when the last reference goes: the LRU drops its reference on
    eviction, and every ``preadv`` piece planned from it holds one (``Piece.owner``) until it
    is read. So a batch spanning more shards than ``max_open_shards``, or a read in flight
    while the next batch opens other shards, never reads through a closed descriptor (or
    its number reused by the next open).
    """

    __slots__ = (
        "path",
        "name",
        "header",
        "fd",
        "views",
        "handle",
        "tokens",
        "fetch",
        "first_sample",
        "_pid",
    )

    def __init__(
        self,
        path: str,
        header: ShardHeader,
        tokens: TokenIndex | None = None,
        fetch: Fetch | None = None,
        name: str | None = None,
        first_sample: int | None = None,
    ) -> None:
        self.path, self.name, self.header, self.fd = path, name or path, header, -1
        self.first_sample = first_sample  # the global index of its row 0 (None: not known)
        self.tokens = tokens  # a token-layout shard's ragged index
        # makes byte ranges present in the local file (``Storage.readable``; None: all are)
        self.fetch = fetch
        self.views: dict[str, torch.Tensor] | None = None
        self.handle: Any = None
        self._pid = os.getpid()

    def descriptor(self, prefetch: Sequence[str], repair: str) -> int:
        """The read-only descriptor, opened on first use with advice: ``"willneed"`` for the byte
        ranges of the keys ``prefetch``, and ``"random"`` for a token shard, whose ragged reads
        fetch a few blocks here and there (one CP rank's tokens)."""
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise _missing(self.path, repair) from None
            if self.tokens is not None:
                advise(self.fd, "random")
            for key in prefetch:
                e = self.header.entries[key]
                advise(self.fd, "willneed", e.start, e.end - e.start)
        return self.fd

    def mapped(self, keys: Sequence[str], repair: str) -> dict[str, torch.Tensor]:
        """``{key: [rows, ...]}`` views of the shard for ``keys``, mapped on first use.

        Mapped copy-on-write (``torch.from_file(shared=False)``: opened read-only, no descriptor
        kept) and never written, so every page stays file-backed (``safe_open`` copies on every
        slice).
        """
        if self.views is None:
            try:
                size = os.path.getsize(self.path)
            except FileNotFoundError:
                raise _missing(self.path, repair) from None
            whole = torch.from_file(self.path, shared=False, size=size, dtype=torch.uint8)
            views: dict[str, torch.Tensor] = {}
            for key in keys:
                e = self.header.entries[key]
                raw = whole[e.start : e.end]
                if e.start % raw.new_empty(0, dtype=e.dtype).element_size():
                    raw = (
                        raw.clone()
                    )  # misaligned (safetensors aligns; a foreign writer may not): copy once
                views[key] = raw.view(e.dtype).view(e.shape)
            self.views = views
        return self.views

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            _close(fd)

    # os's functions bound at definition: at interpreter exit the module may be torn down first
    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        # a forked child's inherited copies are closed by OpenShards.close()
        if self._pid == _getpid():
            try:
                self.close()
            except OSError:
                pass


class OpenShards:
    """LRU of ``shard -> OpenShard``; an evicted shard's descriptor closes once nothing reads from
    it."""

    def __init__(self) -> None:
        self._lru: OrderedDict[int, OpenShard] = OrderedDict()

    def get(self, shard: int) -> OpenShard | None:
        f = self._lru.get(shard)
        if f is not None:
            self._lru.move_to_end(shard)
        return f

    def put(self, shard: int, f: OpenShard, limit: int) -> OpenShard:
        self._lru[shard] = f
        while len(self._lru) > limit:
            self._lru.popitem(last=False)
        return f

    def __len__(self) -> int:
        return len(self._lru)

    def items(self) -> list[tuple[int, OpenShard]]:
        """``[(shard index, open shard)]``, least recently used first."""
        return list(self._lru.items())

    def drop(self, shard: int) -> None:
        """Forget shard ``shard`` (it is opened, and its header read and checked, again on next
        use)."""
        self._lru.pop(shard, None)

    def close(self) -> None:
        """Close every descriptor now (a forked child closing its inherited copies: no reads in
        flight)."""
        while self._lru:
            self._lru.popitem()[1].close()
