"""Copy a batch's rows out of a shard file: one copy per byte, page cache -> batch tensor.

A batch of a cache key is ``n`` rows of ``row_bytes`` bytes each, at file offset
``base + row * row_bytes`` (safetensors stores every tensor contiguously, row-major).
:func:`plan_runs` sorts the batch's rows by file position and cuts them into
*runs* of consecutive file rows; :func:`plan_pieces` makes each run one
``os.preadv`` (:func:`read_piece`) whose iovecs point straight at the destination rows (in batch order,
wherever they sit), so the kernel copies each byte once from the page cache into
the tensor: no mapping, so no page faults on the source, and no staging buffer.

The batch tensors themselves come from ``buffers.DestinationBuffers``.

Everything here is per process and owns no file descriptors: the reader opens
and caches them (see ``reader.py``).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from te_thd.args import check_int

__all__ = [
    "GatherPiece",
    "ParallelReads",
    "PendingReads",
    "Piece",
    "ReadError",
    "RunPlan",
    "advise",
    "plan_pieces",
    "plan_runs",
    "default_read_threads",
    "read_piece",
    "tensor_memoryview",
]

#: Linux's limit on iovecs per ``preadv`` call; longer runs are split.
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024

_fadvise = getattr(os, "posix_fadvise", None)  # not on macOS


def advise(fd: int, advice: str, offset: int = 0, length: int = 0) -> None:
    """Page-cache advice on ``fd``'s bytes ``[offset, offset + length)`` (``length`` 0: to the end), the
    one place the cache gives it; nothing where the platform has no ``posix_fadvise``.

    ``"willneed"``: start reading those pages now, so scattered reads queue up at the
    storage at once. ``"random"``: no kernel read-ahead, for a file read a few pieces
    here and there (a shard header; a ragged shard), where read-ahead reads what is not needed.
    """
    if _fadvise is not None:
        _fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED if advice == "willneed" else os.POSIX_FADV_RANDOM)


@dataclass(frozen=True)
class RunPlan:
    """How to read rows of one shard tensor into rows of a batch tensor.

    ``dst`` (``n`` ints): destination batch rows, sorted by the file row they
    receive and then by themselves (a repeated file row fills its rows in
    ascending order). Run ``k`` fills
    ``dst[starts[k]:starts[k+1]]`` (``starts``: ``runs + 1`` ints) from file rows
    ``first_row[k] + 0, 1, ...``. ``dst_contiguous[k]``: those destination rows are
    consecutive too, so the whole run is one iovec.
    """

    dst: list[int]
    starts: list[int]
    first_row: list[int]
    dst_contiguous: list[bool]

    @property
    def num_runs(self) -> int:
        return len(self.first_row)


def plan_runs(local: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray | None = None) -> RunPlan:
    """Cut the file rows ``local`` (``n`` ints, any order, repeats allowed) into runs.

    ``dst`` (``n`` ints, default ``0..n-1``): the batch row each of ``local`` goes
    to. A run is a maximal stretch of the rows sorted by file position where each
    row is the previous plus one; a repeated row (wrap-around padding) starts a new
    run, so the runs partition the batch rows. Pure, no I/O. Plain Python: for a
    batch's few dozen rows it costs a few microseconds, a tenth of the equivalent
    dozen numpy calls.
    """
    rows = local.tolist() if isinstance(local, np.ndarray) else list(local)
    targets = range(len(rows)) if dst is None else (dst.tolist() if isinstance(dst, np.ndarray) else list(dst))
    if len(targets) != len(rows):
        raise ValueError(f"dst has {len(targets)} rows, local {len(rows)}; pass one batch row per file row")
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


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """Writable byte view (``memoryview`` of ``[numel * itemsize]`` uint8) of a contiguous CPU tensor."""
    if not t.is_contiguous():
        raise ValueError(f"tensor of shape {list(t.shape)} is not contiguous; read into a contiguous tensor")
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B") if flat.numel() else memoryview(bytearray())


#: Called after each piece of a read: ``(batch row of the piece's first row, the file rows
#: it read)`` (a ``range`` or a list, one per batch row); the piece's batch rows are consecutive.
AfterRead = Callable[[int, Sequence[int]], None]


class Piece(NamedTuple):
    """One ``preadv`` of a batch read: ``iov`` (writable byte views of batch rows) from ``offset`` of ``fd``.

    ``after(*args)`` (or None) runs right after the bytes are in place, on the
    thread that read them: a checksum finds them still in cache. ``nbytes`` is
    the size of ``iov``; ``path`` names the file in errors. A named tuple, not a
    frozen dataclass: a batch builds a dozen of these, and a frozen dataclass's
    checked ``__init__`` is several times slower to build.
    """

    fd: int
    offset: int
    iov: list[memoryview]
    nbytes: int
    path: str
    after: AfterRead | None = None
    args: tuple[int, Sequence[int]] = (0, ())
    #: what keeps ``fd`` open until the piece is read (the reader's open-shard object)
    owner: object = None


class GatherPiece(NamedTuple):
    """One gather of a batch read: rows of ``src`` (a memory-mapped shard tensor ``[rows, ...]``)
    copied into ``dst`` (``[m, ...]``, consecutive batch rows), then ``after(*args)``.

    ``rows``: the file rows, int64 ``[m]``, or ``None`` for the run ``first, first + 1, ...``
    (one slice copy instead of an index). ``src`` keeps its mapping alive until the piece is read.
    """

    src: torch.Tensor
    rows: torch.Tensor | None
    first: int
    dst: torch.Tensor
    nbytes: int
    path: str
    after: AfterRead | None = None
    args: tuple[int, Sequence[int]] = (0, ())


def plan_pieces(
    fd: int, base: int, row_bytes: int, plan: RunPlan, dst: memoryview, path: str,
    after: AfterRead | None = None, chunk_bytes: int = 0, owner: object = None,
) -> list[Piece]:  # fmt: skip
    """The reads that put the planned rows of one tensor into ``dst`` (the bytes of the batch tensor ``[B, row]``).

    ``base``: file offset of row 0 of the tensor; ``row_bytes``: bytes per row.
    A run whose batch rows are consecutive is one piece, or pieces of at most
    ``chunk_bytes`` (whole rows; 0: no limit) -- so a checksum finds them in
    cache, or so that threads can share them. A run scattered over the batch is
    one iovec per row, at most ``IOV_MAX`` per piece; with ``after``, one row
    per piece. ``after(batch row of the piece's first row, its file rows)`` is called
    once per piece, whose batch rows are consecutive. ``owner``: kept
    by every piece (whatever keeps ``fd`` open while the pieces wait to be read).
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
                out.append(Piece(fd, offset + c * row_bytes, [view], r * row_bytes, path, after, (p + c, rows), owner))
            continue
        if after is not None:
            for j, p in enumerate(dst_rows[a:b]):
                view = dst[p * row_bytes : (p + 1) * row_bytes]
                row = first[k] + j
                out.append(Piece(fd, offset + j * row_bytes, [view], row_bytes, path, after, (p, range(row, row + 1)), owner))
            continue
        per = min(IOV_MAX, max(1, step)) if step else IOV_MAX
        for c in range(a, b, per):
            rows = dst_rows[c : min(b, c + per)]
            iov = [dst[p * row_bytes : (p + 1) * row_bytes] for p in rows]
            out.append(Piece(fd, offset + (c - a) * row_bytes, iov, len(rows) * row_bytes, path, None, (0, ()), owner))
    return out


class ReadError(OSError):
    """A piece could not be read: ``path`` names the file, the message says why."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


def read_piece(piece: Piece | GatherPiece) -> None:
    """Read ``piece`` and run its ``after``; a failed read raises :class:`ReadError`."""
    if type(piece) is GatherPiece:
        m = piece.dst.shape[0]
        if piece.rows is None:
            piece.dst.copy_(piece.src[piece.first : piece.first + m])
        else:
            torch.index_select(piece.src, 0, piece.rows, out=piece.dst)
    else:
        try:
            _preadv_all(piece.fd, piece.iov, piece.offset)
        except OSError as exc:
            raise ReadError(piece.path, str(exc)) from exc
    if piece.after is not None:
        piece.after(*piece.args)


#: A batch is read by several threads only from this many bytes on: below it,
#: waking a helper thread (when its core sleeps) costs more than the second core
#: saves (the crossover, measured by ``perf/measure_read_crossover.py``: docs/performance-io.md).
PARALLEL_MIN_BYTES = 4 << 20


def default_read_threads() -> int:
    """Threads a main-process reader uses by default: 2 when this process may run on 2+ CPUs, else 1.

    Two, not one per CPU: a training process needs its other cores for itself
    (CUDA launches, the step's own CPU work), and two copy threads already take
    a large share of a socket's memory bandwidth on a copy that lasts a millisecond.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cpus >= 2 else 1


class _Batch:
    """The pieces of one batch, taken one at a time by whichever thread is free.

    ``deque.popleft`` is atomic, so the caller and any number of helpers can
    :meth:`drain` it together: a helper that wakes late, or a core that is busy
    elsewhere, leaves its share to the others instead of holding up the batch.
    """

    def __init__(self, pieces: Sequence[Piece | GatherPiece]) -> None:
        self._left: deque[Piece | GatherPiece] = deque(pieces)
        self.errors: list[BaseException] = []

    def drain(self) -> None:
        """Read pieces until none is left; on a failure record it and drop the rest."""
        left = self._left
        while True:
            try:
                piece = left.popleft()
            except IndexError:
                return
            try:
                read_piece(piece)
            except BaseException as exc:  # noqa: BLE001 - raised by the waiting thread
                self.errors.append(exc)
                left.clear()
                return


class _Worker:
    """One helper thread with its own queue, draining the batches it is handed.

    A daemon thread: a read still in flight at interpreter exit only wrote into
    memory nobody reads.
    """

    def __init__(self, name: str) -> None:
        # the thread holds only the queue, so a dropped worker can be collected: its
        # __del__ sends the thread the stop marker
        self._queue: queue.SimpleQueue[tuple[_Batch, Future[None]] | None] = queue.SimpleQueue()
        self._pid = os.getpid()
        threading.Thread(target=_work, args=(self._queue,), name=name, daemon=True).start()

    def submit(self, batch: _Batch) -> Future[None]:
        done: Future[None] = Future()
        self._queue.put((batch, done))
        return done

    # os.getpid bound at definition: at interpreter exit the module may be torn down first
    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        if getattr(self, "_pid", None) == _getpid():  # a forked child has no thread to stop
            self._queue.put(None)


def _work(jobs: queue.SimpleQueue[tuple[_Batch, Future[None]] | None]) -> None:
    """A helper thread's loop: drain each batch it is handed, until the stop marker."""
    while True:
        job = jobs.get()
        if job is None:
            return
        batch, done = job
        batch.drain()
        done.set_result(None)
        del job, batch, done  # while idle, hold no batch memory and no shard open


class PendingReads:
    """A batch being read (:meth:`ParallelReads.start`); :meth:`wait` finishes it."""

    def __init__(self, batch: _Batch, helpers: list[Future[None]], finish: Callable[[], None] | None) -> None:
        self._batch: _Batch | None = batch
        self._helpers = helpers
        self._finish = finish

    def wait(self) -> None:
        """Read whatever pieces are left on this thread too, then run ``finish``.

        Returns once no thread writes into the batch any more, also when one of
        them failed: then the first error recorded is raised (and ``finish`` does not run).
        """
        batch, self._batch = self._batch, None
        if batch is None:
            return
        batch.drain()
        for f in self._helpers:
            f.result()  # waits for the piece a helper may still be reading
        finish, self._helpers, self._finish = self._finish, [], None
        if batch.errors:
            raise batch.errors[0]
        if finish is not None:
            finish()


class ParallelReads:
    """Reads a batch's pieces on up to ``threads`` threads.

    ``preadv`` and ``xxh3_64`` both release the GIL, so each thread's kernel copy
    and checksum run on their own core; a single-threaded copy tops out at one
    core's memory bandwidth. The pieces sit in one queue per batch that every
    participating thread takes from (``_Batch``). :meth:`run` reads with the
    calling thread and ``threads - 1`` helpers; :meth:`start` hands a batch to
    ``threads`` helpers and returns at once (read-ahead: the caller plans the
    next batch, or the training step runs, meanwhile), and the caller joins in
    when it waits. Helper threads start on first use and belong to the process
    that started them (a forked DataLoader worker starts its own).
    """

    def __init__(self, threads: int, min_bytes: int | None = None) -> None:
        check_int("read_threads", threads, 1, meaning=" (1: read on the calling thread only)")
        self.threads = threads
        self.min_bytes = min_bytes
        self._workers: list[_Worker] = []
        self._pid = os.getpid()

    def _shared(self, pieces: Sequence[Piece]) -> bool:
        # the module constant is looked up per batch: a bench measuring the split patches it
        limit = PARALLEL_MIN_BYTES if self.min_bytes is None else self.min_bytes
        return self.threads > 1 and len(pieces) > 1 and sum(p.nbytes for p in pieces) >= limit

    def run(
        self, pieces: Sequence[Piece | GatherPiece], finish: Callable[[], None] | None = None
    ) -> None:
        """Read every piece; ``finish`` (the batch's last step) then runs on the calling thread.

        The pieces are shared out only when they hold at least ``min_bytes``
        (``None``: :data:`PARALLEL_MIN_BYTES`). Returns once every thread is done
        with the batch's memory, also when one of them failed: then the first
        error is raised.
        """
        self.start(pieces, finish, helpers=self.threads - 1).wait()

    def start(
        self, pieces: Sequence[Piece | GatherPiece], finish: Callable[[], None] | None = None,
        helpers: int | None = None,
    ) -> PendingReads:  # fmt: skip
        """Hand the pieces to ``helpers`` (default ``threads``) helper threads and return at once.

        ``run``'s threshold applies: a smaller batch is read by :meth:`PendingReads.wait`
        on the waiting thread, which also runs ``finish``.
        """
        batch = _Batch(pieces)
        if not self._shared(pieces):
            return PendingReads(batch, [], finish)
        workers = self._started()
        n = self.threads if helpers is None else helpers
        return PendingReads(batch, [w.submit(batch) for w in workers[:n]], finish)

    def _started(self) -> list[_Worker]:
        """This process's ``threads`` helper threads, one queue each."""
        if len(self._workers) != self.threads or self._pid != os.getpid():
            self._pid = os.getpid()  # a forked child inherits the list but not the threads
            self._workers = [_Worker(f"te_thd-read-{i}") for i in range(self.threads)]
        return self._workers

    def __getstate__(self) -> dict[str, int | None]:
        # threads belong to the process that started them
        return {"threads": self.threads, "min_bytes": self.min_bytes}

    def __setstate__(self, state: dict[str, int | None]) -> None:
        self.__init__(**state)  # type: ignore[misc]


def _preadv_all(fd: int, iov: list[memoryview], offset: int) -> None:
    """``os.preadv`` until every iovec is full (a large read may return short)."""
    want = sum(v.nbytes for v in iov)
    got = os.preadv(fd, iov, offset)
    while got < want:
        if got == 0:
            raise OSError(f"file ended at byte {offset} while reading {want} bytes (truncated after open?)")
        # drop the filled part and retry the rest
        rest: list[memoryview] = []
        skip = got
        for v in iov:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        offset, want, iov = offset + got, want - got, rest
        got = os.preadv(fd, iov, offset)
