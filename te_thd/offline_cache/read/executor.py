"""Execute a planned batch read: read its pieces (``preadv`` runs, gathers from a mapped shard),
each verified by the thread that read it, into destination tensors that are recycled once the
consumer lets go.

Everything here is per process and owns no file descriptors: the read source opens and caches them
(``read.source.ShardSource``); ``read.planner`` and the ragged reads make the pieces.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from te_thd.args import check_int
from te_thd.offline_cache.format.integrity import byte_view
from te_thd.offline_cache.format.schema import tensor_nbytes

__all__ = [
    "DestinationBuffers",
    "GatherPiece",
    "ParallelReads",
    "PendingReads",
    "Piece",
    "ReadError",
    "default_read_threads",
    "fill_rows",
    "new_tensor",
    "read_piece",
]


#: Linux's limit on iovecs per ``preadv`` call: a piece holds at most this many.
IOV_MAX = (
    os.sysconf("SC_IOV_MAX")
    if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names
    else 1024
)

#: Called after each piece of a read: ``(batch row of the piece's first row, the file rows
#: it read)`` (a ``range`` or a list, one per batch row); the piece's batch rows are consecutive.
AfterRead = Callable[[int, Sequence[int]], None]


class Piece(NamedTuple):
    """One ``preadv`` of a batch read: ``iov`` (writable byte views of batch rows) from ``offset``
    of ``fd``.

    ``after(*args)`` (or None) runs right after the bytes are in place, on the thread that read
    them: a checksum finds them still in cache. ``nbytes``: the size of ``iov``; ``path`` names
    the file in errors. A named tuple: a batch builds many, and it is the cheapest to build.
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


class ReadError(OSError):
    """A piece could not be read: ``path`` names the file, the message says why."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


def read_piece(piece: Piece | GatherPiece) -> None:
    """Read ``piece`` and run its ``after``; a failed read raises :class:`ReadError`."""
    if type(piece) is Piece:
        try:
            got = os.preadv(piece.fd, piece.iov, piece.offset)
            if got != piece.nbytes:
                _preadv_rest(piece.fd, piece.iov, piece.offset, piece.nbytes, got)
        except OSError as exc:
            raise ReadError(piece.path, str(exc)) from exc
    elif piece.rows is None:
        piece.dst.copy_(piece.src[piece.first : piece.first + piece.dst.shape[0]])
    else:
        torch.index_select(piece.src, 0, piece.rows, out=piece.dst)
    if piece.after is not None:
        piece.after(*piece.args)


def _preadv_rest(fd: int, iov: list[memoryview], offset: int, want: int, got: int) -> None:
    """``os.preadv`` until all ``want`` bytes of the iovecs (``got`` read so far) are in: a read may
    return short."""
    while got < want:
        if got == 0:
            raise OSError(
                f"file ended at byte {offset} while reading {want} bytes (truncated after open?)"
            )
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


#: A batch is read by several threads only from this many bytes on: below it,
#: waking a helper thread (when its core sleeps) costs more than the second core
#: saves (the crossover, measured by ``perf/measure_read_crossover.py``: docs/performance-io.md).
PARALLEL_MIN_BYTES = 4 << 20


def default_read_threads() -> int:
    """Threads a main-process reader uses by default: 2 when this process may run on 3+ CPUs, else
    1.

    Two, not one per CPU: a training process needs its other cores for itself
    (CUDA launches, the step's own CPU work), and two copy threads already take
    a large share of a socket's memory bandwidth on a copy that lasts a millisecond.
    One on 2 CPUs: the other core is the rest of the machine's, and a helper waiting
    for it costs a batch more than its copy saves (docs/performance-io.md).
    """
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return 2 if cpus >= 3 else 1


class _Batch:
    """The pieces of one batch, taken one at a time by whichever thread is free (``deque.popleft``
    is atomic): a helper that wakes late leaves its share to the others instead of holding up the
    batch. A helper counts itself busy before it takes a piece, so once none is left and none is
    busy, no thread writes into the batch any more (the waiting thread never waits for one that
    never woke)."""

    def __init__(self, pieces: Sequence[Piece | GatherPiece], shared: bool) -> None:
        self._left: deque[Piece | GatherPiece] = deque(pieces)
        self.errors: list[BaseException] = []
        self._idle = (
            threading.Condition() if shared else None
        )  # None: read by the waiting thread alone
        self._busy = 0

    def drain(self, helper: bool = False) -> None:
        """Read pieces until none is left; on a failure record it and drop the rest."""
        if helper:  # a helper is handed only a shared batch: one with a condition
            with self._idle:  # type: ignore[union-attr]
                self._busy += 1
        left = self._left
        try:
            while left:
                try:
                    piece = left.popleft()
                except IndexError:
                    return
                read_piece(piece)
        except BaseException as exc:  # noqa: BLE001 - raised by the waiting thread
            self.errors.append(exc)
            left.clear()
        finally:
            if helper:
                with self._idle:  # type: ignore[union-attr]
                    self._busy -= 1
                    self._idle.notify_all()

    def wait_idle(self) -> None:
        """Return once no helper reads a piece of this batch."""
        if self._idle is None:
            return
        with self._idle:
            while self._busy:
                self._idle.wait()


class _Worker:
    """One helper thread with its own queue, draining the batches it is handed. A daemon thread: a
    read still in flight at interpreter exit only writes into memory nobody reads."""

    def __init__(self, name: str) -> None:
        # the thread holds only the queue, so a dropped worker can be collected: its
        # __del__ sends the thread the stop marker
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._pid = os.getpid()
        threading.Thread(target=_work, args=(self._queue,), name=name, daemon=True).start()

    def submit(self, batch: _Batch) -> None:
        self._queue.put(batch)

    # os.getpid bound at definition: at interpreter exit the module may be torn down first
    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        if getattr(self, "_pid", None) == _getpid():  # a forked child has no thread to stop
            self._queue.put(None)


def _work(jobs: queue.SimpleQueue[_Batch | None]) -> None:
    """A helper thread's loop: drain each batch it is handed, until the stop marker."""
    while True:
        batch = jobs.get()
        if batch is None:
            return
        batch.drain(helper=True)
        del batch  # while idle, hold no batch and no shard open


class PendingReads:
    """A batch being read (:meth:`ParallelReads.start`); :meth:`wait` finishes it."""

    def __init__(self, batch: _Batch, finish: Callable[[], None] | None) -> None:
        self._batch: _Batch | None = batch
        self._finish = finish

    def wait(self) -> None:
        """Read whatever pieces are left on this thread too, then run ``finish``. Returns once no
        thread writes into the batch any more; if one failed, raises the first error (``finish``
        does not run)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        batch.drain()
        batch.wait_idle()  # a helper may still be reading the piece it took
        finish, self._finish = self._finish, None
        if batch.errors:
            raise batch.errors[0]
        if finish is not None:
            finish()


class ParallelReads:
    """Reads a batch's pieces on up to ``threads`` threads.

    ``preadv`` and ``xxh3_64`` both release the GIL, so each thread's copy and checksum run
    on their own core. :meth:`run` reads with the calling thread and ``threads - 1`` helpers;
    :meth:`start` hands a batch to ``threads`` helpers and returns at once (read-ahead), and
    the caller joins in when it waits. Helper threads start on first use and belong to the
    process that started them (a forked DataLoader worker starts its own).
    """

    def __init__(self, threads: int) -> None:
        check_int("read_threads", threads, 1, meaning=" (1: read on the calling thread only)")
        self.threads = threads
        self._workers: list[_Worker] = []
        self._pid = os.getpid()

    def _shared(self, pieces: Sequence[Piece]) -> bool:
        # the module constant is looked up per batch: a bench measuring the split patches it
        return (
            self.threads > 1
            and len(pieces) > 1
            and sum(p.nbytes for p in pieces) >= PARALLEL_MIN_BYTES
        )

    def run(
        self, pieces: Sequence[Piece | GatherPiece], finish: Callable[[], None] | None = None
    ) -> None:
        """Read every piece, then run ``finish`` (the batch's last step) on the calling thread;
        shared out only from :data:`PARALLEL_MIN_BYTES`. As :meth:`PendingReads.wait`."""
        self.start(pieces, finish, helpers=self.threads - 1).wait()

    def start(
        self,
        pieces: Sequence[Piece | GatherPiece],
        finish: Callable[[], None] | None = None,
        helpers: int | None = None,
    ) -> PendingReads:
        """Hand the pieces to ``helpers`` (default ``threads``) helper threads and return at once;
        below ``run``'s threshold, :meth:`PendingReads.wait` reads them on the waiting thread."""
        shared = self._shared(pieces)
        batch = _Batch(pieces, shared)
        if shared:
            for w in self._started()[: self.threads if helpers is None else helpers]:
                w.submit(batch)
        return PendingReads(batch, finish)

    def _started(self) -> list[_Worker]:
        """This process's ``threads`` helper threads, one queue each."""
        if len(self._workers) != self.threads or self._pid != os.getpid():
            self._pid = os.getpid()  # a forked child inherits the list but not the threads
            self._workers = [_Worker(f"te_thd-read-{i}") for i in range(self.threads)]
        return self._workers

    def __getstate__(self) -> dict[str, int]:
        # threads belong to the process that started them
        return {"threads": self.threads}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(**state)  # type: ignore[misc]


def new_tensor(
    shape: Sequence[int], dtype: torch.dtype, *, shared: bool = False, pinned: bool = False
) -> torch.Tensor:
    """An uninitialised CPU tensor ``shape``/``dtype``; ``shared``: in shared memory (a DataLoader
    worker's batch travels without a copy); ``pinned``: page-locked, for a non-blocking copy to
    CUDA."""
    shape = tuple(int(s) for s in shape)
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if not shared:
        return torch.empty(shape, dtype=dtype)
    # public API: moving a fresh tensor to shared memory costs the one copy torch's
    # worker pickling would make of a tensor that is not there yet
    return torch.empty(shape, dtype=dtype).share_memory_()


def fill_rows(
    t: torch.Tensor, starts: Sequence[int], ends: Sequence[int], value: float = 0
) -> None:
    """Set rows ``[starts[i], ends[i])`` of the contiguous CPU tensor ``t`` (``[N, ...]``) to
    ``value``.

    Zeros are a plain ``memset`` of the rows' bytes on this thread: a large ``zero_`` would wake
    torch's intra-op threads, which on a busy machine wait for a core longer than the fill takes.
    """
    if value == 0 and t.numel():
        raw = np.frombuffer(byte_view(t), dtype=np.uint8)
        row = raw.size // t.shape[0]
        for a, b in zip(starts, ends, strict=True):
            raw[a * row : b * row] = 0
        return
    for a, b in zip(starts, ends, strict=True):
        t[a:b].fill_(value)


#: A buffer asked for zeroed (:meth:`DestinationBuffers.get_zeroed`) is allocated zeroed from this
#: size on: glibc serves it from freshly mapped pages, whose untouched pages cost nothing. A smaller
#: one may be recycled heap memory that ``calloc`` would zero whole, more than the caller's padding.
ZEROED_MIN_BYTES = 32 << 20


class _Buffer:
    """One pooled buffer: its bytes (a numpy array, the owner of the memory), a writable view of
    them, and the owner's reference count while no tensor uses it."""

    __slots__ = ("idle_refs", "owner", "whole")

    def __init__(self, nbytes: int, zeroed: bool = False) -> None:
        # zeroed: calloc'd, so fresh pages are the kernel's zero pages, paid for only when written
        self.owner = (
            np.zeros(nbytes, dtype=np.uint8) if zeroed else np.empty(nbytes, dtype=np.uint8)
        )
        self.whole = memoryview(self.owner)
        self.idle_refs = 0
        self.idle_refs = self.refs()

    def refs(self) -> int:
        """The owner's reference count: every tensor made over it holds one through its storage
        (``torch.frombuffer``), however many views of that tensor exist. Always measured
        through this method, so the interpreter's own temporaries count the same each time."""
        return sys.getrefcount(self.owner)

    def idle(self) -> bool:
        return self.refs() == self.idle_refs


class DestinationBuffers:
    """Destination tensors for batches: fresh to the consumer, recycled once it lets go.

    ``get(key, n, sample_shape, dtype)`` -> ``(tensor, bytes)``: an uninitialised
    ``[n, *sample_shape]`` tensor and a writable memoryview of its bytes. A buffer is handed
    out again only once every reference to its memory outside this pool is gone: the pool
    owns it as a numpy array and hands out tensors made over it (``torch.frombuffer``), so
    the array's reference count says whether the consumer still holds the batch. A loop
    that drops batch ``i`` while it reads ``i + 1`` cycles between two buffer sets; one
    that keeps its batches gets new memory. Recycling saves the page faults of fresh memory.

    Args:
        shared: allocate in shared memory, never recycle (inside a DataLoader worker: the
            batch leaves the process, and the main process's references are invisible here).
        pinned: page-locked memory for a CUDA destination, never recycled here: torch's
            caching host allocator recycles it once the copies that used it have finished.
        max_pooled: buffers kept per key (and dtype / sample shape).
    """

    def __init__(self, *, shared: bool = False, pinned: bool = False, max_pooled: int = 4) -> None:
        if shared and pinned:
            raise ValueError(
                "shared=True and pinned=True: a DataLoader worker's batch is pinned by "
                "the main process"
            )
        self.shared = shared
        self.pinned = pinned
        self.max_pooled = max_pooled
        self._pool: dict[tuple[str, torch.dtype, tuple[int, ...]], list[_Buffer]] = {}

    def get(
        self, key: str, n: int, sample_shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, memoryview]:
        t, raw, _ = self.get_zeroed(key, n, sample_shape, dtype, zeroed=False)
        return t, raw

    def get_zeroed(
        self,
        key: str,
        n: int,
        sample_shape: tuple[int, ...],
        dtype: torch.dtype,
        zeroed: bool = True,
        recycle: bool = True,
    ) -> tuple[torch.Tensor, memoryview, bool]:
        """As :meth:`get`, and whether every byte of the tensor is zero: a buffer newly made here of
        at least :data:`ZEROED_MIN_BYTES` (``zeroed``: allocated zeroed, whose pages cost nothing
        until written), so a caller that zeroes what it does not write skips that. A recycled
        buffer holds what it held.

        ``recycle=False``: a caller that writes a small part of a large tensor (a batch mostly
        padding) gets a new zeroed buffer of that size instead of an idle one, whose unwritten
        pages then cost nothing, where an idle one's would all be filled; the idle buffers of the
        key are let go."""
        shape = (n, *sample_shape)
        if self.shared or self.pinned:
            t = new_tensor(shape, dtype, shared=self.shared, pinned=self.pinned)
            return t, byte_view(t), False
        nbytes = tensor_nbytes(dtype, shape)
        entries = self._pool.setdefault((key, dtype, sample_shape), [])
        if not recycle and zeroed and nbytes >= ZEROED_MIN_BYTES:
            entries[:] = [buf for buf in entries if not buf.idle()]
        else:
            for buf in entries:
                if buf.owner.nbytes >= nbytes and buf.idle():
                    return self._tensor(buf.owner, nbytes, dtype, shape), buf.whole[:nbytes], False
        zeroed = zeroed and nbytes >= ZEROED_MIN_BYTES
        buf = _Buffer(nbytes, zeroed)
        entries.append(buf)
        if len(entries) > self.max_pooled:
            entries.pop(0)  # the oldest: still held by the consumer (now only theirs) or idle
        return self._tensor(buf.owner, nbytes, dtype, shape), buf.whole, zeroed

    @staticmethod
    def _tensor(
        owner: np.ndarray, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        if nbytes == 0:  # zero-size rows: nothing to share (an empty array has no strides to view)
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(owner, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
