"""DataLoader over an offline cache: reference signature, DP-only sharding, batched collate.

``build_cached_dataloader`` keeps the reference positional/keyword signature and adds keyword
options (seed, drop_last, data-parallel rank/size, resume state, worker settings). It always uses
:class:`~te_thd.offline_cache.train.sampler.CacheShardSampler`, so an order is a pure function of
``(seed, epoch)``, and returns a :class:`CachedDataLoader` (a ``torch.utils.data.DataLoader``) that
counts the batches the training loop took, for ``state_dict()`` / ``load_state_dict()``.

``distributed=True`` shards over the data-parallel group *without* context parallelism (megatron's
``parallel_state`` when initialised), so the CP ranks of a replica read the same samples. The
reference shards over the whole world, which hands different samples to the CP ranks of one replica.

A balanced loader plans from every sample's real length. :func:`cache_lengths` returns the
producer's record (:mod:`~te_thd.offline_cache.format.lengths`) when its rule is the one asked
for, else the side file ``lengths.<key>.json`` (an object of the cache, read and written through
its storage) when it belongs to the current manifest, else a scan of the cache (reading only the
key), kept in that side file for the next run. The side file is checksummed and tied to the
manifest's checksum, so a changed manifest makes it stale; readers ignore it.
"""

from __future__ import annotations

import errno
import functools
import json
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from te_thd.args import check_int
from te_thd.balance import DEFAULT_ATTN_SCALE
from te_thd.offline_cache.format.lengths import (
    DEFAULT_LENGTH_KEY,
    LengthRule,
    collator_rule,
    for_tensor_spec,
    recorded_lengths,
    recorded_rule,
)
from te_thd.offline_cache.format.schema import CacheError, json_crc32
from te_thd.offline_cache.read.dataset import CachedTensorDataset
from te_thd.offline_cache.read.follow import FollowTimeoutError
from te_thd.offline_cache.record.manifest import cache_schema, load_manifest, manifest_checksum
from te_thd.offline_cache.storage.base import LocalDirectory, Storage
from te_thd.offline_cache.storage.schemes import as_storage
from te_thd.offline_cache.train.collate import CachedThdCollator
from te_thd.offline_cache.train.sampler import (
    BalancedBatchSampler,
    CacheShardSampler,
    PlannedDataset,
    default_data_parallel_rank_size,
    read_samples,
    scan_rule,
)

__all__ = ["CachedDataLoader", "build_cached_dataloader", "cache_lengths", "to_device"]


class CachedDataLoader(DataLoader):
    """A ``DataLoader`` whose ``state_dict()`` says how far the training loop got.

    A batch counts as consumed once the loop has received it (the same convention
    as torchdata's ``StatefulDataLoader``): checkpoint after the step, then
    ``load_state_dict`` in the restarted job continues with the next batch, for any
    ``num_workers`` (prefetched batches are simply read again).
    """

    #: a ``BalancedBatchSampler`` (a ``CacheShardSampler`` of planned steps) with ``balance=True``
    sampler: CacheShardSampler

    #: ``build_cached_dataloader(read_ahead=...)``: with ``num_workers=0``, start reading batch
    #: ``i + 1`` before handing out batch ``i`` when the step leaves time for it
    #: (:func:`_read_ahead`)
    read_ahead: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._base = 0  # global samples consumed when the current pass started
        self._epoch_of_pass: int | None = None  # None: no pass since construction / load_state_dict
        self._batches = 0

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        self._base, self._epoch_of_pass, self._batches = s.resume_offset, s.epoch, 0
        for batch in self._inline_batches() if self._reads_inline() else super().__iter__():
            self._batches += 1
            yield batch
            # while the next batch is read, the consumer's reference is the only one:
            # a batch it has dropped can be recycled (see executor.DestinationBuffers)
            del batch

    def _reads_inline(self) -> bool:
        """``num_workers=0`` (map-style dataset): batches are read on this thread by
        :meth:`_inline_batches`."""
        return self.num_workers == 0 and not isinstance(self.dataset, IterableDataset)

    def _inline_batches(self) -> Iterator[Any]:
        """What torch's single-process iterator yields, without its per-batch machinery.

        Same batches in the same order (batch sampler -> ``__getitems__`` or one
        ``dataset[i]`` per index -> ``collate_fn``; without a batch size, one
        ``dataset[index]`` per sampler item), minus the profiler hooks and fetcher
        dispatch of each batch. With ``pin_memory`` on a CUDA machine every batch is
        pinned, as torch's pin step does.
        """
        dataset, collate = self.dataset, self.collate_fn
        if self.pin_memory and torch.cuda.is_available():
            # torch's pin step, here: a batch the dataset read into page-locked memory
            # is returned as it is (Tensor.pin_memory keeps a pinned tensor), the
            # rest (e.g. a collator's packed THD tensors) is copied into pinned memory
            collate = functools.partial(_pinned_collate, collate)
        if self.batch_sampler is None:
            for index in self.sampler:
                yield collate(dataset[index])
            return
        start = getattr(dataset, "start_read", None) if self.read_ahead else None
        read = functools.partial(read_samples, dataset)
        ready = getattr(dataset, "ready", None)
        yield from _read_ahead(start, read, self.batch_sampler, collate, ready)

    def consumed_samples(self) -> int:
        """Samples of the current epoch the loop has received, over all replicas."""
        s = self.sampler
        if self._epoch_of_pass is None or s.epoch != self._epoch_of_pass:
            # no pass of this epoch yet (or set_epoch since): only the resume offset
            return s.resume_offset
        # samples per replica per batch: the loader's batch_size, or a batch sampler's own
        per_batch = int(self.batch_size or getattr(s, "batch_size", 1))
        local = min(self._batches * per_batch, (s.total_size - self._base) // s.num_replicas)
        return self._base + local * s.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": ...}`` resume state (epoch, consumed samples, seed, ...)."""
        return {"sampler": self.sampler.state_dict(self.consumed_samples())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the saved position (call before iterating; keep ``set_epoch(saved
        epoch)``)."""
        if "sampler" not in state:
            raise ValueError(
                f"loader state must hold 'sampler' (got keys {sorted(state)}); pass "
                "loader.state_dict()"
            )
        self.sampler.load_state_dict(state["sampler"])
        self._epoch_of_pass = None


def _pinned_collate(collate: Callable[[Any], Any], data: Any) -> Any:
    """``collate(data)`` with every tensor in page-locked memory (CUDA only)."""
    return _map_tensors(collate(data), torch.Tensor.pin_memory)


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (dicts, lists, tuples and namedtuples
    nested)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


def _read_ahead(
    start: Callable[[Sequence[int]], Any] | None,
    read: Callable[[Sequence[int]], Any],
    batches: Iterator[Sequence[int]] | Any,
    collate: Callable[[Any], Any],
    ready: Callable[[Sequence[int]], bool] | None = None,
) -> Iterator[Any]:
    """``collate(batch)`` for every index list of ``batches``, read ahead when the consumer leaves
    time for it.

    Each batch is read by ``read``, or, when the consumer's last time between batches
    was at least half the last synchronous read, started by ``start`` before the
    previous batch is handed out, so the reader's threads copy it while the consumer
    works; ``start`` None (a dataset that cannot, or ``read_ahead=False``): every batch by
    ``read``. A consumer that asks for the next batch at once is served synchronously: there
    read-ahead would only contend with the planning of the next batch (docs/performance-io.md).
    A read still in flight when the consumer stops early is waited for (its buffers must not
    be written once they can be handed out again).

    ``ready(indices)`` False (a followed producer has not committed their shards yet):
    that batch is not started ahead, so the batch before it is handed out at once and
    only the consumer's own read of it waits. A :class:`FollowTimeoutError` that ``start``
    raises all the same is raised as it is, after the batch before it: never waited again.
    """
    it = iter(batches)
    pending = None
    read_s = step_s = 0.0  # the last synchronous read; the consumer's last time between batches
    try:
        indices = next(it, None)
        while indices is not None:
            if pending is None:
                t0 = time.perf_counter()
                batch = read(indices)
                read_s = time.perf_counter() - t0  # the last one: the first read of a shard is slow
            else:
                current, pending = pending, None
                batch = current.result()
            indices = next(it, None)
            timed_out = None
            if indices is not None and start is not None and 2 * step_s >= read_s:
                try:
                    pending = start(indices) if ready is None or ready(indices) else None
                except FollowTimeoutError as exc:  # waited its follow_timeout already
                    timed_out = exc
                except Exception:  # noqa: BLE001 - e.g. a damaged shard: raised by the plain read of
                    pending = None  # this batch, once the batch before it has been handed out

            out = collate(batch)
            del batch
            t1 = time.perf_counter()
            yield out
            step_s = time.perf_counter() - t1
            if timed_out is not None:
                raise timed_out
    finally:
        if pending is not None:
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - nobody asked for this batch: its error is not theirs
                pass


def side_file_name(rule: LengthRule) -> str:
    """``lengths.<key>[.nonzero][.pad<id>].json``, an object of the cache: one per rule."""
    suffix = "" if rule.kind != "nonzero" else ".nonzero"
    pad = f".pad{rule.pad_token_id}" if rule.kind == "last_nonpad" and rule.pad_token_id else ""
    return f"lengths.{rule.key}{suffix}{pad}.json"


def read_side_file(
    storage: Storage, rule: LengthRule, manifest_sum: str, num_samples: int
) -> np.ndarray | None:
    """The lengths the cache keeps for ``rule`` if intact and of this manifest, else ``None``."""
    try:
        obj = json.loads((storage.get(side_file_name(rule)) or b"").decode("utf-8"))
        body = {k: v for k, v in obj.items() if k != "checksum"}
        ok = (
            obj.get("checksum") == json_crc32(body)
            and body.get("manifest_checksum") == manifest_sum
            and body.get("rule") == rule.to_json()
            and isinstance(body.get("lengths"), list)
            and len(body["lengths"]) == num_samples
        )
    except (OSError, ValueError, AttributeError):  # ValueError: also no file (b"")
        return None
    return np.asarray(body["lengths"], dtype=np.int64) if ok else None


def write_side_file(
    storage: Storage, rule: LengthRule, manifest_sum: str, lengths: np.ndarray
) -> None:
    body = {
        "manifest_checksum": manifest_sum,
        "rule": rule.to_json(),
        "lengths": [int(v) for v in lengths],
    }
    data = json.dumps({**body, "checksum": json_crc32(body)}, sort_keys=True) + "\n"
    storage.put(side_file_name(rule), data.encode("ascii"))


def cache_lengths(
    cache_dir: str | Storage,
    cache_name: str = "offline",
    length_key: str | None = None,
    *,
    rule: LengthRule | None = None,
    block: int = 4096,
) -> np.ndarray:
    """Every sample's real length in the cache at ``cache_dir``: int64 ``[num_samples]``.

    Under ``rule``, else under ``length_key``'s (its value when it holds one
    number per sample, else its non-padding length), else under the rule the
    cache records, else ``input_ids``' non-padding length; recorded, kept or
    scanned as the module docstring says. Raises :class:`CacheError` when a scan's
    result cannot be kept because the directory is read-only (saying how to add the lengths).
    ``cache_dir``: a path, a URL or the cache's opened storage.
    """
    store = as_storage(cache_dir)
    return lengths_of(store, load_manifest(store, cache_name), cache_name, length_key, rule, block)


def lengths_of(
    storage: Storage,
    manifest: Mapping[str, Any],
    cache_name: str,
    length_key: str | None = None,
    rule: LengthRule | None = None,
    block: int = 4096,
) -> np.ndarray:
    """:func:`cache_lengths` of the cache an entry point opened (``storage``, its ``manifest``)."""
    cache_dir = storage.name
    recorded = recorded_rule(manifest)
    if recorded is not None and rule is None and length_key in (None, recorded.key):
        return recorded_lengths(manifest)
    key = rule.key if rule is not None else (length_key or DEFAULT_LENGTH_KEY)
    schema = cache_schema(storage, manifest, strict=True)
    assert schema is not None
    if key not in schema:
        raise ValueError(
            f"length_key={key!r}: the {cache_name} cache at {cache_dir} has no such key (it holds "
            f"{sorted(schema)}); pass length_key= naming the key with each sample's "
            "length or tokens"
        )
    rule = for_tensor_spec(rule or LengthRule(key), schema[key])
    num_samples = int(manifest["num_samples"])
    if rule == recorded:
        return recorded_lengths(manifest)
    if rule.kind == "row":  # known from the schema: nothing to scan or keep
        return np.full(num_samples, int(np.prod(schema[key].shape, dtype=np.int64)), dtype=np.int64)
    msum = manifest_checksum(manifest)
    kept = read_side_file(storage, rule, msum, num_samples)
    if kept is not None:
        return kept
    # a local directory tells before the scan that what it finds cannot be kept
    if isinstance(storage, LocalDirectory) and not os.access(cache_dir, os.W_OK):
        raise CacheError(_read_only_message(cache_dir, key))
    dataset = CachedTensorDataset(cache_dir, cache_name, manifest["format_version"], (key,))
    lengths = scan_rule(dataset, rule, block)
    try:
        write_side_file(storage, rule, msum, lengths)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise CacheError(_read_only_message(cache_dir, key)) from None
        raise
    return lengths


def _read_only_message(cache_dir: str, key: str) -> str:
    return (
        f"the cache at {cache_dir} records no per-sample lengths and its directory is "
        f"read-only, so the lengths scanned from {key!r} cannot be kept beside it. Either "
        f"rebuild it with produce_cache(..., length_key={key!r}) (which records them in the "
        f"manifest), or run `te_thd.offline_cache.train.loader.cache_lengths({cache_dir!r}, "
        f"length_key={key!r})` once where the directory is writable, or pass "
        "lengths=scan_lengths(...) to build_cached_dataloader on every run."
    )


def build_cached_dataloader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    collate_fn: Callable[[Sequence[dict[str, torch.Tensor]]], Any],
    num_workers: int = 0,
    distributed: bool = False,
    *,
    seed: int = 0,
    drop_last: bool = False,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    resume_state: Mapping[str, Any] | None = None,
    start_sample: int = 0,
    pin_memory: bool | None = None,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: Any = None,
    balance: bool = False,
    lengths: Sequence[int] | Any = None,
    attn_scale: float = DEFAULT_ATTN_SCALE,
    rows_per_replica: int | None = None,
    length_key: str | None = None,
    read_ahead: bool = True,
) -> CachedDataLoader:
    """Build a dataloader over a precomputed offline cache dataset.

    Args (reference): ``dataset`` (a ``CachedTensorDataset`` or any map-style
    dataset), ``batch_size`` (per data-parallel replica), ``shuffle`` (shard-block
    shuffle), ``collate_fn``, ``num_workers``, ``distributed`` (shard over the
    data-parallel replicas).

    Keyword options:
        seed: order seed, the same on every rank; epoch ``e`` reads
            ``shard_block_order(N, shard_size, seed, e)`` (:class:`CacheShardSampler`).
        drop_last: drop the samples that do not split evenly over the replicas and
            the last incomplete batch (default: pad by wrap-around, keep it).
        dp_rank, dp_size: the data-parallel rank and size. Default with
            ``distributed=True``: megatron's DP group without CP when
            ``parallel_state`` is initialised, else the ``torch.distributed`` world
            (pure data parallelism, as the reference); with ``distributed=False``, 1
            replica.
        resume_state: a ``loader.state_dict()`` to continue from.
        start_sample: alternatively, global samples of epoch 0 already consumed.
        pin_memory: default: pinned when CUDA is available. With ``num_workers=0``
            a :class:`CachedTensorDataset` then reads each batch straight into
            page-locked memory (its ``pin_memory`` is set), so the DataLoader's own
            pin step finds it pinned and copies nothing.
        persistent_workers, prefetch_factor, multiprocessing_context: passed to the
            ``DataLoader`` when ``num_workers > 0`` (``"forkserver"`` / ``"spawn"`` when
            the parent holds a CUDA context).
        balance: work-balanced steps (``BalancedBatchSampler``): each step draws the
            same global batch as without it (same order, same resume points) and this
            replica packs the rows ``te_thd.balance.plan_global_batch`` plans for it;
            ``collate_fn`` must be a ``CachedThdCollator`` (its ``seq_len`` and padding
            multiple are planned for). ``loader.sampler`` is then the batch sampler.
        lengths: with ``balance``, every sample's real length. Default: the lengths
            the collator packs (its ``length_key``'s value, its ``mask_key``'s nonzero
            count, else full rows), from the cache's record when the producer
            recorded them under that rule, else from a scan kept beside the cache
            (:func:`cache_lengths`).
        length_key: with ``balance`` and no ``lengths``, read the lengths from this
            key instead of the collator's.
        attn_scale, rows_per_replica: with ``balance``, passed to the planner.
        read_ahead: with ``num_workers=0``, start reading the next batch before
            handing out the current one whenever the consumer spends at least half a
            read's time per batch (``CachedDataLoader.read_ahead``; one more batch of
            buffers); a dataset following its producer reads ahead only a batch whose
            shards are committed (``ready``). False: read each batch when it is asked for.
    """
    check_int("batch_size", batch_size, 1, meaning=" (samples per data-parallel replica)")
    check_int("num_workers", num_workers, 0)
    if not isinstance(read_ahead, bool):
        raise ValueError(f"read_ahead={read_ahead!r} must be True or False")
    if (dp_rank is None) != (dp_size is None):
        raise ValueError(
            f"pass dp_rank and dp_size together (got dp_rank={dp_rank!r}, dp_size={dp_size!r})"
        )
    if dp_size is None:
        found = default_data_parallel_rank_size() if distributed else (0, 1)
        if found is None and dist.is_available() and dist.is_initialized():
            found = (dist.get_rank(), dist.get_world_size())
        dp_rank, dp_size = found if found is not None else (0, 1)
    cached = isinstance(dataset, CachedTensorDataset)
    order = dict(
        num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    if balance:
        packer = getattr(collate_fn, "packer", None)
        if packer is None:
            raise ValueError(
                "balance=True plans each step's rows: pass collate_fn=CachedThdCollator(...) "
                f"(its seq_len and padding are planned for), not {type(collate_fn).__name__}"
            )
        if lengths is None:
            cache_dir = getattr(dataset, "cache_dir", None)
            if cache_dir is None:
                raise ValueError(
                    "balance=True without lengths= reads the lengths a cache records, but the "
                    f"dataset ({type(dataset).__name__}) is not a CachedTensorDataset; pass "
                    "lengths= (every sample's length, e.g. "
                    "te_thd.offline_cache.train.sampler.scan_lengths(dataset, mask_key=...))"
                )
            if getattr(dataset, "following", False):
                raise ValueError(
                    "balance=True plans every step from the samples' lengths, which a cache whose "
                    "producer still runs has not recorded yet; pass lengths= (every sample's "
                    "length, e.g. from the tokenized data the producer reads), or build the "
                    "loader once the producer has finished"
                )
            # plan with what the collator packs: its length key, its mask, or full rows
            rule = None if length_key is not None else collator_rule(collate_fn)
            lengths = (  # the dataset's open cache, when it is one: opened once
                lengths_of(dataset.storage, dataset.manifest, dataset.cache_name, length_key, rule)
                if cached
                else cache_lengths(cache_dir, dataset.cache_name, length_key, rule=rule)
            )
        sampler: CacheShardSampler = BalancedBatchSampler(
            dataset,
            lengths,
            batch_size,
            packer.seq_len,
            **order,
            pad_to_multiple_of=packer.pad_to_multiple_of,
            attn_scale=attn_scale,
            rows_per_replica=rows_per_replica,
        )
    else:
        sampler = CacheShardSampler(dataset, **order)
    per_replica = sampler.total_size // dp_size
    if drop_last and 0 < len(dataset) < dp_size:
        raise ValueError(
            f"the dataset's {len(dataset)} samples are too few for {dp_size} data-parallel "
            "replicas with drop_last=True: every replica needs at least one, so the loader "
            f"would yield nothing; use a dataset of at least {dp_size} samples, fewer replicas, "
            "or drop_last=False"
        )
    if drop_last and len(dataset) > 0 and per_replica < batch_size:
        raise ValueError(
            f"batch_size={batch_size} with drop_last=True: each of the {dp_size} data-parallel "
            f"replica(s) gets {per_replica} of the {len(dataset)} samples per epoch, fewer than "
            f"one batch, so the loader would yield nothing; pass batch_size <= {per_replica}, or "
            "drop_last=False"
        )
    if resume_state is not None and start_sample:
        raise ValueError(f"pass resume_state or start_sample={start_sample}, not both")
    if start_sample:
        sampler.load_state_dict(sampler.state_dict(start_sample))
    worker_kwargs: dict[str, Any] = {}
    if num_workers > 0:
        worker_kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            worker_kwargs["prefetch_factor"] = prefetch_factor
        why = f"multiprocessing_context={multiprocessing_context!r}"
        if multiprocessing_context is None and not getattr(
            getattr(dataset, "storage", None), "fork_safe", True
        ):
            # an object store's cache: its client's runtime does not survive fork, so workers start
            # from a fresh server process (forkserver) instead of a copy of this one
            multiprocessing_context = "forkserver"
            why = "an s3:// or msc:// cache's client does not survive fork"
        if multiprocessing_context is not None:
            worker_kwargs["multiprocessing_context"] = multiprocessing_context
        _check_picklable_collate(collate_fn, multiprocessing_context, why)
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if pin and num_workers == 0 and cached and torch.cuda.is_available():
        dataset.pin_memory = True
    if cached and isinstance(collate_fn, CachedThdCollator):
        collate_fn.check_dataset(dataset)
        # the keys the collator places token by token are read by it, only the tokens it places
        dataset.defer_keys(collate_fn.gathered_keys(dataset.disk_keys))
    loader = CachedDataLoader(
        PlannedDataset(dataset) if balance else dataset,
        # a planned step is one sampler item (a PlannedBatch) read whole by PlannedDataset
        batch_size=None if balance else batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin,
        collate_fn=collate_fn,
        drop_last=drop_last and not balance,
        **worker_kwargs,
    )
    loader.read_ahead = read_ahead
    if resume_state is not None:
        loader.load_state_dict(resume_state)
    return loader


def _check_picklable_collate(collate_fn: Any, context: Any, why: str) -> None:
    """Refuse, in one line, a ``collate_fn`` that DataLoader workers started without fork cannot
    receive.

    Workers started by forkserver or spawn (``context``: a start method's name, a
    multiprocessing context, or None for the default; ``why``: what chose it) get
    ``collate_fn`` pickled; a lambda or a function defined inside another one fails
    there, deep in multiprocessing.
    """
    if context is None:
        method = multiprocessing.get_start_method(allow_none=True)
        method = method or multiprocessing.get_all_start_methods()[0]
        why = "the default start method"
    else:
        method = context if isinstance(context, str) else context.get_start_method()
    if method == "fork":
        return
    try:
        pickle.dumps(collate_fn)
    except Exception as exc:  # noqa: BLE001 - whatever pickle raises, a worker would raise too
        name = getattr(collate_fn, "__qualname__", type(collate_fn).__name__)
        raise ValueError(
            f"collate_fn={name!r} cannot be pickled ({type(exc).__name__}: {exc}), and the "
            f"DataLoader workers start by {method} ({why}), which sends collate_fn to them "
            "pickled; pass a "
            "module-level function, or a picklable object such as functools.partial of one"
        ) from None


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in ``batch`` (dicts/lists/tuples nested) to ``device``.

    ``non_blocking=True``: from pinned memory the copy is asynchronous and the host
    thread does not wait for the GPU. Python scalars (``max_seqlen_int``,
    ``pad_between_seqs``) stay on the host.
    """
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=True))
