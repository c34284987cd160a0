"""Shard-local, deterministic, resumable, data-parallel sampler for an offline cache.

Same shape as torch's ``DistributedSampler`` (explicit ``num_replicas`` / ``rank``,
``set_epoch``, an order that is a pure function of ``(seed, epoch)``), with three
differences that a cache reader needs:

* **shard-block shuffling**: an epoch's global order visits the shards in a random
  order and, inside each shard, its samples in a random order, so consecutive
  samples (and the ranks' batches, which interleave them) come from one shard and
  a batch is one ``index_select`` over one memory-mapped file;
* **data-parallel groups, not the world**: the default ``rank`` / ``num_replicas``
  come from ``megatron.core.parallel_state``'s data-parallel group *without*
  context parallelism, so the CP (and TP) ranks of one replica get identical
  samples; expert parallelism does not enter (Megatron builds EP groups out of the
  DP x CP ranks and its all-to-all moves tokens, not samples);
* **resume from a consumed-sample count**: ``state_dict(consumed_samples)`` /
  ``load_state_dict`` restart an epoch exactly where the training loop stopped. The
  count is global (all replicas together), so the same state also resumes at a
  different data-parallel size.

Global order ``G`` (length ``N``) is cut to ``total_size``: with ``drop_last`` the
tail that does not divide evenly is dropped, otherwise ``G`` is padded by
wrapping around (as ``DistributedSampler`` does) so every replica gets the same
number of samples. Replica ``r`` reads ``G[start + r :: num_replicas]``, streamed
one shard block at a time: the order costs O(num_shards + shard_size) memory, not
O(N) (torch's ``DistributedSampler`` builds a list of all N indices every epoch).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from te_thd.args import check_int
from te_thd.offline_cache.format import shard_layout, shard_rows

__all__ = ["CacheShardSampler", "default_data_parallel_rank_size", "shard_block_order"]

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
    """The epoch's order as ``(shard, make)`` pairs in visiting order, lazily.

    ``make()`` returns that shard's sample ids (int64 ndarray) in their epoch
    order; it is called only for blocks that are read, so the order costs
    O(num_shards + shard_size) memory whatever the cache size. ``follow``: epoch 0
    visits the shards in index order, the order the producer commits them.
    """
    count = shard_layout(num_samples, shard_size)[0]
    shards = _shard_rng(seed, epoch).permutation(count) if shuffle and not (follow and epoch == 0) else range(count)
    for shard in shards:
        shard = int(shard)
        first = shard * shard_size
        rows = shard_rows(shard, num_samples, shard_size)
        if shuffle:
            yield shard, lambda first=first, rows=rows, shard=shard: first + _shard_rng(seed, epoch, shard).permutation(rows)
        else:
            yield shard, lambda first=first, rows=rows: np.arange(first, first + rows, dtype=np.int64)


def shard_block_order(
    num_samples: int, shard_size: int, seed: int, epoch: int, shuffle: bool = True, follow: bool = False
) -> torch.Tensor:
    """The epoch's global sample order, int64 ``[num_samples]``.

    ``shuffle=False``: ``0..N-1``. Otherwise a permutation in which each shard's
    samples (shard ``s`` = ``[s*shard_size, min((s+1)*shard_size, N))``) are contiguous,
    the shards come in the order ``numpy.random.default_rng([seed, epoch])
    .permutation(num_shards)`` and shard ``s``'s samples in the order
    ``s*shard_size + default_rng([seed, epoch, s]).permutation(rows)`` (numpy
    ``SeedSequence`` streams of those words): the same on every rank and in every
    worker, independent of the global RNG. ``CacheShardSampler``
    streams the same order shard by shard instead of materialising it.

    ``follow=True`` (a reader following its producer, docs/follow.md): epoch 0 visits the
    shards in index order ``0, 1, ...``, the order a producer commits them, each shard's
    samples still in the order above; later epochs are unchanged. A function of the seed,
    the epoch and the shard plan alone, never of when a shard was committed.
    """
    _check_seed(seed, epoch)
    blocks = [make() for _, make in _epoch_blocks(num_samples, shard_size, seed, epoch, shuffle, follow)]
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
            ``shard_block_order(N, shard_size, seed, e)``: the shard order drawn from
            numpy's ``default_rng([seed, e])``, shard ``s``'s sample order from
            ``default_rng([seed, e, s])`` (never the global RNG).
        drop_last: drop the tail that does not divide evenly over the replicas
            instead of padding it with wrapped-around samples.
        shard_size: block size for the shuffle (default ``data_source.shard_size``,
            else 1, which is a plain random permutation).

    A ``data_source`` with ``follow`` set (``CachedTensorDataset(follow=True)``) gets epoch 0
    in the producer's commit order (``shard_block_order(..., follow=True)``); its blocks must
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
        if shard_size is None:
            shard_size = int(getattr(data_source, "shard_size", 1) or 1)
        check_int("shard_size", shard_size, 1)
        _check_seed(seed, 0)
        #: epoch 0 in the producer's commit order (a dataset following its producer)
        self.follow = bool(getattr(data_source, "follow", False))
        if self.follow and shard_size != getattr(data_source, "shard_size", None):
            raise ValueError(
                f"shard_size={shard_size}: the dataset follows its producer, whose shards hold "
                f"{getattr(data_source, 'shard_size', None)} samples; epoch 0 visits them in commit order, so omit "
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

    def global_order(self) -> torch.Tensor:
        """The epoch's order over all replicas, int64 ``[total_size]`` (padded / cut)."""
        g = shard_block_order(self.num_samples_total, self.shard_size, self.seed, self.epoch, self.shuffle, self.follow)
        if self.total_size <= g.numel():
            return g[: self.total_size]
        reps = -(-self.total_size // g.numel())
        return g.repeat(reps)[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        """This replica's indices, ``global_order()[start + rank :: num_replicas]``,
        streamed one shard block at a time (memory independent of the cache size)."""
        n, r, total, start = self.num_samples_total, self.num_replicas, self.total_size, self.resume_offset
        pos = 0  # global position of the current block's first sample
        while pos < total:  # more than one pass over the order only when padding wraps
            for shard, make in _epoch_blocks(n, self.shard_size, self.seed, self.epoch, self.shuffle, self.follow):
                length = min(self.shard_size, n - shard * self.shard_size)
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
        check_int("consumed_samples", consumed_samples, 0, maximum=self.total_size, bound_name="total_size",
                  meaning=" (samples of this epoch consumed by all data-parallel replicas together)")  # fmt: skip
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "consumed_samples": consumed_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shard_size": self.shard_size,
            "num_samples": self.num_samples_total,
            "follow": self.follow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch after its ``consumed_samples`` (any ``num_replicas``
        that divides the count)."""
        for key in ("epoch", "consumed_samples", "seed", "shuffle", "shard_size", "num_samples"):
            if key not in state:
                raise ValueError(f"sampler state is missing {key!r} (got keys {sorted(state)}); pass a dict from state_dict()")
        mismatch = {
            k: (state[k], mine)
            for k, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("shard_size", self.shard_size),
                            ("num_samples", self.num_samples_total), ("follow", self.follow))  # fmt: skip
            if state.get(k, False) != mine  # a state saved before "follow" existed did not follow
        }
        if mismatch:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in mismatch.items())
            raise ValueError(f"sampler state does not match this sampler ({detail}); build the sampler with the saved settings")
        consumed = int(state["consumed_samples"])
        if consumed % self.num_replicas:
            raise ValueError(
                f"consumed_samples={consumed} is not a multiple of num_replicas={self.num_replicas}; "
                "every replica must have consumed the same number of samples"
            )
        if consumed > self.total_size:
            raise ValueError(f"consumed_samples={consumed} exceeds the epoch's total_size={self.total_size}")
        self.epoch = int(state["epoch"])
        self.resume_offset = consumed
