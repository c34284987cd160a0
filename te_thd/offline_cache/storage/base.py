"""Where a cache lives: one interface (:class:`Storage`), chosen once from the path by its URL
scheme.

Every writer, reader and tool of the cache reaches its files through the :class:`Storage` that
:func:`~te_thd.offline_cache.storage.schemes.open_storage` makes, never by testing what kind of
path it was given: a path without a URL scheme is a :class:`LocalDirectory`; the object stores
are chosen by their URL's scheme (``te_thd.offline_cache.storage.schemes``).

Readers only ever open local files (:meth:`Storage.readable`: a shard's local path, and what makes
its byte ranges present there), and messages name the cache's objects as :meth:`Storage.display`
spells them: the file's path, or the object's URL.

A local directory is written crash-safe: :func:`atomic_write` flushes a sibling temp file (named
for its writer: pid and a random token, dot-prefixed so no reader pattern matches it) to stable
storage, renames it over the target and fsyncs the directory, so the name only ever points at a
complete file and the rename itself survives a power cut. A killed writer leaves at worst a temp
file, which :func:`remove_stale_temp_files` (run by the next producer, under the lock) deletes.
:class:`ProducerLock` is an ``fcntl.flock`` on ``<dir>/.te_thd-producer.lock``, which the kernel
drops when its holder dies, SIGKILL included: a crashed producer never leaves a stale lock (the
file may remain). On network filesystems flock needs lock support (NFSv4; Lustre ``-o flock``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import sys
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from te_thd.offline_cache.format.schema import (
    MANIFEST_NAME,
    CacheError,
    CacheLockError,
    ManifestError,
    ManifestNotFoundError,
)

_PRIVATE = re.compile(r"^[a-z0-9]+-(?P<host>.+)-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-[a-z0-9_]+$")
LOCK_NAME = ".te_thd-producer.lock"
# ".<target name>.<pid>-<8 hex>.tmp": dot-prefixed so SHARD_RE / MANIFEST_NAME never match.
TEMP_RE = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")
#: what a non-blocking flock fails with while another process holds the lock
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class StorageError(CacheError):
    """The store cannot be used as configured: unreachable, no such bucket, access denied. A
    configuration problem, not a damaged cache: the command line exits with :attr:`exit_status`."""

    exit_status = 2


def json_object(raw: bytes | None) -> dict[str, Any]:
    """The JSON object of a producer's record (the lock's holder, the follow record, the run's
    options); ``{}`` when there is none, or it is not one."""
    try:
        value = json.loads(raw.decode() or "{}") if raw is not None else {}
    except (UnicodeDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def temp_path_for(path: str) -> str:
    """A sibling temp name for ``path`` unique to this process and call."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def fsync(path: str) -> None:
    """Flush file ``path``'s data, or directory ``path``'s entries (creations, renames, unlinks), to
    stable storage."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_temp(tmp_path: str, path: str, fsync_directory: bool = True) -> str:
    """Fsync ``tmp_path``, rename it over ``path``, fsync the directory; returns ``path``. The data
    is on stable storage before the name points at it: no crash exposes a torn file.
    ``fsync_directory=False`` leaves the rename to a later :func:`fsync` of the directory (the
    writer batches it)."""
    try:
        fsync(tmp_path)
        os.replace(tmp_path, path)
    except BaseException:
        unlink_quietly(tmp_path)
        raise
    if fsync_directory:
        fsync(os.path.dirname(path))
    return path


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def atomic_write(path: str, write_fn: Callable[[str], object]) -> str:
    """``write_fn(tmp_path)`` writes the complete content to a sibling temp file that then replaces
    ``path`` (a reader sees the old file or the new one, never a mix); if it raises, ``path`` is
    untouched."""
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
    return atomic_write(path, lambda tmp_path: pathlib.Path(tmp_path).write_bytes(data))


def remove_stale_temp_files(cache_dir: str) -> list[str]:
    """Delete temp files left by killed writers; returns the removed paths. Only safe while holding
    the :class:`ProducerLock` of ``cache_dir`` (a live writer's temp file looks like a dead
    one's)."""
    names = sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []
    removed = [os.path.join(cache_dir, name) for name in names if TEMP_RE.match(name)]
    for path in removed:
        unlink_quietly(path)
    if removed:
        fsync(cache_dir)
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
                if exc.errno in _HELD:
                    try:  # the holder's record: informational only, the flock is the lock
                        record = json_object(pathlib.Path(self.path).read_bytes())
                        holder = f"pid {record['pid']} on host {record['host']}"
                    except (OSError, KeyError):
                        holder = "holder unknown"
                    raise CacheLockError(
                        f"output_dir {self.cache_dir} is held by another producer "
                        f"({holder}; lock file {self.path}). Two producers "
                        "writing one cache would interleave shards: wait for it to finish, "
                        "stop it, or choose another output_dir."
                    ) from None
                raise CacheLockError(
                    f"cannot lock {self.path}: {exc}. The filesystem of output_dir does not "
                    "support flock (NFS needs v4, Lustre needs '-o flock'); use a local or "
                    "lock-capable directory, or pass lock=False if you guarantee a single producer."
                ) from None
            # the previous holder may have unlinked the file between our open and flock: retry
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

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # unlinked while still holding the flock: nobody locks an inode we remove
            unlink_quietly(self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> ProducerLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def flock_held(path: str) -> bool | None:
    """Whether a process holds the flock of the lock file ``path`` (None: it cannot be told). Tested
    with a shared lock taken and dropped at once: a producer taking the lock within that one system
    call is refused as if another producer held it (the tools that ask are run by hand, rarely)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in _HELD else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, Linux); 0 where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: object, started: int = 0) -> bool:
    """Whether process ``pid`` of this host runs; with ``started`` (its :func:`start_time`), whether
    it is still that process and not a later one that got the same pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it runs
    return not started or start_time(pid) in (0, started)


def private_dir(kind: str, owner: object) -> str:
    """A new local directory of this process for a store's own files (a reader's private
    read-through copy, a producer's staging; ``kind``: what it holds, e.g. ``"s3"``) under
    ``$TE_THD_TMPDIR`` (default ``<tempdir>/te_thd``), named ``<kind>-<host>-<pid>-<start
    time>-<random>``. Removed when ``owner`` is collected or this interpreter exits
    (``weakref.finalize``: a pickled copy of ``owner`` in another process does not remove it); what
    a killed owner left, by the next process on its host that makes one (its pid is gone, or was
    reused: the start time differs)."""
    root = os.environ.get("TE_THD_TMPDIR") or os.path.join(tempfile.gettempdir(), "te_thd")
    host = socket.gethostname()
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        m = _PRIVATE.match(name)
        if m and m["host"] == host and not process_alive(int(m["pid"]), int(m["start"])):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    path = tempfile.mkdtemp(
        prefix=f"{kind}-{host}-{os.getpid()}-{start_time(os.getpid())}-", dir=root
    )
    weakref.finalize(owner, shutil.rmtree, path, True)
    return path


#: fetch byte ranges ``[(offset, length)]`` of one shard into its local file (``Storage.readable``)
Fetch = Callable[[Sequence[tuple[int, int]]], None]
Known = tuple[bytes | None, dict[str, int]]  # what an open read: manifest (None: none), listing


class Lock(Protocol):
    """The producer lock of a cache: ``acquire`` raises :class:`CacheLockError` while another holds
    it."""

    def acquire(self) -> Any: ...

    def release(self) -> None: ...


class Storage(ABC):
    """What the cache needs from the place it lives in. ``name``: the cache as messages name it."""

    name: str
    #: False when a process forked from one that used this storage cannot use it (an object-store
    #: client's runtime does not survive fork): DataLoader workers then start by forkserver
    fork_safe: bool = True

    def display(self, obj: str) -> str:
        """Object ``obj`` of the cache as messages name it."""
        return os.path.join(self.name, obj)

    @abstractmethod
    def list(self) -> dict[str, int]:
        """``{name: size}`` of the objects directly in the cache (``{}``: no such cache)."""

    def admit(self, obj: str, size: int) -> None:  # noqa: B027 - a local directory reads every file as it is
        """Make shard ``obj`` (``size`` bytes), committed after :meth:`prepare_reads`, readable
        here."""

    @abstractmethod
    def get(self, obj: str) -> bytes | None:
        """The whole (small) object ``obj``: a manifest, a producer record; None when there is
        none."""

    @abstractmethod
    def put(self, obj: str, data: bytes) -> str:
        """Write object ``obj`` whole: a reader finds the old bytes or the new ones. Its display
        name."""

    @abstractmethod
    def delete(self, obj: str) -> None:
        """Remove object ``obj`` durably (nothing when there is none)."""

    @property
    @abstractmethod
    def work_dir(self) -> str:
        """The local directory a shard is written in before :meth:`commit`."""

    @abstractmethod
    def commit(self, obj: str, tmp_path: str) -> str:
        """Make the finished local file ``tmp_path`` (in :attr:`work_dir`) object ``obj``, whole or
        not at all; its display name. A local rename is made durable by :meth:`flush`."""

    def flush(self) -> None:  # noqa: B027 - most stores have nothing to flush
        """Make the commits so far survive a power cut."""

    @abstractmethod
    def readable(self, obj: str) -> tuple[str, Fetch | None]:
        """The local path of shard ``obj`` and the function that makes its byte ranges present there
        (None: every byte already is). Called once per shard open."""

    def header(self, obj: str) -> str:
        """The local path of shard ``obj`` with its header present (the length prefix, then the
        JSON)."""
        return self.readable(obj)[0]

    def whole(self, obj: str) -> str:
        """The local path of shard ``obj`` with every byte present (verify, resume); of a store
        whose :meth:`readable` needs no fetch, that path."""
        return self.readable(obj)[0]

    def prepare_reads(self, known: Known | None = None) -> None:  # noqa: B027 - nothing locally
        """Prepare this process and the DataLoader workers it starts to read (an object store: the
        read-through copy's directory and the listing of the shards). ``known``: the manifest's
        bytes and the listing the opener just read, so they are not requested again."""

    def refetch(self, obj: str) -> bool:
        """Forget the local bytes of shard ``obj`` (a check failed on them); False when they are the
        cache's own (nothing to fetch again)."""
        return False

    @abstractmethod
    def set_aside(self, objs: Sequence[str], into: str) -> str | None:
        """Move objects ``objs`` under ``into/`` (which readers never list); where they went (None:
        none)."""

    @abstractmethod
    def lock(self) -> Lock:
        """The producer lock (one producer per cache)."""

    def lock_holder(self) -> dict[str, Any] | None:
        """Who holds the producer lock, or held it when killed: its record (``host``, ``pid``) and
        ``alive``: True while that process runs, False once it is gone, None where this host cannot
        tell (a process of another host). None when no lock is held or left behind."""
        raw = self.get(LOCK_NAME)
        if raw is None:
            return None
        holder = json_object(raw)
        mine = holder.get("host") == socket.gethostname() and "pid" in holder
        return {**holder, "alive": process_alive(holder["pid"]) if mine else None}

    @abstractmethod
    def unlock(self) -> str | None:
        """Remove a lock its holder could not (killed elsewhere); its holder as messages name it
        (None: no lock). :class:`CacheLockError` while the holder runs on this host
        (:meth:`lock_holder`), and where no lock ever needs removing (a flock dies with its
        holder)."""

    def clean(self) -> list[str]:
        """Remove what killed writers left (only under the lock); what was removed."""
        return []

    def must_exist(self, marker: str) -> None:  # noqa: B027 - an object store has no such place
        """Raise :class:`ManifestError` when no cache can be here at all (a local path that is a
        file, e.g. its ``marker`` file, or that does not exist); a missing object is its reader's to
        report."""


class LocalDirectory(Storage):
    """A cache in a local directory (``name``: the path as given)."""

    def __init__(self, path: str) -> None:
        self.name = path

    def list(self) -> dict[str, int]:
        try:
            with os.scandir(self.name) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def get(self, obj: str) -> bytes | None:
        try:
            with open(self.display(obj), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def put(self, obj: str, data: bytes) -> str:
        return atomic_write_bytes(self.display(obj), data)

    def delete(self, obj: str) -> None:
        if os.path.exists(self.display(obj)):
            unlink_quietly(self.display(obj))
            fsync(self.name)

    @property
    def work_dir(self) -> str:
        return self.name  # the rename that commits a shard stays on one filesystem

    def commit(self, obj: str, tmp_path: str) -> str:
        return commit_temp(tmp_path, self.display(obj), fsync_directory=False)

    def flush(self) -> None:
        fsync(self.name)

    def readable(self, obj: str) -> tuple[str, Fetch | None]:
        return self.display(obj), None

    def set_aside(self, objs: Sequence[str], into: str) -> str | None:
        if not objs:
            return None
        aside = self.display(into)
        os.makedirs(aside, exist_ok=True)
        for obj in objs:
            name, n = obj, 1
            # what an earlier repair set aside is kept too
            while os.path.exists(os.path.join(aside, name)):
                name, n = f"{obj}.{n}", n + 1
            os.replace(self.display(obj), os.path.join(aside, name))
        fsync(aside)
        fsync(self.name)
        return aside

    def lock(self) -> ProducerLock:
        return ProducerLock(self.name)

    def unlock(self) -> str | None:
        self.must_exist(MANIFEST_NAME)
        raise CacheLockError(
            f"{self.name} is a local directory: its producer lock is a flock the kernel drops "
            "when the producer dies, so there is nothing to remove"
        )

    def clean(self) -> list[str]:
        return remove_stale_temp_files(self.name)

    def lock_holder(self) -> dict[str, Any] | None:
        holder = super().lock_holder()
        # the flock tells, whatever host holds it and whoever has its old pid now
        if holder is not None:
            held = flock_held(self.display(LOCK_NAME))
            holder["alive"] = holder["alive"] if held is None else held
        return holder

    def must_exist(self, marker: str) -> None:
        path = self.name
        if os.path.isfile(path):
            hint = (
                f"pass its directory, cache_dir={os.path.dirname(path) or '.'!r}"
                if os.path.basename(path) == marker
                else "pass the directory that holds manifest.json and the shards"
            )
            raise ManifestError(f"cache_dir={path!r} is a file, not a cache directory; {hint}")
        if not os.path.exists(path):
            raise ManifestNotFoundError(
                f"cache_dir={path!r}: no such directory; check the path (a cache directory holds "
                f"manifest.json and shard-*.safetensors)"
            )


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


def punch_hole(path: str, size: int) -> None:
    """Free the local bytes of file ``path`` (``size`` bytes; a read-through copy's shard), keeping
    its size: another process reading it through a mapping (a DataLoader worker) then reads zeros,
    which its checksums reject, instead of faulting past the end of a truncated file. Linux:
    fallocate(PUNCH_HOLE)."""
    fd, fallocate = os.open(path, os.O_RDWR), _libc_fallocate()
    try:
        if (
            fallocate is not None
            and fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) == 0
        ):
            return
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


# looked up on first use: finding libc may run a program, which no import should wait for
@functools.cache
def _libc_fallocate() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn
