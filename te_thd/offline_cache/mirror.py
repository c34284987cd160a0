"""A local read-through copy of an s3:// cache: the bytes a reader fetched, kept in sparse local files.

Reading an s3:// cache goes through an :class:`ObjectMirror`: a local directory with
the cache's ``manifest.json`` and one *sparse* file per shard object, of the object's
size. Before a reader touches a byte range of a shard (the header once, then a batch's
rows, or a CP rank's token blocks) it calls :meth:`ObjectMirror.ensure`: the 64 KiB
chunks of the range not fetched yet are fetched with ranged GETs (one ``get_ranges``
call per shard and batch: obstore coalesces and parallelises them) and written into
the sparse file, and then the ordinary local read path -- ``preadv``, the mapped
gather, ``safe_open`` -- reads and verifies them exactly as for a local cache. Which
chunks are present is kept beside each file (``.<shard>.present``, one byte per
chunk), so a later process -- a DataLoader worker, the next run -- reuses them: that is
the read-through cache. ``max_bytes`` bounds it: past the budget whole shards are
dropped, least recently used first.

Every read is still verified against the row checksums: a damaged local copy is caught
by the read and fetched again once (:meth:`invalidate`); a second failure is the
object's, and is raised naming it. Without ``cache_dir`` the mirror lives in a private
temporary directory removed with the dataset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import sys
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from te_thd.offline_cache import objectstore
from te_thd.offline_cache.durable import atomic_write_bytes, unlink_quietly
from te_thd.offline_cache.errors import lost_manifest
from te_thd.offline_cache.format import MANIFEST_NAME, SHARD_RE
from te_thd.offline_cache.location import ObjectLocation

#: fetch granularity: a range is fetched as the chunks that hold it
CHUNK_BYTES = 64 * 1024


class ObjectMirror:
    """The local read-through copy of the cache at ``loc`` (see the module docstring).

    ``cache_dir``: where the copy lives (a subdirectory per cache URL), kept between runs;
    None: a private temporary directory. ``max_bytes``: the most fetched bytes it keeps
    (None: no limit). ``root`` is the local directory readers open.
    """

    def __init__(self, loc: ObjectLocation, cache_dir: str | None = None, max_bytes: int | None = None) -> None:
        self.loc = loc
        self.max_bytes = max_bytes
        self.config = objectstore.settings()  # captured here: workers may have another environment
        if cache_dir is None:
            self.root = tempfile.mkdtemp(prefix="te_thd-s3-")
            self._cleanup: Any = weakref.finalize(self, shutil.rmtree, self.root, True)
        else:
            self.root = os.path.join(cache_dir, hashlib.sha1(loc.url.encode()).hexdigest()[:16])
            os.makedirs(self.root, exist_ok=True)
            self._cleanup = None
        self.sizes: dict[str, int] = {}
        self._present: dict[str, bytearray] = {}
        self._absent: dict[str, np.ndarray] = {}  # per shard: prefix counts of chunks not yet fetched
        self._lru: OrderedDict[str, None] = OrderedDict()
        #: requests made and bytes fetched from the store by this process (benchmarks, docs)
        self.requests = 0
        self.fetched_bytes = 0
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cleanup"] = None  # the directory belongs to the process that made it
        state["_present"], state["_absent"], state["_lru"] = {}, {}, OrderedDict()
        return state

    # -- the cache as a whole ---------------------------------------------------------------

    def sync(self) -> None:
        """Fetch the manifest and list the shard objects; drop local copies the store no longer matches."""
        raw = objectstore.get(self.loc, MANIFEST_NAME, self.config)
        self.requests += 1
        local = os.path.join(self.root, MANIFEST_NAME)
        if raw is None:
            shards = sum(1 for name in objectstore.listing(self.loc, self.config) if SHARD_RE.match(name))
            raise lost_manifest(f"{self.loc.url}/{MANIFEST_NAME}", self.loc.url, "offline", shards, None)
        old = open(local, "rb").read() if os.path.exists(local) else None
        listing = objectstore.listing(self.loc, self.config)
        self.requests += 1
        self.sizes = {n: s for n, s in listing.items() if SHARD_RE.match(n)}
        for name in os.listdir(self.root):
            if SHARD_RE.match(name) and (name not in self.sizes or raw != old):
                self._drop(name)  # another cache, or another version of this one, was here
        for name, size in self.sizes.items():
            path = os.path.join(self.root, name)
            if not os.path.exists(path) or os.path.getsize(path) != size:
                self._drop(name)
                with open(path, "wb") as f:
                    f.truncate(size)  # sparse: no data until fetched
        if raw != old:
            atomic_write_bytes(local, raw)

    def _drop(self, name: str) -> None:
        unlink_quietly(os.path.join(self.root, name))
        unlink_quietly(self._bitmap_path(name))
        self._present.pop(name, None)
        self._absent.pop(name, None)
        self._lru.pop(name, None)

    # -- one shard ------------------------------------------------------------------------

    def _bitmap_path(self, name: str) -> str:
        return os.path.join(self.root, f".{name}.present")

    def _bitmap(self, name: str) -> bytearray:
        bits = self._present.get(name)
        if bits is None:
            n = -(-self.sizes[name] // CHUNK_BYTES)
            try:
                with open(self._bitmap_path(name), "rb") as f:
                    bits = bytearray(f.read(n).ljust(n, b"\0"))
            except FileNotFoundError:
                bits = bytearray(n)
            self._present[name] = bits
        return bits

    def ensure(self, name: str, ranges: Iterable[tuple[int, int]]) -> None:
        """Make bytes ``[offset, offset + n)`` of shard file ``name`` present locally, for each range."""
        if self._pid != os.getpid():  # a forked worker: its own client and bookkeeping
            self._pid, self._present, self._absent, self._lru = os.getpid(), {}, {}, OrderedDict()
        size = self.sizes[name]
        bits = self._bitmap(name)
        spans_in = np.asarray([(off, off + n) for off, n in ranges if n > 0], dtype=np.int64).reshape(-1, 2)
        first = spans_in[:, 0] // CHUNK_BYTES
        last = np.minimum(-(-spans_in[:, 1] // CHUNK_BYTES), len(bits))
        self._lru[name] = None
        self._lru.move_to_end(name)
        absent = self._absent.get(name)
        if absent is None:  # prefix counts of absent chunks: "is every chunk of these ranges here" in O(ranges)
            absent = self._absent[name] = np.concatenate(([0], np.cumsum(np.frombuffer(bytes(bits), np.uint8) == 0)))
        if not np.any(absent[last] - absent[first]):
            return
        want: set[int] = set()
        for a, b in zip(first.tolist(), last.tolist(), strict=True):
            want.update(range(a, b))
        missing = sorted(c for c in want if not bits[c])
        runs: list[tuple[int, int]] = []
        for c in missing:
            if runs and runs[-1][1] == c:
                runs[-1] = (runs[-1][0], c + 1)
            else:
                runs.append((c, c + 1))
        spans = [(a * CHUNK_BYTES, min(b * CHUNK_BYTES, size)) for a, b in runs]
        data = objectstore.get_ranges(self.loc, name, spans, self.config)
        self.requests += 1
        fd = os.open(os.path.join(self.root, name), os.O_WRONLY)
        try:
            for (a, _), blob in zip(spans, data, strict=True):
                os.pwrite(fd, blob, a)
                self.fetched_bytes += len(blob)
        finally:
            os.close(fd)
        for a, b in runs:
            bits[a:b] = b"\1" * (b - a)
        self._absent.pop(name, None)
        with open(self._bitmap_path(name), "wb") as f:  # after the data: a set byte means its chunk is there
            f.write(bits)
        self._evict(keep=name)

    def invalidate(self, name: str) -> None:
        """Forget shard ``name``'s local bytes (a read found them damaged): they are fetched again."""
        _punch(os.path.join(self.root, name), self.sizes[name])
        self._present[name] = bytearray(-(-self.sizes[name] // CHUNK_BYTES))
        self._absent.pop(name, None)
        unlink_quietly(self._bitmap_path(name))

    def _evict(self, keep: str) -> None:
        """Drop least recently used shards (never ``keep``) until the fetched bytes fit ``max_bytes``."""
        if self.max_bytes is None:
            return
        held = sum(b.count(1) for b in self._present.values()) * CHUNK_BYTES  # counted once, then kept up to date
        for name in list(self._lru):
            if held <= self.max_bytes:
                break
            if name != keep:
                held -= self._present[name].count(1) * CHUNK_BYTES if name in self._present else 0
                self.invalidate(name)
                self._lru.pop(name, None)

    def shard_ranges_header(self, name: str) -> None:
        """Make the shard's header present (its length prefix first)."""
        self.ensure(name, [(0, 8)])
        with open(os.path.join(self.root, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        self.ensure(name, [(0, 8 + min(n, self.sizes[name]))])


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


def _punch(path: str, size: int) -> None:
    """Free the local bytes of file ``path`` (``size`` bytes) and read zeros there, keeping its size:
    another process reading it through a mapping (a DataLoader worker sharing ``cache_dir``) then
    reads zeros -- which its checksums reject, so it fetches again -- instead of faulting past the
    end of a file truncated under it. On Linux the libc call fallocate with FALLOC_FL_PUNCH_HOLE; elsewhere truncate and extend."""
    fd = os.open(path, os.O_RDWR)
    try:
        if _fallocate is not None and _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) == 0:
            return
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _libc_fallocate() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate() if sys.platform.startswith("linux") else None
