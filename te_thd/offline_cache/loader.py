"""DataLoader over an offline cache: reference signature, DP-only sharding, batched collate.

``build_cached_dataloader`` keeps the reference positional/keyword signature and adds
keyword options (seed, drop_last, data-parallel rank/size, resume state, worker
settings). It always uses :class:`~te_thd.offline_cache.sampler.CacheShardSampler`,
so an order is a pure function of ``(seed, epoch)``, and returns a
:class:`CachedDataLoader` (a ``torch.utils.data.DataLoader``) that counts the
batches the training loop took, for ``state_dict()`` / ``load_state_dict()``.

``distributed=True`` shards over the data-parallel group *without* context
parallelism (megatron's ``parallel_state`` when initialised), so the CP ranks of a
replica read the same samples. The reference shards over the whole world, which
hands different samples to the CP ranks of one replica.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..args import check_int
from .balanced_sampler import BalancedBatchSampler, PlannedDataset
from .length_scan import cache_lengths
from .lengths import collator_rule
from .reader import CachedBatch, CachedTensorDataset
from .readexec import new_tensor
from .sampler import CacheShardSampler, default_data_parallel_rank_size

__all__ = [
    "CachedDataLoader",
    "build_cached_dataloader",
    "collate_cached",
    "to_device",
]


def collate_cached(features: Sequence[dict[str, torch.Tensor]], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Stack per-sample cache dicts into a batch: ``{key: [B, *sample_shape]}``.

    A :class:`CachedBatch` (what ``CachedTensorDataset.__getitems__`` returns) is
    already stacked: its tensors are returned as they are, without the unstack +
    restack a list of samples needs. Inside a DataLoader worker a list is stacked
    straight into shared memory (one copy less on the way to the main process).
    """
    if isinstance(features, CachedBatch):
        try:
            return {key: features.tensors[key] for key in keys}
        except KeyError as e:
            raise ValueError(
                f"collate_cached: key {e.args[0]!r} was not read (the dataset's disk_keys are "
                f"{tuple(features.tensors)}); add it to disk_keys or drop it from keys"
            ) from None
    if len(features) == 0:
        raise ValueError(
            "collate_cached: features is empty; a batch needs at least one sample (a sampler "
            "or batch_sampler yielded an empty batch)"
        )
    shared = get_worker_info() is not None
    out = {}
    for key in keys:
        try:
            rows = [feature[key] for feature in features]
        except KeyError:
            i = next(i for i, f in enumerate(features) if key not in f)
            raise ValueError(
                f"collate_cached: sample {i} has no key {key!r} (it holds {sorted(features[i])}); "
                "add it to the dataset's disk_keys or drop it from keys"
            ) from None
        dst = None
        if shared:
            # torch.stack promotes mixed dtypes; the shared-memory output must too
            dtype = functools.reduce(torch.promote_types, {r.dtype for r in rows}) if all(
                isinstance(r, torch.Tensor) for r in rows) else None
            if dtype is not None:
                dst = new_tensor((len(rows), *rows[0].shape), dtype, shared=True)
        try:
            out[key] = torch.stack(rows, dim=0, out=dst)
        except (RuntimeError, TypeError) as exc:
            raise _stack_error(key, rows, exc) from None
    return out


def _stack_error(key: str, rows: list[Any], exc: Exception) -> ValueError:
    """Why ``torch.stack(rows)`` failed, naming the key and the first offending sample."""
    for i, r in enumerate(rows):
        if not isinstance(r, torch.Tensor):
            return ValueError(f"collate_cached: key {key!r} of sample {i} is of type {type(r).__name__}, not a tensor")
    first = list(rows[0].shape)
    for i, r in enumerate(rows):
        if list(r.shape) != first:
            return ValueError(
                f"collate_cached: key {key!r} of sample {i} is {list(r.shape)}, sample 0's is {first}: "
                "the samples of one batch must share each key's shape (pad them when producing the "
                "cache, or collate variable lengths with CachedThdCollator)"
            )
    return ValueError(f"collate_cached: cannot stack key {key!r} ({exc})")


class CachedDataLoader(DataLoader):
    """A ``DataLoader`` whose ``state_dict()`` says how far the training loop got.

    A batch counts as consumed once the loop has received it (the same convention
    as torchdata's ``StatefulDataLoader``): checkpoint after the step, then
    ``load_state_dict`` in the restarted job continues with the next batch, for any
    ``num_workers`` (prefetched batches are simply read again).
    """

    sampler: CacheShardSampler | BalancedBatchSampler

    #: With ``num_workers=0`` (also pinned for CUDA): when the training step leaves time
    #: for it (a step of at least half a batch's read), start reading batch ``i + 1``
    #: (``CachedTensorDataset.start_read``) before handing out batch ``i``, so its copy
    #: runs on the reader's helper threads while the step runs. Costs one more batch of
    #: buffers; the sampler is then one batch ahead (as with DataLoader workers).
    #: ``build_cached_dataloader(read_ahead=...)``.
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
            # a batch it has dropped can be recycled (see readexec.DestinationBuffers)
            del batch

    def _reads_inline(self) -> bool:
        """``num_workers=0`` (map-style dataset): batches are read on this thread by :meth:`_inline_batches`."""
        return self.num_workers == 0 and not isinstance(self.dataset, IterableDataset)

    def _inline_batches(self) -> Iterator[Any]:
        """What torch's single-process iterator yields, without its per-batch machinery.

        Same batches in the same order (batch sampler -> ``__getitems__`` or one
        ``dataset[i]`` per index -> ``collate_fn``; without a batch size, one
        ``dataset[index]`` per sampler item), minus the profiler hooks and fetcher
        dispatch of each batch, a share of reading a cached batch worth saving. With
        ``pin_memory`` on a CUDA machine every batch is pinned, as torch's pin step does.
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
        if start is not None:
            yield from _read_ahead(start, dataset.__getitems__, self.batch_sampler, collate)
            return
        getitems = getattr(dataset, "__getitems__", None)
        for indices in self.batch_sampler:
            yield collate(getitems(indices) if getitems else [dataset[i] for i in indices])

    def consumed_samples(self) -> int:
        """Samples of the current epoch the loop has received, over all replicas."""
        s = self.sampler
        if self._epoch_of_pass is None or s.epoch != self._epoch_of_pass:
            return s.resume_offset  # no pass of this epoch yet (or set_epoch since): only the resume offset
        # samples per replica per batch: the loader's batch_size, or a batch sampler's own
        per_batch = int(self.batch_size or getattr(s, "batch_size", 1))
        local = min(self._batches * per_batch, (s.total_size - self._base) // s.num_replicas)
        return self._base + local * s.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": ...}`` resume state (epoch, consumed samples, seed, ...)."""
        return {"sampler": self.sampler.state_dict(self.consumed_samples())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the saved position (call before iterating; keep ``set_epoch(saved epoch)``)."""
        if "sampler" not in state:
            raise ValueError(f"loader state must hold 'sampler' (got keys {sorted(state)}); pass loader.state_dict()")
        self.sampler.load_state_dict(state["sampler"])
        self._epoch_of_pass = None


def _pinned_collate(collate: Callable[[Any], Any], data: Any) -> Any:
    return _pin(collate(data))


def _pin(batch: Any) -> Any:
    """Every tensor of ``batch`` (dicts/lists/tuples nested) in page-locked memory (CUDA only)."""
    return _map_tensors(batch, torch.Tensor.pin_memory)


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (dicts, lists, tuples and namedtuples nested)."""
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
    start: Callable[[Sequence[int]], Any], read: Callable[[Sequence[int]], Any],
    batches: Iterator[Sequence[int]] | Any, collate: Callable[[Any], Any],
) -> Iterator[Any]:  # fmt: skip
    """``collate(batch)`` for every index list of ``batches``, read ahead when the consumer leaves time for it.

    Each batch is read by ``read`` (on this thread and the reader's helpers), or,
    when the consumer's last time between batches was at least half the last
    synchronous read, started by ``start`` before the previous batch is handed
    out, so the reader's threads copy it while the consumer works: then at least
    half of each read hides behind the consumer's work. A consumer that asks for
    the next batch at once (a bare read loop) is served synchronously, where
    read-ahead would only make the reader's threads contend with the planning of
    the next batch (docs/performance-io.md). A read still in flight when the
    consumer stops early is waited for (its buffers must not be written once they
    can be handed out again).
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
            if indices is not None and 2 * step_s >= read_s:
                try:
                    pending = start(indices)
                except Exception:  # noqa: BLE001 - e.g. a damaged shard: raised by the plain read of
                    pending = None  # this batch, once the batch before it has been handed out

            out = collate(batch)
            del batch
            t1 = time.perf_counter()
            yield out
            step_s = time.perf_counter() - t1
    finally:
        if pending is not None:
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - nobody asked for this batch: its error is not theirs
                pass


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
    attn_scale: float = 49152.0,
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
            ``shard_block_order(N, shard_size, seed, e)`` (numpy ``default_rng([seed,
            e])`` for the shard order, ``default_rng([seed, e, s])`` inside shard ``s``;
            see :class:`CacheShardSampler`).
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
            (``te_thd.offline_cache.length_scan.cache_lengths``).
        length_key: with ``balance`` and no ``lengths``, read the lengths from this
            key instead of the collator's.
        attn_scale, rows_per_replica: with ``balance``, passed to the planner.
        read_ahead: with ``num_workers=0``, start reading the next batch before
            handing out the current one whenever the consumer spends at least half a
            read's time per batch (``CachedDataLoader.read_ahead``; one more batch of
            buffers). False: read each batch when it is asked for.
    """
    check_int("batch_size", batch_size, 1, meaning=" (samples per data-parallel replica)")
    check_int("num_workers", num_workers, 0)
    if not isinstance(read_ahead, bool):
        raise ValueError(f"read_ahead={read_ahead!r} must be True or False")
    if (dp_rank is None) != (dp_size is None):
        raise ValueError(f"pass dp_rank and dp_size together (got dp_rank={dp_rank!r}, dp_size={dp_size!r})")
    if dp_size is None:
        if distributed:
            found = default_data_parallel_rank_size()
            if found is None and torch.distributed.is_available() and torch.distributed.is_initialized():
                found = (torch.distributed.get_rank(), torch.distributed.get_world_size())
            dp_rank, dp_size = found if found is not None else (0, 1)
        else:
            dp_rank, dp_size = 0, 1
    if balance:
        packer = getattr(collate_fn, "packer", None)
        if packer is None:
            raise ValueError(
                f"balance=True plans each step's rows: pass collate_fn=CachedThdCollator(...) (its seq_len "
                f"and padding are planned for), not {type(collate_fn).__name__}"
            )
        if lengths is None:
            cache_dir = getattr(dataset, "cache_dir", None)
            if cache_dir is None:
                raise ValueError(
                    f"balance=True without lengths= reads the lengths a cache records, but the dataset "
                    f"({type(dataset).__name__}) is not a CachedTensorDataset; pass lengths= (every sample's "
                    "length, e.g. te_thd.offline_cache.balanced_sampler.scan_lengths(dataset, mask_key=...))"
                )
            if getattr(dataset, "following", False):
                raise ValueError(
                    "balance=True plans every step from the samples' lengths, which a cache whose producer still "
                    "runs has not recorded yet; pass lengths= (every sample's length, e.g. from the tokenized "
                    "data the producer reads), or build the loader once the producer has finished"
                )
            # plan with what the collator packs: its length key, its mask, or full rows
            rule = None if length_key is not None else collator_rule(collate_fn)
            lengths = cache_lengths(cache_dir, dataset.cache_name, length_key, rule=rule)
        sampler: CacheShardSampler | BalancedBatchSampler = BalancedBatchSampler(
            dataset, lengths, batch_size, packer.seq_len, dp_size, dp_rank, shuffle, seed, drop_last,
            pad_to_multiple_of=packer.pad_to_multiple_of, attn_scale=attn_scale,
            rows_per_replica=rows_per_replica,
        )
    else:
        sampler = CacheShardSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    per_replica = sampler.total_size // dp_size
    if drop_last and 0 < len(dataset) < dp_size:
        raise ValueError(
            f"the dataset's {len(dataset)} samples are too few for {dp_size} data-parallel replicas with "
            "drop_last=True: every replica needs at least one, so the loader would yield nothing; use a dataset of "
            f"at least {dp_size} samples, fewer replicas, or drop_last=False"
        )
    if drop_last and len(dataset) > 0 and per_replica < batch_size:
        raise ValueError(
            f"batch_size={batch_size} with drop_last=True: each of the {dp_size} data-parallel replica(s) gets "
            f"{per_replica} of the {len(dataset)} samples per epoch, fewer than one batch, so the loader would "
            f"yield nothing; pass batch_size <= {per_replica}, or drop_last=False"
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
        if multiprocessing_context is None and not getattr(getattr(dataset, "_storage", None), "fork_safe", True):
            # an object store's cache: its client's runtime does not survive fork, so workers start
            # from a fresh server process (forkserver) instead of a copy of this one
            multiprocessing_context = "forkserver"
        if multiprocessing_context is not None:
            worker_kwargs["multiprocessing_context"] = multiprocessing_context
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if pin and num_workers == 0 and isinstance(dataset, CachedTensorDataset) and torch.cuda.is_available():
        dataset.pin_memory = True
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


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in ``batch`` (dicts/lists/tuples nested) to ``device``.

    ``non_blocking=True``: from pinned memory the copy is asynchronous and the host
    thread does not wait for the GPU. Python scalars (``max_seqlen_int``,
    ``pad_between_seqs``) stay on the host.
    """
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=True))
