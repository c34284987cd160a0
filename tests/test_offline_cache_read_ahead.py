"""Read-ahead: ``CachedTensorDataset.start_read`` and the loader that starts batch ``i + 1`` before handing out ``i``.

Real shard files written by the producer; the threaded path is forced on these
small files with ``readexec.PARALLEL_MIN_BYTES = 0`` and compared with the plain
single-thread read (differential), with a flipped byte, and with the loader's
resume state.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _offline_cache_support import read_tuning
from crash_test import IndexDataset
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from te_thd.offline_cache import (
    CachedTensorDataset,
    CacheIntegrityError,
    build_cached_dataloader,
    collate_cached,
    produce_cache,
)
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.schema import shard_path

KEYS = ("hidden", "ids")
N, SHARD = 40, 8


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    i = batch["idx"].to(torch.int64)
    return {
        "hidden": torch.sin(i[:, None, None] * 0.3 + torch.arange(24).view(1, 4, 6)).to(
            torch.bfloat16
        ),
        "ids": i[:, None] * 7 + torch.arange(5),
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("read_ahead") / "cache")
    produce_cache(
        DataLoader(IndexDataset(N), batch_size=4), d, SHARD, _compute, KEYS, progress=False
    )
    return d


def _expected(d: str) -> dict[str, torch.Tensor]:
    parts = [load_file(shard_path(d, s)) for s in range(N // SHARD)]
    return {k: torch.cat([p[k] for p in parts]) for k in KEYS}


def _threaded(d: str, engine: str = "auto", threads: int = 2) -> CachedTensorDataset:
    read_tuning(engine=engine, parallel_min_bytes=0)  # share out every batch, however small
    return CachedTensorDataset(d, "test", 1, KEYS, read_threads=threads)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, N - 1), min_size=1, max_size=20), st.sampled_from(["auto", "preadv", "mapped"]),
       st.integers(1, 3))  # fmt: skip
def test_start_read_equals_getitems_and_the_file(cache, indices, engine, threads):
    want = _expected(cache)
    plain = CachedTensorDataset(cache, "test", 1, KEYS, read_threads=1).__getitems__(indices)
    got = _threaded(cache, engine, threads).start_read(indices).result()
    for k in KEYS:
        assert torch.equal(got.tensors[k], want[k][indices]), k
        assert torch.equal(plain.tensors[k], want[k][indices]), k


def test_start_read_hands_a_large_batch_to_helper_threads(cache):
    """With the threshold at 0 the copy runs on the pool's threads, not the caller's."""
    ds = _threaded(cache, "preadv")
    readers: set[str] = set()
    import te_thd.offline_cache.read.executor as readexec

    original = readexec.read_piece

    def spy(piece):
        readers.add(threading.current_thread().name)
        original(piece)

    readexec.read_piece = spy
    try:
        pending = ds.start_read(list(range(0, 16)))
        time.sleep(0.3)  # the helpers read it meanwhile (result() would join in)
        pending.result()
    finally:
        readexec.read_piece = original
    assert readers and all(name.startswith("te_thd-read") for name in readers), readers


def _flip(d: str, shard: int, key: str, row: int) -> None:
    path = Path(shard_path(d, shard))
    e = read_shard_header(str(path)).entries[key]
    data = bytearray(path.read_bytes())
    data[e.start + row * (e.end - e.start) // e.shape[0]] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flip_read_by_a_helper_thread_is_raised_by_result(tmp_path):
    d = str(tmp_path / "cache")
    produce_cache(
        DataLoader(IndexDataset(N), batch_size=4), d, SHARD, _compute, KEYS, progress=False
    )
    _flip(d, 2, "hidden", 3)  # sample 19
    ds = _threaded(d, "preadv")
    pending = ds.start_read(list(range(16, 24)))  # no error yet: it is being read
    with pytest.raises(
        CacheIntegrityError, match=r"sample 19 \(row 3 of the shard\), key 'hidden'"
    ):
        pending.result()
    assert ds.start_read(list(range(0, 8))).result().tensors["ids"].shape == (
        8,
        5,
    )  # the pool still works


def _loader(d: str, read_ahead: bool, shuffle: bool = True, **kw) -> torch.utils.data.DataLoader:
    ds = _threaded(d)
    return build_cached_dataloader(ds, 4, shuffle, functools.partial(collate_cached, keys=KEYS),
                                   read_ahead=read_ahead, **kw)  # fmt: skip


def _train(batches, step_s: float = 0.01):
    """A training loop: each batch is followed by a step of ``step_s`` (the CPU is free)."""
    for batch in batches:
        yield {k: v.clone() for k, v in batch.items()}
        time.sleep(step_s)


class _Spy:
    """Counts ``start_read`` calls on a dataset (the loader's read-ahead)."""

    def __init__(self, ds: CachedTensorDataset) -> None:
        self.calls = 0
        original = ds.start_read

        def start_read(indices):
            self.calls += 1
            return original(indices)

        ds.start_read = start_read


def test_read_ahead_starts_only_when_the_consumer_leaves_time(cache):
    busy = _loader(cache, True)
    spy_busy = _Spy(busy.dataset)
    assert len(list(_train(busy))) == N // 4
    assert spy_busy.calls >= N // 4 - 3  # every batch after the first couple was read ahead
    bare = _loader(cache, True)
    spy_bare = _Spy(bare.dataset)
    assert len([b for b in bare]) == N // 4
    assert spy_bare.calls <= 1  # a bare read loop is served synchronously
    never = _loader(cache, False)
    spy_never = _Spy(never.dataset)
    assert len(list(_train(never))) == N // 4 and spy_never.calls == 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_read_ahead_loader_yields_what_the_plain_loader_yields(cache, shuffle):
    ahead = list(_train(_loader(cache, True, shuffle)))
    plain = list(_train(_loader(cache, False, shuffle), 0.0))
    torch_iter = list(_train(DataLoader.__iter__(_loader(cache, True, shuffle)), 0.0))
    assert len(ahead) == len(plain) == len(torch_iter) == N // 4
    for a, p, t in zip(ahead, plain, torch_iter, strict=True):
        for k in KEYS:
            assert torch.equal(a[k], p[k]) and torch.equal(a[k], t[k]), k


def test_read_ahead_keeps_the_resume_state_of_what_was_consumed(cache):
    ahead, plain = _loader(cache, True), _loader(cache, False)
    it_a, it_p = _train(ahead), iter(plain)
    for _ in range(4):
        next(it_a), next(it_p)
    time.sleep(0.01)  # the batch after is being read ahead
    assert ahead.state_dict() == plain.state_dict()
    resumed = _loader(cache, True, resume_state=ahead.state_dict())
    rest = [b["ids"] for b in _train(resumed)]
    want = [b["ids"].clone() for b in it_p]
    assert len(rest) == len(want) == N // 4 - 4
    assert all(torch.equal(a, b) for a, b in zip(rest, want, strict=True))


def test_a_damaged_batch_is_raised_when_it_is_asked_for_not_before(tmp_path):
    d = str(tmp_path / "cache")
    produce_cache(
        DataLoader(IndexDataset(N), batch_size=4), d, SHARD, _compute, KEYS, progress=False
    )
    _flip(d, 2, "ids", 2)  # sample 18: the fifth batch of 4 in sequential order, read ahead
    got = []
    loader = _loader(d, True, shuffle=False)
    spy = _Spy(loader.dataset)
    with pytest.raises(CacheIntegrityError, match=r"sample 18 "):
        for batch in _train(loader):
            got.append(batch["ids"][:, 0].tolist())
    assert spy.calls >= 2  # the damaged batch was read ahead
    assert got == [
        [7 * i for i in range(b * 4, b * 4 + 4)] for b in range(4)
    ]  # batches 0-3 arrived whole


def test_stopping_early_waits_for_the_batch_in_flight(cache):
    loader = _loader(cache, True)
    it = _train(loader)
    first = [next(it)["ids"] for _ in range(3)]
    time.sleep(0.005)  # the fourth batch is in flight
    it.close()  # closes the loader's generator too: it waits for that read
    again = [b["ids"] for b in list(_train(loader))[:3]]
    assert all(
        torch.equal(a, b) for a, b in zip(first, again, strict=True)
    )  # nothing scribbled on reused buffers
    assert all(np.array_equal(a[:, 0].numpy() % 7, np.zeros(4)) for a in first)


@pytest.mark.filterwarnings(
    "ignore::te_thd.offline_cache.UnverifiedCacheWarning"
)  # verify=False on purpose
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("verify", [False, True])
def test_a_batch_over_more_shards_than_max_open_shards_reads_right(cache, threads, verify):
    """Planning a batch opens its shards one after the other; with max_open_shards=1 each
    open evicts the previous shard while its pieces are still to be read. Its descriptor
    must stay open until they are (a closed one, or its number reused by the next open,
    would read the wrong file)."""
    want = _expected(cache)
    indices = [1, 9, 17, 25, 33, 2, 10]  # five shards
    read_tuning(engine="preadv", parallel_min_bytes=0)
    ds = CachedTensorDataset(
        cache, "test", 1, KEYS, max_open_shards=1, read_threads=threads, verify=verify
    )
    for read in (ds.__getitems__, lambda i: ds.start_read(i).result()):
        got = read(indices)
        for k in KEYS:
            assert torch.equal(got.tensors[k], want[k][indices]), k
    ahead = ds.start_read(
        [0, 8, 16]
    )  # in flight while the next batch opens (and evicts) other shards
    later = ds.start_read([24, 32])
    for pending, idx in ((ahead, [0, 8, 16]), (later, [24, 32])):
        assert torch.equal(pending.result().tensors["ids"], want["ids"][idx])


def test_a_pending_batch_dropped_unread_is_finished_before_its_buffers_are_reused(cache):
    want = _expected(cache)
    ds = _threaded(cache, "preadv")
    for _ in range(20):
        ds.start_read(list(range(0, 8)))  # dropped at once: waits in __del__
        got = ds.__getitems__(list(range(8, 16)))  # may get the same buffers
        assert torch.equal(got.tensors["hidden"], want["hidden"][8:16])


def test_engine_choice(cache):
    """``auto``: a key whose runs average at least ``PREADV_MIN_RUN_BYTES`` uses preadv, and
    one-run keys join it; with no such key every key is gathered; forced engines decide alone.
    Here ``hidden`` rows are 48 bytes, ``ids`` rows 40."""
    from te_thd.offline_cache.read.planner import choose_engines

    ds = CachedTensorDataset(cache, "test", 1, KEYS)
    entries = ds._shard_file(0).header.entries

    def engines(local, pos):
        return choose_engines(KEYS, local, pos, entries)[0]

    seq, scattered = np.arange(0, 4), np.array([0, 2, 5, 7])
    read_tuning(preadv_min_run_bytes=48)  # hidden rows reach it, ids rows do not
    assert engines(scattered, None) == {"hidden": True, "ids": False}
    assert engines(seq, None) == {"hidden": True, "ids": True}  # one run rides along
    assert engines(seq, np.array([3, 0, 1, 2])) == {
        "hidden": True,
        "ids": True,
    }  # one file run of 160 B
    read_tuning(preadv_min_run_bytes=1 << 20)  # no key reaches it
    assert engines(seq, None) == {"hidden": False, "ids": False}
    read_tuning(
        preadv_min_run_bytes=100
    )  # ids: 4 rows x 40 B in one run = 160 >= 100: preadv by bytes
    assert engines(seq, None) == {"hidden": True, "ids": True}
    assert engines(scattered, None) == {"hidden": False, "ids": False}  # 4 runs of 40-48 B
    for engine in ("preadv", "mapped"):
        read_tuning(engine=engine)
        assert engines(scattered, None) == dict.fromkeys(KEYS, engine == "preadv")
