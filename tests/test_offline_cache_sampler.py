"""CacheShardSampler: shard-block order, DP partition, drop_last, resume (pure, no processes)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from te_thd.offline_cache import CacheShardSampler, shard_block_order
from te_thd.offline_cache.train.sampler import default_data_parallel_rank_size


class _Sized:
    def __init__(self, n: int, shard_size: int | None = None) -> None:
        self.n = n
        if shard_size is not None:
            self.shard_size = shard_size

    def __len__(self) -> int:
        return self.n


@given(
    n=st.integers(0, 300),
    shard=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_shard_block_order_is_a_permutation_of_shard_blocks(n, shard, seed, epoch):
    order = shard_block_order(n, shard, seed, epoch)
    assert order.dtype == torch.int64
    assert sorted(order.tolist()) == list(range(n))  # a permutation
    # consecutive runs: each shard's samples form one contiguous block of the order
    shards = (order // shard).tolist()
    blocks = [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]
    assert len(blocks) == len(set(blocks)) == -(-n // shard)
    assert torch.equal(order, shard_block_order(n, shard, seed, epoch))  # pure in (seed, epoch)
    assert torch.equal(shard_block_order(n, shard, seed, epoch, shuffle=False), torch.arange(n))


def test_shard_block_order_changes_with_epoch_and_seed():
    a = shard_block_order(1000, 64, 0, 0)
    assert not torch.equal(a, shard_block_order(1000, 64, 0, 1))
    assert not torch.equal(a, shard_block_order(1000, 64, 1, 0))
    # the within-shard order is shuffled too, not only the shard order
    first = a[:64]
    assert not torch.equal(first, first.sort().values)


def test_seeding_is_the_documented_one():
    """The docstrings' recipe, written out with numpy: shard order from
    ``default_rng([seed, epoch])``, shard s's order from ``default_rng([seed, epoch, s])``."""
    import numpy as np

    n, shard, seed, epoch = 100, 16, 7, 3
    expected = []
    for s in np.random.default_rng([seed, epoch]).permutation(-(-n // shard)).tolist():
        rows = min(shard, n - s * shard)
        expected += (s * shard + np.random.default_rng([seed, epoch, s]).permutation(rows)).tolist()
    assert shard_block_order(n, shard, seed, epoch).tolist() == expected
    sampler = CacheShardSampler(_Sized(n, shard), num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(epoch)
    assert list(sampler) == expected


def _all_ranks(n, r, drop_last, shard=7, seed=3, epoch=0):
    out = []
    for rank in range(r):
        s = CacheShardSampler(
            _Sized(n, shard), num_replicas=r, rank=rank, seed=seed, drop_last=drop_last
        )
        s.set_epoch(epoch)
        got = list(s)
        assert len(got) == len(s)
        out.append(got)
    return out


@given(n=st.integers(1, 200), r=st.integers(1, 6), drop_last=st.booleans(), epoch=st.integers(0, 3))
def test_every_sample_once_per_epoch_across_replicas(n, r, drop_last, epoch):
    per_rank = _all_ranks(n, r, drop_last, epoch=epoch)
    assert len({len(x) for x in per_rank}) == 1  # equal counts: no rank waits in a collective
    counts = Counter(i for x in per_rank for i in x)
    if drop_last:
        assert sum(counts.values()) == (n // r) * r
        assert all(c == 1 for c in counts.values())  # never twice
        assert len(counts) == (n // r) * r
    else:
        assert set(counts) == set(range(n))  # every sample
        extra = sum(counts.values()) - n
        assert 0 <= extra < r  # only the wrap-around padding repeats
        assert sum(c - 1 for c in counts.values()) == extra


def test_replicas_interleave_one_global_order():
    n, r = 50, 3
    s0 = CacheShardSampler(_Sized(n, 8), num_replicas=r, rank=0, seed=5)
    g = s0.global_order()
    per_rank = _all_ranks(n, r, False, shard=8, seed=5)
    for rank in range(r):
        assert per_rank[rank] == g[rank::r].tolist()


@given(
    n=st.integers(1, 150),
    r=st.integers(1, 4),
    r_new=st.integers(1, 4),
    drop_last=st.booleans(),
    frac=st.floats(0, 1),
)
def test_resume_yields_exactly_the_remaining_order(n, r, r_new, drop_last, frac):
    ref = CacheShardSampler(_Sized(n, 6), num_replicas=r, rank=0, seed=11, drop_last=drop_last)
    ref.set_epoch(2)
    total = ref.total_size
    consumed = int(frac * (total // r)) * r
    state = ref.state_dict(consumed)
    # same DP size: every rank continues with the rest of its own list
    for rank in range(r):
        full = CacheShardSampler(
            _Sized(n, 6), num_replicas=r, rank=rank, seed=11, drop_last=drop_last
        )
        full.set_epoch(2)
        whole = list(full)
        res = CacheShardSampler(
            _Sized(n, 6), num_replicas=r, rank=rank, seed=11, drop_last=drop_last
        )
        res.load_state_dict(state)
        res.set_epoch(2)  # the loop's usual set_epoch(saved epoch) keeps the offset
        assert len(res) == len(whole) - consumed // r
        assert list(res) == whole[consumed // r :]
        assert list(res) == whole  # the offset applied to one pass only
    # a different DP size (when it divides the count) continues the same global order
    new_total = (n // r_new) * r_new if drop_last else -(-n // r_new) * r_new
    if consumed % r_new == 0 and consumed <= new_total:
        parts = []
        for rank in range(r_new):
            s = CacheShardSampler(
                _Sized(n, 6), num_replicas=r_new, rank=rank, seed=11, drop_last=drop_last
            )
            s.load_state_dict(state)
            parts.append(list(s))
        order = ref.global_order().tolist()
        merged = [parts[k % r_new][k // r_new] for k in range(sum(map(len, parts)))]
        remaining = CacheShardSampler(
            _Sized(n, 6), num_replicas=r_new, rank=0, seed=11, drop_last=drop_last
        )
        remaining.set_epoch(2)
        new_order = remaining.global_order().tolist()
        assert merged == new_order[consumed:]
        assert order[:consumed] == new_order[:consumed]


def test_set_epoch_to_another_epoch_drops_the_resume_offset():
    s = CacheShardSampler(_Sized(40, 8), num_replicas=2, rank=1, seed=0)
    s.set_epoch(3)
    state = s.state_dict(10)
    t = CacheShardSampler(_Sized(40, 8), num_replicas=2, rank=1, seed=0)
    t.load_state_dict(state)
    assert t.epoch == 3 and len(t) == 15
    t.set_epoch(4)
    assert len(t) == 20
    u = CacheShardSampler(_Sized(40, 8), num_replicas=2, rank=1, seed=0)
    u.set_epoch(4)
    assert list(t) == list(u)


def test_order_is_streamed_not_materialised():
    # a billion samples: the first indices come without building the epoch's order
    # (which would take 8 GB as int64); only the shard order and one shard's order exist
    s = CacheShardSampler(_Sized(10**9, 4096), num_replicas=4, rank=3, seed=9)
    it = iter(s)
    first = [next(it) for _ in range(5)]
    shard = first[0] // 4096
    assert all(i // 4096 == shard for i in first) and len(set(first)) == 5
    assert len(s) == 10**9 // 4


def test_no_shuffle_is_sequential_and_shard_size_default():
    s = CacheShardSampler(_Sized(10), num_replicas=2, rank=1, shuffle=False)
    assert s.shard_size == 1 and list(s) == [1, 3, 5, 7, 9]
    assert CacheShardSampler(_Sized(10, 4)).shard_size == 4


def test_defaults_without_megatron_are_one_replica():
    assert default_data_parallel_rank_size() is None  # parallel_state not initialised here
    s = CacheShardSampler(_Sized(9, 4))
    assert (s.num_replicas, s.rank) == (1, 0) and len(s) == 9


def test_pad_wraps_when_fewer_samples_than_replicas():
    per_rank = _all_ranks(2, 5, drop_last=False)
    assert all(len(x) == 1 for x in per_rank)
    assert set(sum(per_rank, [])) == {0, 1}
    assert _all_ranks(2, 5, drop_last=True) == [[]] * 5


# -- bad input -----------------------------------------------------------------------


def test_bad_arguments():
    d = _Sized(10, 4)
    with pytest.raises(ValueError, match=r"num_replicas=0 must be an int >= 1"):
        CacheShardSampler(d, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match=r"rank=2 must be an int in \[0, num_replicas=2\)"):
        CacheShardSampler(d, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="shard_size=0 must be an int >= 1"):
        CacheShardSampler(d, shard_size=0)
    with pytest.raises(ValueError, match="seed=1.5 must be an int >= 0"):
        CacheShardSampler(d, seed=1.5)
    with pytest.raises(ValueError, match="seed=-1 must be an int >= 0"):
        CacheShardSampler(d, seed=-1)
    with pytest.raises(ValueError, match="epoch=-2 must be an int >= 0"):
        CacheShardSampler(d).set_epoch(-2)
    assert list(CacheShardSampler(_Sized(0), num_replicas=2, rank=1)) == []  # empty is not an error


def test_bad_resume_state():
    s = CacheShardSampler(_Sized(10, 4), num_replicas=2, rank=0, seed=1)
    with pytest.raises(
        ValueError, match=r"consumed_samples=11 must be an int in \[0, total_size=10\]"
    ):
        s.state_dict(11)
    with pytest.raises(ValueError, match="sampler state is missing 'epoch'"):
        s.load_state_dict({"consumed_samples": 2})
    good = s.state_dict(4)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        CacheShardSampler(_Sized(10, 4), num_replicas=2, rank=0, seed=2).load_state_dict(good)
    with pytest.raises(ValueError, match="num_samples: saved 10, now 12"):
        CacheShardSampler(_Sized(12, 4), num_replicas=2, rank=0, seed=1).load_state_dict(good)
    with pytest.raises(ValueError, match="consumed_samples=4 is not a multiple of num_replicas=3"):
        CacheShardSampler(_Sized(10, 4), num_replicas=3, rank=0, seed=1).load_state_dict(good)
    with pytest.raises(ValueError, match=r"consumed_samples=12 exceeds the epoch's total_size=8"):
        CacheShardSampler(
            _Sized(10, 4), num_replicas=4, rank=0, seed=1, drop_last=True
        ).load_state_dict({**good, "consumed_samples": 12})
    # a state saved before samplers recorded "follow" did not follow: a following sampler refuses it
    following = _Sized(10, 4)
    following.follow = True
    old = {k: v for k, v in good.items() if k != "follow"}
    with pytest.raises(ValueError, match="follow: saved False, now True"):
        CacheShardSampler(following, num_replicas=2, rank=0, seed=1).load_state_dict(old)
    CacheShardSampler(_Sized(10, 4), num_replicas=2, rank=0, seed=1).load_state_dict(old)
