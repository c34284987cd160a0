"""Plan a batch read: which shard rows go where, which copy primitive reads each part, as pieces.

A batch of sample indices becomes, per shard it touches, one *part*: the shard's
rows (``local``) and the batch rows they fill (``pos``). :func:`plan_shard_rows`
turns every key's part into pieces for the read executor
(``copyread.ParallelReads``), each checked right after it is read by the thread
that read it. A part is copied one of two ways, chosen per (key, shard) by
:func:`choose_engines`:

* ``preadv``: one system call per run of consecutive file rows, the kernel
  copying page cache -> batch tensor; no mapping, no page faults on the source,
  and a shard that shrinks under the reader is a clean error. Used when a key's
  runs average at least :data:`PREADV_MIN_RUN_BYTES`, and then also for the
  part's other keys whose rows are one run.
* gather: rows copied from the memory-mapped shard with one ``index_select``;
  used for smaller scattered rows, where one system call per row costs more
  than the row's bytes (figures: docs/performance-io.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .copyread import GatherPiece, Piece, RunPlan, plan_pieces, plan_runs
from .format import tensor_nbytes
from .integrity import ShardSums, row_views, verify_row_views
from .open_shards import OpenShard
from .shardheader import HeaderEntry

__all__ = [
    "COPY_ENGINE",
    "PREADV_MIN_RUN_BYTES",
    "Part",
    "Scattered",
    "batch_places",
    "choose_engines",
    "is_run",
    "plan_shard_rows",
    "row_ranges",
    "shard_groups",
]

#: A (key, shard) part of a batch is read with ``preadv`` when its runs of
#: consecutive file rows average at least this many bytes, else gathered from the
#: mapped shard. Measured crossover: see ``perf/measure_read_crossover.py`` and
#: docs/performance-io.md.
PREADV_MIN_RUN_BYTES = 256 * 1024

#: How every (key, shard) part of a batch is copied: ``"auto"`` (:func:`choose_engines`),
#: or ``"preadv"`` / ``"mapped"`` for all of them. Looked up per batch, so a bench that
#: measures one engine patches this constant.
COPY_ENGINE = "auto"

#: One shard's part of a batch: ``(shard, local rows int64 [m], batch rows int64 [m] or None for 0..m-1)``.
Part = tuple[int, np.ndarray, "np.ndarray | None"]

#: Gathered rows whose batch rows interleave with another shard's: ``(batch tensor, batch rows, rows)``,
#: moved into place by the batch's last step.
Scattered = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def shard_groups(idx: np.ndarray, shard_size: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``[(shard, local rows, batch positions)]`` of ``idx`` (int64 ``[B]``, in range), by shard."""
    shards = idx // shard_size
    order = np.argsort(shards, kind="stable")  # batch positions, grouped by shard
    sorted_shards = shards[order]
    cuts = (np.flatnonzero(np.diff(sorted_shards)) + 1).tolist()
    bounds = [0, *cuts, idx.size]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        shard = int(sorted_shards[a])
        pos = order[a:b]
        out.append((shard, idx[pos] - shard * shard_size, pos))
    return out


def is_run(a: np.ndarray) -> bool:
    """True iff the int array ``a`` is ``[a0, a0+1, ..., a0+n-1]``."""
    return a.size <= 1 or (int(a[-1]) - int(a[0]) == a.size - 1 and bool(np.all(np.diff(a) == 1)))


def batch_places(groups: Sequence[Part], n: int) -> list[tuple[int, int]]:
    """``(shard, row)`` of each of the ``n`` batch rows, from the batch's shard groups."""
    places: list[tuple[int, int]] = [(0, 0)] * n
    for shard, local, pos in groups:
        at = range(local.size) if pos is None else pos.tolist()
        for p, r in zip(at, local.tolist(), strict=True):
            places[p] = (shard, r)
    return places


def row_ranges(entries: dict[str, HeaderEntry], keys: Sequence[str], rows: np.ndarray) -> list[tuple[int, int]]:
    """``(file offset, bytes)`` of rows ``rows`` of every key in ``keys``: one range per run of consecutive rows."""
    rows = np.unique(rows)
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    out = []
    for key in keys:
        e = entries[key]
        rb = tensor_nbytes(e.dtype, e.shape[1:])
        out += [(e.start + int(run[0]) * rb, int(run.size) * rb) for run in runs if run.size]
    return out


def choose_engines(
    keys: Sequence[str], local: np.ndarray, pos: np.ndarray | None, entries: dict[str, HeaderEntry],
) -> tuple[dict[str, bool], RunPlan | None]:  # fmt: skip
    """``{key: read with preadv}`` for rows ``local`` -> batch rows ``pos`` of one shard,
    and the run plan if counting the runs needed one (the preadv pieces reuse it).

    :data:`COPY_ENGINE` ``"preadv"`` / ``"mapped"`` decides alone. ``"auto"``: a key goes
    through ``preadv`` when its runs of consecutive file rows average at least
    :data:`PREADV_MIN_RUN_BYTES`; then every key whose rows are one run joins it (one
    more system call costs less than the mapped gather's fixed cost for one small
    key), while a part with no such key uses the mapped gather throughout (its fixed
    cost shared by all keys).
    """
    if COPY_ENGINE != "auto":
        return dict.fromkeys(keys, COPY_ENGINE == "preadv"), None
    min_run_bytes = PREADV_MIN_RUN_BYTES
    plan: RunPlan | None = None  # the same row pattern for every key: planned at most once
    out: dict[str, bool] = {}
    for key in keys:
        row_bytes = tensor_nbytes(entries[key].dtype, entries[key].shape[1:])
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
    f: OpenShard, fd: int, keys: Sequence[str], local: np.ndarray, pos: np.ndarray | None,
    out: dict[str, torch.Tensor], raw: dict[str, memoryview], chunk: int, sums: ShardSums | None,
    first_sample: int, repair: str, engines: dict[str, bool], plan: RunPlan | None, pieces: list[Piece | GatherPiece], scattered: list[Scattered],
) -> None:  # fmt: skip
    """Plan copying rows ``local`` (int64 ``[m]``) of the open shard ``f`` into batch rows ``pos``
    (int64 ``[m]``; None: ``0..m-1``) of every key's batch tensor ``out[key]`` (whose bytes
    are ``raw[key]``).

    Every key's rows become pieces of at most ``chunk`` bytes (0: no limit; at least one
    row), appended to ``pieces``; with ``sums`` (the shard's checksums; None: no check), each
    is verified right after it is read, by the thread that read it (a mismatch names sample
    ``first_sample + row`` and says ``repair``). ``engines`` (:func:`choose_engines`) says per key whether
    ``preadv`` pieces read it from ``fd`` (``plan``: its run plan, if already made), else
    gather pieces from ``f``'s mapping. Gathered rows whose batch rows are not one stretch
    go to a scratch tensor, moved into place by the batch's last step (appended to
    ``scattered``).
    """
    path, entries = f.path, f.header.entries

    def verifier(key: str, dst: torch.Tensor) -> Callable[[int, Sequence[int]], None] | None:
        """The check of a piece's rows once they are in ``dst`` (``[m, ...]`` rows, contiguous;
        None: nothing to check)."""
        if sums is None:
            return None
        expected, views = sums.sums[key], row_views(dst, dst.shape[0])

        def after(p: int, rows: Sequence[int]) -> None:
            verify_row_views(views[p : p + len(rows)], rows, expected, path=path, key=key,
                             first_sample=first_sample, repair=repair)  # fmt: skip

        return after

    views: dict[str, torch.Tensor] | None = None
    local_run = pos_run = False
    rows_t: torch.Tensor | None = None
    all_rows: Sequence[int] = ()
    for key in keys:
        e = entries[key]
        row_bytes = tensor_nbytes(e.dtype, e.shape[1:])
        if engines[key]:
            after = verifier(key, out[key])
            plan = plan or plan_runs(local, pos)
            pieces += plan_pieces(fd, e.start, row_bytes, plan, raw[key], path, after, chunk, owner=f)
            continue
        if views is None:  # the row pattern is the same for every key: work it out once per shard
            views = f.mapped(keys, repair)
            local_run, pos_run = is_run(local), pos is None or is_run(pos)
            rows_t = None if local_run else torch.from_numpy(local)
            all_rows = range(int(local[0]), int(local[0]) + local.size) if local_run else local.tolist()
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
            pieces.append(GatherPiece(views[key], rows_t, first, target, local.size * row_bytes, path, after,
                                      (0, all_rows)))  # fmt: skip
            continue
        for a in range(0, local.size, step):
            m = min(step, local.size - a)
            pieces.append(GatherPiece(
                views[key], None if rows_t is None else rows_t[a : a + m], first + a if local_run else 0,
                target[a : a + m], m * row_bytes, path, after, (a, all_rows[a : a + m]),
            ))  # fmt: skip
