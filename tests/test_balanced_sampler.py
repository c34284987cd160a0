"""BalancedBatchSampler: the unbalanced loader's samples per step, planned rows per replica."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd.balance import replica_costs
from te_thd.offline_cache.train.sampler import BalancedBatchSampler, CacheShardSampler, PlannedBatch


class Samples:
    """What the samplers read of a dataset: its size and shard size."""

    def __init__(self, n: int, shard_size: int) -> None:
        self.n, self.shard_size = n, shard_size

    def __len__(self) -> int:
        return self.n


def lengths_for(n: int, seed: int = 0, seq_len: int = 256) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(seq_len / 10), 1.0, n), 1, seq_len).astype(np.int64)


def samplers(n, R, b, S=256, **kw):
    data = Samples(n, kw.pop("shard_size", 16))
    lengths = kw.pop("lengths", None)
    lengths = lengths_for(n, seq_len=S) if lengths is None else lengths
    return [BalancedBatchSampler(data, lengths, b, S, R, r, **kw) for r in range(R)], lengths


def unbalanced_steps(n, R, b, shard_size=16, **kw):
    """Per step, the set of samples the unbalanced loader hands all replicas."""
    ranks = [list(CacheShardSampler(Samples(n, shard_size), R, r, **kw)) for r in range(R)]
    drop = kw.get("drop_last", False)
    out, step = [], 0
    while True:
        parts = [idx[step * b : (step + 1) * b] for idx in ranks]
        if not parts[0] or (drop and len(parts[0]) < b):
            return out
        out.append(sorted(i for p in parts for i in p))
        step += 1


@settings(max_examples=25)
@given(
    st.integers(1, 300),
    st.integers(1, 5),
    st.integers(1, 12),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
)
def test_same_samples_per_step_equal_rows_same_plan_on_every_rank(
    n, R, b, shuffle, drop_last, seed
):
    ranks, lengths = samplers(n, R, b, shuffle=shuffle, drop_last=drop_last, seed=seed)
    per_rank = [list(s) for s in ranks]
    steps = unbalanced_steps(n, R, b, shuffle=shuffle, drop_last=drop_last, seed=seed)
    assert all(len(p) == len(steps) == len(s) for p, s in zip(per_rank, ranks, strict=True))
    for step, expected in enumerate(steps):
        batches = [p[step] for p in per_rank]
        assert len({len(x.rows) for x in batches}) == 1  # equal rows on every replica
        assert sorted(i for x in batches for i in x) == expected  # the unbalanced step's samples
        for x in batches:
            assert sum(x.rows) == len(x)
            start = 0
            for k in x.rows:  # every row fits
                assert int(lengths[x[start : start + k]].sum()) <= 256
                start += k


def test_exactly_once_per_epoch_and_a_new_order_each_epoch():
    ranks, _ = samplers(240, 4, 6)  # divides evenly: no wrap-around padding
    for epoch in (0, 1):
        for s in ranks:
            s.set_epoch(epoch)
        seen = sorted(i for s in ranks for x in s for i in x)
        assert seen == list(range(240))
    firsts = []
    for epoch in (0, 1):
        for s in ranks:
            s.set_epoch(epoch)
        firsts.append(sorted(next(iter(ranks[0]))))
    assert firsts[0] != firsts[1]


def test_balances_what_the_strided_split_does_not():
    ranks, lengths = samplers(8 * 32 * 10, 8, 32, S=8192, lengths=lengths_for(2560, 4, 8192) * 1)
    from te_thd.balance import document_costs

    costs = document_costs(lengths)
    steps = list(zip(*[list(s) for s in ranks], strict=True))
    planned, strided = [], []
    for step, batches in enumerate(steps):
        per = np.array([float(costs[list(x)].sum()) for x in batches])
        planned.append(per.max() / per.mean())
        glob = [i for x in batches for i in x]
        plan = [[[glob.index(i) for i in x]] for x in batches]
        assert np.allclose(replica_costs(plan, lengths[glob]), per)
        base = np.array(
            [
                float(
                    costs[
                        list(CacheShardSampler(Samples(2560, 16), 8, r))[
                            step * 32 : (step + 1) * 32
                        ]
                    ].sum()
                )
                for r in range(8)
            ]
        )
        strided.append(base.max() / base.mean())
    assert np.median(planned) <= 1.05 < np.median(strided)


def test_resume_equals_uninterrupted():
    ranks, lengths = samplers(200, 2, 7, seed=3)
    whole = [list(s) for s in ranks]
    consumed = 3 * 2 * 7  # three steps of both replicas
    state = ranks[0].state_dict(consumed)
    resumed, _ = samplers(200, 2, 7, seed=3, lengths=lengths)
    for s in resumed:
        s.load_state_dict(state)
    assert [list(s) for s in resumed] == [w[3:] for w in whole]
    assert [list(s) for s in resumed] == whole  # the offset applied to one pass only


def test_planned_batch_pickles_with_its_rows():
    x = PlannedBatch([5, 2, 9], [2, 0, 1])
    y = pickle.loads(pickle.dumps(x))
    assert y == [5, 2, 9] and y.rows == (2, 0, 1) and isinstance(y, PlannedBatch)


def test_errors():
    with pytest.raises(ValueError, match=r"lengths has 3 entries but the dataset has 4 samples"):
        BalancedBatchSampler(Samples(4, 2), [1, 2, 3], 2, 8, 1, 0)
    with pytest.raises(ValueError, match=r"lengths\[2\]=9 .*> seq_len=8"):
        BalancedBatchSampler(Samples(4, 2), [1, 2, 9, 3], 2, 8, 1, 0)
    with pytest.raises(ValueError, match=r"batch_size=0 must be an int >= 1"):
        BalancedBatchSampler(Samples(4, 2), [1, 2, 3, 4], 0, 8, 1, 0)
    with pytest.raises(ValueError, match=r"attn_scale=0.0 must be > 0"):
        BalancedBatchSampler(Samples(4, 2), [1, 2, 3, 4], 2, 8, 1, 0, attn_scale=0.0)


# --------------------------------------------------------------------------- through the loader


def _loaders(cache_dir, R, **kw):
    from _offline_cache_support import CACHE_NAME, FORMAT_VERSION

    from te_thd.offline_cache import CachedTensorDataset, CachedThdCollator, build_cached_dataloader
    from te_thd.offline_cache.train.sampler import scan_lengths

    data = CachedTensorDataset(
        cache_dir, CACHE_NAME, FORMAT_VERSION, ("sample_id", "input_ids", "length")
    )
    lengths = scan_lengths(data, length_key="length")
    collate = CachedThdCollator(16, length_key="length", keys=("sample_id", "input_ids", "length"))
    return [
        build_cached_dataloader(
            data,
            6,
            True,
            collate,
            distributed=True,
            dp_rank=r,
            dp_size=R,
            seed=2,
            balance=True,
            lengths=lengths,
            attn_scale=64.0,
            **kw,
        )
        for r in range(R)
    ], lengths


def test_loader_packs_the_planned_rows_and_resumes(tmp_path):
    from _offline_cache_support import make_cache

    tensors = make_cache(str(tmp_path), 90, 16, width=8)
    assert scan_lengths_matches(tmp_path, tensors)
    loaders, lengths = _loaders(str(tmp_path), 3)
    per_rank = [list(loader) for loader in loaders]
    steps = unbalanced_steps(90, 3, 6, seed=2)
    assert [len(p) for p in per_rank] == [len(steps)] * 3
    for step, expected in enumerate(steps):
        batches = [p[step] for p in per_rank]
        ids = sorted(i for b in batches for i in b["sample_id"].tolist())
        assert ids == expected  # the unbalanced loader's samples for this step
        rows = {b["input_ids"].numel() // 16 for b in batches}  # T = rows * S
        assert len(rows) == 1  # the same rows on every replica
        for b in batches:  # the collator kept the planned documents
            assert b["num_seqs"] == len(b["sample_id"])
    # resume after two steps: the remaining steps, identical
    fresh, _ = _loaders(str(tmp_path), 3)
    it = iter(fresh[1])
    next(it), next(it)
    saved = fresh[1].state_dict()
    assert saved["sampler"]["consumed_samples"] == 2 * 3 * 6
    resumed, _ = _loaders(str(tmp_path), 3, resume_state=saved)
    rest = [b["sample_id"].tolist() for b in resumed[1]]
    assert rest == [b["sample_id"].tolist() for b in per_rank[1][2:]]
    # a worker process receives the planned batch (pickled) and collates it the same way
    workers, _ = _loaders(str(tmp_path), 3, num_workers=1)
    assert [b["sample_id"].tolist() for b in workers[2]] == [
        b["sample_id"].tolist() for b in per_rank[2]
    ]


def scan_lengths_matches(tmp_path, tensors) -> bool:
    from _offline_cache_support import CACHE_NAME, FORMAT_VERSION

    from te_thd.offline_cache import CachedTensorDataset
    from te_thd.offline_cache.train.sampler import scan_lengths

    data = CachedTensorDataset(
        str(tmp_path), CACHE_NAME, FORMAT_VERSION, ("input_ids", "length", "position_mask")
    )
    by_key = scan_lengths(data, length_key="length")
    by_ids = scan_lengths(data)  # ids are right-padded with 0 after the length
    return by_key.tolist() == tensors["length"].tolist() == by_ids.tolist()
