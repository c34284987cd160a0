"""Plan a batch read: which shard rows go where, read by which copy, as pieces for ``readexec``.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd.args import check_index
from te_thd.offline_cache.format.integrity import (
    HeaderEntry,
    ShardHeader,
    ShardSums,
    row_views,
    verify_row_views,
)
from te_thd.offline_cache.format.schema import CacheIntegrityError, advise, tensor_nbytes
from te_thd.offline_cache.format.token_index import TokenIndex
from te_thd.offline_cache.read.executor import AfterRead, GatherPiece, Piece
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
    "is_run",
    "plan_pieces",
    "plan_runs",
    "plan_shard_rows",
    "row_nbytes",
    "row_ranges",
]

#: Linux's limit on iovecs per ``preadv`` call; longer runs are split.
IOV_MAX = (
    os.sysconf("SC_IOV_MAX")
    if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names
    else 1024
)


@dataclass(frozen=True)
class RunPlan:
    """How to read rows of one shard tensor into rows of a batch tensor.

    ``dst`` (``n`` ints): destination batch rows, sorted by the file row they receive,
    then by themselves. Run ``k`` fills ``dst[starts[k]:starts[k+1]]`` (``starts``:
    ``runs + 1`` ints) from file rows ``first_row[k] + 0, 1, ...``; ``dst_contiguous[k]``:
    those destination rows are consecutive too (the whole run is one iovec).
    """

    dst: list[int]
    starts: list[int]
    first_row: list[int]
    dst_contiguous: list[bool]

    @property
    def num_runs(self) -> int:
        return len(self.first_row)


def plan_runs(
    local: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray | None = None
) -> RunPlan:
    """Cut the file rows ``local`` (``n`` ints, any order, repeats allowed) into runs.

    ``dst`` (``n`` ints, default ``0..n-1``): the batch row each of ``local`` goes
    to. A run is a maximal stretch of the rows sorted by file position where each
    row is the previous plus one; a repeated row (wrap-around padding) starts a new
    run, so the runs partition the batch rows. Pure; plain Python, which beats numpy
    calls on a batch's few dozen rows.
    """
    rows = local.tolist() if isinstance(local, np.ndarray) else list(local)
    targets = (
        range(len(rows))
        if dst is None
        else (dst.tolist() if isinstance(dst, np.ndarray) else list(dst))
    )
    if len(targets) != len(rows):
        raise ValueError(
            f"dst has {len(targets)} rows, local {len(rows)}; pass one batch row per file row"
        )
    n = len(rows)
    if n and dst is None and rows == list(range(rows[0], rows[0] + n)):
        return RunPlan(list(range(n)), [0, n], [rows[0]], [True])  # sequential reads: one run
    pairs = sorted(zip(rows, targets, strict=True))
    out_dst: list[int] = []
    starts: list[int] = []
    first_row: list[int] = []
    contiguous: list[bool] = []
    prev_row = prev_dst = None
    for i, (row, d) in enumerate(pairs):
        if prev_row is None or row != prev_row + 1:
            starts.append(i)
            first_row.append(row)
            contiguous.append(True)
        elif d != prev_dst + 1:  # type: ignore[operator]
            contiguous[-1] = False
        out_dst.append(d)
        prev_row, prev_dst = row, d
    starts.append(len(pairs))
    return RunPlan(out_dst, starts, first_row, contiguous)


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

    ``base``: file offset of row 0 of the tensor. A run whose batch rows are consecutive is
    one piece, or pieces of at most ``chunk_bytes`` (whole rows; 0: no limit) so a checksum
    finds them in cache and threads can share them. A run scattered over the batch is one
    iovec per row, at most ``IOV_MAX`` per piece; with ``after`` (called once per piece:
    ``after(batch row of its first row, its file rows)``), one row per piece. ``owner``:
    kept by every piece (whatever keeps ``fd`` open until the pieces are read).
    """
    dst_rows, starts, first, contiguous = plan.dst, plan.starts, plan.first_row, plan.dst_contiguous
    step = max(1, chunk_bytes // row_bytes) if chunk_bytes and row_bytes else 0
    out: list[Piece] = []
    for k in range(len(first)):
        a, b = starts[k], starts[k + 1]
        offset = base + first[k] * row_bytes
        if contiguous[k]:
            p, n = dst_rows[a], b - a
            m = step or n
            for c in range(0, n, m):
                r = min(m, n - c)
                view = dst[(p + c) * row_bytes : (p + c + r) * row_bytes]
                rows = range(first[k] + c, first[k] + c + r)
                out.append(
                    Piece(
                        fd,
                        offset + c * row_bytes,
                        [view],
                        r * row_bytes,
                        path,
                        after,
                        (p + c, rows),
                        owner,
                    )
                )
            continue
        if after is not None:
            for j, p in enumerate(dst_rows[a:b]):
                view = dst[p * row_bytes : (p + 1) * row_bytes]
                row = first[k] + j
                out.append(
                    Piece(
                        fd,
                        offset + j * row_bytes,
                        [view],
                        row_bytes,
                        path,
                        after,
                        (p, range(row, row + 1)),
                        owner,
                    )
                )
            continue
        per = min(IOV_MAX, max(1, step)) if step else IOV_MAX
        for c in range(a, b, per):
            rows = dst_rows[c : min(b, c + per)]
            iov = [dst[p * row_bytes : (p + 1) * row_bytes] for p in rows]
            out.append(
                Piece(
                    fd,
                    offset + (c - a) * row_bytes,
                    iov,
                    len(rows) * row_bytes,
                    path,
                    None,
                    (0, ()),
                    owner,
                )
            )
    return out


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
    out of range, naming it as given and ``where`` (the cache)."""
    if set(map(type, indices)) != {int}:  # a float or str would pass the range test below
        indices = [check_index(f"indices[{i}]", v, total, where) for i, v in enumerate(indices)]
    lo, hi = min(indices), max(indices)
    if lo >= 0 and hi < total and lo // shard_size == hi // shard_size:
        # the common case (shard-block order, sequential reads): one shard
        shard = lo // shard_size
        return [(shard, np.asarray(indices, dtype=np.int64) - shard * shard_size, None)]
    if len(indices) <= 64:  # a batch's few rows: Python ints beat numpy's per-call cost
        by: dict[int, tuple[list[int], list[int]]] = {}
        for p, i in enumerate(indices):
            j = i + total if i < 0 else i
            if not 0 <= j < total:
                check_index(f"indices[{p}]", i, total, where)
            s = j // shard_size
            if s not in by:
                by[s] = ([], [])
            by[s][0].append(j - s * shard_size)
            by[s][1].append(p)
        return [
            (s, np.array(rows, dtype=np.int64), np.array(pos, dtype=np.int64))
            for s, (rows, pos) in sorted(by.items())
        ]
    idx = np.asarray(indices, dtype=np.int64)
    idx = np.where(idx < 0, idx + total, idx)
    bad = np.flatnonzero((idx < 0) | (idx >= total))
    if bad.size:
        check_index(f"indices[{bad[0]}]", indices[bad[0]], total, where)
    shards = idx // shard_size
    order = np.argsort(shards, kind="stable")  # batch positions, grouped by shard
    sorted_shards = shards[order]
    cuts = (np.flatnonzero(np.diff(sorted_shards)) + 1).tolist()
    bounds = [0, *cuts, idx.size]
    out: list[Part] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        shard = int(sorted_shards[a])
        pos = order[a:b]
        out.append((shard, idx[pos] - shard * shard_size, pos))
    return out


def is_run(a: np.ndarray) -> bool:
    """True iff the int array ``a`` is ``[a0, a0+1, ..., a0+n-1]`` (Python ints: numpy's per-call
    cost exceeds a batch's few rows)."""
    rows = a.tolist()
    return not rows or rows == list(range(rows[0], rows[0] + len(rows)))


def batch_places(groups: Sequence[Part], n: int) -> list[tuple[int, int]]:
    """``(shard, row)`` of each of the ``n`` batch rows, from the batch's shard groups."""
    places: list[tuple[int, int]] = [(0, 0)] * n
    for shard, local, pos in groups:
        at = range(local.size) if pos is None else pos.tolist()
        for p, r in zip(at, local.tolist(), strict=True):
            places[p] = (shard, r)
    return places


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
    and the run plan if counting the runs needed one (the preadv pieces reuse it).

    :data:`COPY_ENGINE` ``"preadv"`` / ``"mapped"`` decides alone. ``"auto"``: a key goes
    through ``preadv`` when its runs average at least :data:`PREADV_MIN_RUN_BYTES`; then
    every key whose rows are one run joins it (one more system call costs less than a
    gather's fixed cost), while a part with no such key gathers throughout.
    """
    if COPY_ENGINE != "auto":
        return dict.fromkeys(keys, COPY_ENGINE == "preadv"), None
    min_run_bytes = PREADV_MIN_RUN_BYTES
    plan: RunPlan | None = None  # the same row pattern for every key: planned at most once
    out: dict[str, bool] = {}
    for key in keys:
        row_bytes = row_nbytes(entries[key])
        use = row_bytes >= min_run_bytes
        # the run count is only needed when the bounds 1 <= runs <= m leave it open
        if not use and row_bytes * local.size >= min_run_bytes:
            plan = plan or plan_runs(local, pos)
            use = row_bytes * local.size >= min_run_bytes * plan.num_runs
        out[key] = use
    if any(out.values()) and is_run(local) and (pos is None or is_run(pos)):
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
    if f.tokens is None:
        engines, plan = choose_engines(keys, local, pos, f.header.entries)
    else:
        # a token shard's per-sample keys are small: preadv them. A mapping's page faults would
        # read around them and leave read-ahead marks that make the kernel prefetch the ragged
        # tensors behind them too, which a CP rank reads only a share of
        engines, plan = dict.fromkeys(keys, True), None
    path, entries = f.name, f.header.entries  # messages name the shard as its storage does

    def verifier(key: str, dst: torch.Tensor) -> Callable[[int, Sequence[int]], None] | None:
        """The check of a piece's rows once they are in ``dst`` (``[m, ...]`` rows, contiguous;
        None: nothing to check)."""
        if sums is None:
            return None
        expected, views = sums.sums[key], row_views(dst, dst.shape[0])

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
    local_run = pos_run = False
    rows_t: torch.Tensor | None = None
    all_rows: Sequence[int] = ()
    for key in keys:
        e = entries[key]
        row_bytes = row_nbytes(e)
        if engines[key]:
            after = verifier(key, out[key])
            plan = plan or plan_runs(local, pos)
            pieces += plan_pieces(
                fd, e.start, row_bytes, plan, raw[key], path, after, chunk, owner=f
            )
            continue
        if views is None:  # the row pattern is the same for every key: work it out once per shard
            views = f.mapped(keys, repair)
            local_run, pos_run = is_run(local), pos is None or is_run(pos)
            rows_t = None if local_run else torch.from_numpy(local)
            all_rows = (
                range(int(local[0]), int(local[0]) + local.size) if local_run else local.tolist()
            )
        dst = out[key]
        if pos is None and local.size == dst.shape[0]:
            target = dst
        elif pos is None or pos_run:
            start = 0 if pos is None else int(pos[0])
            target = dst[start : start + local.size]
        else:
            target = torch.empty((local.size, *dst.shape[1:]), dtype=dst.dtype)
            scattered.append((dst, torch.from_numpy(pos), target))
        after = verifier(key, target)
        step = max(1, chunk // row_bytes) if chunk and row_bytes else local.size
        first = int(local[0]) if local_run else 0
        if step >= local.size:  # the common case: one piece for the key's rows of this shard
            pieces.append(
                GatherPiece(
                    views[key],
                    rows_t,
                    first,
                    target,
                    local.size * row_bytes,
                    path,
                    after,
                    (0, all_rows),
                )
            )
            continue
        for a in range(0, local.size, step):
            m = min(step, local.size - a)
            pieces.append(
                GatherPiece(
                    views[key],
                    None if rows_t is None else rows_t[a : a + m],
                    first + a if local_run else 0,
                    target[a : a + m],
                    m * row_bytes,
                    path,
                    after,
                    (a, all_rows[a : a + m]),
                )
            )


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

    __slots__ = ("path", "name", "header", "fd", "views", "handle", "tokens", "fetch", "_pid")

    def __init__(
        self,
        path: str,
        header: ShardHeader,
        tokens: TokenIndex | None = None,
        fetch: Fetch | None = None,
        name: str | None = None,
    ) -> None:
        self.path, self.name, self.header, self.fd = path, name or path, header, -1
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
