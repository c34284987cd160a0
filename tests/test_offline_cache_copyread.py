"""copyread: run planning (property test vs a loop), preadv reads (differential vs
safetensors' own loader on real files) and destination buffers (recycled only once
the consumer lets go)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import te_thd.offline_cache.copyread as copyread
from te_thd.offline_cache.copyread import (
    DestinationBuffers,
    plan_runs,
    read_rows,
    tensor_memoryview,
)
from te_thd.offline_cache.shardfile import read_header

# -- planning ------------------------------------------------------------------------


def _runs_by_loop(local: list[int], dst: list[int]) -> list[tuple[int, list[int]]]:
    """Reference: sort (row, dst) pairs and cut where row != previous + 1."""
    pairs = sorted(zip(local, dst, strict=True))
    runs: list[tuple[int, list[int]]] = []
    for row, d in pairs:
        if runs and row == runs[-1][0] + len(runs[-1][1]):
            runs[-1][1].append(d)
        else:
            runs.append((row, [d]))
    return runs


@given(st.lists(st.integers(0, 40), max_size=60), st.randoms(use_true_random=False))
def test_plan_runs_matches_a_loop(local, rnd):
    dst = list(range(len(local)))
    rnd.shuffle(dst)
    for d in (None, dst):
        plan = plan_runs(np.array(local, dtype=np.int64), None if d is None else np.array(d, dtype=np.int64))
        want = _runs_by_loop(local, list(range(len(local))) if d is None else d)
        got = [(plan.first_row[k], plan.dst[plan.starts[k] : plan.starts[k + 1]]) for k in range(plan.num_runs)]
        assert got == want
        for k, (_, rows) in enumerate(want):
            assert bool(plan.dst_contiguous[k]) == (rows == list(range(rows[0], rows[0] + len(rows))))


def test_plan_runs_examples():
    plan = plan_runs(np.array([5, 3, 4, 9, 1, 2]))
    assert plan.first_row == [1, 9] and plan.starts == [0, 5, 6]
    assert plan.dst == [4, 5, 1, 2, 0, 3] and plan.dst_contiguous == [False, True]
    seq = plan_runs(np.arange(10, 18))
    assert seq.num_runs == 1 and seq.dst_contiguous == [True]
    assert plan_runs([3, 3, 4]).first_row == [3, 3]  # a repeat starts a new run
    assert plan_runs(np.array([4, 3, 3]), np.array([2, 1, 0])).dst == [0, 1, 2]  # a repeat: ascending rows
    assert plan_runs([]).num_runs == 0 and plan_runs([]).starts == [0]
    with pytest.raises(ValueError, match=r"dst has 2 rows, local 3"):
        plan_runs(np.arange(3), np.arange(2))


# -- reads ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A real safetensors file: odd row sizes, every common dtype, 37 rows."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "hidden": torch.randn(37, 5, 33, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 10**9, (37, 7), generator=g),
        "mask": torch.rand(37, 3, 1, generator=g) > 0.5,
        "length": torch.randint(0, 100, (37,), generator=g, dtype=torch.int32),
        "f32": torch.randn(37, 2, generator=g),
    }
    path = str(tmp_path_factory.mktemp("copyread") / "shard.safetensors")
    save_file(tensors, path)
    return path


def _read(path: str, key: str, local: list[int], dst: list[int] | None, batch: int) -> torch.Tensor:
    e = read_header(path)[key]
    out = torch.full((batch, *e.shape[1:]), 0, dtype=e.dtype)
    plan = plan_runs(np.array(local, dtype=np.int64), None if dst is None else np.array(dst, dtype=np.int64))
    fd = os.open(path, os.O_RDONLY)
    try:
        read_rows(fd, e.start, (e.end - e.start) // e.shape[0], plan, tensor_memoryview(out), path)
    finally:
        os.close(fd)
    return out


@given(st.lists(st.integers(0, 36), min_size=1, max_size=50), st.randoms(use_true_random=False),
       st.sampled_from(["hidden", "ids", "mask", "length", "f32"]))
def test_read_rows_equals_safetensors_load_file(shard, local, rnd, key):
    expect = load_file(shard)[key]
    batch = len(local) + 3  # rows the plan does not fill stay untouched
    dst = rnd.sample(range(batch), len(local))
    got = _read(shard, key, local, dst, batch)
    want = torch.zeros_like(got)
    want[torch.tensor(dst)] = expect[torch.tensor(local)]
    assert torch.equal(got, want)
    assert torch.equal(_read(shard, key, local, None, len(local)), expect[torch.tensor(local)])


@given(st.lists(st.integers(0, 36), min_size=1, max_size=30), st.randoms(use_true_random=False), st.integers(0, 3))
def test_read_rows_calls_after_on_each_piece_once_it_is_read(shard, local, rnd, chunk_rows):
    """Every batch row is announced exactly once, in pieces of at most ``chunk_bytes``,
    and the bytes of a piece are final when its callback runs (what a checksum needs)."""
    expect = load_file(shard)["ids"]
    e = read_header(shard)["ids"]
    row = (e.end - e.start) // e.shape[0]
    dst = rnd.sample(range(len(local)), len(local))
    out = torch.zeros(len(local), 7, dtype=torch.int64)
    seen: list[int] = []

    def after(p: int, first: int, m: int) -> None:
        assert chunk_rows == 0 or m <= chunk_rows
        assert torch.equal(out[p : p + m], expect[first : first + m])
        seen.extend(range(p, p + m))

    fd = os.open(shard, os.O_RDONLY)
    try:
        read_rows(fd, e.start, row, plan_runs(local, dst), tensor_memoryview(out), shard, after, chunk_rows * row)
    finally:
        os.close(fd)
    assert sorted(seen) == list(range(len(local)))
    assert torch.equal(out[torch.tensor(dst)], expect[torch.tensor(local)])


def test_read_rows_splits_runs_at_iov_max(shard, monkeypatch):
    monkeypatch.setattr(copyread, "IOV_MAX", 3)
    expect = load_file(shard)["ids"]
    local = list(range(4, 30))
    dst = list(reversed(range(len(local))))  # one file run, 26 scattered iovecs
    got = _read(shard, "ids", local, dst, len(local))
    assert torch.equal(got, expect[torch.tensor(local)].flip(0))


def test_read_rows_names_a_file_that_shrank(shard, tmp_path):
    short = str(tmp_path / "short.safetensors")
    with open(shard, "rb") as f:
        data = f.read()
    e = read_header(shard)["ids"]
    with open(short, "wb") as f:
        f.write(data[: e.start + 10 * 56 + 5])  # rows 0..9 and part of row 10
    out = torch.empty(3, 7, dtype=torch.int64)
    fd = os.open(short, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=r"short\.safetensors: file ended at byte 909 while reading 107 bytes \(truncated after open\?\)"):
            read_rows(fd, e.start, 56, plan_runs(np.array([9, 10, 11])), tensor_memoryview(out), short)
    finally:
        os.close(fd)


def test_tensor_memoryview_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match=r"tensor of shape \[4, 2\] is not contiguous"):
        tensor_memoryview(torch.zeros(2, 4).t())


# -- destination buffers ---------------------------------------------------------------


class _Pool(DestinationBuffers):
    def get_t(self, *args):
        t, raw = self.get(*args)
        assert raw.nbytes == t.numel() * t.element_size() and raw.readonly is False
        return t


def test_buffers_are_recycled_only_after_the_consumer_drops_them():
    pool = _Pool()
    a = pool.get_t("x", 4, (3,), torch.float32)
    b = pool.get_t("x", 4, (3,), torch.float32)
    assert a.data_ptr() != b.data_ptr()  # a is held: b is new memory
    ptr_a = a.data_ptr()
    del a
    gc.collect()
    c = pool.get_t("x", 4, (3,), torch.float32)
    assert c.data_ptr() == ptr_a  # released: recycled
    # any reference to the memory keeps it: a row view, a numpy array over it
    row, arr = c[1], c.numpy()
    del c
    assert pool.get_t("x", 4, (3,), torch.float32).data_ptr() != ptr_a
    del row
    assert pool.get_t("x", 4, (3,), torch.float32).data_ptr() != ptr_a
    del arr
    gc.collect()
    d = pool.get_t("x", 2, (3,), torch.float32)  # a shorter batch fits in a larger buffer
    assert d.data_ptr() == ptr_a and d.shape == (2, 3)
    # another dtype or sample shape never shares a buffer
    assert pool.get_t("x", 2, (3,), torch.float64).dtype == torch.float64
    assert pool.get_t("x", 2, (4,), torch.float32).shape == (2, 4)


def test_buffer_pool_is_bounded():
    pool = _Pool(max_pooled=2)
    held = [pool.get_t("x", 1, (2,), torch.int64) for _ in range(5)]
    assert len({t.data_ptr() for t in held}) == 5
    assert sum(len(v) for v in pool._pool.values()) == 2


def test_shared_buffers_are_fresh_shared_memory():
    pool = _Pool(shared=True)
    a = pool.get_t("x", 4, (3,), torch.float32)
    assert a.is_shared() and a.shape == (4, 3)
    ptr = a.data_ptr()
    del a
    gc.collect()
    b = pool.get_t("x", 4, (3,), torch.float32)
    assert b.is_shared() and not pool._pool  # never pooled: the batch leaves the process
    del b, ptr


def test_buffer_options_are_checked():
    with pytest.raises(ValueError, match="shared=True and pinned=True"):
        DestinationBuffers(shared=True, pinned=True)
