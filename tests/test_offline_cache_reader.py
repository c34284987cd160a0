"""CachedTensorDataset: per-item (reference behaviour) and batched reads.

The oracle is the tensors ``make_cache`` wrote; per-item reads go through
safetensors' own ``safe_open`` and batched reads through our header parse and
either engine (``preadv`` runs or the mapped gather, forced by the ``engine``
fixture), so comparing them is a differential test of independent read paths.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _offline_cache_support import (
    CACHE_NAME,
    FORMAT_VERSION,
    make_cache,
    read_tuning,
    share_every_batch,
)
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.utils.data import DataLoader, get_worker_info

import te_thd.offline_cache.read.executor as readexec
from te_thd.offline_cache import (
    CachedBatch,
    CachedTensorDataset,
    CacheIntegrityError,
    UnverifiedCacheWarning,
    cache_info,
    collate_cached,
    verify_cache,
)
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.schema import shard_path
from te_thd.offline_cache.record.manifest import write_manifest

KEYS = ("sample_id", "input_ids", "loss_mask", "position_mask", "length", "hidden")
N, SHARD = 83, 16  # 6 shards, the last one short (3 samples)


@pytest.fixture(autouse=True)
def _unverified_reads_are_asserted(request):
    """The ``UnverifiedCacheWarning`` a read of a plain (reference-format) cache raises is
    asserted here, not printed: a test of the plain cache may see it (when it reads a shard) and
    it must say what it should; a test marked ``unverified_cache`` must see it; any other test
    must not (pyproject makes it an error)."""
    plain = "plain_save_file" in request.node.name
    required = request.node.get_closest_marker("unverified_cache") is not None
    if not (plain or required):
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnverifiedCacheWarning)
        yield
    unverified = [w for w in caught if issubclass(w.category, UnverifiedCacheWarning)]
    for w in unverified:
        assert re.search(r"carries no checksums .* its reads are not verified", str(w.message)), (
            w.message
        )
    assert unverified or not required, "the test reads no unverified shard"
    for w in caught:  # anything else goes on to pytest's own handling
        if not issubclass(w.category, UnverifiedCacheWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@pytest.fixture(scope="module", params=["produce_cache", "plain_save_file"])
def cache(tmp_path_factory, request):
    """The same samples written by te_thd's producer (manifest with schema and shard
    records) and as plain safetensors files with a seed-only manifest."""
    d = str(tmp_path_factory.mktemp("cache"))
    tensors = make_cache(d, N, SHARD, width=8, hidden=3, producer=request.param == "produce_cache")
    return d, tensors


@pytest.fixture(scope="module", params=["preadv", "mapped"])
def engine(request) -> str:
    """A ``readplan.COPY_ENGINE`` that forces one copy engine for every (key, shard) part of a
    batch (the test rows are tiny: the default choice would mostly pick the mapped
    gather)."""
    return request.param


def _ds(d: str, engine: str = "auto", **kw) -> CachedTensorDataset:
    read_tuning(engine=engine)
    return CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, KEYS, **kw)


def _assert_batch(batch: CachedBatch, tensors: dict[str, torch.Tensor], indices: list[int]) -> None:
    idx = torch.tensor([i % N for i in indices], dtype=torch.int64)
    assert len(batch) == len(indices)
    for k in KEYS:
        expect = tensors[k].index_select(0, idx)
        got = batch.tensors[k]
        assert got.dtype == expect.dtype and got.shape == expect.shape, k
        assert torch.equal(got, expect), k


def test_getitem_reference_behaviour(cache):
    d, tensors = cache
    ds = _ds(d)
    assert len(ds) == N and ds.num_samples == N and ds.shard_size == SHARD
    assert ds._shard_indices == list(range(6))
    for i in [0, 1, 15, 16, 47, N - 1, -1, -N]:
        item = ds[i]
        assert set(item) == set(KEYS)
        for k in KEYS:
            assert torch.equal(item[k], tensors[k][i]), (i, k)
    for bad in (N, -N - 1):
        with pytest.raises(IndexError):
            ds[bad]


@pytest.mark.parametrize(
    "indices",
    [
        list(range(16, 48)),  # whole shards, contiguous: slice path
        list(range(20, 28)),  # contiguous inside one shard
        [5, 3, 9, 3, 0],  # one shard, shuffled with a repeat: index_select path
        [14, 15, 16, 17, 80, 82, 0],  # several shards incl. the short last one
        [-1, -2, 0, -N],  # negative indices
        [7],
        list(range(82, 78, -1)),  # decreasing run
    ],
)
def test_getitems_equals_written_tensors_and_getitem(cache, engine, indices):
    d, tensors = cache
    ds = _ds(d, engine)
    batch = ds.__getitems__(indices)
    _assert_batch(batch, tensors, indices)
    for pos, i in enumerate(indices):
        item = ds[i]
        for k in KEYS:
            assert torch.equal(batch[pos][k], item[k])


@given(st.lists(st.integers(min_value=-N, max_value=N - 1), min_size=1, max_size=40))
def test_getitems_property_random_indices(cache, engine, indices):
    d, tensors = cache
    _assert_batch(_ds(d, engine).__getitems__(indices), tensors, indices)


def test_getitems_out_of_range_and_empty(cache):
    d, _ = cache
    ds = _ds(d)
    where = (
        f"the {CACHE_NAME} cache at {d}, which holds {N} samples; pass an index in \\[-{N}, {N}\\)$"
    )
    with pytest.raises(IndexError, match=f"^indices\\[1\\]={N} is out of range for {where}"):
        ds.__getitems__([0, N])
    # a negative index is named as given, on the one-shard path and across shards
    for batch, i in (([-7 * N], 0), ([0, 40, -N - 1], 2)):
        with pytest.raises(
            IndexError, match=f"^indices\\[{i}\\]={batch[i]} is out of range for {where}"
        ):
            ds.__getitems__(batch)
    with pytest.raises(IndexError, match=f"^index={-7 * N} is out of range for {where}"):
        ds[-7 * N]
    assert len(ds.__getitems__([])) == 0


@pytest.mark.parametrize("bad", [1.0, "a", True, None])
def test_an_index_that_is_not_an_int_is_named_with_its_type(cache, bad):
    d, tensors = cache
    ds = _ds(d)
    want = f"is of type {type(bad).__name__}, not int; pass an index in \\[-{N}, {N}\\) as an int$"
    for batch in ([bad], [3, bad], [40, 3, bad]):  # one shard, or several
        with pytest.raises(
            TypeError, match=f"^indices\\[{len(batch) - 1}\\]={re.escape(repr(bad))} {want}"
        ):
            ds.__getitems__(batch)
    with pytest.raises(TypeError, match=f"^index={re.escape(repr(bad))} {want}"):
        ds[bad]
    # numpy integers are indices (a sampler's array, listed)
    _assert_batch(ds.__getitems__([np.int64(40), np.int32(-1)]), tensors, [40, N - 1])


def test_duplicate_disk_keys_and_a_cache_dir_that_is_no_path_are_refused(cache, tmp_path):
    d, _ = cache
    with pytest.raises(
        ValueError,
        match=r"^disk_keys=\('hidden', 'length', 'hidden'\) must be a non-empty tuple of "
        r"distinct key names, but names 'hidden' twice; pass each key once, e\.g\. \('hidden', 'length'\)$",
    ):
        CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("hidden", "length", "hidden"))
    for bad in (None, 123, b"/tmp"):
        want = (
            f"^cache_dir={re.escape(repr(bad))} is of type {type(bad).__name__}, not a path; pass a local "
            r"directory \(str or os\.PathLike\), an s3:// or an msc:// URL$"
        )
        with pytest.raises(TypeError, match=want):
            CachedTensorDataset(bad, CACHE_NAME, FORMAT_VERSION, KEYS)
        with pytest.raises(TypeError, match=want):
            cache_info(bad)
        with pytest.raises(TypeError, match=want):
            verify_cache(bad)
    with pytest.raises(ValueError, match="^cache_dir='' is empty; pass a local directory"):
        CachedTensorDataset("", CACHE_NAME, FORMAT_VERSION, KEYS)
    # a pathlib.Path is a path
    assert len(CachedTensorDataset(Path(d), CACHE_NAME, FORMAT_VERSION, KEYS)) == N


def test_batch_is_a_fresh_copy_not_a_view_of_the_file(cache, engine):
    d, tensors = cache
    ds = _ds(d, engine)
    b = ds.__getitems__(list(range(0, 8)))
    b.tensors["input_ids"].fill_(-7)  # writing the batch must not touch the mapping
    again = ds.__getitems__(list(range(0, 8)))
    assert torch.equal(again.tensors["input_ids"], tensors["input_ids"][:8])


def test_cached_batch_sequence_protocol_and_collate(cache):
    d, tensors = cache
    ds = _ds(d)
    idx = [3, 40, 41, 2]
    b = ds.__getitems__(idx)
    rows = list(b)
    assert len(rows) == 4 and torch.equal(rows[1]["input_ids"], tensors["input_ids"][40])
    assert torch.equal(b[-1]["hidden"], tensors["hidden"][2])
    assert [r["sample_id"].item() for r in b[1:3]] == [40, 41]
    with pytest.raises(IndexError):
        b[4]
    # batched path: the stacked tensors are returned as they are (no restack)
    out = collate_cached(b, ("input_ids", "hidden"))
    assert out["input_ids"].data_ptr() == b.tensors["input_ids"].data_ptr()
    # list path (the reference's input) gives the same values
    ref = collate_cached([ds[i] for i in idx], ("input_ids", "hidden"))
    for k in ("input_ids", "hidden"):
        assert torch.equal(out[k], ref[k])
    with pytest.raises(ValueError, match="key 'nope' was not read"):
        collate_cached(b, ("nope",))
    # a collate written for a list of samples (torch's default) still works on it
    default = torch.utils.data.default_collate(b)
    assert all(torch.equal(default[k], b.tensors[k]) for k in KEYS)


def test_lru_bounds_open_shards(cache, engine):
    d, tensors = cache
    ds = _ds(d, engine, max_open_shards=2)
    order = [0, 17, 33, 49, 65, 81, 1, 18]
    fds = set(os.listdir("/proc/self/fd"))
    for i in order:
        _assert_batch(ds.__getitems__([i, i]), tensors, [i, i])
        ds[i]
        assert (
            len(ds._source.files) <= 2
        )  # the one cache of open shards: descriptors, mappings and handles
    assert len(set(os.listdir("/proc/self/fd")) - fds) <= 2  # evicted descriptors are closed
    ds._source.files.close()
    assert not set(os.listdir("/proc/self/fd")) - fds


def test_pickle_drops_process_state(cache):
    d, tensors = cache
    ds = _ds(d)
    ds.__getitems__([0, 2, 20])  # rows 0 and 2: scattered small rows, the mapped gather
    ds[0]
    opened = ds._source.files.get(0)
    assert opened is not None and opened.views is not None and opened.handle is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone._source.files) == 0
    _assert_batch(clone.__getitems__([0, 20, 82]), tensors, [0, 20, 82])


def _child_read(ds: CachedTensorDataset, parent_views_id: int, q) -> None:
    b = ds.__getitems__([1, 2, 70])
    q.put(
        (
            os.getpid(),
            ds._source.pid,
            id(ds._source.files) != parent_views_id,
            b.tensors["sample_id"].tolist(),
            ds[5]["sample_id"].item(),
        )
    )


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_handles_reopened_in_child_processes(tmp_path, method):
    d = str(tmp_path)
    make_cache(d, N, SHARD, width=8, hidden=3)
    ds = _ds(d)
    ds.__getitems__([1, 2, 70])  # parent has open mappings and handles
    ds[5]
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_child_read, args=(ds, id(ds._source.files), q))
    p.start()
    pid, ds_pid, fresh_views, ids, item = q.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert pid != os.getpid() and ds_pid == pid and fresh_views
    assert ids == [1, 2, 70] and item == 5


def test_reads_do_not_load_the_whole_shard(tmp_path):
    # a batch from a large shard allocates only the batch: large rows are read by
    # preadv (no mapping at all), small scattered rows gathered from a file mapping
    d = str(tmp_path)
    make_cache(d, 64, 64, width=4096, hidden=64)  # one ~33 MB shard, 512 KiB hidden rows
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("hidden",))
    b = ds.__getitems__([3, 9])
    assert b.tensors["hidden"].shape == (2, 4096, 64)
    assert len(ds._source.files) == 1 and ds._source.files.get(0).views is None
    small = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("length",))
    small.__getitems__([3, 9])
    view = small._source.files.get(0).views["length"]
    assert view.shape == (64,)
    whole = view.untyped_storage()
    assert whole.nbytes() >= 64 * 4096 * 64 * 2  # the mapping spans the file
    assert not whole.resizable()  # a file mapping, not an allocation


# -- reads on several threads ----------------------------------------------------------

_THREADED: dict[tuple[str, int], CachedTensorDataset] = {}


def _threaded(d: str, engine: str, threads: int) -> CachedTensorDataset:
    """A dataset reading with ``threads`` threads from the first byte on (the test rows
    are far below ``PARALLEL_MIN_BYTES``), kept across hypothesis examples."""
    read_tuning(engine=engine, parallel_min_bytes=0)
    ds = _THREADED.get((d, threads))
    if ds is None:
        ds = _THREADED[(d, threads)] = _ds(d, engine, read_threads=threads)
    return ds


@pytest.mark.parametrize("copy_engine", ["auto", "preadv", "mapped"])
@given(
    st.lists(st.integers(min_value=-N, max_value=N - 1), min_size=1, max_size=40), st.integers(2, 4)
)
def test_parallel_reads_equal_one_thread_reads(cache, copy_engine, indices, threads):
    """Differential: ``read_threads=2..4`` (threaded from any size) returns what
    ``read_threads=1`` and the written tensors say, for any index set and engine."""
    d, tensors = cache
    one = _threaded(d, copy_engine, 1).__getitems__(indices)
    many = _threaded(d, copy_engine, threads).__getitems__(indices)
    _assert_batch(many, tensors, indices)
    for k in KEYS:
        assert torch.equal(many.tensors[k], one.tensors[k]), k


@pytest.fixture
def readers(monkeypatch):
    """Thread names that read a piece (the real ``read_piece`` runs, then waits 5 ms as a
    slow disk would, so that a helper thread wakes up before the caller has read it all, also
    on a loaded machine and for a batch of only three pieces)."""
    names: list[str] = []
    real = readexec.read_piece

    def read_piece(piece):
        real(piece)
        names.append(threading.current_thread().name)
        time.sleep(0.005)

    monkeypatch.setattr(readexec, "read_piece", read_piece)
    return names


def test_parallel_reads_use_the_helper_threads(cache, readers):
    """The threaded differential above is not vacuous: the pieces of either copy engine
    (``auto`` gathers these small rows from the mapped shard) are read by helper threads
    too; ``read_threads=1`` never uses them."""
    d, tensors = cache
    for engine, threads, helped in (("preadv", 2, True), ("auto", 3, True), ("mapped", 2, True), ("preadv", 1, False),
                                    ("mapped", 1, False)):  # fmt: skip
        ds = _ds(d, engine, read_threads=threads)
        read_tuning(parallel_min_bytes=0)
        readers.clear()
        _assert_batch(ds.__getitems__(list(range(10, 40))), tensors, list(range(10, 40)))
        assert any(n.startswith("te_thd-read") for n in readers) == helped, (
            engine,
            threads,
            readers,
        )


def test_read_threads_default(cache):
    """None: 2 threads in the main process on a machine with 3+ CPUs (1 on one or two CPUs)."""
    d, _ = cache
    ds = _ds(d)
    assert ds.read_threads is None
    cpus = len(os.sched_getaffinity(0))
    assert ds._parallel(False).threads == (2 if cpus >= 3 else 1) == readexec.default_read_threads()
    assert ds._parallel(True).threads == 1  # inside a DataLoader worker
    assert readexec.PARALLEL_MIN_BYTES == 4 << 20
    assert _ds(d, read_threads=3)._parallel(True).threads == 3  # explicit: also in workers


def test_a_large_batch_is_read_by_two_threads(tmp_path, readers):
    """Real sizes, two read threads (the default on 3+ CPUs): an 8 x 512 KiB batch (4 MiB,
    ``PARALLEL_MIN_BYTES``) is read by the caller and a helper thread and equals a one-thread
    read; a smaller one stays on the calling thread."""
    d = str(tmp_path)
    tensors = make_cache(d, 16, 16, width=4096, hidden=64)
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("hidden", "length"), read_threads=2)
    one = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("hidden", "length"), read_threads=1)
    small = [3, 9, 4, 0]  # 2 MiB: one thread
    assert torch.equal(ds.__getitems__(small).tensors["hidden"], tensors["hidden"][small])
    assert set(readers) == {threading.current_thread().name}
    for idx in ([1, 2, 3, 4, 5, 6, 7, 8], [15, 0, 7, 3, 3, 9, 11, 12, 2]):
        readers.clear()
        got = ds.__getitems__(idx)
        assert any(n.startswith("te_thd-read") for n in readers), readers
        for k in ("hidden", "length"):
            assert torch.equal(got.tensors[k], tensors[k][idx]) and torch.equal(
                got.tensors[k], one.__getitems__(idx).tensors[k]
            )


def _collate_reporting_threads(
    batch: CachedBatch,
) -> tuple[dict[str, torch.Tensor], int, bool, int]:
    """Collate in a worker and report its reader: (batch, threads, helper threads running here, pid)."""
    reads = get_worker_info().dataset._source.reads[True]
    helpers = any(t.name.startswith("te_thd-read") for t in threading.enumerate())
    return collate_cached(batch, KEYS), reads.threads, helpers, os.getpid()


@pytest.mark.parametrize(("method", "read_threads"), [("fork", None), ("fork", 2), ("spawn", 2)])
def test_workers_read_correct_batches_after_the_parent_started_its_pool(
    tmp_path, method, read_threads
):
    """A dataset whose parent process already read on its thread pool is used by two
    DataLoader workers: they read with 1 thread by default, with their own threads for
    an explicit ``read_threads=2``, and return the written tensors either way."""
    d = str(tmp_path)
    tensors = make_cache(d, N, SHARD, width=8, hidden=3)
    ds = _ds(d, "preadv", read_threads=read_threads)
    read_tuning(parallel_min_bytes=0)
    ds.__getitems__(list(range(0, 40)))
    assert any(
        t.name.startswith("te_thd-read") for t in threading.enumerate()
    )  # helper threads in the parent
    loader = DataLoader(
        ds,
        batch_size=8,
        num_workers=2,
        multiprocessing_context=method,
        collate_fn=_collate_reporting_threads,
        worker_init_fn=share_every_batch,
    )  # a spawned worker imports the constants afresh
    seen, pids = [], set()
    for batch, threads, started, pid in loader:
        assert threads == (read_threads or 1)
        assert started == (threads > 1)  # the worker started its own helpers (a fork inherits none)
        seen.append(batch)
        pids.add(pid)
    assert os.getpid() not in pids and len(pids) == 2
    for k in KEYS:
        assert torch.equal(torch.cat([b[k] for b in seen]), tensors[k]), k


# -- bad input -----------------------------------------------------------------------


def test_bad_arguments(cache):
    d, _ = cache
    with pytest.raises(ValueError, match=r"disk_keys='input_ids' must be a non-empty tuple"):
        CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, "input_ids")
    with pytest.raises(ValueError, match=r"disk_keys=\(\) must be a non-empty tuple"):
        CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ())
    with pytest.raises(ValueError, match="max_open_shards=0 must be an int >= 1"):
        _ds(d, max_open_shards=0)
    with pytest.raises(ValueError, match="format_version=3, expected 4"):
        CachedTensorDataset(d, CACHE_NAME, 4, KEYS)
    for bad in (0, -2, True, 1.5, "2"):
        with pytest.raises(
            ValueError,
            match=rf"read_threads={bad!r} must be an int >= 1 \(1: read on the calling thread only\)",
        ):
            _ds(d, read_threads=bad)


def test_missing_key_rejected_at_open_with_a_schema(tmp_path):
    d = str(tmp_path)
    make_cache(d, 20, 8, producer=True)
    with pytest.raises(
        ValueError,
        match=r"disk_keys \['logits'\] are not in the test cache .*\(its manifest .*/manifest\.json lists \[.*\]\); pass keys the producer wrote",
    ):
        CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("input_ids", "logits"))


def test_missing_key_names_the_shard_without_a_schema(tmp_path):
    d = str(tmp_path)
    make_cache(d, 20, 8, producer=False)
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("input_ids", "logits"))
    with pytest.raises(
        CacheIntegrityError, match=r"shard-000000\.safetensors: lacks keys \['logits'\]"
    ) as e:
        ds.__getitems__([0])
    assert e.value.path == shard_path(d, 0)


def test_open_checks_shard_sizes_recorded_by_the_producer(tmp_path):
    d = str(tmp_path)
    make_cache(d, 20, 8, producer=True)
    with open(shard_path(d, 1), "ab") as f:
        f.write(b"x")
    with pytest.raises(CacheIntegrityError, match=r"shard-000001\.safetensors"):
        CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("input_ids",))


def _write(
    d: str, shards: list[dict[str, torch.Tensor]], num_samples: int, shard_size: int
) -> None:
    os.makedirs(d, exist_ok=True)
    for i, t in enumerate(shards):
        save_file(t, shard_path(d, i))
    write_manifest(d, {"num_samples": num_samples, "shard_size": shard_size}, FORMAT_VERSION)


@pytest.mark.unverified_cache
def test_shard_with_wrong_row_count(tmp_path):
    d = str(tmp_path)
    _write(d, [{"x": torch.zeros(4, 2)}, {"x": torch.zeros(3, 2)}], num_samples=8, shard_size=4)
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("x",))
    ds.__getitems__([0, 1])
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard-000001\.safetensors: key 'x' holds 3 samples, the manifest puts 4 in this shard",
    ):
        ds.__getitems__([5])


@pytest.mark.unverified_cache
def test_shard_with_different_schema(tmp_path):
    d = str(tmp_path)
    _write(
        d,
        [{"x": torch.zeros(4, 2)}, {"x": torch.zeros(4, 2, dtype=torch.float64)}],
        num_samples=8,
        shard_size=4,
    )
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("x",))
    ds.__getitems__([0])
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard-000001\.safetensors: key 'x' is float64\[4, 2\], the schema says float32\[n, 2\]",
    ):
        ds.__getitems__([4])


def test_shard_removed_after_open(tmp_path):
    d = str(tmp_path)
    _write(d, [{"x": torch.zeros(4, 2)}, {"x": torch.zeros(4, 2)}], num_samples=8, shard_size=4)
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("x",))
    os.remove(shard_path(d, 1))
    with pytest.raises(CacheIntegrityError, match=r"shard-000001\.safetensors is missing"):
        ds.__getitems__([4])


@pytest.mark.unverified_cache
def test_item_path_checks_each_shard_on_first_open(tmp_path):
    """``ds[i]`` runs the batched path's header + schema checks when it opens a shard."""
    d = str(tmp_path)
    _write(
        d,
        [
            {"x": torch.zeros(4, 2)},
            {"x": torch.zeros(3, 2)},
            {"x": torch.zeros(4, 2, dtype=torch.float64)},
            {"y": torch.zeros(4, 2)},
        ],
        num_samples=16,
        shard_size=4,
    )
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("x",))
    assert ds[0]["x"].dtype == torch.float32
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard-000001\.safetensors: key 'x' holds 3 samples, the manifest puts 4 in this shard",
    ):
        ds[5]
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard-000002\.safetensors: key 'x' is float64\[\d+, 2\], the schema says float32\[n, 2\]",
    ):
        ds[8]
    with pytest.raises(CacheIntegrityError, match=r"shard-000003\.safetensors: lacks keys \['x'\]"):
        ds[12]
    assert [i for i in range(4) if ds._source.files.get(i) is not None] == [
        0
    ]  # a refused shard is never opened


def test_item_path_wraps_a_damaged_header(tmp_path):
    d = str(tmp_path)
    make_cache(d, 20, 8, producer=True)
    with open(shard_path(d, 1), "r+b") as f:
        f.seek(9)
        f.write(b"\x01")  # a control character inside the header JSON
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("input_ids",))
    assert ds[0]["input_ids"].shape[0] > 0
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard .*shard-000001\.safetensors is not a valid safetensors file: header is not JSON",
    ) as e:
        ds[8]
    assert e.value.path == shard_path(d, 1)


def test_item_path_rejects_a_dtype_swapped_header(tmp_path):
    """I64 -> F64 keeps a valid safetensors file; the manifest schema refuses it on both paths."""
    d = str(tmp_path)
    make_cache(d, 20, 8, producer=True)
    path = shard_path(d, 1)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data.replace(b'"I64"', b'"F64"', 1))
    ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("sample_id", "input_ids", "loss_mask"))
    for read in (lambda: ds[8], lambda: ds.__getitems__([8])):
        with pytest.raises(
            CacheIntegrityError,
            match=r"shard-000001\.safetensors: (header checksum mismatch|key 'input_ids' is float64)",
        ):
            read()


def test_open_checks_presence(tmp_path):
    d = str(tmp_path)
    _write(d, [{"x": torch.zeros(4, 2)}], num_samples=8, shard_size=4)
    with pytest.raises(CacheIntegrityError, match="missing shard indices"):
        CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, ("x",))


def test_readahead_hints_the_read_keys_of_each_opened_shard(tmp_path, monkeypatch):
    """``readahead=True`` asks the kernel for exactly the disk_keys' byte ranges of a
    shard, once per open (the real ``posix_fadvise`` still runs); False asks nothing.
    Both read the same bytes."""
    d = str(tmp_path)
    tensors = make_cache(d, 20, 8, width=8, hidden=3)
    calls = []
    import te_thd.offline_cache.format.schema as cache_format

    real = cache_format._fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:  # (each header is read with read-ahead off)
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(cache_format, "_fadvise", fadvise)
    keys = ("hidden", "length")
    for readahead in (True, False):
        calls.clear()
        ds = CachedTensorDataset(d, CACHE_NAME, FORMAT_VERSION, keys, readahead=readahead)
        for _ in range(2):
            b = ds.__getitems__([1, 9, 2])
        assert torch.equal(b.tensors["hidden"], tensors["hidden"][[1, 9, 2]])
        if not readahead:
            assert calls == []
            continue
        want = []
        for s in (0, 1):
            entries = read_shard_header(shard_path(d, s)).entries
            want += [
                (
                    shard_path(d, s),
                    entries[k].start,
                    entries[k].end - entries[k].start,
                    os.POSIX_FADV_WILLNEED,
                )
                for k in keys
            ]
        assert sorted(calls) == sorted(want)


def test_a_reader_alive_at_interpreter_exit_leaves_quietly(tmp_path):
    """Open shards and helper threads of a dataset still referenced at exit are finalised without
    'Exception ignored' noise (their finalisers must not need modules torn down first)."""
    import subprocess
    import sys

    d = str(tmp_path / "c")
    make_cache(d, 64, 16, width=4096, hidden=64)
    script = (
        "import torch\n"
        "import te_thd.offline_cache.read.dataset as reader_module\n"
        "from te_thd.offline_cache import CacheShardSampler, CachedTensorDataset\n"
        f"ds = CachedTensorDataset({d!r}, {CACHE_NAME!r}, {FORMAT_VERSION!r}, ('hidden', 'length'), read_threads=2)\n"
        "order = list(CacheShardSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))\n"
        "for i in range(0, len(order), 8):\n"
        "    x = ds.__getitems__(order[i : i + 8]); del x\n"
        "item = ds[3]\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr
