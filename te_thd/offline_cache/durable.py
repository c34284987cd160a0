"""Crash-safe file writes and the producer lock.

``atomic_write``: the target name only ever points at a complete, fsynced file.
The bytes go to a sibling temp file whose name is unique to the writer (pid +
random token, dot-prefixed so no reader pattern matches it), are flushed to
stable storage, renamed over the target, and the directory entry is fsynced so
the rename itself survives a power cut. A writer killed at any point leaves at
worst a dot-prefixed temp file, which readers never look at and
:func:`remove_stale_temp_files` (run by the next producer, under the lock)
deletes.

``ProducerLock``: one producer per output directory. It is an
``fcntl.flock`` on ``<dir>/.te_thd-producer.lock``; the kernel drops a flock
when its holder dies, SIGKILL included, so a crashed producer never leaves a
stale lock behind (the file may remain; the lock does not). On network
filesystems flock needs lock support (NFSv4; Lustre mounted with ``-o flock``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import json
import os
import queue
import re
import secrets
import socket
import threading
from collections.abc import Callable
from typing import NamedTuple

from te_thd.offline_cache.errors import CacheLockError
from te_thd.offline_cache.hostmem import WriterPriority, process_libc

LOCK_NAME = ".te_thd-producer.lock"
# ".<target name>.<pid>-<8 hex>.tmp": dot-prefixed so SHARD_RE / MANIFEST_NAME never match.
TEMP_RE = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")


def temp_path_for(path: str) -> str:
    """A sibling temp name for ``path`` unique to this process and call."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def fsync_file(path: str) -> None:
    """Flush ``path``'s data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Persist directory entries (creations, renames, unlinks) of ``directory``."""
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages in the range, do not wait


@functools.cache
def _sync_file_range() -> Callable[..., int] | None:
    """libc's ``sync_file_range`` (Linux), or ``None`` where the C library has none."""
    fn = getattr(process_libc(), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` to disk now, without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a no-op elsewhere). A hint, not durability: the
    file is still fsynced before it is committed."""
    fn = _sync_file_range()
    if fn is not None and nbytes > 0:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # errors (e.g. EINVAL on a pipe) ignored


def write_temp(path: str, write_fn: Callable[[str], None]) -> str:
    """Stage 1 of an atomic write: ``write_fn(tmp)`` into a fresh sibling temp file; returns ``tmp``.

    If ``write_fn`` raises, the temp file is removed and the error propagates.
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp_path = temp_path_for(path)
    try:
        write_fn(tmp_path)
    except BaseException:
        unlink_quietly(tmp_path)
        raise
    return tmp_path


def commit_temp(tmp_path: str, path: str, fsync_directory: bool = True) -> str:
    """Stage 2: fsync ``tmp_path``, rename it over ``path``, fsync the directory; returns ``path``.

    The data is on stable storage before the name points at it, so no crash can
    expose a torn file under ``path``. ``fsync_directory=False`` leaves persisting
    the rename to a later :func:`fsync_dir` (the pipelined shard writer batches it).
    """
    try:
        fsync_file(tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        unlink_quietly(tmp_path)
        raise
    if fsync_directory:
        fsync_dir(os.path.dirname(path) or ".")
    return path


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def atomic_write(path: str, write_fn: Callable[[str], None]) -> str:
    """Write through a sibling temporary file, then atomically replace the target path.

    ``write_fn(tmp_path)`` writes the complete content to ``tmp_path``. Then the
    temp file is fsynced, renamed over ``path`` (``os.replace``: atomic on POSIX,
    so a reader sees the old file or the new one, never a mix) and the directory
    is fsynced. If ``write_fn`` raises, the temp file is removed and the error
    propagates; ``path`` is untouched. Returns ``path``.
    """
    return commit_temp(write_temp(path, write_fn), path)


class _Job(NamedTuple):
    """One job of :class:`BackgroundCommitter`: run ``task``, then commit a temp file as ``path``."""

    path: str | None  # the name to commit; None: a task that commits nothing
    tmp_path: str | None  # an already written temp file
    write_fn: Callable[[str], None] | None  # writes a fresh temp file (instead of tmp_path)
    task: Callable[[], None] | None  # runs first (e.g. writes the last piece of a streamed file)
    on_drop: Callable[[], None] | None  # runs instead when an earlier job failed
    nbytes: int  # memory the job holds until it is done (counted against max_pending_bytes)


class BackgroundCommitter:
    """Finishes a stream of durable file writes on one background thread, in order.

    Three kinds of job, run in submission order:

    - :meth:`submit` (a temp file the caller already wrote): fsync it and rename it
      into place. The caller serialises shard ``k+1`` while the disk flushes shard
      ``k``.
    - :meth:`submit_write` (the whole write): ``write_fn(tmp)`` writes a fresh temp
      file on the thread, then fsync and rename as above. A producer computes
      shard ``k+1`` while shard ``k`` is serialised, written and flushed (file
      writes, fsync and hashing release the GIL).
    - :meth:`submit_task` (part of a write, e.g. one batch of a streamed shard):
      ``task()`` runs on the thread; :meth:`submit` with ``before=`` finishes
      such a file and commits it.

    Each file is renamed only after its own fsync; the directory is fsynced
    whenever the queue runs empty and on :meth:`flush`, so consecutive renames
    share one directory fsync. ``submit*`` block while ``max_pending`` jobs wait,
    or while the jobs not yet done hold ``max_pending_bytes`` (when set; a job
    larger than the budget runs alone), bounding the memory of queued data and
    the dirty page cache. The first error of the thread is raised by the next
    ``submit*`` or by ``flush`` / ``close``, and every job after it is dropped
    (its temp file removed, its ``on_drop`` called). Killed mid-way, the process
    leaves temp files of uncommitted shards, which the next producer removes and
    recomputes: the crash-safety of :func:`atomic_write`.

    ``writer_priority="idle"`` runs the thread at ``SCHED_IDLE`` while no caller waits
    on it, so the caller's thread preempts it on wake-up
    (:class:`~te_thd.offline_cache.hostmem.WriterPriority`; normal priority where
    the host does not allow it, and whenever a ``submit*`` or ``flush`` waits).
    """

    def __init__(
        self, max_pending: int = 2, writer_priority: str = "normal", max_pending_bytes: int | None = None
    ) -> None:
        self.priority = WriterPriority(writer_priority)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending)
        self.max_pending_bytes = max_pending_bytes
        # pending bytes = queued - done; each counter has one writing thread, so the hot path takes
        # no lock shared with the writer (a contended lock costs ~15 us of thread handoff here)
        self._queued_bytes = 0
        self._done_bytes = 0
        self._budget = threading.Condition()
        self._budget_waiters = 0
        self._error: BaseException | None = None
        self._dirty: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="te_thd-commit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.priority.attach()
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            nbytes = job.nbytes
            try:
                self.priority.job_started()
                if self._error is not None:
                    try:
                        if job.on_drop is not None:
                            job.on_drop()
                        elif job.tmp_path is not None:
                            unlink_quietly(job.tmp_path)
                    except Exception:  # the first error is the one reported; a failed clean-up must not end
                        pass  # the thread, or every later flush() would wait for it forever
                    continue
                try:
                    if job.task is not None:
                        job.task()
                    path, tmp_path, write_fn = job.path, job.tmp_path, job.write_fn
                    job = None
                    if path is not None:
                        if write_fn is not None:
                            tmp_path = write_temp(path, write_fn)
                        # drop what the job held (a shard's tensors) before the fsync wait: the
                        # producer's next batches reuse that memory while it is still mapped
                        write_fn = None
                        self._release(nbytes)
                        nbytes = 0
                        assert tmp_path is not None
                        commit_temp(tmp_path, path, fsync_directory=False)
                        self._dirty.add(os.path.dirname(path) or ".")
                        if self._queue.empty():
                            self._sync_dirs()
                except BaseException as exc:  # surfaced by submit()/flush()
                    self._error = exc
            finally:
                job = write_fn = None  # nothing of a finished job outlives it while the queue is idle
                self._release(nbytes)
                self._queue.task_done()

    def _release(self, nbytes: int) -> None:
        if nbytes:
            self._done_bytes += nbytes
            if self._budget_waiters:
                with self._budget:
                    self._budget.notify_all()

    def _sync_dirs(self) -> None:
        while self._dirty:
            fsync_dir(self._dirty.pop())

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _over_budget(self, nbytes: int) -> bool:
        limit = self.max_pending_bytes
        pending = self._queued_bytes - self._done_bytes
        return limit is not None and pending > 0 and pending + nbytes > limit

    def _put(self, job: _Job) -> None:
        self._raise_error()
        if job.nbytes and self._over_budget(job.nbytes):
            with self.priority.waiting(), self._budget:  # the caller waits: no idle priority meanwhile
                self._budget_waiters += 1
                try:
                    while self._over_budget(job.nbytes) and self._error is None:
                        self._budget.wait(0.05)  # the timeout bounds a wake-up lost to the lock-free check
                finally:
                    self._budget_waiters -= 1
            self._raise_error()
        self._queued_bytes += job.nbytes
        if self._queue.full():
            with self.priority.waiting():
                self._queue.put(job)
        else:
            self._queue.put(job)

    def submit(
        self,
        tmp_path: str,
        path: str,
        before: Callable[[], None] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        """Queue ``tmp_path`` to be committed as ``path``, after ``before()`` ran on the thread.

        ``on_drop`` replaces removing ``tmp_path`` when an earlier job failed.
        """
        self._put(_Job(path, tmp_path, None, before, on_drop, 0))

    def submit_write(self, path: str, write_fn: Callable[[str], None], nbytes: int = 0) -> None:
        """Queue the whole durable write of ``path``: ``write_fn(tmp)`` runs on the thread.

        Whatever ``write_fn`` reads (e.g. the tensors of a shard, ``nbytes`` of
        memory) must not change until the job is done (:meth:`flush`).
        """
        self._put(_Job(path, None, write_fn, None, None, nbytes))

    def submit_task(self, task: Callable[[], None], on_drop: Callable[[], None] | None = None, nbytes: int = 0) -> None:
        """Queue ``task()`` (holding ``nbytes`` of memory until it ran); ``on_drop()`` runs instead
        when an earlier job failed."""
        self._put(_Job(None, None, None, task, on_drop, nbytes))

    @property
    def running(self) -> bool:
        """Whether the thread still runs (:meth:`close` not called, or interrupted)."""
        return self._thread.is_alive()

    def flush(self) -> None:
        """Wait until every submitted file is fsynced, renamed and its directory fsynced."""
        with self.priority.waiting():
            self._queue.join()
        self._raise_error()
        self._sync_dirs()

    def close(self) -> None:
        """Commit what is queued, stop the thread, raise a pending error."""
        if self._thread.is_alive():
            with self.priority.waiting():
                self._queue.join()
            self._queue.put(None)
            self._thread.join()
            self.priority.detach()  # its thread id may be reused now
        self._raise_error()
        self._sync_dirs()

    def __enter__(self) -> BackgroundCommitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_stale_temp_files(cache_dir: str) -> list[str]:
    """Delete temp files left by killed writers; returns the removed paths.

    Only safe while holding the :class:`ProducerLock` of ``cache_dir`` (a live
    writer's temp file looks the same as a dead one's).
    """
    removed = []
    if not os.path.isdir(cache_dir):
        return removed
    for name in sorted(os.listdir(cache_dir)):
        if TEMP_RE.match(name):
            p = os.path.join(cache_dir, name)
            try:
                os.unlink(p)
                removed.append(p)
            except FileNotFoundError:
                pass
    if removed:
        fsync_dir(cache_dir)
    return removed


def lock_path(cache_dir: str) -> str:
    return os.path.join(cache_dir, LOCK_NAME)


class ProducerLock:
    """Exclusive, crash-released lock on a cache directory (``with ProducerLock(d): ...``).

    ``acquire`` never waits: when another producer holds the directory it raises
    :class:`CacheLockError` naming that producer's pid and host (read from the
    lock file, informational only: the flock is the lock).
    """

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.path = lock_path(cache_dir)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> ProducerLock:
        if self._fd is not None:
            return self
        os.makedirs(self.cache_dir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CacheLockError(
                        f"output_dir {self.cache_dir} is held by another producer "
                        f"({self._describe_holder()}; lock file {self.path}). Two producers "
                        "writing one cache would interleave shards: wait for it to finish, "
                        "stop it, or choose another output_dir."
                    ) from None
                raise CacheLockError(
                    f"cannot lock {self.path}: {exc}. The filesystem of output_dir does not "
                    "support flock (NFS needs v4, Lustre needs '-o flock'); use a local or "
                    "lock-capable directory, or pass lock=False if you guarantee a single producer."
                ) from None
            # The previous holder may have unlinked the file between our open and our
            # flock; then we locked an orphan inode. Retry on the live file.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self._fd = fd
        return self

    def _describe_holder(self) -> str:
        try:
            with open(self.path, "rb") as f:
                info = json.loads(f.read().decode() or "{}")
            return f"pid {info['pid']} on host {info['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # Unlink while still holding the flock so nobody locks an inode we are removing.
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> ProducerLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
