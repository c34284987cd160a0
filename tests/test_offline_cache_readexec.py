"""readplan/readexec: run planning (property test vs a loop), preadv reads (differential vs
safetensors' own loader on real files) and destination buffers (recycled only once
the consumer lets go)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from _offline_cache_support import read_header, read_tuning
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import te_thd.offline_cache.read.executor as readexec
import te_thd.offline_cache.read.planner as readplan
from te_thd.offline_cache.format.integrity import byte_view
from te_thd.offline_cache.read.executor import (
    DestinationBuffers,
    ParallelReads,
    ReadError,
    read_piece,
)
from te_thd.offline_cache.read.planner import plan_pieces, plan_runs

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
        plan = plan_runs(
            np.array(local, dtype=np.int64), None if d is None else np.array(d, dtype=np.int64)
        )
        want = _runs_by_loop(local, list(range(len(local))) if d is None else d)
        got = [
            (plan.first_row[k], plan.dst[plan.starts[k] : plan.starts[k + 1]])
            for k in range(plan.num_runs)
        ]
        assert got == want
        for k, (_, rows) in enumerate(want):
            assert bool(plan.dst_contiguous[k]) == (
                rows == list(range(rows[0], rows[0] + len(rows)))
            )


def test_plan_runs_examples():
    plan = plan_runs(np.array([5, 3, 4, 9, 1, 2]))
    assert plan.first_row == [1, 9] and plan.starts == [0, 5, 6]
    assert plan.dst == [4, 5, 1, 2, 0, 3] and plan.dst_contiguous == [False, True]
    seq = plan_runs(np.arange(10, 18))
    assert seq.num_runs == 1 and seq.dst_contiguous == [True]
    assert plan_runs([3, 3, 4]).first_row == [3, 3]  # a repeat starts a new run
    assert plan_runs(np.array([4, 3, 3]), np.array([2, 1, 0])).dst == [
        0,
        1,
        2,
    ]  # a repeat: ascending rows
    assert plan_runs([]).num_runs == 0 and plan_runs([]).starts == [0]
    with pytest.raises(ValueError, match=r"dst has 2 rows, local 3"):
        plan_runs(np.arange(3), np.arange(2))


def read_rows(fd, base, row_bytes, plan, dst, path, after=None, chunk_bytes=0) -> None:
    """Read the planned rows of one tensor into ``dst`` on this thread: every planned piece in turn."""
    for piece in plan_pieces(fd, base, row_bytes, plan, dst, path, after, chunk_bytes):
        read_piece(piece)


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


@pytest.fixture(scope="module")
def fd(shard):
    """A read-only descriptor of ``shard`` (``preadv`` takes offsets: tests share it)."""
    fd = os.open(shard, os.O_RDONLY)
    yield fd
    os.close(fd)


def _read(path: str, key: str, local: list[int], dst: list[int] | None, batch: int) -> torch.Tensor:
    e = read_header(path)[key]
    out = torch.full((batch, *e.shape[1:]), 0, dtype=e.dtype)
    plan = plan_runs(
        np.array(local, dtype=np.int64), None if dst is None else np.array(dst, dtype=np.int64)
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        read_rows(fd, e.start, (e.end - e.start) // e.shape[0], plan, byte_view(out), path)
    finally:
        os.close(fd)
    return out


@given(
    st.lists(st.integers(0, 36), min_size=1, max_size=50),
    st.randoms(use_true_random=False),
    st.sampled_from(["hidden", "ids", "mask", "length", "f32"]),
)
def test_read_rows_equals_safetensors_load_file(shard, local, rnd, key):
    expect = load_file(shard)[key]
    batch = len(local) + 3  # rows the plan does not fill stay untouched
    dst = rnd.sample(range(batch), len(local))
    got = _read(shard, key, local, dst, batch)
    want = torch.zeros_like(got)
    want[torch.tensor(dst)] = expect[torch.tensor(local)]
    assert torch.equal(got, want)
    assert torch.equal(_read(shard, key, local, None, len(local)), expect[torch.tensor(local)])


@given(
    st.lists(st.integers(0, 36), min_size=1, max_size=30),
    st.randoms(use_true_random=False),
    st.integers(0, 3),
)
def test_read_rows_calls_after_on_each_piece_once_it_is_read(shard, local, rnd, chunk_rows):
    """Every batch row is announced exactly once, in pieces of at most ``chunk_bytes``,
    and the bytes of a piece are final when its callback runs (what a checksum needs)."""
    expect = load_file(shard)["ids"]
    e = read_header(shard)["ids"]
    row = (e.end - e.start) // e.shape[0]
    dst = rnd.sample(range(len(local)), len(local))
    out = torch.zeros(len(local), 7, dtype=torch.int64)
    seen: list[int] = []

    def after(p: int, rows: range) -> None:
        m = len(rows)
        assert chunk_rows == 0 or m <= chunk_rows
        assert torch.equal(out[p : p + m], expect[rows.start : rows.stop])
        seen.extend(range(p, p + m))

    fd = os.open(shard, os.O_RDONLY)
    try:
        read_rows(
            fd, e.start, row, plan_runs(local, dst), byte_view(out), shard, after, chunk_rows * row
        )
    finally:
        os.close(fd)
    assert sorted(seen) == list(range(len(local)))
    assert torch.equal(out[torch.tensor(dst)], expect[torch.tensor(local)])


def test_read_rows_splits_runs_at_iov_max(shard, monkeypatch):
    monkeypatch.setattr(readplan, "IOV_MAX", 3)
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
        with pytest.raises(
            OSError,
            match=r"short\.safetensors: file ended at byte 909 while reading 107 bytes \(truncated after open\?\)",
        ):
            read_rows(fd, e.start, 56, plan_runs(np.array([9, 10, 11])), byte_view(out), short)
    finally:
        os.close(fd)


def test_byte_view_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match=r"tensor of shape \[4, 2\] is not contiguous"):
        byte_view(torch.zeros(2, 4).t())


def test_byte_view_holds_its_tensor_unless_told_not_to():
    """A view a read or a write holds keeps its memory alive; the row-view cache's views
    (``hold=False``) must not, or a pooled batch would never be handed out again."""
    for hold in (True, False):
        t = torch.arange(6, dtype=torch.int32)
        alive, view = weakref.ref(t), byte_view(t, hold=hold)
        del t
        gc.collect()
        assert (alive() is not None) == hold and view.nbytes == 24 and not view.readonly


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


# -- pieces and their split over threads ---------------------------------------------


def _piece(nbytes: int, tag: int = 0) -> readexec.Piece:
    return readexec.Piece(-1, tag, [], nbytes, "p")


def _addr(v: memoryview) -> int:
    return np.frombuffer(v, dtype=np.uint8).__array_interface__["data"][0] if v.nbytes else -1


@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=40),
    st.randoms(use_true_random=False),
    st.integers(1, 24),
    st.integers(0, 100),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1024, 3, 1]),
)
def test_plan_pieces_tile_the_planned_rows(
    local, rnd, row_bytes, chunk_bytes, scatter, with_after, iov_max
):
    """Pure planning: the pieces' iovecs cover every planned batch row exactly once,
    each from the file row the plan assigns it; a piece is whole rows, at most
    ``chunk_bytes`` (or one row when a row is larger), at most ``IOV_MAX`` iovecs; a
    piece with ``after`` holds consecutive batch rows and file rows, named by its args."""
    n = len(local)
    batch = n + 2
    dst = rnd.sample(range(batch), n) if scatter else None
    plan = plan_runs(local, dst)
    base = 1000
    buf = torch.zeros(batch * row_bytes, dtype=torch.uint8)
    raw = byte_view(buf)
    start = _addr(raw)
    after = (lambda p, rows: None) if with_after else None
    old = readplan.IOV_MAX
    readplan.IOV_MAX = iov_max
    try:
        pieces = plan_pieces(7, base, row_bytes, plan, raw, "f", after, chunk_bytes)
    finally:
        readplan.IOV_MAX = old
    targets = list(range(n)) if dst is None else dst
    want = sorted(zip(targets, local, strict=True))  # (batch row, file row)
    got = []
    limit = max(row_bytes, chunk_bytes // row_bytes * row_bytes) if chunk_bytes else None
    for piece in pieces:
        assert piece.fd == 7 and piece.path == "f"
        assert piece.nbytes == sum(v.nbytes for v in piece.iov) and piece.nbytes % row_bytes == 0
        assert (piece.offset - base) % row_bytes == 0
        assert len(piece.iov) <= iov_max
        if limit is not None:
            assert piece.nbytes <= limit
        file_row = (piece.offset - base) // row_bytes
        rows_here = []
        for v in piece.iov:
            off = _addr(v) - start
            assert off % row_bytes == 0 and v.nbytes % row_bytes == 0 and not v.readonly
            rows_here += range(off // row_bytes, (off + v.nbytes) // row_bytes)
        got += [(b, file_row + j) for j, b in enumerate(rows_here)]
        if piece.after is not None:
            p, rows = piece.args
            m = len(rows)
            assert piece.after is after
            assert rows_here == list(range(p, p + m)) and rows == range(file_row, file_row + m)
            assert m * row_bytes == piece.nbytes
        else:
            assert not with_after
    assert sorted(got) == want


def test_after_runs_once_per_piece_on_final_bytes(shard, fd):
    """``read_piece`` runs a piece's ``after`` once, after its bytes are in place."""
    expect = load_file(shard)["ids"]
    e = read_header(shard)["ids"]
    local = [3, 4, 5, 6, 20, 0, 0]  # a run of 4 in batch order, a lone row, a repeated row
    out = torch.zeros(len(local), 7, dtype=torch.int64)
    calls = []

    def after(p: int, rows: range) -> None:
        calls.append((p, rows.start, len(rows)))
        assert torch.equal(out[p : p + len(rows)], expect[rows.start : rows.stop])

    pieces = plan_pieces(fd, e.start, 56, plan_runs(local), byte_view(out), shard, after, 2 * 56)
    for piece in pieces:
        read_piece(piece)
    assert sorted(calls) == sorted(
        (p, rows.start, len(rows)) for p, rows in (pc.args for pc in pieces)
    )
    assert len(calls) == len(pieces)
    assert sorted(calls) == [
        (0, 3, 2),
        (2, 5, 2),
        (4, 20, 1),
        (5, 0, 1),
        (6, 0, 1),
    ]  # at most 2 rows each
    assert torch.equal(out, expect[torch.tensor(local)])


# -- reads on several threads ------------------------------------------------------------

_READS: dict[int, ParallelReads] = {}


def _reads(threads: int) -> ParallelReads:
    """One ParallelReads per thread count (``PARALLEL_MIN_BYTES = 0``: the test file's small
    batches take the threaded path), reused across examples as a dataset reuses its own."""
    read_tuning(parallel_min_bytes=0)
    if threads not in _READS:
        _READS[threads] = ParallelReads(threads)
    return _READS[threads]


_KEYS = ("hidden", "ids", "mask", "length", "f32")


def _batch_pieces(
    path: str,
    fd: int,
    local: list[int],
    dst: list[int],
    batch: int,
    chunk_rows: int,
    after_log=None,
):
    """Zeroed batch tensors ``{key: [batch, ...]}`` for every key, the pieces that fill
    rows ``dst`` of them from file rows ``local``, and the key of each piece."""
    headers = read_header(path)
    out, pieces, keys = {}, [], []
    for key in _KEYS:
        e = headers[key]
        row = (e.end - e.start) // e.shape[0]
        out[key] = torch.zeros((batch, *e.shape[1:]), dtype=e.dtype)
        raw = byte_view(out[key])
        after = None
        if after_log is not None:

            def after(p, rows, key=key, raw=raw, row=row):
                after_log(
                    key, p, rows.start, len(rows), bytes(raw[p * row : (p + len(rows)) * row])
                )

        planned = plan_pieces(
            fd, e.start, row, plan_runs(local, dst), raw, path, after, chunk_rows * row
        )
        pieces += planned
        keys += [key] * len(planned)
    return out, pieces, keys


@given(
    st.lists(st.integers(0, 36), min_size=1, max_size=40),
    st.randoms(use_true_random=False),
    st.integers(2, 4),
    st.integers(0, 3),
    st.booleans(),
    st.booleans(),
)
def test_parallel_reads_equal_one_thread_and_load_file(
    shard, fd, local, rnd, threads, chunk_rows, checked, ahead
):
    """Differential: a batch read by ``threads`` threads (``run``, or ``start`` then
    ``wait``) equals the same pieces read on this thread and safetensors' own
    ``load_file``; ``finish`` runs once, on the calling thread, after every piece, and
    every ``after`` once, over the piece's final bytes."""
    expect = load_file(shard)
    batch = len(local) + 2
    dst = rnd.sample(range(batch), len(local))
    me = threading.current_thread().name
    log: list[tuple[str, int, int, int, bytes]] = []

    def after_log(key, p, first, m, data):
        log.append((key, p, first, m, data))

    want, serial, _ = _batch_pieces(shard, fd, local, dst, batch, chunk_rows)
    for piece in serial:
        read_piece(piece)
    got, pieces, keys = _batch_pieces(
        shard, fd, local, dst, batch, chunk_rows, after_log if checked else None
    )
    finish_calls = []

    def finish() -> None:
        finish_calls.append((threading.current_thread().name, len(log)))

    if ahead:
        pending = _reads(threads).start(pieces, finish)
        pending.wait()
    else:
        _reads(threads).run(pieces, finish)
    assert finish_calls == [(me, len(log))]  # once, last: every after had run
    idx, pos = torch.tensor(local), torch.tensor(dst)
    for key in _KEYS:
        ref = torch.zeros_like(got[key])
        ref[pos] = expect[key][idx]
        assert torch.equal(got[key], ref), key
        assert torch.equal(want[key], ref), key
    if checked:
        want_args = sorted(
            (k, p.args[0], p.args[1].start, len(p.args[1]))
            for k, p in zip(keys, pieces, strict=True)
        )
        assert sorted(entry[:4] for entry in log) == want_args
        for key, _, first, m, data in log:  # the bytes were final when the check ran
            assert (
                data
                == expect[key][first : first + m].contiguous().view(torch.uint8).numpy().tobytes()
            )


def _row_pieces(path: str, fd: int, rows: int, afters) -> tuple[torch.Tensor, list[readexec.Piece]]:
    """``rows`` one-row pieces of ``ids``, piece ``j`` with ``afters[j]`` (None: no callback)."""
    e = read_header(path)["ids"]
    out = torch.zeros(rows, 7, dtype=torch.int64)
    raw = byte_view(out)
    return out, [
        readexec.Piece(
            fd,
            e.start + j * 56,
            [raw[j * 56 : (j + 1) * 56]],
            56,
            path,
            afters[j],
            (j, range(j, j + 1)),
        )
        for j in range(rows)
    ]


class _Boom(Exception):
    pass


def _raise(name: str):
    def after(*_):
        raise _Boom(name)

    return after


def _slow(
    names: list[str] | None = None, done: threading.Event | None = None, seconds: float = 0.02
):
    """An ``after`` that takes ``seconds`` (the GIL released, as in a real copy), logs its thread, sets ``done``."""

    def after(*_):
        time.sleep(seconds)
        if names is not None:
            names.append(threading.current_thread().name)
        if done is not None:
            done.set()

    return after


def test_parallel_reads_share_a_batch_between_threads(shard, fd):
    """Pieces that take time are read by the caller and the helpers together, and the
    batch is right; ``start`` hands them to the helpers before ``wait`` is called."""
    names: list[str] = []
    out, pieces = _row_pieces(shard, fd, 8, [_slow(names)] * 8)
    read_tuning(parallel_min_bytes=0)
    ParallelReads(2).run(pieces)
    assert torch.equal(out, load_file(shard)["ids"][:8])
    me = threading.current_thread().name
    assert me in names and any(n.startswith("te_thd-read") for n in names), names
    names.clear()
    out, pieces = _row_pieces(shard, fd, 4, [_slow(names)] * 4)
    pending = ParallelReads(2).start(pieces)
    deadline = time.monotonic() + 10
    while len(names) < 4 and time.monotonic() < deadline:  # read while nobody waits
        time.sleep(0.01)
    assert len(names) == 4 and all(n.startswith("te_thd-read") for n in names), names
    pending.wait()
    assert torch.equal(out, load_file(shard)["ids"][:4])


def _long(began: threading.Event, done: threading.Event):
    """An ``after`` that signals it began, takes 0.1 s, then signals it is done."""

    def after(*_):
        began.set()
        time.sleep(0.1)
        done.set()

    return after


@pytest.mark.parametrize("how", ["run", "start"])
def test_parallel_reads_wait_for_every_thread_before_raising(shard, fd, how):
    """An error is raised only once no thread writes into the batch any more: a helper
    still reading a long piece when another piece fails is waited for. ``run``: the
    caller takes piece 0 (20 ms), the helper the long piece 1, the caller then the
    failing piece 2. ``start``: the helpers hold the long piece and the failing one
    before ``wait`` is called. The reader keeps working afterwards."""
    read_tuning(parallel_min_bytes=0)
    reads = ParallelReads(2)
    for _ in range(3):
        began, done = threading.Event(), threading.Event()
        if how == "run":
            _, pieces = _row_pieces(shard, fd, 3, [_slow(), _long(began, done), _raise("failed")])
            with pytest.raises(_Boom, match="^failed$"):
                reads.run(pieces)
        else:
            _, pieces = _row_pieces(shard, fd, 2, [_long(began, done), _raise("failed")])
            pending = reads.start(pieces)
            assert began.wait(10)
            with pytest.raises(_Boom, match="^failed$"):
                pending.wait()
        assert done.is_set()
    began, done = threading.Event(), threading.Event()
    _, pieces = _row_pieces(shard, fd, 2, [_long(began, done), None])
    pending = reads.start(pieces, _raise("finish"))
    assert began.wait(10)
    with pytest.raises(
        _Boom, match="^finish$"
    ):  # the batch's last step fails: only after every piece
        pending.wait()
    assert done.is_set()
    out, pieces = _row_pieces(shard, fd, 3, [None, None, None])
    reads.run(pieces)
    assert torch.equal(out, load_file(shard)["ids"][:3])


def test_a_failed_piece_drops_the_rest_of_the_batch(shard, fd):
    """After a failure the other pieces are not read: the batch is lost anyway."""
    names: list[str] = []
    _, pieces = _row_pieces(shard, fd, 6, [_raise("first")] + [_slow(names)] * 5)
    with pytest.raises(_Boom, match="^first$"):
        ParallelReads(1).run(pieces)
    assert names == []


def test_parallel_reads_a_file_that_shrank_raises_read_error(shard, tmp_path):
    short = str(tmp_path / "short.safetensors")
    with open(shard, "rb") as f:
        data = f.read()
    with open(short, "wb") as f:
        f.write(data)
    fd = os.open(short, os.O_RDONLY)
    try:
        _, pieces = _row_pieces(short, fd, 4, [None] * 4)
        os.truncate(short, pieces[1].offset)  # after open: only row 0 of ids is left
        for how in ("run", "start"):
            read_tuning(parallel_min_bytes=0)
            reads = ParallelReads(2)
            with pytest.raises(
                ReadError,
                match=r"short\.safetensors: file ended at byte \d+ while reading 56 bytes",
            ) as err:
                reads.run(pieces) if how == "run" else reads.start(pieces).wait()
            assert err.value.path == short
    finally:
        os.close(fd)


def test_parallel_reads_below_min_bytes_stay_on_the_calling_thread(shard, fd):
    names: list[str] = []
    _, pieces = _row_pieces(shard, fd, 4, [_slow(names)] * 4)
    read_tuning(parallel_min_bytes=4 * 56 + 1)
    reads = ParallelReads(2)
    reads.run(pieces)
    reads.start(pieces).wait()  # start leaves a small batch to wait()
    assert set(names) == {threading.current_thread().name} and len(names) == 8
    names.clear()
    read_tuning(parallel_min_bytes=4 * 56)
    ParallelReads(2).run(pieces)  # at the threshold: shared out
    assert len(set(names)) == 2


def test_parallel_reads_threads_are_checked():
    for bad in (0, -1, True, 1.5, "2", None):
        with pytest.raises(
            ValueError,
            match=rf"read_threads={bad!r} must be an int >= 1 \(1: read on the calling thread only\)",
        ):
            ParallelReads(bad)


def _read_in_child(reads: ParallelReads, path: str, q) -> None:
    names: list[str] = []
    fd = os.open(path, os.O_RDONLY)
    out, pieces = _row_pieces(path, fd, 4, [_slow(names)] * 4)
    reads.run(pieces)
    q.put((sorted(set(names)), out.tolist()))


def _helper_threads() -> int:
    return sum(t.name.startswith("te_thd-read") for t in threading.enumerate())


@pytest.mark.parametrize("how", ["fork", "pickle"])
def test_parallel_reads_in_a_child_process_start_their_own_threads(shard, fd, how):
    """Helper threads started in the parent do not exist in a forked child (a batch
    handed to them would never finish): the child starts its own. Pickled, the object
    travels without threads and starts them on first use."""
    read_tuning(parallel_min_bytes=0)
    reads = ParallelReads(2)
    names: list[str] = []
    _, pieces = _row_pieces(shard, fd, 4, [_slow(names)] * 4)
    reads.run(pieces)
    assert any(n.startswith("te_thd-read") for n in names)  # the parent's helpers run
    want = load_file(shard)["ids"][:4].tolist()
    if how == "pickle":
        clone = pickle.loads(pickle.dumps(reads))
        assert clone.threads == 2
        assert not clone._workers  # no threads travel
        q: list = []
        _read_in_child(clone, shard, type("Q", (), {"put": staticmethod(q.append)}))
        # the clone started its own two helpers, and they read (a count of all helper
        # threads would also see other readers' threads ending meanwhile)
        assert q[0][1] == want and len(clone._workers) == 2
        assert any(n.startswith("te_thd-read") for n in q[0][0])
        return
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(reads, shard, q))
    p.start()
    p.join(timeout=30)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the forked child hung on the parent's helper threads")
    assert p.exitcode == 0
    child_names, rows = q.get(timeout=10)
    assert rows == want and any(n.startswith("te_thd-read") for n in child_names)


def test_helper_threads_end_with_their_reader(shard, fd):
    """A reader that is gone takes its helper threads with it (as a ThreadPoolExecutor
    does): a process that builds datasets over and over does not pile up threads."""
    before = _helper_threads()
    for _ in range(3):
        read_tuning(parallel_min_bytes=0)
        reads = ParallelReads(2)
        _, pieces = _row_pieces(shard, fd, 4, [None] * 4)
        reads.run(pieces)
        del reads, pieces
    gc.collect()
    deadline = time.monotonic() + 1
    while _helper_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _helper_threads() <= before, (
        f"{_helper_threads() - before} helper threads outlived their readers"
    )
