"""The offline cache's CP reads follow the chosen strategy, and a rank still reads only its tokens."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from te_thd.offline_cache import (
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    produce_cache,
)
from te_thd.offline_cache.format.schema import TensorSpec
from te_thd.offline_cache.read import planner as readplan
from te_thd.offline_cache.read.cp_reads import contiguous_ranges, cp_spans
from te_thd.offline_cache.tools.plan import CacheSpec, plan_cache

L, H = 24, 8
KEYS = ("input_ids", "hidden", "length")


def _samples(n: int, seed: int, max_len: int, min_len: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.zeros(max_len, dtype=torch.int64)
        ids[:length] = torch.randint(1, 1000, (length,), generator=g)
        out.append({"input_ids": ids, "length": torch.tensor(length)})
    return out


def _produce(out: Path, samples: list, hidden: int, **kw) -> None:
    def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids, length = batch["input_ids"], batch["length"]
        real = torch.arange(ids.shape[1]).unsqueeze(0) < length.unsqueeze(1)
        h = ids.unsqueeze(-1).float() + torch.arange(hidden).float() / hidden
        return {
            "input_ids": ids,
            "hidden": (h * real.unsqueeze(-1)).to(torch.bfloat16),
            "length": length,
        }

    produce_cache(
        DataLoader(samples, batch_size=3),
        str(out),
        8,
        compute,
        KEYS,
        progress=False,
        length_key="length",
        **kw,
    )


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("cp_strategy")
    samples = _samples(21, seed=1, max_len=L)
    _produce(base / "padded", samples, H)
    _produce(base / "ragged", samples, H, token_keys=("input_ids", "hidden"))
    return {"padded": base / "padded", "ragged": base / "ragged"}


def _ds(path: Path, keys=KEYS) -> CachedTensorDataset:
    return CachedTensorDataset(str(path), "test", 1, keys)


@pytest.mark.parametrize("cp_size", [2, 3, 4])
@pytest.mark.parametrize("name", ["padded", "ragged"])
def test_no_load_balance_ranks_hold_contiguous_pieces(caches, cp_size, name) -> None:
    ds = _ds(caches[name])
    idx = [3, 17, 0, 9, 20, 5, 11]
    seq_len = 48 * cp_size // 2  # a multiple of cp_size; docs are not padded
    whole = CachedThdCollator(seq_len, length_key="length")(ds.__getitems__(idx))
    total = whole["input_ids"].shape[0]
    local = total // cp_size
    for rank in range(cp_size):
        col = CachedThdCollator(
            seq_len, length_key="length", cp_size=cp_size, cp_rank=rank, strategy="no_load_balance"
        )
        for deferred in ((), col.gathered_keys(ds.disk_keys)):
            ds.defer_keys(deferred)
            got = col(ds.__getitems__(idx))
            piece = slice(rank * local, (rank + 1) * local)
            for key in ("input_ids", "labels", "position_ids", "padding_mask", "hidden"):
                assert torch.equal(got[key], whole[key][piece]), (key, rank)
            assert torch.equal(got["cu_seqlens"], whole["cu_seqlens"])  # global boundaries
            assert got["cp_strategy"] == "no_load_balance"
            assert got["thd_layout"].cp_strategy == "no_load_balance"
        ds.defer_keys(())


def test_the_default_strategy_is_todays_partition(caches) -> None:
    ds = _ds(caches["ragged"])
    idx = list(range(9))
    for rank in range(2):
        plain = CachedThdCollator(48, length_key="length", cp_size=2, cp_rank=rank)(
            ds.__getitems__(idx)
        )
        named = CachedThdCollator(
            48, length_key="length", cp_size=2, cp_rank=rank, strategy="dual_chunk_swap"
        )(ds.__getitems__(idx))
        assert set(plain) == set(named) and "cp_strategy" not in plain
        for key, value in plain.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, named[key]), key


def test_bad_strategy_and_seq_len_are_one_line() -> None:
    with pytest.raises(ValueError, match="strategy='zigzag' is not a CP load-balancing strategy"):
        CachedThdCollator(48, cp_size=2, strategy="zigzag")
    with pytest.raises(
        ValueError, match=r"seq_len=50 must be a multiple of cp_size=4 .* use seq_len=52"
    ):
        CachedThdCollator(50, cp_size=4, strategy="no_load_balance")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_a_no_load_balance_rank_reads_only_its_share(tmp_path: Path) -> None:
    """Bytes the read system calls return (rchar): each rank reads its own real tokens (the
    pieces are contiguous, not balanced: their real tokens differ), together the whole once."""
    big_l, big_h = 1024, 256  # 512-byte tokens, 8 tokens per checksum block
    samples = _samples(8, seed=3, max_len=big_l, min_len=600)
    _produce(tmp_path / "c", samples, big_h, token_keys=("hidden",))
    ds = _ds(tmp_path / "c")
    ds[0]  # opens the shard: header, and the block sums on first verified read
    idx = list(range(8))

    def fetched(cp: int, rank: int) -> tuple[int, int]:
        col = CachedThdCollator(
            8 * big_l, length_key="length", cp_size=cp, cp_rank=rank, strategy="no_load_balance"
        )
        ds.defer_keys(col.gathered_keys(ds.disk_keys))
        batch = ds.__getitems__(idx)
        before = _rchar()
        out = col(batch)
        return _rchar() - before, int((~out["padding_mask"]).sum()) * big_h * 2

    whole, real = fetched(1, 0)
    assert real <= whole < real * 1.05
    for cp in (2, 4):
        shares = [fetched(cp, rank) for rank in range(cp)]
        for got, own in shares:
            assert own <= got <= own * 1.05 + 8 * 1024, (cp, shares)  # + a block at each end
        assert sum(got for got, _ in shares) <= whole * 1.05


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("strategy", ["no_load_balance", "dual_chunk_swap"])
def test_cache_plan_cp_reads_follow_the_strategy(tmp_path: Path, monkeypatch, strategy) -> None:
    """``plan_cache(CacheSpec(strategy=...))``'s CP rank bytes are what an epoch reads."""
    monkeypatch.setattr(readplan, "COPY_ENGINE", "preadv")  # every read counted by rchar
    big_l, big_h, batch, seq_len = 512, 256, 8, 2048
    samples = _samples(24, seed=5, max_len=big_l, min_len=40)
    _produce(tmp_path / "c", samples, big_h, token_keys=("input_ids", "hidden"))
    lengths = np.array([int(s["length"]) for s in samples])
    schema = {
        "input_ids": TensorSpec(torch.int64, (big_l,)),
        "hidden": TensorSpec(torch.bfloat16, (big_l, big_h)),
        "length": TensorSpec(torch.int64, ()),
    }
    spec = CacheSpec(
        schema,
        ("input_ids", "hidden"),
        8,
        2,
        length_key="length",
        pack_seq_len=seq_len,
        batch_size=batch,
        strategy=strategy,
    )
    planned = next(c for c in plan_cache(lengths, spec) if c.name == "ragged").rank_bytes

    def fetched(rank: int) -> int:
        before = _rchar()
        ds = _ds(tmp_path / "c")
        col = CachedThdCollator(
            seq_len, length_key="length", cp_size=2, cp_rank=rank, strategy=strategy
        )
        for _ in build_cached_dataloader(
            dataset=ds, batch_size=batch, shuffle=False, collate_fn=col
        ):
            pass
        return _rchar() - before

    fetched(0)  # the reader's modules imported, not counted below
    got = [fetched(rank) for rank in range(2)]
    for want, have in zip(planned, got, strict=True):
        assert abs(want - have) <= 0.05 * have, (strategy, planned, got)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=20),
    cp=st.integers(2, 4),
    packed=st.booleans(),
    batch=st.integers(1, 6),
)
def test_contiguous_ranges_tile_every_stream(lengths, cp, packed, batch) -> None:
    lengths = np.asarray(lengths, dtype=np.int64)
    seq = 48 * cp if packed else None
    spans = cp_spans(lengths, cp, seq, batch, "no_load_balance")
    held = [contiguous_ranges(spans, cp, r, seq, batch, lengths) for r in range(cp)]
    assert np.array_equal(sum(b - a for a, b in held), spans)  # every slot held once
    streams = np.arange(lengths.size) // batch if packed else np.arange(lengths.size)
    for a, b in held:  # each rank holds 1/cp of every stream
        assert np.array_equal(
            np.bincount(streams, weights=b - a), np.bincount(streams, weights=spans) / cp
        )
