"""The shards of one open cache, as a process reads them: :class:`ShardSource`.

One source per open cache (the dataset holds it) opens each shard once per process, checked
against the cache (:func:`~te_thd.offline_cache.format.integrity.check_shard_header`), makes the
byte ranges a read needs local (an object store's read-through copy), fetches a shard whose copy
fails a check again, once, and turns a failed read into the cache's one error. The planners and
the ragged reads call it; it calls nothing above it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.utils.data import get_worker_info

from te_thd.offline_cache.format.integrity import check_shard_header, logical_entries
from te_thd.offline_cache.format.ragged import TokenLayout
from te_thd.offline_cache.format.schema import (
    SHARD_RE,
    CacheIntegrityError,
    TensorSpec,
    UnverifiedCacheWarning,
    shard_name,
    shard_rows,
    unreadable_shard,
)
from te_thd.offline_cache.format.token_index import token_index
from te_thd.offline_cache.read.executor import (
    ParallelReads,
    Piece,
    ReadError,
    default_read_threads,
)
from te_thd.offline_cache.read.follow import Follower
from te_thd.offline_cache.read.planner import OpenShard, OpenShards
from te_thd.offline_cache.record.files import requires_shard_sums
from te_thd.offline_cache.record.manifest import shard_records
from te_thd.offline_cache.storage.base import Storage

__all__ = ["ShardSource"]

T = TypeVar("T")


class ShardSource:
    """The shards of the cache at ``storage`` (``manifest``), read by this process.

    Args:
        storage, manifest: the opened cache (``read.open.open_cache``).
        cache_name, cache_dir: how messages name the cache; ``repair``: the sentence that says how
            to rebuild it.
        disk_keys: the keys every shard must hold; ``schema``: their expected specs (the
            manifest's; None: the first shard this process opens sets them); ``token_layout``:
            the manifest's ragged layout (None: a padded cache).
        follower: the producer being followed (None: a finished cache); ``versions``: the format
            version and producer command its manifest must record.
        verify: check what is read against the shards' checksums.
        prefetch: keys whose byte ranges a shard's first descriptor asks the kernel for.
        read_threads: threads that read a batch (None: ``default_read_threads`` in the main
            process, 1 inside a DataLoader worker).
        max_open: shards a process keeps open (LRU).
    """

    def __init__(
        self,
        storage: Storage,
        manifest: dict[str, Any],
        *,
        cache_name: str,
        cache_dir: str,
        repair: str,
        disk_keys: tuple[str, ...],
        schema: dict[str, TensorSpec] | None,
        token_layout: TokenLayout | None,
        follower: Follower | None,
        versions: tuple[int, str | None],
        verify: bool,
        prefetch: tuple[str, ...],
        read_threads: int | None,
        max_open: int,
    ) -> None:
        self.storage, self.manifest, self.follower = storage, manifest, follower
        self.cache_name, self.cache_dir, self.repair = cache_name, cache_dir, repair
        self.disk_keys, self.versions, self.verify = disk_keys, versions, verify
        self.prefetch, self.read_threads, self.max_open = prefetch, read_threads, max_open
        self.shard_size = int(manifest["shard_size"])
        self.num_samples = int(manifest["num_samples"])
        self.require_sums = requires_shard_sums(manifest)
        self.token_layout = token_layout
        # the manifest's record of each shard, checked against its header digest on open
        self.checksums = {
            i: str(r["checksum"]) for i, r in enumerate(shard_records(manifest) or [])
        }
        self.manifest_schema = schema
        self.warned_unverified = not verify
        self._reset()

    def _reset(self) -> None:
        """This process's state: its open shards, its read threads, the schema it has seen."""
        self.pid = os.getpid()
        self.files = OpenShards()
        self.reads: dict[bool, ParallelReads] = {}  # by "inside a DataLoader worker"
        self.schema = self.manifest_schema

    def __getstate__(self) -> dict[str, Any]:
        # descriptors, mappings and threads belong to this process: another opens its own
        return {**self.__dict__, "files": OpenShards(), "reads": {}}

    def own(self) -> None:
        """After a fork, drop the parent's shards (closing the child's copies of its descriptors
        leaves the parent's open) and threads."""
        if self.pid != os.getpid():
            self.files.close()
            self._reset()

    # -- shards ------------------------------------------------------------------------

    def shard(self, index: int) -> OpenShard:
        """Shard ``index`` open in this process (the one LRU of ``max_open``): its local path and
        checked header; its descriptor, mapping and ``safe_open`` handle are made when first
        used. A followed producer's shard is waited for."""
        self.own()
        f = self.files.get(index)
        if f is not None:
            return f
        if self.follower is not None:
            self._follow(index)
        name = shard_name(index)
        path = self.storage.display(name)
        rows = shard_rows(index, self.num_samples, self.shard_size)
        try:
            header = check_shard_header(
                self.storage.header(name),
                self.schema,
                rows,
                self.disk_keys,
                self.require_sums,
                self.checksums.get(index),
                path,
            )
            tokens = token_index(path, header) if header.tokens is not None else None
        except CacheIntegrityError as exc:
            raise CacheIntegrityError(f"{exc}. {self.repair}", path=path) from None
        if self.schema is None:  # no schema in the manifest: the first shard opened sets it
            entries = logical_entries(header)
            self.schema = {
                k: TensorSpec(entries[k].dtype, entries[k].shape[1:]) for k in self.disk_keys
            }
        if header.sums is None and not self.warned_unverified:
            self.warned_unverified = True
            warnings.warn(
                f"{self.cache_name} cache at {self.cache_dir}: shard {path} carries no checksums "
                "(written by the reference implementation or te_thd before layout 3), so its reads "
                "are not verified; rewrite the cache with te_thd's writers to verify every read",
                UnverifiedCacheWarning,
                stacklevel=3,
            )
        if self.follower is not None:
            self.follower.check_shard(path, header)
        if tokens is None and self.token_layout is not None:
            raise CacheIntegrityError(
                f"shard {path} has no token fields although the manifest records a token layout "
                f"(it was replaced by another writer's). {self.repair}",
                path=path,
            )
        local, fetch = self.storage.readable(name)
        f = OpenShard(local, header, tokens, fetch, path, index * self.shard_size)
        return self.files.put(index, f, self.max_open)

    def _follow(self, index: int) -> None:
        """Wait until the followed producer has committed shard ``index``; read by the manifest
        once it is there (``Follower.finished`` checks it against the run followed and the shards
        opened)."""
        assert self.follower is not None
        self.follower.wait(index)
        done = self.follower.finished(self.versions, self.files.items(), self.schema, self.repair)
        if done is not None:
            (self.manifest, self.checksums), self.follower = done, None

    @staticmethod
    def ensure(f: OpenShard, ranges: Callable[..., Sequence[tuple[int, int]]], *args: Any) -> None:
        """Make the byte ranges ``ranges(*args)`` (``[(offset, n)]``) of shard ``f`` present in its
        local file: an object store's read-through copy fetches what it lacks; a local cache has
        them all, and never works out the ranges."""
        if f.fetch is not None:
            f.fetch(ranges(*args))

    # -- reads -------------------------------------------------------------------------

    def threads(self, in_worker: bool | None = None) -> ParallelReads:
        """This process's :class:`ParallelReads`: ``read_threads``, or 1 thread inside a DataLoader
        worker when it is None (the workers are the parallelism there)."""
        self.own()
        if in_worker is None:
            in_worker = get_worker_info() is not None
        reads = self.reads.get(in_worker)
        if reads is None:
            n = self.read_threads or (1 if in_worker else default_read_threads())
            reads = self.reads[in_worker] = ParallelReads(n)
        return reads

    def run(self, pieces: list[Piece]) -> None:
        """Read the planned pieces on this process's read threads, each verified by its reader; a
        failed read (the file shrank after it was opened) is the cache's "cannot be read" error."""
        try:
            self.threads().run(pieces)
        except ReadError as exc:
            raise self.unreadable(exc.path, exc) from exc

    def unreadable(self, path: str, exc: BaseException) -> CacheIntegrityError:
        """The error of shard ``path`` that could not be read (``exc``: why)."""
        by = "" if isinstance(exc, ReadError) else " by safetensors"
        return unreadable_shard(path, exc, self.repair, by)

    def retry(self, read: Callable[[Any], T], arg: Any) -> T:
        """``read(arg)``; a shard of an object store whose local copy fails a check is fetched
        again and read once more, and a second failure says the object itself is damaged."""
        try:
            return read(arg)
        except CacheIntegrityError as exc:
            if not self.refetch(exc.path):
                raise
        try:
            return read(arg)
        except CacheIntegrityError as exc:
            name = os.path.basename(exc.path or "")
            raise CacheIntegrityError(
                f"{exc} The object {self.storage.display(name)} itself is damaged: fetched "
                "again, it failed the same check.",
                path=exc.path,
                sample=exc.sample,
                key=exc.key,
                expected=exc.expected,
                actual=exc.actual,
            ) from None

    def refetch(self, path: str | None) -> bool:
        """Drop this process's local copy of the shard at ``path`` (a check failed on it); False
        when there is nothing to fetch again (a local cache)."""
        name = os.path.basename(path or "")
        if not self.storage.refetch(name):
            return False
        m = SHARD_RE.match(name)
        if m is not None:
            self.own()
            self.files.drop(int(m.group(1)))
        return True
