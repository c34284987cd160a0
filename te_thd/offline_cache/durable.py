"""Crash-safe file writes and the producer lock.

``atomic_write``: the target name only ever points at a complete, fsynced file. The bytes go
to a sibling temp file whose name is unique to the writer (pid + random token, dot-prefixed so
no reader pattern matches it), are flushed to stable storage, renamed over the target, and the
directory entry is fsynced so the rename itself survives a power cut. A writer killed at any
point leaves at worst a dot-prefixed temp file, which :func:`remove_stale_temp_files` (run by
the next producer, under the lock) deletes.

``ProducerLock``: one producer per output directory, an ``fcntl.flock`` on
``<dir>/.te_thd-producer.lock``. The kernel drops a flock when its holder dies, SIGKILL
included, so a crashed producer never leaves a stale lock (the file may remain). On network
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


def commit_temp(tmp_path: str, path: str, fsync_directory: bool = True) -> str:
    """Fsync ``tmp_path``, rename it over ``path``, fsync the directory; returns ``path``.

    The data is on stable storage before the name points at it: no crash exposes a torn file.
    ``fsync_directory=False`` leaves the rename to a later :func:`fsync_dir` (the writer batches it).
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


def copy_range(src: int, dst: int, count: int, dst_offset: int) -> None:
    """Copy bytes ``[0, count)`` of ``src`` to ``dst`` at ``dst_offset`` (in the kernel where it can)."""
    src_off = 0
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, count, src_off, dst_offset)
        except (AttributeError, OSError):  # no copy_file_range here (or across these files): read and write
            n = 0
        if n <= 0:
            chunk = os.pread(src, min(count, 8 << 20), src_off)
            if not chunk:
                raise OSError(f"temp file ended {count} bytes early while finishing a shard")
            n = os.pwrite(dst, chunk, dst_offset)  # a short write: the rest is read again
        src_off += n
        dst_offset += n
        count -= n


def atomic_write(path: str, write_fn: Callable[[str], None]) -> str:
    """``write_fn(tmp_path)`` writes the complete content to a sibling temp file, which is
    fsynced and renamed over ``path`` (``os.replace``: a reader sees the old file or the new one,
    never a mix), then the directory is fsynced. If ``write_fn`` raises, ``path`` is untouched.
    Returns ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp_path = temp_path_for(path)
    try:
        write_fn(tmp_path)
    except BaseException:
        unlink_quietly(tmp_path)
        raise
    return commit_temp(tmp_path, path)


def atomic_write_bytes(path: str, data: bytes) -> str:
    """:func:`atomic_write` of the bytes ``data`` (a manifest, a run record, a lengths file)."""

    def _write(tmp_path: str) -> None:
        with open(tmp_path, "wb") as f:
            f.write(data)

    return atomic_write(path, _write)


def remove_stale_temp_files(cache_dir: str) -> list[str]:
    """Delete temp files left by killed writers; returns the removed paths. Only safe while holding
    the :class:`ProducerLock` of ``cache_dir`` (a live writer's temp file looks like a dead one's)."""
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


class ProducerLock:
    """Exclusive, crash-released lock on a cache directory (``with ProducerLock(d): ...``).
    ``acquire`` never waits: another holder is a :class:`CacheLockError` naming its pid and host
    (read from the lock file, informational only: the flock is the lock)."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.path = os.path.join(cache_dir, LOCK_NAME)
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
