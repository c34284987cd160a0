"""Read an offline cache: per-item (reference behaviour) and batched, memory-mapped reads.

``CachedTensorDataset`` keeps the reference API (``__getitem__`` through a lazily
opened ``safetensors.safe_open`` handle, ``_handle``, ``__len__``) and adds the
batched hook torch's ``DataLoader`` calls, ``__getitems__``: the requested indices
are grouped by shard, a contiguous run is one slice per key (one ``memcpy``), any
other group is one ``index_select`` per key. Shards are memory-mapped
(``MAP_PRIVATE``, read-only use), so only the pages a batch touches are read and
they stay file-backed page cache: the anonymous memory of a reader does not grow
with the size of the cache.

Every open handle and mapping belongs to the process that opened it: the caches
are keyed by ``os.getpid()`` and dropped on pickling, so DataLoader workers started
by fork, spawn or forkserver open their own on first use.

Both read paths check a shard when this process first opens it (and again if it
was evicted from the LRU): ``shardfile.read_header`` parses the header (offsets
must tile the file), and the keys, row count, dtypes and sample shapes must agree
with the manifest's schema (or, for a reference manifest without one, with the
first shard opened). Failures are :class:`CacheIntegrityError` naming the shard;
nothing is re-checked per read.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .errors import CacheIntegrityError
from .format import load_safetensors, manifest_path, manifest_schema, read_manifest, shard_path
from .shardfile import HeaderEntry, read_header
from .verify import check_cache_files

try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # pragma: no cover - safetensors is a hard dependency (load_safetensors explains)

    class _SafetensorError(Exception):  # type: ignore[no-redef]
        pass

__all__ = ["CachedBatch", "CachedTensorDataset"]


class CachedBatch(Sequence[dict[str, torch.Tensor]]):
    """The result of ``CachedTensorDataset.__getitems__``: a batch already stacked.

    ``tensors[key]`` is ``[B, *sample_shape]`` in the requested order, a fresh
    tensor (in shared memory inside a DataLoader worker, so sending it to the main
    process costs no copy). The object is also a sequence of ``B`` per-sample dicts
    (row views), so a collate function written for a list of samples still works;
    ``collate_cached`` and ``CachedThdCollator`` take ``tensors`` as is instead
    of unstacking and restacking.
    """

    __slots__ = ("tensors", "_len")

    def __init__(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        self.tensors = tensors
        self._len = length

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, torch.Tensor]]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        return {k: v[i] for k, v in self.tensors.items()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self[i] for i in range(self._len))


def _empty(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """Uninitialised tensor; in shared memory when ``shared`` (a DataLoader worker).

    Same trick as torch's ``default_collate``: a worker's batch is pickled to the
    main process by moving its storage to shared memory, so allocating it there
    up front saves one copy of every batch.
    """
    if not shared:
        return torch.empty(shape, dtype=dtype)
    proto = torch.empty(0, dtype=dtype)
    storage = proto._typed_storage()._new_shared(math.prod(shape), device=proto.device)
    return proto.new(storage).resize_(shape)


def _map_shard(path: str, entries: dict[str, HeaderEntry], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Memory-map one safetensors file and return ``{key: [rows, ...] view}`` for ``keys``.

    ``entries`` is the file's parsed header (``shardfile.read_header``, already
    checked against the schema). The file is mapped copy-on-write
    (``torch.from_file(shared=False)``: opened read-only, no descriptor kept) and
    never written, so every page stays file-backed; safetensors itself has no
    zero-copy view API, ``safe_open`` copies on every slice.
    """
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CacheIntegrityError(
            f"shard {path} is missing (removed after the cache was opened?); re-run the producer", path=path
        ) from None
    whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    views: dict[str, torch.Tensor] = {}
    for key in keys:
        e = entries[key]
        raw = whole[e.start : e.end]
        if e.start % raw.new_empty(0, dtype=e.dtype).element_size():
            raw = raw.clone()  # misaligned (safetensors aligns; a foreign writer may not): copy once
        views[key] = raw.view(e.dtype).view(e.shape)
    return views


class CachedTensorDataset(Dataset):
    """Lazily read fixed-key safetensors shards by sample index.

    Args:
        cache_dir: directory holding ``manifest.json`` and ``shard-NNNNNN.safetensors``.
        cache_name: human name used in error messages.
        format_version: the manifest's expected ``format_version``.
        disk_keys: the keys to read from every shard, e.g. ``("input_ids", "loss_mask")``.
        max_open_shards: how many shards a process keeps open (LRU); bounds
            descriptors and mappings for caches with thousands of shards.

    ``dataset[i]`` -> ``{key: tensor[*sample_shape]}`` (reference behaviour);
    ``dataset.__getitems__([i, j, ...])`` -> :class:`CachedBatch` with
    ``tensors[key]`` of shape ``[len(indices), *sample_shape]``.
    """

    def __init__(
        self,
        cache_dir: str,
        cache_name: str,
        format_version: int,
        disk_keys: tuple[str, ...],
        *,
        max_open_shards: int = 64,
    ) -> None:
        if isinstance(disk_keys, str) or not disk_keys or not all(isinstance(k, str) for k in disk_keys):
            raise ValueError(
                f"disk_keys={disk_keys!r} must be a non-empty tuple of key names, e.g. ('input_ids', 'loss_mask')"
            )
        if not isinstance(max_open_shards, int) or max_open_shards < 1:
            raise ValueError(f"max_open_shards={max_open_shards!r} must be an int >= 1")
        self.cache_dir = cache_dir
        self.cache_name = cache_name
        self.manifest = read_manifest(cache_dir, cache_name=cache_name, format_version=format_version)
        self.shard_size = int(self.manifest["shard_size"])
        self.num_samples = int(self.manifest["num_samples"])
        self._disk_keys = tuple(disk_keys)
        # presence of shards 0..N-1 and, when the manifest records them, their byte sizes
        self._shard_indices = check_cache_files(cache_dir, self.manifest, cache_name)
        self._max_open = max_open_shards
        # Expected {key: (dtype, sample shape)}: from the manifest's schema when it
        # records one (te_thd producers), else from the first shard mapped.
        schema = manifest_schema(self.manifest)
        self._manifest_sample_schema: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        if schema is not None:
            unknown = [k for k in self._disk_keys if k not in schema]
            if unknown:
                raise ValueError(
                    f"disk_keys {unknown} are not in the {cache_name} cache at {cache_dir} "
                    f"(its manifest {manifest_path(cache_dir)} lists {list(schema)}); pass keys "
                    "the producer wrote"
                )
            self._manifest_sample_schema = {k: (schema[k].dtype, tuple(schema[k].shape)) for k in self._disk_keys}
        self._reset_process_state()

    # -- per-process state -------------------------------------------------------------

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._open_handles: dict[int, Any] = OrderedDict()
        self._views: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._sample_schema = self._manifest_sample_schema

    def __getstate__(self) -> dict[str, Any]:
        # Handles and mappings belong to this process: a spawned/forkserver worker
        # gets the dataset pickled and opens its own.
        state = self.__dict__.copy()
        state["_open_handles"] = OrderedDict()
        state["_views"] = OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def _own(self) -> None:
        # After fork the child inherits the parent's handles; reopen rather than share.
        if self._pid != os.getpid():
            self._reset_process_state()

    def __len__(self) -> int:
        return self.num_samples

    def _rows_in(self, shard_index: int) -> int:
        return min(self.shard_size, self.num_samples - shard_index * self.shard_size)

    def _checked_header(self, shard_index: int) -> tuple[str, dict[str, HeaderEntry]]:
        """Parse shard ``shard_index``'s header and check it against the cache's schema.

        Run by both read paths when this process opens the shard (not per read).
        Returns ``(path, entries)``; raises :class:`CacheIntegrityError` naming the
        file for a damaged header, a missing or scalar key, another row count, or
        dtypes / sample shapes that differ from the manifest schema (or, without
        one, from the first shard this process opened).
        """
        path = shard_path(self.cache_dir, shard_index)
        try:
            entries = read_header(path)
        except FileNotFoundError:
            raise CacheIntegrityError(
                f"shard {path} is missing (removed after the cache was opened?); re-run the producer", path=path
            ) from None
        for key in self._disk_keys:
            e = entries.get(key)
            if e is None:
                raise CacheIntegrityError(
                    f"shard {path} has no key {key!r} (it holds {sorted(entries)}); pass disk_keys that the producer wrote",
                    path=path,
                )
            if not e.shape:
                raise CacheIntegrityError(f"shard {path} key {key!r} is a scalar, not [samples, ...]", path=path)
        rows = self._rows_in(shard_index)
        for key in self._disk_keys:
            if entries[key].shape[0] != rows:
                raise CacheIntegrityError(
                    f"shard {path} key {key!r} holds {entries[key].shape[0]} samples, but the manifest "
                    f"(num_samples={self.num_samples}, shard_size={self.shard_size}) puts {rows} in it; "
                    "the cache is inconsistent, re-run the producer",
                    path=path,
                )
        schema = {k: (entries[k].dtype, tuple(entries[k].shape[1:])) for k in self._disk_keys}
        if self._sample_schema is None:
            self._sample_schema = schema
        elif schema != self._sample_schema:
            raise CacheIntegrityError(
                f"shard {path} stores {schema}, but earlier shards store {self._sample_schema}; "
                "every shard of a cache must hold the same dtypes and sample shapes (the manifest "
                "schema, when recorded); re-run the producer for this shard",
                path=path,
            )
        return path, entries

    def _handle(self, shard_index: int):
        """The ``safe_open`` handle of shard ``shard_index``, opened lazily in this process.

        Opening checks the shard first (:meth:`_checked_header`); a file safetensors
        still refuses is a :class:`CacheIntegrityError` naming it.
        """
        self._own()
        handles = self._open_handles
        handle = handles.get(shard_index)
        if handle is None:
            path, _ = self._checked_header(shard_index)
            _, safe_open = load_safetensors(self.cache_name)
            try:
                handle = safe_open(path, framework="pt")
            except (_SafetensorError, OSError) as exc:
                raise self._unreadable(path, exc) from exc
            handles[shard_index] = handle
            if len(handles) > self._max_open:
                handles.popitem(last=False)
        else:
            handles.move_to_end(shard_index)
        return handle

    def _unreadable(self, path: str, exc: BaseException) -> CacheIntegrityError:
        return CacheIntegrityError(
            f"shard {path} cannot be read by safetensors ({exc}); run `te-thd cache verify --deep "
            f"{self.cache_dir}` to find every damaged shard, then restore or rebuild them",
            path=path,
        )

    def _shard_views(self, shard_index: int) -> dict[str, torch.Tensor]:
        """``{key: [rows, *sample_shape] tensor}`` memory-mapped over shard ``shard_index``."""
        self._own()
        views = self._views.get(shard_index)
        if views is not None:
            self._views.move_to_end(shard_index)
            return views
        path, entries = self._checked_header(shard_index)
        views = _map_shard(path, entries, self._disk_keys)
        self._views[shard_index] = views
        if len(self._views) > self._max_open:
            self._views.popitem(last=False)
        return views

    # -- reads -------------------------------------------------------------------------

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        shard_index = index // self.shard_size
        offset = index % self.shard_size
        handle = self._handle(shard_index)
        try:
            return {key: handle.get_slice(key)[offset] for key in self._disk_keys}
        except _SafetensorError as exc:  # the header was checked on open; the file changed since?
            raise self._unreadable(shard_path(self.cache_dir, shard_index), exc) from exc

    def __getitems__(self, indices: Sequence[int]) -> CachedBatch:
        """Read samples ``indices`` (in that order) into stacked tensors.

        Indices are grouped by shard; per shard a contiguous increasing run is one
        slice copy per key, anything else one ``index_select`` per key, written
        straight into the batch. Negative indices count from the end; an index out
        of range raises ``IndexError``.
        """
        if isinstance(indices, torch.Tensor | np.ndarray):
            indices = indices.tolist()
        n = len(indices)
        if n == 0:
            return CachedBatch({}, 0)
        shared = get_worker_info() is not None
        ss, total = self.shard_size, self.num_samples
        lo, hi = min(indices), max(indices)
        if lo >= 0 and hi < total and lo // ss == hi // ss:
            # The common case (shard-block order, sequential reads): one shard.
            shard = lo // ss
            views = self._shard_views(shard)
            local = np.asarray(indices, dtype=np.int64) - shard * ss
            run = hi - lo == n - 1 and _is_run(local)
            out = {}
            for k, v in views.items():
                dst = _empty((n, *v.shape[1:]), v.dtype, True) if shared else None
                out[k] = _take(v, local, run, dst)
            return CachedBatch(out, n)
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + total, idx)
        bad = idx[(idx < 0) | (idx >= total)]
        if bad.size:
            raise IndexError(f"index {int(bad[0])} out of range for a cache of {total} samples")
        return self._gather(idx, shared)

    def _gather(self, idx: np.ndarray, shared: bool) -> CachedBatch:
        """General path: ``idx`` (int64 ``[B]``, in range) in any order over any shards."""
        n = idx.size
        shards = idx // self.shard_size
        order = np.argsort(shards, kind="stable")  # batch positions, grouped by shard
        sorted_shards = shards[order]
        cuts = np.flatnonzero(np.diff(sorted_shards)) + 1
        bounds = np.concatenate(([0], cuts, [n])).tolist()
        outs: dict[str, torch.Tensor] = {}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            shard = int(sorted_shards[a])
            views = self._shard_views(shard)
            pos = order[a:b]
            local = idx[pos] - shard * self.shard_size
            run = _is_run(local)
            # this shard's rows fill a contiguous stretch of the batch (a batch that
            # crosses a shard boundary in shard-block order): write them in place
            in_place = _is_run(pos)
            for k, v in views.items():
                if k not in outs:
                    outs[k] = _empty((n, *v.shape[1:]), v.dtype, shared)
                if in_place:
                    _take(v, local, run, outs[k][int(pos[0]) : int(pos[0]) + pos.size])
                else:
                    outs[k].index_copy_(0, torch.from_numpy(pos), _take(v, local, run, None))
        return CachedBatch(outs, n)


def _take(view: torch.Tensor, local: np.ndarray, run: bool, dst: torch.Tensor | None) -> torch.Tensor:
    """Rows ``local`` of ``view`` (``[rows, ...]``) -> ``[len(local), ...]``, into ``dst`` if given.

    ``run``: ``local`` is ``a, a+1, ...`` -- one slice copy instead of a gather.
    """
    if run:
        src = view[int(local[0]) : int(local[0]) + local.size]
        return src.clone() if dst is None else dst.copy_(src)
    index = torch.from_numpy(local)
    return view.index_select(0, index) if dst is None else torch.index_select(view, 0, index, out=dst)


def _is_run(a: np.ndarray) -> bool:
    """True iff the int array ``a`` is ``[a0, a0+1, ..., a0+n-1]``."""
    return a.size <= 1 or (int(a[-1]) - int(a[0]) == a.size - 1 and bool(np.all(np.diff(a) == 1)))
