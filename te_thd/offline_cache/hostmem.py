"""Host resources of a write-behind producer: freed batch memory kept mapped, an idle-priority writer.

Both exist because a producer shares the host with the thread that drives the
model, and on a small host the writer's side effects, not its CPU time, are
what that thread feels (measured with ``perf/bench_produce_overlap.py`` on a
2-vCPU VM, compute time == write time; docs/performance-io.md):

- **Freed memory kept mapped** (:func:`retained_freed_memory`). A producer
  holds each computed batch until its shard is written, then frees it on the
  writer thread. Under glibc's default (dynamic) thresholds a freed block of a
  few MiB is returned to the kernel -- it was its own ``mmap``, or it tops a
  heap that glibc trims -- so the next batch's output lands in fresh pages and
  pays a page fault per page: ~110 faults and +0.3 ms per 3 MiB batch, 6-10% of
  the producer's throughput. Raising ``M_MMAP_THRESHOLD`` and
  ``M_TRIM_THRESHOLD`` keeps such blocks in the heap for reuse. glibc only
  (elsewhere a no-op); the thresholds are process-wide, so on exit the context
  leaves them where glibc's own dynamic rule ends after a 32 MiB block (mmap
  above 32 MiB, trim above 64 MiB): the next free returns what exceeds that to
  the kernel. The dynamic rule itself cannot be switched back on.
- **Idle-priority writer** (:class:`WriterPriority`). A write-behind thread at
  the default priority delays the compute thread's wake-ups when both CPUs are
  busy; at ``SCHED_IDLE`` the kernel preempts it the moment the compute thread
  wakes (a lower nice value does not do that under EEVDF: measured, no gain).
  Whenever the caller waits on the writer (its queue is full, a flush), the
  writer runs at normal priority again, so a busy host can slow it but never
  starve it. Used only where a thread may leave ``SCHED_IDLE`` again (root
  with ``CAP_SYS_NICE``, or ``RLIMIT_NICE`` allowing nice 0): probed once, on
  a throwaway thread; otherwise the writer stays at normal priority.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator

# glibc <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest M_MMAP_THRESHOLD glibc accepts on 64-bit hosts (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD_MAX = 32 << 20
#: free memory the heap keeps at its top while a producer runs
PRODUCER_TRIM_THRESHOLD = 1 << 30

@functools.cache
def process_libc() -> ctypes.CDLL | None:
    """The C library this process runs on (``ctypes.CDLL(None)``), or ``None`` where it cannot be loaded."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The process's glibc (for ``mallopt``), or ``None`` on another C library."""
    libc = process_libc()
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl's mallopt is a stub
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc ``mallopt``: blocks up to ``mmap_threshold`` bytes come from the heap, which keeps up
    to ``trim_threshold`` free bytes at its top. ``False`` when not glibc or refused."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


_retain_depth = 0
_retain_lock = threading.Lock()


@contextlib.contextmanager
def retained_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """Keep freed blocks up to :data:`MMAP_THRESHOLD_MAX` mapped while the block runs.

    Yields whether the thresholds were raised (glibc and ``enabled``). Nested or
    concurrent uses share one setting; the last one out trims and settles the
    thresholds (see the module docstring).
    """
    global _retain_depth
    if not enabled or _libc() is None:
        yield False
        return
    with _retain_lock:
        _retain_depth += 1
        applied = set_malloc_thresholds(MMAP_THRESHOLD_MAX, PRODUCER_TRIM_THRESHOLD)
    try:
        yield applied
    finally:
        with _retain_lock:
            _retain_depth -= 1
            if _retain_depth == 0 and applied:
                # not malloc_trim(0): a next producer call in this process reuses the memory at once
                set_malloc_thresholds(MMAP_THRESHOLD_MAX, 2 * MMAP_THRESHOLD_MAX)


_idle_ok: bool | None = None


def _probe_idle() -> None:
    global _idle_ok
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        _idle_ok = False
        return
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        _idle_ok = True
    except OSError:
        _idle_ok = False  # this thread is stuck at SCHED_IDLE; it ends here


def idle_priority_available() -> bool:
    """Whether a thread of this process may enter ``SCHED_IDLE`` and leave it again."""
    global _idle_ok
    if _idle_ok is None:
        if not hasattr(os, "SCHED_IDLE"):
            _idle_ok = False
        else:
            probe = threading.Thread(target=_probe_idle, name="te_thd-priority-probe")
            probe.start()
            probe.join()
    return bool(_idle_ok)


WRITER_PRIORITIES = ("idle", "normal")


def check_writer_priority(mode: object) -> str:
    """``mode`` if it is one of :data:`WRITER_PRIORITIES`, else a ``ValueError`` naming the argument."""
    if not isinstance(mode, str) or mode not in WRITER_PRIORITIES:
        raise ValueError(
            f"writer_priority={mode!r} must be one of {WRITER_PRIORITIES}: 'idle' lets the compute thread "
            "preempt the background writer, 'normal' keeps the default scheduling"
        )
    return mode


class WriterPriority:
    """The CPU priority of one background writer thread: idle while nobody waits on it.

    The writer calls :meth:`attach` from its own thread, then :meth:`job_started`
    before each job; a caller about to wait on the writer brackets the wait with
    ``with priority.waiting():``. ``mode="normal"`` (or a host where
    :func:`idle_priority_available` is false) makes every call a no-op.
    """

    def __init__(self, mode: str = "idle") -> None:
        self.mode = check_writer_priority(mode)
        self._tid: int | None = None
        self._idle = False
        self._waiters = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._tid is not None

    def attach(self) -> None:
        """Called on the writer thread: enable idle scheduling for it when the host allows."""
        if self.mode == "idle" and idle_priority_available():
            self._tid = threading.get_native_id()

    def detach(self) -> None:
        """The writer thread ended: change nothing any more."""
        with self._lock:
            self._tid = None

    def _set(self, idle: bool) -> None:
        """Under ``_lock``."""
        if self._tid is None or idle == self._idle:
            return
        try:
            os.sched_setscheduler(self._tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
            self._idle = idle
        except OSError:  # the thread ended, or the host took the right away: stay at normal priority
            self._tid = None

    def job_started(self) -> None:
        """Called on the writer thread before each job: idle unless a caller waits."""
        with self._lock:
            self._set(self._waiters == 0)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A caller waits on the writer: normal priority until the wait ends."""
        if self._tid is None:
            yield
            return
        with self._lock:
            self._waiters += 1
            self._set(False)
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1
