"""Work-balanced batch sampler: each step's global batch planned over the DP replicas.

The unbalanced path (``CacheShardSampler`` + ``batch_size``) hands replica ``r`` the
global positions ``start + r + R*j`` of its share; step ``i`` of all ``R`` replicas
together covers the global order's slice ``[start + i*R*b, start + (i+1)*R*b)``.
``BalancedBatchSampler`` takes exactly that slice at step ``i`` -- the same samples per
step, the same epoch order, the same resume points -- and hands each replica the rows
:func:`te_thd.balance.plan_global_batch` plans for it, so every replica gets the same
number of rows and close to the same compute. Every rank computes the same plan from
the samples' lengths, with no collective.

Each item it yields is a :class:`PlannedBatch`: this replica's dataset indices, row
by row, with ``rows`` = the number of samples in each row (``K`` entries, the same
``K`` on every replica; a row may be empty). A ``DataLoader`` hands only the samples
to its ``collate_fn``, so :class:`PlannedDataset` wraps the dataset and returns the
samples together with the rows (:class:`PlannedSamples`); ``CachedThdCollator`` packs
those along the plan instead of bin-packing them again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from te_thd.balance import DEFAULT_ATTN_SCALE, min_rows_per_replica, plan_global_batch

from ..args import check_int
from .lengths import LengthRule, scan_rule
from .sampler import CacheShardSampler

__all__ = ["BalancedBatchSampler", "PlannedBatch", "PlannedDataset", "PlannedSamples", "scan_lengths"]


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
        read = getattr(self.dataset, "__getitems__", None)
        batch = read(list(indices)) if read is not None else [self.dataset[i] for i in indices]
        rows = getattr(indices, "rows", None)
        return batch if rows is None else PlannedSamples(batch, rows)


class BalancedBatchSampler(Sampler[PlannedBatch]):
    """Batch sampler: per step, this replica's planned rows of the step's global batch.

    Args:
        data_source: the dataset (anything with ``__len__``; its ``shard_size``
            attribute is the shuffle block, as for ``CacheShardSampler``).
        lengths: ``[len(data_source)]`` ints, every sample's real token count.
        batch_size: samples per replica per step (``b``); the global batch is
            ``num_replicas * b`` samples, exactly the unbalanced loader's.
        seq_len, pad_to_multiple_of, attn_scale, rows_per_replica: passed to
            :func:`te_thd.balance.plan_global_batch` for every step.
        num_replicas, rank, shuffle, seed, drop_last, shard_size: as
            ``CacheShardSampler`` (the order, resume and its checks are that sampler's).
            ``drop_last`` also drops a last global batch smaller than ``R * b``.
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
        self.order = CacheShardSampler(
            data_source, num_replicas, rank, shuffle, seed, drop_last, shard_size=shard_size
        )
        check_int("batch_size", batch_size, 1, meaning=" (samples per data-parallel replica)")
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().cpu().numpy()
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if self.lengths.shape[0] != self.order.num_samples_total:
            raise ValueError(
                f"lengths has {self.lengths.shape[0]} entries but the dataset has "
                f"{self.order.num_samples_total} samples; pass one length per sample"
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
        plan_global_batch(self.lengths[:0], self.order.num_replicas, **self.plan_args)
        min_rows_per_replica(self.lengths, self.order.num_replicas, seq_len, pad_to_multiple_of)

    @property
    def num_replicas(self) -> int:
        return self.order.num_replicas

    @property
    def rank(self) -> int:
        return self.order.rank

    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def total_size(self) -> int:
        """Global samples of an epoch (as ``CacheShardSampler.total_size``)."""
        return self.order.total_size

    @property
    def resume_offset(self) -> int:
        """Global samples of this epoch consumed before this pass (as ``CacheShardSampler.resume_offset``)."""
        return self.order.resume_offset

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (as ``CacheShardSampler.set_epoch``)."""
        self.order.set_epoch(epoch)

    def global_batches(self) -> Iterator[np.ndarray]:
        """The remaining global batches of the epoch, int64 ``[<= R*b]`` dataset indices each."""
        g = self.order.global_order().numpy()[self.order.resume_offset :]
        step = self.num_replicas * self.batch_size
        for begin in range(0, g.shape[0], step):
            batch = g[begin : begin + step]
            if batch.shape[0] < step and self.order.drop_last:
                return
            yield batch

    def __iter__(self) -> Iterator[PlannedBatch]:
        R, r = self.num_replicas, self.rank
        for batch in self.global_batches():
            rows = plan_global_batch(self.lengths[batch], R, **self.plan_args)[r]
            yield PlannedBatch([int(batch[i]) for row in rows for i in row], [len(row) for row in rows])
        # as CacheShardSampler: a resume offset applies to one pass
        self.order.resume_offset = 0

    def __len__(self) -> int:
        remaining = self.order.total_size - self.order.resume_offset
        step = self.num_replicas * self.batch_size
        return remaining // step if self.order.drop_last else -(-remaining // step)

    def state_dict(self, consumed_samples: int) -> dict[str, Any]:
        """Resume state after ``consumed_samples`` global samples of the epoch (``R*b`` per step)."""
        return self.order.state_dict(consumed_samples)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved position (the same state as ``CacheShardSampler``'s)."""
        self.order.load_state_dict(state)


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
    if length_key is not None:
        rule = LengthRule(length_key, "value")
    elif mask_key is not None:
        rule = LengthRule(mask_key, "nonzero")
    else:
        rule = LengthRule(input_key, "last_nonpad", pad_token_id)
    return scan_rule(dataset, rule, block)
