"""build_cached_dataloader / CachedDataLoader / CachedThdCollator / to_device (one process + workers)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import namedtuple

import pytest
import torch
from _offline_cache_support import CACHE_NAME, FORMAT_VERSION, make_cache, read_tuning
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd import ThdLayout
from te_thd.attention import te_attention_kwargs
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.offline_cache import (
    CachedDataLoader,
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    collate_cached,
    produce_cache,
    to_device,
)
from te_thd.packing import PackingCollator
from te_thd.thd_utils import process_input_for_thd

KEYS = ("sample_id", "input_ids", "loss_mask", "position_mask", "length", "hidden")
N, SHARD, WIDTH, H = 75, 16, 8, 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cache"))
    return d, make_cache(d, N, SHARD, width=WIDTH, hidden=H)


def _ds(d):
    return CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, KEYS)


def _collate():
    return functools.partial(collate_cached, keys=KEYS)


def _epochs(loader, epochs=(0, 1)):
    out = []
    for e in epochs:
        loader.sampler.set_epoch(e)
        out.append(
            [
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                for b in loader
            ]
        )
    return out


def _same(a, b):
    assert len(a) == len(b)
    for ea, eb in zip(a, b, strict=True):
        assert len(ea) == len(eb)
        for ba, bb in zip(ea, eb, strict=True):
            assert ba.keys() == bb.keys()
            for k in ba:
                assert torch.equal(ba[k], bb[k]), k


class _PerItem(torch.utils.data.Dataset):
    """A plain map-style dataset over the cache: no ``__getitems__``, one sample per call."""

    def __init__(self, ds):
        self.ds = ds
        self.shard_size = ds.shard_size

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def test_reference_signature_and_defaults(cache):
    d, tensors = cache
    # positional, as on the reference page
    loader = build_cached_dataloader(_ds(d), 8, False, _collate(), 0, False)
    assert isinstance(loader, CachedDataLoader) and isinstance(loader, torch.utils.data.DataLoader)
    assert loader.pin_memory == torch.cuda.is_available()
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (1, 0)
    batches = list(loader)
    assert len(batches) == len(loader) == 10  # 75 samples, last batch of 3 kept
    ids = torch.cat([b["sample_id"] for b in batches])
    assert torch.equal(ids, torch.arange(N))  # shuffle=False: sequential
    for k in KEYS:
        assert torch.equal(torch.cat([b[k] for b in batches]), tensors[k])
    # keyword names of the reference
    loader = build_cached_dataloader(
        dataset=_ds(d),
        batch_size=8,
        shuffle=True,
        collate_fn=_collate(),
        num_workers=0,
        distributed=False,
    )
    ids = torch.cat([b["sample_id"] for b in loader])
    assert sorted(ids.tolist()) == list(range(N)) and ids.tolist() != list(range(N))


def test_drop_last_drops_the_partial_batch(cache):
    d, _ = cache
    loader = build_cached_dataloader(_ds(d), 8, True, _collate(), drop_last=True)
    sizes = [b["sample_id"].numel() for b in loader]
    assert sizes == [8] * 9


def test_workers_give_identical_batches(cache):
    d, _ = cache
    base = _epochs(build_cached_dataloader(_ds(d), 8, True, _collate(), 0, seed=7))
    two = build_cached_dataloader(
        _ds(d), 8, True, _collate(), 2, seed=7, persistent_workers=True, prefetch_factor=2
    )
    _same(base, _epochs(two))


def test_batched_and_per_item_collate_paths_agree(cache):
    d, _ = cache
    ds = _ds(d)
    _same(
        _epochs(build_cached_dataloader(ds, 8, True, _collate(), seed=3)),
        _epochs(
            build_cached_dataloader(_PerItem(ds), 8, True, _collate(), seed=3)
        ),  # the reference's path
    )


def test_collate_cached_list_bad_input():
    a2, a3 = torch.zeros(2), torch.zeros(3)
    with pytest.raises(
        ValueError,
        match=r"collate_cached: sample 1 has no key 'b' \(it holds \['a'\]\); add it to the dataset's disk_keys or drop it from keys",
    ):
        collate_cached([{"a": a2, "b": a2}, {"a": a2}], ("a", "b"))
    with pytest.raises(
        ValueError,
        match=r"collate_cached: key 'a' of sample 2 is \[3\], sample 0's is \[2\]: the samples of one batch must share each key's shape",
    ):
        collate_cached([{"a": a2}, {"a": a2}, {"a": a3}], ("a",))
    with pytest.raises(
        ValueError, match=r"collate_cached: features is empty; a batch needs at least one sample"
    ):
        collate_cached([], ("a",))
    with pytest.raises(
        ValueError, match=r"collate_cached: key 'a' of sample 1 is of type int, not a tensor"
    ):
        collate_cached([{"a": a2}, {"a": 3}], ("a",))


def _mixed_dtype_samples():
    return [{"a": torch.ones(2)}, {"a": torch.ones(2, dtype=torch.float64)}]


def test_collate_cached_list_promotes_dtypes_like_torch_stack_also_in_workers():
    data = _mixed_dtype_samples()
    want = torch.stack([d["a"] for d in data])
    assert collate_cached(data, ("a",))["a"].dtype == want.dtype == torch.float64
    loader = torch.utils.data.DataLoader(
        [data],
        batch_size=None,
        num_workers=1,
        collate_fn=functools.partial(collate_cached, keys=("a",)),
        multiprocessing_context="fork",
    )
    (batch,) = list(loader)  # the worker stacks into shared memory
    assert batch["a"].dtype == torch.float64 and torch.equal(batch["a"], want)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_mid_epoch(cache, num_workers):
    d, _ = cache
    full = build_cached_dataloader(_ds(d), 4, True, _collate(), num_workers, seed=1)
    full.sampler.set_epoch(1)
    whole = [b["sample_id"].clone() for b in full]
    run = build_cached_dataloader(_ds(d), 4, True, _collate(), num_workers, seed=1)
    run.sampler.set_epoch(1)
    it = iter(run)
    head = [next(it)["sample_id"].clone() for _ in range(5)]
    state = run.state_dict()
    del it
    assert state["sampler"]["consumed_samples"] == 20 and state["sampler"]["epoch"] == 1
    resumed = build_cached_dataloader(
        _ds(d), 4, True, _collate(), num_workers, seed=1, resume_state=state
    )
    resumed.sampler.set_epoch(1)
    assert resumed.state_dict() == state  # nothing consumed since the restart
    assert len(resumed) == len(whole) - 5
    rest = [b["sample_id"].clone() for b in resumed]
    assert torch.equal(torch.cat(head + rest), torch.cat(whole))
    # after the pass the epoch is complete; the next epoch starts from its beginning
    assert resumed.consumed_samples() == N
    resumed.sampler.set_epoch(2)
    assert resumed.consumed_samples() == 0 and len(list(resumed)) == len(whole)


def test_start_sample(cache):
    d, _ = cache
    loader = build_cached_dataloader(_ds(d), 10, False, _collate(), start_sample=30)
    assert loader.consumed_samples() == 30  # epoch 0, before iterating
    assert torch.equal(torch.cat([b["sample_id"] for b in loader]), torch.arange(30, N))


def test_distributed_without_process_group_is_one_replica(cache):
    d, _ = cache
    loader = build_cached_dataloader(_ds(d), 8, True, _collate(), distributed=True)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (1, 0)
    loader = build_cached_dataloader(
        _ds(d), 8, True, _collate(), distributed=True, dp_rank=1, dp_size=3
    )
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (3, 1) and len(
        loader.sampler
    ) == 25


def test_loader_bad_arguments(cache):
    d, _ = cache
    ds = _ds(d)
    with pytest.raises(ValueError, match="batch_size=0 must be an int >= 1"):
        build_cached_dataloader(ds, 0, True, _collate())
    with pytest.raises(ValueError, match="num_workers=-1 must be an int >= 0"):
        build_cached_dataloader(ds, 4, True, _collate(), -1)
    with pytest.raises(ValueError, match="pass dp_rank and dp_size together"):
        build_cached_dataloader(ds, 4, True, _collate(), dp_rank=0)
    with pytest.raises(ValueError, match="pass resume_state or start_sample=8, not both"):
        build_cached_dataloader(
            ds, 4, True, _collate(), start_sample=8, resume_state={"sampler": {}}
        )
    loader = build_cached_dataloader(ds, 4, True, _collate())
    with pytest.raises(ValueError, match="loader state must hold 'sampler'"):
        loader.load_state_dict({})


# -- the inline read path (num_workers=0) vs torch's own iterator ---------------------------


def _through_torch(loader: CachedDataLoader) -> CachedDataLoader:
    """The same loader, iterated by torch's ``_SingleProcessDataLoaderIter`` (the
    reference the inline path must equal)."""
    assert loader._reads_inline()
    loader._reads_inline = lambda: False
    return loader


def _take(it, n, pause=0.0):
    """The next ``n`` batches (all for ``n=-1``), copied; ``pause`` seconds of work per batch."""
    out = []
    for batch in it:
        out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        time.sleep(pause)
        if len(out) == n:
            break
    return out


def _pass(loader, epoch, stop, pause=0.0):
    """One pass of ``epoch``: the first ``stop`` batches, the state then, the rest, the state at the end."""
    loader.sampler.set_epoch(epoch)
    it = iter(loader)
    head = _take(it, stop, pause) if stop else []
    state = loader.state_dict()
    rest = _take(it, -1, pause)
    return head, state, rest, loader.state_dict()


@pytest.fixture
def count_torch_iterators(monkeypatch):
    """How many times torch's single-process iterator was built (the real one runs)."""
    from torch.utils.data import dataloader as torch_dataloader

    calls = []
    real = torch_dataloader._SingleProcessDataLoaderIter.__init__

    def init(self, loader):
        calls.append(loader)
        real(self, loader)

    monkeypatch.setattr(torch_dataloader._SingleProcessDataLoaderIter, "__init__", init)
    return calls


@settings(max_examples=20)
@given(
    st.integers(1, 12),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
    st.integers(0, 2),
    st.integers(0, 12),
    st.booleans(),
    st.booleans(),
)
def test_inline_batches_equal_torch_iterator(
    cache, batch_size, shuffle, drop_last, seed, epoch, stop, per_item, ahead
):
    """Differential: with ``num_workers=0`` the loader yields exactly the batches torch's
    own iterator yields (shuffle on/off, drop_last, read-ahead on/off, a dataset with or
    without ``__getitems__``), reports the same state mid-epoch and at the end, and a
    loader resumed from that state continues with the same batches on both paths."""
    d, _ = cache
    ds = _PerItem(_ds(d)) if per_item else _ds(d)
    started = []
    if not per_item:  # count the batches read ahead (the real start_read runs)
        start_read = ds.start_read
        ds.start_read = lambda indices: started.append(indices) or start_read(indices)
    pause = 0.001 if ahead else 0.0  # read-ahead only starts behind a consumer that leaves it time

    def make(inline, **kw):
        loader = build_cached_dataloader(ds, batch_size, shuffle, _collate(), seed=seed, drop_last=drop_last,
                                         pin_memory=False, read_ahead=ahead, **kw)  # fmt: skip
        return loader if inline else _through_torch(loader)

    ours, ref = _pass(make(True), epoch, stop, pause), _pass(make(False), epoch, stop)
    _same([ours[0], ours[2]], [ref[0], ref[2]])
    assert ours[1] == ref[1] and ours[3] == ref[3]
    resumed = [
        _pass(make(inline, resume_state=ours[1]), epoch, 0, pause) for inline in (True, False)
    ]
    _same([resumed[0][2]], [resumed[1][2]])
    _same([resumed[0][2]], [ours[2]])  # continues with the batches the interrupted pass had left
    assert resumed[0][3] == resumed[1][3] == ours[3]
    assert bool(started) == (ahead and not per_item)


def test_inline_path_is_taken_without_workers(cache, count_torch_iterators):
    d, _ = cache
    loader = build_cached_dataloader(_ds(d), 8, True, _collate(), pin_memory=False)
    assert loader._reads_inline() and len(list(loader)) == 10
    assert count_torch_iterators == []  # no torch iterator was built
    assert len(list(_through_torch(loader))) == 10 and len(count_torch_iterators) == 1
    assert not build_cached_dataloader(_ds(d), 8, True, _collate(), 1)._reads_inline()


def test_inline_batches_equal_torch_iterator_with_balance(tmp_path):
    """``balance=True`` (batch_size=None: one planned step per sampler item, read whole)
    yields the same packed THD batches inline as through torch's iterator, also resumed."""
    from te_thd.offline_cache.train.sampler import scan_lengths

    make_cache(str(tmp_path), 60, 16, width=8)
    keys = ("sample_id", "input_ids", "length")
    data = CachedTensorDataset(str(tmp_path), CACHE_NAME, FORMAT_VERSION, keys)
    lengths = scan_lengths(data, length_key="length")

    def make(inline, rank, **kw):
        loader = build_cached_dataloader(
            data, 4, True, CachedThdCollator(16, length_key="length", keys=keys), distributed=True, dp_rank=rank,
            dp_size=2, seed=5, balance=True, lengths=lengths, attn_scale=64.0, pin_memory=False, **kw,
        )  # fmt: skip
        assert loader.batch_size is None
        return loader if inline else _through_torch(loader)

    for rank in (0, 1):
        for epoch in (0, 1):
            ours, ref = _pass(make(True, rank), epoch, 3), _pass(make(False, rank), epoch, 3)
            assert ours[0] and ours[2]
            _same_batches(ours[0] + ours[2], ref[0] + ref[2])
            assert ours[1] == ref[1] and ours[3] == ref[3]
            resumed = [
                _pass(make(inline, rank, resume_state=ours[1]), epoch, 0)[2]
                for inline in (True, False)
            ]
            _same_batches(resumed[0], resumed[1])
            _same_batches(resumed[0], ours[2])


@pytest.mark.parametrize("ahead", [True, False])
def test_batches_the_consumer_keeps_are_never_overwritten(cache, ahead):
    """A loop that keeps every batch (or only a view of one row) while the loader reads
    on, with two reading threads and read-ahead: recycled buffers never reach a batch
    that is still referenced; the kept batches equal the written tensors."""
    d, tensors = cache
    read_tuning(engine="preadv", parallel_min_bytes=0)
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, KEYS, read_threads=2)
    loader = build_cached_dataloader(
        ds, 8, True, _collate(), seed=4, pin_memory=False, read_ahead=ahead
    )
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        kept, rows = [], []
        for i, batch in enumerate(loader):
            (kept.append(batch) if i % 2 else rows.append(batch["input_ids"][0]))
            time.sleep(0.001)  # work per batch: the loader reads ahead behind it
        order = list(loader.sampler)
        assert len(kept) + len(rows) == len(loader)
        for i, batch in enumerate(kept):
            idx = torch.tensor(order[(2 * i + 1) * 8 : (2 * i + 2) * 8])
            for k in KEYS:
                assert torch.equal(batch[k], tensors[k][idx]), (epoch, i, k)
        for i, row in enumerate(rows):
            assert torch.equal(row, tensors["input_ids"][order[2 * i * 8]]), (epoch, i)


def _same_batches(a, b):
    """Batches equal key by key: tensors by value, host scalars (``max_seqlen_int``, ...) by ==."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k], k


# -- THD collate -----------------------------------------------------------------------


def _oracle(tensors, idx, seq_len, cp_size, cp_rank, lengths):
    """Packing -> THD -> CP through the public functions, one sample at a time, with
    each multi-dim token key split into 1-D columns the packer can carry."""
    samples = []
    for j, i in enumerate(idx):
        n = int(lengths[j])
        s = {"input_ids": tensors["input_ids"][i, :n], "loss_mask": tensors["loss_mask"][i, :n]}
        s["pm0"] = tensors["position_mask"][i, :n, 0].to(torch.int64)
        for h in range(H):
            s[f"h{h}"] = tensors["hidden"][i, :n, h].float()
        samples.append(s)
    m = 2 * cp_size if cp_size > 1 else 1
    packed = PackingCollator(seq_len, pad_to_multiple_of=m, label_key=None)(samples)
    thd = process_input_for_thd(
        {
            k: packed[k]
            for k in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
        }
    )
    thd["loss_mask"] = packed["loss_mask"].reshape(-1)
    thd["position_mask"] = packed["pm0"].reshape(-1, 1).bool()
    thd["hidden"] = torch.stack([packed[f"h{h}"].reshape(-1) for h in range(H)], -1).to(
        torch.bfloat16
    )
    extra = ("loss_mask", "position_mask", "hidden")
    return shard_thd_batch_for_cp(thd, cp_size, cp_rank, extra_keys=extra, num_seqs=thd["num_seqs"])


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("source", ["length_key", "mask_key", "full"])
def test_thd_collate_matches_composition_of_public_functions(cache, cp_size, source):
    d, tensors = cache
    ds = _ds(d)
    idx = [3, 17, 4, 60, 61, 9, 70]
    batch = ds.__getitems__(idx)
    if source == "length_key":
        kw, lengths = {"length_key": "length"}, tensors["length"][idx]
    elif source == "mask_key":
        # a right-padded mask: the first `length` slots
        kw, lengths = {"mask_key": "position_mask"}, tensors["length"][idx]
        batch.tensors["position_mask"] = (torch.arange(WIDTH) < lengths.unsqueeze(1)).unsqueeze(-1)
        tensors = {**tensors, "position_mask": tensors["position_mask"].clone()}
        tensors["position_mask"][idx] = batch.tensors["position_mask"]
    else:
        kw, lengths = {}, torch.full((len(idx),), WIDTH)
    for rank in range(cp_size):
        out = CachedThdCollator(16, cp_size=cp_size, cp_rank=rank, **kw)(batch)
        ref = _oracle(tensors, idx, 16, cp_size, rank, lengths)
        for k in (
            "input_ids",
            "labels",
            "position_ids",
            "padding_mask",
            "cu_seqlens",
            "cu_seqlens_padded",
            "max_seqlen",
            "loss_mask",
            "position_mask",
            "hidden",
        ):
            assert out[k].dtype == ref[k].dtype and torch.equal(out[k], ref[k]), k
        for k in ("pad_between_seqs", "max_seqlen_int", "num_seqs"):
            assert out[k] == ref[k] and type(out[k]) is type(ref[k]), k
        assert out["num_samples"] == len(idx) and isinstance(out["packing_efficiency"], float)
        assert torch.equal(out["sample_id"], torch.tensor(idx))  # per-sample keys pass through
        if cp_size > 1:
            assert (out["cp_size"], out["cp_rank"]) == (cp_size, rank)
        # the batch carries its layout: what ThdLayout.from_thd reads from the same dict
        # (absorption is a property of the whole stream, the dict's mask only of this rank's)
        layout, want = out["thd_layout"], ThdLayout.from_thd(ref)
        assert isinstance(layout, ThdLayout) and (layout.cp_size, layout.cp_rank) == (cp_size, rank)
        if cp_size > 1:
            want = dataclasses.replace(want, absorbed_trailing_pad=layout.absorbed_trailing_pad)
        assert layout == want
        plain = {k: v for k, v in out.items() if k != "thd_layout"}
        te_kw = [te_attention_kwargs(x) for x in (out, plain, layout)]
        for other in te_kw[1:]:
            assert other.keys() == te_kw[0].keys()
            for k, v in other.items():
                assert (
                    torch.equal(v, te_kw[0][k]) if isinstance(v, torch.Tensor) else v == te_kw[0][k]
                ), k


def test_thd_collate_in_workers_gives_host_values(cache):
    d, _ = cache
    ds = _ds(d)
    collate = CachedThdCollator(32, cp_size=2, cp_rank=1, length_key="length")
    a = _epochs(build_cached_dataloader(ds, 6, True, collate, 0, seed=2), epochs=(0,))
    loader = build_cached_dataloader(ds, 6, True, collate, 2, seed=2)
    loader.sampler.set_epoch(0)
    b = list(loader)
    assert len(a[0]) == len(b)
    for x, y in zip(a[0], b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k] and not isinstance(y[k], torch.Tensor), k
    assert all(
        type(bb["max_seqlen_int"]) is int and type(bb["pad_between_seqs"]) is bool for bb in b
    )


def test_thd_collate_pickles_for_spawned_workers(cache):
    import pickle

    d, _ = cache
    batch = _ds(d).__getitems__([5, 6, 7, 30])
    c = CachedThdCollator(16, cp_size=2, cp_rank=1, length_key="length")
    a, b = c(batch), pickle.loads(pickle.dumps(c))(batch)
    for k, v in a.items():
        assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]


def test_thd_collate_accepts_a_list_of_samples(cache):
    d, _ = cache
    ds = _ds(d)
    c = CachedThdCollator(16, length_key="length")
    a, b = c(ds.__getitems__([1, 2, 3])), c([ds[1], ds[2], ds[3]])
    for k, v in a.items():
        assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]


def test_thd_collate_bad_input(cache):
    d, _ = cache
    ds = _ds(d)
    batch = ds.__getitems__([0, 1])
    with pytest.raises(
        ValueError, match="pass length_key='length' or mask_key='loss_mask', not both"
    ):
        CachedThdCollator(16, length_key="length", mask_key="loss_mask")
    with pytest.raises(ValueError, match=r"cp_rank=2 must be an int in \[0, cp_size=2\)"):
        CachedThdCollator(16, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="length_key='nope' was not read"):
        CachedThdCollator(16, length_key="nope")(batch)
    with pytest.raises(ValueError, match="length_key='hidden' must hold one integer per sample"):
        CachedThdCollator(16, length_key="hidden")(batch)
    with pytest.raises(ValueError, match="mask_key='loss_mask' of sample 0 .* is not right-padded"):
        bad = ds.__getitems__([0, 1])
        bad.tensors["loss_mask"] = torch.tensor([[0, 1] + [0] * 6, [1] * 8])
        CachedThdCollator(16, mask_key="loss_mask")(bad)
    with pytest.raises(
        ValueError, match=r"sample 1 of this batch has length 0, outside \[1, L=8\]"
    ):
        bad = ds.__getitems__([0, 1])
        bad.tensors["length"] = torch.tensor([3, 0], dtype=torch.int32)
        CachedThdCollator(16, length_key="length")(bad)
    with pytest.raises(ValueError, match=r"keys \['nope'\] were not read"):
        CachedThdCollator(16, keys=("input_ids", "nope"))(batch)
    with pytest.raises(ValueError, match="token_keys entry 'length' must be read and shaped"):
        CachedThdCollator(16, token_keys=("length",))(batch)


# -- to_device -------------------------------------------------------------------------


def test_to_device_moves_tensors_and_keeps_host_scalars():
    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": torch.ones(3),
        "max_seqlen_int": 5,
        "pad_between_seqs": False,
        "nested": [torch.zeros(2), (torch.ones(1), "s")],
        "pair": Pair(torch.ones(2), 7),
    }
    out = to_device(batch, "meta")
    assert (
        out["x"].device.type == "meta"
        and out["max_seqlen_int"] == 5
        and out["pad_between_seqs"] is False
    )
    assert out["nested"][0].device.type == "meta" and out["nested"][1][1] == "s"
    assert (
        isinstance(out["pair"], Pair) and out["pair"].a.device.type == "meta" and out["pair"].b == 7
    )


@pytest.mark.parametrize("balance", [False, True])
def test_drop_last_with_fewer_samples_than_a_batch_says_so(tmp_path, balance) -> None:
    """24 samples over 2 replicas with batch_size 16 and drop_last: not an empty loader, one line
    with the numbers and the fix."""
    d = str(tmp_path / "c")
    produce_cache(torch.utils.data.DataLoader([{"input_ids": torch.arange(1, 9)} for _ in range(24)], batch_size=4), d, 8,
                  lambda b: {"input_ids": b["input_ids"]}, ("input_ids",), progress=False)  # fmt: skip
    ds = CachedTensorDataset(d, "offline", 1, ("input_ids",))
    collate = (
        CachedThdCollator(8) if balance else functools.partial(collate_cached, keys=("input_ids",))
    )
    with pytest.raises(
        ValueError,
        match=r"batch_size=16 with drop_last=True: each of the 2 data-parallel replica\(s\) gets 12 of the 24 samples per epoch, fewer than one batch, so the loader would yield nothing; pass batch_size <= 12, or drop_last=False",
    ):
        build_cached_dataloader(
            ds, 16, True, collate, drop_last=True, dp_rank=0, dp_size=2, balance=balance
        )
    loader = build_cached_dataloader(
        ds, 12, True, collate, drop_last=True, dp_rank=0, dp_size=2, balance=balance
    )
    assert len(list(loader)) == 1
    # more replicas than samples: no batch size helps
    with pytest.raises(
        ValueError,
        match=r"^the dataset's 24 samples are too few for 32 data-parallel replicas with drop_last=True: every replica needs at least one, so the loader would yield nothing; use a dataset of at least 32 samples, fewer replicas, or drop_last=False$",
    ):
        build_cached_dataloader(
            ds, 1, True, collate, drop_last=True, dp_rank=0, dp_size=32, balance=balance
        )
