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

import errno
import fcntl
import json
import os
import re
import secrets
import socket
from collections.abc import Callable

from te_thd.offline_cache.errors import CacheLockError

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
        _unlink_quietly(tmp_path)
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
        _unlink_quietly(tmp_path)
        raise
    if fsync_directory:
        fsync_dir(os.path.dirname(path) or ".")
    return path


def _unlink_quietly(path: str) -> None:
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


class BackgroundCommitter:
    """Finishes a stream of durable file writes on one background thread, in order.

    Two kinds of job, committed in submission order:

    - :meth:`submit` (a temp file the caller already wrote): fsync it and rename it
      into place. The caller serialises shard ``k+1`` while the disk flushes shard
      ``k``.
    - :meth:`submit_write` (the whole write): ``write_fn(tmp)`` writes a fresh temp
      file on the thread, then fsync and rename as above. The caller only waits
      when ``max_pending`` jobs are queued, so a producer computes shard ``k+1``
      while shard ``k`` is serialised, written and flushed (file writes, fsync and
      hashing release the GIL).

    Each file is renamed only after its own fsync; the directory is fsynced
    whenever the queue runs empty and on :meth:`flush`, so consecutive renames
    share one directory fsync. ``submit*`` block while ``max_pending`` jobs wait
    (bounding the memory of queued shards and the dirty page cache); the first
    error of the thread is raised by the next ``submit*`` or by ``flush`` /
    ``close``, and every job after it is dropped (its temp file removed). Killed
    mid-way, the process leaves temp files of uncommitted shards, which the next
    producer removes and recomputes: the crash-safety of :func:`atomic_write`.
    """

    def __init__(self, max_pending: int = 2) -> None:
        import queue
        import threading

        self._queue: queue.Queue[tuple[str | None, str, Callable[[str], None] | None] | None] = queue.Queue(
            maxsize=max_pending
        )
        self._error: BaseException | None = None
        self._dirty: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="te_thd-commit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                tmp_path, path, write_fn = item
                if self._error is not None:
                    if tmp_path is not None:
                        _unlink_quietly(tmp_path)
                    continue
                try:
                    if write_fn is not None:
                        tmp_path = write_temp(path, write_fn)
                    assert tmp_path is not None
                    commit_temp(tmp_path, path, fsync_directory=False)
                    self._dirty.add(os.path.dirname(path) or ".")
                    if self._queue.empty():
                        self._sync_dirs()
                except BaseException as exc:  # surfaced by submit()/flush()
                    self._error = exc
            finally:
                self._queue.task_done()

    def _sync_dirs(self) -> None:
        while self._dirty:
            fsync_dir(self._dirty.pop())

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, tmp_path: str, path: str) -> None:
        """Queue ``tmp_path`` (already written) to be committed as ``path``."""
        self._raise_error()
        self._queue.put((tmp_path, path, None))

    def submit_write(self, path: str, write_fn: Callable[[str], None]) -> None:
        """Queue the whole durable write of ``path``: ``write_fn(tmp)`` runs on the thread.

        Whatever ``write_fn`` reads (e.g. the tensors of a shard) must not change
        until the job is done (:meth:`flush`).
        """
        self._raise_error()
        self._queue.put((None, path, write_fn))

    def flush(self) -> None:
        """Wait until every submitted file is fsynced, renamed and its directory fsynced."""
        self._queue.join()
        self._raise_error()
        self._sync_dirs()

    def close(self) -> None:
        """Commit what is queued, stop the thread, raise a pending error."""
        if self._thread.is_alive():
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
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
