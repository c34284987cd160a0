"""Samplers over an offline cache: the deterministic DP order and the work-balanced plan.

:class:`CacheShardSampler` has the shape of torch's ``DistributedSampler`` (explicit
``num_replicas`` / ``rank``, ``set_epoch``, an order that is a pure function of ``(seed,
epoch)``), with three differences that a cache reader needs:

* **shard-block shuffling**: the epoch visits the shards in a random order and each
  shard's samples in a random order, so a batch comes from one shard;
* **data-parallel groups, not the world**: the default ``rank`` / ``num_replicas`` come
  from megatron's data-parallel group *without* context parallelism, so the CP (and TP)
  ranks of one replica get identical samples; expert parallelism does not enter (its
  all-to-all moves tokens, not samples);
* **resume from a consumed-sample count**, global over all replicas, so the same state
  also resumes at a different data-parallel size.

:class:`BalancedBatchSampler` takes at step ``i`` exactly the unbalanced path's global
slice ``[start + i*R*b, start + (i+1)*R*b)`` (same samples per step, same resume points)
and hands each replica the rows :func:`te_thd.balance.plan_global_batch` plans for it,
computed on every rank from the samples' lengths, with no collective. A ``DataLoader``
hands only the samples to its ``collate_fn``, so :class:`PlannedDataset` returns them
together with the rows (:class:`PlannedSamples`), which ``CachedThdCollator`` packs as
planned.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from te_thd.args import check_int
from te_thd.balance import DEFAULT_ATTN_SCALE, min_rows_per_replica, plan_global_batch
from te_thd.offline_cache.format.integrity import on_cpu
from te_thd.offline_cache.format.lengths import LengthRule, keyed_rule
from te_thd.offline_cache.format.schema import num_shards, shard_rows

__all__ = [
    "BalancedBatchSampler",
    "CacheShardSampler",
    "PlannedBatch",
    "PlannedDataset",
    "PlannedSamples",
    "default_data_parallel_rank_size",
    "scan_lengths",
    "shard_block_order",
]

_STATE_VERSION = 1


def default_data_parallel_rank_size() -> tuple[int, int] | None:
    """``(rank, size)`` of this process's data-parallel group without CP, or None.

    Read from ``megatron.core.parallel_state`` only when the caller already imported
    and initialised it (importing megatron-core here would cost every DataLoader
    worker seconds, and an uninitialised parallel state has no groups to read).
    """
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return (
        ps.get_data_parallel_rank(with_context_parallel=False),
        ps.get_data_parallel_world_size(with_context_parallel=False),
    )


def _shard_rng(seed: int, epoch: int, *rest: int) -> np.random.Generator:
    # SeedSequence mixes the words: (seed, epoch) and (seed, epoch, shard) streams are
    # independent, and the same on every rank and worker (never the global RNG).
    return np.random.default_rng([seed, epoch, *rest])


def _epoch_blocks(
    num_samples: int, shard_size: int, seed: int, epoch: int, shuffle: bool, follow: bool = False
) -> Iterator[tuple[int, Any]]:
    """The epoch's order as ``(rows, make)`` pairs, one per shard in visiting order, lazily.

    ``make()`` returns that shard's ``rows`` sample ids (int64 ndarray) in their epoch
    order; it is called only for blocks that are read, so the order costs
    O(num_shards + shard_size) memory whatever the cache size.
    """
    count = num_shards(num_samples, shard_size)
    in_order = not shuffle or (follow and epoch == 0)
    shards = range(count) if in_order else _shard_rng(seed, epoch).permutation(count)
    for shard in map(int, shards):
        rows = shard_rows(shard, num_samples, shard_size)
        yield rows, functools.partial(_block, seed, epoch, shard, shard * shard_size, rows, shuffle)


def _block(seed: int, epoch: int, shard: int, first: int, rows: int, shuffle: bool) -> np.ndarray:
    """Shard ``shard``'s sample ids (``first`` onwards), int64 ``[rows]``, in their epoch order."""
    if shuffle:
        return first + _shard_rng(seed, epoch, shard).permutation(rows)
    return np.arange(first, first + rows, dtype=np.int64)


def shard_block_order(
    num_samples: int,
    shard_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    follow: bool = False,
) -> torch.Tensor:
    """The epoch's global sample order, int64 ``[num_samples]``.

    ``shuffle=False``: ``0..N-1``. Otherwise a permutation in which each shard's
    samples (shard ``s`` = ``[s*shard_size, min((s+1)*shard_size, N))``) are contiguous,
    the shards come in the order ``numpy.random.default_rng([seed, epoch])
    .permutation(num_shards)`` and shard ``s``'s samples in the order
    ``s*shard_size + default_rng([seed, epoch, s]).permutation(rows)`` (numpy
    ``SeedSequence`` streams of those words): the same on every rank and in every
    worker, independent of the global RNG.

    ``follow=True`` (a reader following its producer, docs/follow.md): epoch 0 visits the
    shards in index order ``0, 1, ...`` (a one-rank producer's commit order), each shard's
    samples still in the order above; later epochs are unchanged. A function of the seed,
    the epoch and the shard plan alone, never of when a shard was committed.
    """
    _check_seed(seed, epoch)
    blocks = [
        make() for _, make in _epoch_blocks(num_samples, shard_size, seed, epoch, shuffle, follow)
    ]
    return torch.from_numpy(np.concatenate(blocks)) if blocks else torch.zeros(0, dtype=torch.int64)


def _check_seed(seed: Any, epoch: Any) -> None:
    check_int("seed", seed, 0, meaning=" (the same on every rank)")
    check_int("epoch", epoch, 0)


class CacheShardSampler(Sampler[int]):
    """Deterministic shard-block-shuffling sampler over ``num_replicas`` data-parallel replicas.

    Args:
        data_source: the dataset (anything with ``__len__``); its ``shard_size``
            attribute, when present, is the default block size.
        num_replicas: data-parallel size. Default: megatron's DP size without CP when
            ``parallel_state`` is initialised, else 1.
        rank: data-parallel rank, default as ``num_replicas``.
        shuffle: shard-block shuffle when True, ``0..N-1`` when False.
        seed: int ``>= 0``, the same on every rank. Epoch ``e``'s order is
            ``shard_block_order(N, shard_size, seed, e)`` (never the global RNG).
        drop_last: drop the tail that does not divide evenly over the replicas
            instead of padding it with wrapped-around samples.
        shard_size: block size for the shuffle (default ``data_source.shard_size``,
            else 1, which is a plain random permutation).

    A ``data_source`` with ``follow`` set (``CachedTensorDataset(follow=True)``) gets epoch 0
    in index order (``shard_block_order(..., follow=True)``); its blocks must
    then be the cache's shards (``shard_size`` equal to ``data_source.shard_size``).

    Yields this replica's sample indices (Python ints) for the current epoch.
    """

    def __init__(
        self,
        data_source: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        shard_size: int | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            found = default_data_parallel_rank_size()
            d_rank, d_size = found if found is not None else (0, 1)
            if num_replicas is None:
                num_replicas = d_size
            if rank is None:
                rank = d_rank if num_replicas == d_size else 0
        check_int("num_replicas", num_replicas, 1, meaning=" (the data-parallel size)")
        check_int("rank", rank, 0, below=num_replicas, bound_name="num_replicas")
        shards_of_data = getattr(data_source, "shard_size", None)
        if shard_size is None:
            shard_size = int(shards_of_data or 1)
        check_int("shard_size", shard_size, 1)
        _check_seed(seed, 0)
        #: epoch 0 in index order (a dataset following its producer)
        self.follow = bool(getattr(data_source, "follow", False))
        if self.follow and shard_size != shards_of_data:
            raise ValueError(
                f"shard_size={shard_size}: the dataset follows its producer, whose shards hold "
                f"{shards_of_data} samples; epoch 0 visits them in index order, so omit "
                "shard_size (the dataset's is used)"
            )
        self.num_samples_total = len(data_source)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.shard_size = shard_size
        self.epoch = 0
        #: global samples of this epoch consumed before this pass (a resume's ``consumed_samples``)
        self.resume_offset = 0
        n, r = self.num_samples_total, num_replicas
        self.total_size = (n // r) * r if self.drop_last else -(-n // r) * r

    # -- torch Sampler protocol --------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a resume offset is kept only for the epoch it was saved in."""
        _check_seed(self.seed, epoch)
        if epoch != self.epoch:
            self.resume_offset = 0
        self.epoch = epoch

    def _order_args(self) -> tuple[int, int, int, int, bool, bool]:
        """``(num_samples, shard_size, seed, epoch, shuffle, follow)``: what fixes the epoch's
        order (:func:`shard_block_order`)."""
        n = self.num_samples_total
        return n, self.shard_size, self.seed, self.epoch, self.shuffle, self.follow

    def global_order(self) -> torch.Tensor:
        """The epoch's order over all replicas, int64 ``[total_size]`` (padded / cut)."""
        g = shard_block_order(*self._order_args())
        if self.total_size <= g.numel():
            return g[: self.total_size]
        reps = -(-self.total_size // g.numel())
        return g.repeat(reps)[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        """This replica's indices, ``global_order()[start + rank :: num_replicas]``,
        streamed one shard block at a time (memory independent of the cache size)."""
        r, total, start = self.num_replicas, self.total_size, self.resume_offset
        pos = 0  # global position of the current block's first sample
        while pos < total:  # more than one pass over the order only when padding wraps
            for length, make in _epoch_blocks(*self._order_args()):
                end = min(pos + length, total)
                # first global position >= max(pos, start) that belongs to this rank
                lo = max(pos, start + self.rank)
                lo += (self.rank - lo) % r
                if lo < end:
                    yield from make()[lo - pos : end - pos : r].tolist()
                pos += length
                if pos >= total:
                    break
        # A resume offset applies to one pass: the next pass (also without
        # set_epoch, as with torch's samplers) starts the epoch from the beginning.
        self.resume_offset = 0

    def __len__(self) -> int:
        return (self.total_size - self.resume_offset) // self.num_replicas

    # -- resume ------------------------------------------------------------------------

    def state_dict(self, consumed_samples: int) -> dict[str, Any]:
        """Resume state after ``consumed_samples`` samples of the current epoch, counted
        over all replicas (``num_replicas`` x samples this replica consumed)."""
        check_int(
            "consumed_samples",
            consumed_samples,
            0,
            maximum=self.total_size,
            bound_name="total_size",
            meaning=" (samples of this epoch consumed by all data-parallel replicas together)",
        )
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "consumed_samples": consumed_samples,
            **self._settings(),
        }

    def _settings(self) -> dict[str, Any]:
        """What fixes the order, which a resumed sampler must share with the saved one."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shard_size": self.shard_size,
            "num_samples": self.num_samples_total,
            "follow": self.follow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch after its ``consumed_samples`` (any ``num_replicas``
        that divides the count)."""
        settings = self._settings()
        # a state saved before "follow" existed lacks it, and did not follow
        for key in ["epoch", "consumed_samples", *(k for k in settings if k != "follow")]:
            if key not in state:
                raise ValueError(
                    f"sampler state is missing {key!r} (got keys {sorted(state)}); pass a "
                    "dict from state_dict()"
                )
        saved = {k: state.get(k, False) for k in settings}
        mismatch = {k: (saved[k], mine) for k, mine in settings.items() if saved[k] != mine}
        if mismatch:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in mismatch.items())
            raise ValueError(
                f"sampler state does not match this sampler ({detail}); build the sampler "
                "with the saved settings"
            )
        consumed = int(state["consumed_samples"])
        if consumed % self.num_replicas:
            raise ValueError(
                f"consumed_samples={consumed} is not a multiple of num_replicas="
                f"{self.num_replicas}; every replica must have consumed the same number of samples"
            )
        if consumed > self.total_size:
            raise ValueError(
                f"consumed_samples={consumed} exceeds the epoch's total_size={self.total_size}"
            )
        self.epoch = int(state["epoch"])
        self.resume_offset = consumed


class PlannedBatch(list):
    """This replica's dataset indices for one step, row by row.

    ``rows[k]`` is the number of indices in row ``k``: the first ``rows[0]`` indices
    form row 0, and so on. ``len(rows)`` is the step's rows per replica.
    """

    def __init__(self, indices: Sequence[int], rows: Sequence[int]) -> None:
        super().__init__(indices)
        self.rows = tuple(int(r) for r in rows)

    def __reduce__(self) -> tuple[Any, ...]:  # DataLoader workers receive it pickled
        return (PlannedBatch, (list(self), self.rows))


class PlannedSamples(Sequence[Any]):
    """One step's samples (what the dataset read, in row order) and their rows.

    ``batch``: the dataset's output for the step (a ``CachedBatch`` or a list of
    sample dicts); ``rows``: samples per row, as :class:`PlannedBatch`.
    """

    def __init__(self, batch: Sequence[Any], rows: Sequence[int]) -> None:
        self.batch = batch
        self.rows = tuple(rows)

    def __len__(self) -> int:
        return len(self.batch)

    def __getitem__(self, i: Any) -> Any:
        return self.batch[i]


class PlannedDataset(Dataset):
    """The dataset, reading a :class:`PlannedBatch` into :class:`PlannedSamples`.

    Every other access (``len``, ``dataset[i]``, ``shard_size``, ...) is the wrapped
    dataset's.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int | PlannedBatch) -> Any:
        # a DataLoader built with batch_size=None hands each PlannedBatch here whole
        return self.__getitems__(index) if isinstance(index, PlannedBatch) else self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitems__(self, indices: Sequence[int]) -> PlannedSamples | Sequence[Any]:
        batch = read_samples(self.dataset, list(indices))
        rows = getattr(indices, "rows", None)
        return batch if rows is None else PlannedSamples(batch, rows)


class BalancedBatchSampler(CacheShardSampler):
    """Batch sampler: per step, this replica's planned rows of the step's global batch.

    A :class:`CacheShardSampler` whose items are steps: its order, epochs, resume state
    (``state_dict(consumed_samples)`` counts global samples, ``R * b`` per step) and their
    checks are that sampler's.

    Args:
        data_source: the dataset (anything with ``__len__``; its ``shard_size``
            attribute is the shuffle block, as for ``CacheShardSampler``).
        lengths: ``[len(data_source)]`` ints, every sample's real token count.
        batch_size: samples per replica per step (``b``); the global batch is
            ``num_replicas * b`` samples, exactly the unbalanced loader's.
        seq_len, pad_to_multiple_of, attn_scale, rows_per_replica: passed to
            :func:`te_thd.balance.plan_global_batch` for every step.
        num_replicas, rank, shuffle, seed, drop_last, shard_size: as
            ``CacheShardSampler``. ``drop_last`` also drops a last global batch smaller
            than ``R * b``.
    """

    def __init__(
        self,
        data_source: Sized,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        batch_size: int,
        seq_len: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        shard_size: int | None = None,
        pad_to_multiple_of: int = 1,
        attn_scale: float = DEFAULT_ATTN_SCALE,
        rows_per_replica: int | None = None,
    ) -> None:
        super().__init__(
            data_source, num_replicas, rank, shuffle, seed, drop_last, shard_size=shard_size
        )
        check_int("batch_size", batch_size, 1, meaning=" (samples per data-parallel replica)")
        if isinstance(lengths, torch.Tensor):
            lengths = on_cpu(lengths).numpy()
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if self.lengths.shape[0] != self.num_samples_total:
            raise ValueError(
                f"lengths has {self.lengths.shape[0]} entries but the dataset has "
                f"{self.num_samples_total} samples; pass one length per sample"
            )
        self.batch_size = batch_size
        self.plan_args = dict(
            seq_len=seq_len,
            pad_to_multiple_of=pad_to_multiple_of,
            attn_scale=attn_scale,
            rows_per_replica=rows_per_replica,
        )
        # validate the arguments and every length once, here (errors name the dataset
        # index), not at the first step that meets them
        plan_global_batch(self.lengths[:0], self.num_replicas, **self.plan_args)
        min_rows_per_replica(self.lengths, self.num_replicas, seq_len, pad_to_multiple_of)

    def global_batches(self) -> Iterator[np.ndarray]:
        """The remaining global batches of the epoch, int64 ``[<= R*b]`` dataset indices each."""
        g = self.global_order().numpy()[self.resume_offset :]
        step = self.num_replicas * self.batch_size
        for begin in range(0, g.shape[0], step):
            batch = g[begin : begin + step]
            if batch.shape[0] < step and self.drop_last:
                return
            yield batch

    def __iter__(self) -> Iterator[PlannedBatch]:  # type: ignore[override]  # steps, not indices
        R, r = self.num_replicas, self.rank
        for batch in self.global_batches():
            rows = plan_global_batch(self.lengths[batch], R, **self.plan_args)[r]
            yield PlannedBatch(
                [int(batch[i]) for row in rows for i in row], [len(row) for row in rows]
            )
        # as CacheShardSampler: a resume offset applies to one pass
        self.resume_offset = 0

    def __len__(self) -> int:
        remaining = self.total_size - self.resume_offset
        step = self.num_replicas * self.batch_size
        return remaining // step if self.drop_last else -(-remaining // step)


def scan_lengths(
    dataset: Any,
    *,
    length_key: str | None = None,
    mask_key: str | None = None,
    input_key: str = "input_ids",
    pad_token_id: int = 0,
    block: int = 4096,
) -> np.ndarray:
    """Every sample's real length, int64 ``[len(dataset)]``, by reading the dataset once.

    From ``length_key`` (one integer per sample), else the nonzero count of
    ``mask_key`` (a right-padded per-token mask), else the non-padding length of
    ``input_key`` (up to and including the last token that is not ``pad_token_id``).
    The dataset must read those keys. Reads ``block`` samples at a time.
    """
    rule = keyed_rule(length_key, mask_key, LengthRule(input_key, "last_nonpad", pad_token_id))
    return scan_rule(dataset, rule, block)


def read_samples(dataset: Any, indices: list[int]) -> Any:
    """The samples ``indices`` of a map-style dataset: its batched ``__getitems__`` when it has one
    (a ``CachedBatch`` for a cache), else a list of ``dataset[i]``."""
    read = getattr(dataset, "__getitems__", None)
    return read(indices) if read is not None else [dataset[i] for i in indices]


def scan_rule(dataset: Any, rule: LengthRule, block: int = 4096) -> np.ndarray:
    """Every sample's length under ``rule``, int64 ``[len(dataset)]``, reading ``block`` samples at
    a time."""
    n = len(dataset)
    out = np.empty(n, dtype=np.int64)
    for begin in range(0, n, block):
        idx = list(range(begin, min(begin + block, n)))
        batch = read_samples(dataset, idx)
        tensors = getattr(batch, "tensors", None)
        t = tensors[rule.key] if tensors is not None else torch.stack([s[rule.key] for s in batch])
        out[begin : begin + len(idx)] = rule.lengths(t.reshape(len(idx), -1))
    return out
