"""The cached loader under real megatron.core.parallel_state groups in real gloo processes.

World 4 = TP 1 x CP 2 x DP 2 (and EP 2, which megatron builds out of the DP x CP
ranks). One spawn checks every property: the default DP rank/size come from the DP
group without CP, the two CP ranks of a replica read identical batches, the DP
replicas together read every sample once per epoch (with and without drop_last), a
resumed loader continues with exactly the remaining batches, and the THD collate
splits one packed batch between the CP ranks.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from _offline_cache_support import CACHE_NAME, FORMAT_VERSION, make_cache, run_gloo

N, SHARD, BS = 75, 16, 4
KEYS = ("sample_id", "input_ids", "length")


def _ids(batches) -> list[list[int]]:
    return [b["sample_id"].tolist() for b in batches]


def _rank_main(rank: int, world: int, cache_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from te_thd.offline_cache import (
        CachedTensorDataset,
        CachedThdCollator,
        CacheShardSampler,
        build_cached_dataloader,
        collate_cached,
    )

    ps.initialize_model_parallel(
        tensor_model_parallel_size=1, context_parallel_size=2, expert_model_parallel_size=2
    )
    try:
        res: dict = {
            "dp": (
                ps.get_data_parallel_rank(with_context_parallel=False),
                ps.get_data_parallel_world_size(with_context_parallel=False),
            ),
            "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        }
        ds = CachedTensorDataset(cache_dir, CACHE_NAME, FORMAT_VERSION, KEYS)
        collate = functools.partial(collate_cached, keys=KEYS)
        s = CacheShardSampler(ds)
        res["sampler_default"] = (s.rank, s.num_replicas)
        for drop_last in (False, True):
            loader = build_cached_dataloader(
                ds, BS, True, collate, 0, True, seed=5, drop_last=drop_last
            )
            res[("sampler", drop_last)] = (loader.sampler.rank, loader.sampler.num_replicas)
            epochs = []
            for e in (0, 1):
                loader.sampler.set_epoch(e)
                epochs.append(_ids(loader))
            res[("epochs", drop_last)] = epochs
        # resume mid-epoch 1 after 3 batches
        loader = build_cached_dataloader(ds, BS, True, collate, 0, True, seed=5)
        loader.sampler.set_epoch(1)
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        del it
        resumed = build_cached_dataloader(
            ds, BS, True, collate, 0, True, seed=5, resume_state=state
        )
        resumed.sampler.set_epoch(1)
        res["resume"] = (state["sampler"]["consumed_samples"], _ids(head), _ids(resumed))
        # THD collate for this rank's CP rank
        cp_rank, cp_size = res["cp"]
        thd_collate = CachedThdCollator(16, cp_size=cp_size, cp_rank=cp_rank, length_key="length")
        res["thd"] = next(iter(build_cached_dataloader(ds, BS, True, thd_collate, 0, True, seed=5)))
        return res
    finally:
        ps.destroy_model_parallel()


def test_dp_sharding_cp_identical_resume_under_megatron_groups(tmp_path):
    cache_dir = str(tmp_path / "cache")
    make_cache(cache_dir, N, SHARD, width=8)
    out = run_gloo(4, _rank_main, cache_dir, out_dir=str(tmp_path))
    assert [r["dp"][1] for r in out] == [2, 2, 2, 2]  # DP without CP: world 4 / CP 2
    assert sorted(r["cp"] for r in out) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for r in out:
        # defaults read the DP group without CP (not the world of 4, as the reference)
        assert r["sampler_default"] == r[("sampler", False)] == r[("sampler", True)] == r["dp"]
    replicas: dict[int, list[dict]] = {}
    for r in out:
        replicas.setdefault(r["dp"][0], []).append(r)
    assert sorted(replicas) == [0, 1] and all(len(v) == 2 for v in replicas.values())
    for drop_last in (False, True):
        key = ("epochs", drop_last)
        for a, b in replicas.values():
            assert a["cp"][0] != b["cp"][0]
            assert a[key] == b[key]  # CP ranks of one replica: identical batches
        for e in (0, 1):
            flat = [i for rep in replicas.values() for batch in rep[0][key][e] for i in batch]
            counts = Counter(flat)
            if drop_last:
                # 75 -> 74 split evenly (37 each) -> 9 full batches each; nothing twice
                assert all(c == 1 for c in counts.values()) and len(flat) == 2 * 9 * BS
            else:
                assert set(counts) == set(range(N)) and len(flat) == N + 1  # one wrap-around pad
        assert replicas[0][0][key][0] != replicas[0][0][key][1]  # epochs differ
    for members in replicas.values():
        consumed, head, rest = members[0]["resume"]
        assert consumed == 3 * BS * 2  # global count: 3 batches x 4 samples x 2 replicas
        assert head + rest == members[0][("epochs", False)][1]  # exactly the remaining order
        assert members[1]["resume"] == members[0]["resume"]
        t0, t1 = (m["thd"] for m in sorted(members, key=lambda m: m["cp"][0]))
        assert torch.equal(t0["cu_seqlens_padded"], t1["cu_seqlens_padded"])  # global boundaries
        total = int(t0["cu_seqlens_padded"][-1])
        assert t0["input_ids"].numel() == t1["input_ids"].numel() == total // 2
        assert not torch.equal(t0["position_ids"], t1["position_ids"])  # different halves
        assert torch.equal(t0["sample_id"], t1["sample_id"])
