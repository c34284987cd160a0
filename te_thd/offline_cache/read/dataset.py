"""Read an offline cache: per-item (reference behaviour) and batched reads.

``CachedTensorDataset`` keeps the reference API (``__getitem__`` through a lazily opened
``safetensors.safe_open`` handle, ``_handle``, ``__len__``) and adds the batched hook
torch's ``DataLoader`` calls, ``__getitems__``: the batch is planned as pieces per shard
and key (``read.planner``), copied straight into the batch tensors by ``read_threads``
threads and verified by the thread that copied them (``read.executor``). Only the bytes a
batch needs are read, and the source stays file-backed page cache.

The cache's shards are the dataset's :class:`~te_thd.offline_cache.read.source.ShardSource`:
each process opens its own (DataLoader workers open theirs), each checked when opened; every
row a read copies is verified against its checksums, a failure naming the shard.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from te_thd.args import check_index, check_int, check_names
from te_thd.offline_cache.format.integrity import (
    ShardSums,
    verify_rows,
)
from te_thd.offline_cache.format.ragged import TOKEN_LAYOUT_KEY, TokenLayout
from te_thd.offline_cache.format.schema import (
    TensorSpec,
    UnverifiedCacheWarning,
    load_safetensors,
    manifest_path,
    repair_hint,
)
from te_thd.offline_cache.read.batch import CachedBatch, PendingBatch
from te_thd.offline_cache.read.executor import (
    DestinationBuffers,
    GatherPiece,
    ParallelReads,
    Piece,
    ReadError,
)
from te_thd.offline_cache.read.follow import DEFAULT_FOLLOW_TIMEOUT
from te_thd.offline_cache.read.open import open_cache
from te_thd.offline_cache.read.planner import (
    OpenShard,
    Scattered,
    batch_groups,
    batch_places,
    plan_shard_rows,
    row_ranges,
)
from te_thd.offline_cache.read.source import ShardSource
from te_thd.offline_cache.read.tokens import TokenRows
from te_thd.offline_cache.record.manifest import manifest_schema

#: Rows are copied and hashed in pieces of about this many bytes per key (over the read threads),
#: so the hash reads them from a core's own cache right after the copy (a piece as large as that
#: cache is hashed from memory); each piece costs one system call and a little Python.
VERIFY_CHUNK_BYTES = 1 << 20

# safetensors is a hard dependency; load_safetensors explains when it is missing
try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # pragma: no cover

    class _SafetensorError(Exception):  # type: ignore[no-redef]
        pass


__all__ = ["CachedBatch", "CachedTensorDataset", "PendingBatch"]


class CachedTensorDataset(Dataset):
    """Lazily read fixed-key safetensors shards by sample index, verifying what it returns.

    Args:
        cache_dir: directory holding ``manifest.json`` and ``shard-NNNNNN.safetensors``.
        cache_name: human name used in error messages.
        format_version: the manifest's expected ``format_version``.
        disk_keys: the keys to read from every shard, e.g. ``("input_ids", "loss_mask")``.
        max_open_shards: how many shards a process keeps open (LRU; descriptors and mappings).
        verify: check every row a read returns against its shard's checksums (default). ``False``
            only for a cache verified since it was written (``te-thd cache verify``).
        producer_name: the command that rebuilds the cache, named in error messages.
        pin_memory: read batches into page-locked memory, for CUDA (``build_cached_dataloader``
            sets it when it pins with ``num_workers=0``); ignored inside DataLoader workers.
        readahead: when the batched path opens a shard, ask the kernel to read its
            ``disk_keys`` byte ranges in the background (``POSIX_FADV_WILLNEED``). Pass False
            when each node reads a small part of every shard from a shared network filesystem.
        read_threads: threads that copy (and verify) a batch of at least
            ``executor.PARALLEL_MIN_BYTES``. ``None`` (default): 2 in the main process on 3+
            CPUs (``executor.default_read_threads``), 1 inside DataLoader workers.
        follow: open a cache whose producer may still be running (docs/follow.md): a read of a
            shard not committed yet waits for it.
        follow_timeout: with ``follow``, the seconds a read waits for a shard (or the open for
            the producer's record) before :class:`FollowTimeoutError`.

    ``dataset[i]`` -> ``{key: tensor[*sample_shape]}`` (reference behaviour);
    ``dataset.__getitems__([i, j, ...])`` -> :class:`CachedBatch` (``tensors[key]``:
    ``[len(indices), *sample_shape]``). A row whose bytes fail their checksum raises
    :class:`CacheIntegrityError` (file, sample, key, both checksums, the repair command) and
    nothing of the batch is returned. Shards without checksums (the reference producer's) are
    read unverified, with one :class:`UnverifiedCacheWarning` per dataset.
    """

    def __init__(
        self,
        cache_dir: str,
        cache_name: str,
        format_version: int,
        disk_keys: tuple[str, ...],
        *,
        max_open_shards: int = 64,
        verify: bool = True,
        producer_name: str | None = None,
        pin_memory: bool = False,
        readahead: bool = True,
        read_threads: int | None = None,
        read_cache_dir: str | None = None,
        read_cache_bytes: int | None = None,
        follow: bool = False,
        follow_timeout: float = DEFAULT_FOLLOW_TIMEOUT,
    ) -> None:
        disk_keys = check_names("disk_keys", disk_keys, non_empty=True, distinct=True)
        check_int("max_open_shards", max_open_shards, 1)
        check_int("read_cache_bytes", read_cache_bytes, 1, optional=True)
        # the one open of the cache: storage, manifest (or producer record), shard files checked
        opened = open_cache(
            cache_dir,
            cache_name,
            format_version,
            producer_name,
            follow=follow,
            follow_timeout=follow_timeout,
            read_cache_dir=read_cache_dir,
            read_cache_bytes=read_cache_bytes,
        )
        self.storage, manifest = opened.storage, opened.manifest
        producer_name = opened.producer_name
        self._shard_indices, follower = opened.shard_indices, opened.follower
        cache_dir = os.fspath(cache_dir)  # open_storage took it: a str or an os.PathLike
        self.cache_dir = cache_dir
        self.cache_name = cache_name
        self.verify = bool(verify)
        #: epoch 0 visits the shards in index order 0, 1, ... (``sampler.CacheShardSampler``)
        self.follow = bool(follow)
        self._repair = repair_hint(cache_dir, producer_name)
        self.shard_size = int(manifest["shard_size"])
        self.num_samples = int(manifest["num_samples"])
        self.disk_keys = tuple(disk_keys)
        # the reference's name for it: its subclasses (EAGLE-3's dataset) read it in __getitem__
        self._disk_keys = self.disk_keys
        # a ragged cache (``token_keys``): its token keys are read through ``read.tokens``, the rest
        # as rows
        layout = manifest.get(TOKEN_LAYOUT_KEY)
        token_layout = TokenLayout.from_json(layout) if layout is not None else None
        self._token_keys = tuple(
            k for k in self.disk_keys if token_layout and k in token_layout.keys
        )
        self._row_keys = tuple(k for k in self.disk_keys if k not in self._token_keys)
        # ragged keys a batched read leaves to the collate (defer_keys)
        self._deferred: tuple[str, ...] = ()
        if follower is not None:  # its record's keys: the producer's
            follower.check_keys(self.disk_keys)
        self.pin_memory = bool(pin_memory)
        if read_threads is not None:
            ParallelReads(read_threads)  # checks the value: an int >= 1
        self.read_threads = read_threads
        # Expected {key: TensorSpec}: from the manifest's schema when it records one
        # (te_thd producers), else from the first shard this process opens.
        schema = manifest_schema(manifest)
        expected: dict[str, TensorSpec] | None = None
        if schema is not None:
            unknown = [k for k in self.disk_keys if k not in schema]
            if unknown:
                raise ValueError(
                    f"disk_keys {unknown} are not in the {cache_name} cache at {cache_dir} "
                    f"(its manifest {manifest_path(cache_dir)} lists {list(schema)}); pass keys "
                    "the producer wrote"
                )
            expected = {k: schema[k] for k in self.disk_keys}
        if not self.verify:
            warnings.warn(
                f"{cache_name} cache at {cache_dir}: reads are not verified "
                "(verify=False); a damaged "
                "byte reaches training unnoticed",
                UnverifiedCacheWarning,
                stacklevel=2,
            )
        # the shards, as each process reads them: opened, checked, made local, read
        self._source = ShardSource(
            self.storage,
            manifest,
            cache_name=cache_name,
            cache_dir=cache_dir,
            repair=self._repair,
            disk_keys=self.disk_keys,
            schema=expected,
            token_layout=token_layout,
            follower=follower,
            versions=(format_version, producer_name),
            verify=self.verify,
            prefetch=self._row_keys if readahead else (),  # what a shard's first open asks for
            read_threads=read_threads,
            max_open=max_open_shards,
        )
        self._buffers: dict[tuple[bool, bool], DestinationBuffers] = {}
        self._pid = os.getpid()

    # -- per-process state (the source's, and the destination buffers) ----------------------

    def __getstate__(self) -> dict[str, Any]:
        # buffers belong to this process (the source drops its own shards and threads)
        return {**self.__dict__, "_buffers": {}}

    def _own(self) -> None:
        # after fork the child drops the parent's buffers (and the source its shards)
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._source.own()
            self._buffers = {}

    @property
    def manifest(self) -> dict[str, Any]:
        """The cache's manifest (while following: the producer's record, until the manifest)."""
        return self._source.manifest

    @property
    def following(self) -> bool:
        """Whether this process still reads by the producer's follow record (it has not seen the
        manifest)."""
        return self._source.follower is not None

    def defer_keys(self, keys: Sequence[str]) -> tuple[str, ...]:
        """Leave the ragged keys among ``keys`` (returned) to ``CachedBatch.gather`` / ``padded``,
        which read only the blocks of the tokens asked for (a CP rank's share); ``()``: a batch read
        reads every key."""
        keys = check_names("keys", keys)
        if unknown := [k for k in keys if k not in self.disk_keys]:
            raise ValueError(
                f"defer_keys: keys {unknown} are not among the dataset's disk_keys "
                f"{list(self.disk_keys)}; pass keys it reads"
            )
        self._deferred = tuple(k for k in keys if k in self._token_keys)
        return self._deferred

    def __len__(self) -> int:
        return self.num_samples

    def _handle(self, shard_index: int):
        """The ``safe_open`` handle of shard ``shard_index``, opened lazily in this process once the
        shard is checked; a file safetensors still refuses is a :class:`CacheIntegrityError` naming
        it."""
        f = self._shard_file(shard_index)
        if f.handle is None:
            _, safe_open = load_safetensors(self.cache_name)
            try:
                f.handle = safe_open(f.path, framework="pt")
            except (_SafetensorError, OSError) as exc:
                raise self._source.unreadable(f.name, exc) from exc
        return f.handle

    def verify_copied_rows(
        self,
        shard_index: int,
        sums: ShardSums | None,
        key: str,
        data: torch.Tensor,
        rows: np.ndarray | list[int],
    ) -> None:
        """Check rows ``rows`` (shard-local) of ``key`` that a read just copied into ``data``
        (``[len(rows), *sample_shape]``, contiguous CPU) against ``sums``, the shard's checksums
        (``None``: an unverified shard). Callable on its own by a faster copy path; raises
        :class:`CacheIntegrityError` on a mismatch."""
        if sums is None or not self.verify:
            return
        verify_rows(
            data,
            rows,
            sums.sums[key],
            path=self._shard_file(shard_index).name,
            key=key,
            first_sample=shard_index * self.shard_size,
            repair=self._repair,
        )

    def _shard_file(self, shard_index: int) -> OpenShard:
        """Shard ``shard_index`` open in this process (:meth:`ShardSource.shard`)."""
        return self._source.shard(shard_index)

    def _destination(self, shared: bool) -> DestinationBuffers:
        pinned = self.pin_memory and not shared
        pool = self._buffers.get((shared, pinned))
        if pool is None:
            pool = self._buffers[(shared, pinned)] = DestinationBuffers(
                shared=shared, pinned=pinned
            )
        return pool

    # -- reads -------------------------------------------------------------------------

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._source.retry(self._getitem, index)

    def _getitem(self, index: int) -> dict[str, torch.Tensor]:
        index = check_index("index", index, self.num_samples, self._where())
        shard_index, offset = divmod(index, self.shard_size)
        f = self._shard_file(shard_index)
        self._source.ensure(f, row_ranges, f.header.entries, self._row_keys, [offset])
        handle = self._handle(shard_index)
        try:
            out = {key: handle.get_slice(key)[offset] for key in self._row_keys}
        except _SafetensorError as exc:  # the header was checked on open; the file changed since?
            raise self._source.unreadable(f.name, exc) from exc
        for key, t in out.items():
            self.verify_copied_rows(shard_index, f.header.sums, key, t.unsqueeze(0), [offset])
        if self._token_keys:
            tokens = TokenRows(
                self._source,
                (np.array([shard_index]), np.array([offset])),
                self._token_keys,
            )
            out.update({k: v[0] for k, v in tokens.padded_many(self._token_keys).items()})
            out = {k: out[k] for k in self.disk_keys}
        return out

    def __getitems__(self, indices: Sequence[int]) -> CachedBatch:
        """Read samples ``indices`` (in that order; negative ones count from the end) into stacked
        tensors, every row verified; the ragged keys zero-padded to ``[B, L, ...]``, but for those
        :meth:`defer_keys` names."""
        return self._source.retry(self._read_batch, indices)

    def _read_batch(self, indices: Sequence[int]) -> CachedBatch:
        batch, reads, pieces, finish = self._plan_batch(indices)
        try:
            reads.run(pieces, finish)
        except ReadError as exc:
            raise self._source.unreadable(exc.path, exc) from exc
        return batch

    def ready(self, indices: Sequence[int]) -> bool:
        """Whether a read of ``indices`` starts at once: False while the followed producer has not
        committed one of their shards (one listing tells; never waits). The loader reads ahead only
        a ready batch."""
        f, n = self._source.follower, self.num_samples
        return f is None or f.has({int(i) % n // self.shard_size for i in indices})

    def start_read(self, indices: Sequence[int]) -> PendingBatch:
        """Start reading ``indices`` and return at once: ``.result()`` is ``__getitems__(indices)``.

        A batch of at least ``executor.PARALLEL_MIN_BYTES`` is read by the ``read_threads`` helpers
        meanwhile (read-ahead); a smaller one by ``result()``. Bad indices raise here. ``result()``
        (or dropping the pending batch) waits until no thread writes into the batch any more.
        """
        batch, reads, pieces, finish = self._plan_batch(indices)
        return PendingBatch(batch, reads.start(pieces, finish), self._source.unreadable)

    def _plan_batch(
        self, indices: Sequence[int]
    ) -> tuple[CachedBatch, ParallelReads, list[Piece | GatherPiece], Callable[[], None] | None]:
        """The batch's tensors (unfilled), this process's reader, the pieces that fill them, and
        the batch's last step (None: nothing left once the pieces are read)."""
        if type(indices) is not list and isinstance(indices, (torch.Tensor, np.ndarray)):
            indices = indices.tolist()
        n = len(indices)
        self._own()
        in_worker = get_worker_info() is not None
        reads = self._parallel(in_worker)
        if n == 0:
            return CachedBatch({}, 0), reads, [], None
        groups = batch_groups(indices, self.shard_size, self.num_samples, self._where())
        buffers = self._destination(in_worker)
        entries = self._shard_file(groups[0][0]).header.entries
        out: dict[str, torch.Tensor] = {}
        raw: dict[str, memoryview] = {}
        for k in self._row_keys:
            out[k], raw[k] = buffers.get(k, n, entries[k].shape[1:], entries[k].dtype)
        chunk = VERIFY_CHUNK_BYTES // reads.threads if self.verify or reads.threads > 1 else 0
        pieces: list[Piece | GatherPiece] = []
        scattered: list[Scattered] = []
        for shard, local, pos in groups:
            f = self._shard_file(shard)
            self._source.ensure(f, row_ranges, f.header.entries, self._row_keys, local)
            fd = f.descriptor(
                self._source.prefetch, self._repair
            )  # the first batched read of the shard opens it
            plan_shard_rows(
                f,
                fd,
                self._row_keys,
                local,
                pos,
                out,
                raw,
                chunk,
                f.header.sums if self.verify else None,
                shard * self.shard_size,
                self._repair,
                pieces,
                scattered,
            )

        tokens = eager = None
        if self._token_keys:
            tokens = TokenRows(
                self._source,
                batch_places(groups, n),
                self._token_keys,
            )
            later = [k for k in self._token_keys if k not in self._deferred]
            if (
                later
            ):  # one plan: the ragged keys' pieces are read with the rows, on the same threads
                eager = tokens.plan_padded(later, pieces, buffers=buffers)

        def finish() -> None:
            for dst, pos, rows in scattered:  # gathered rows of shards whose batch rows interleave
                dst.index_copy_(0, pos, rows)
            if eager is not None:
                out.update(eager())

        deferred = tokens if self._deferred else None
        return (
            CachedBatch(out, n, deferred, self._token_keys),
            reads,
            pieces,
            finish if scattered or eager is not None else None,
        )

    def _where(self) -> str:
        """The cache as an index error names it."""
        return (
            f"the {self.cache_name} cache at {self.cache_dir}, which holds {self.num_samples} "
            "samples"
        )

    def _parallel(self, in_worker: bool) -> ParallelReads:
        """This process's :class:`ParallelReads` (:meth:`ShardSource.threads`)."""
        return self._source.threads(in_worker)
