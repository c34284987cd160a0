"""The write path: ShardStream (the one serialiser), the DurableShardWriter in each of its modes,
the WriteBehind thread's ordering, error handling and byte budget, and produce_cache through all of it.

Every comparison is against another way to write the same shard (whole, in other pieces, through
another writer mode or loop) and against safetensors' own ``save_file``.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import tempfile
import threading
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from _offline_cache_support import write_shard_file
from crash_test import IndexDataset
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, default_collate

from te_thd.offline_cache import (
    DurableShardWriter,
    SchemaError,
    produce_cache,
    read_manifest,
    verify_cache,
    write_cache_shards,
)
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.lengths import LengthRule
from te_thd.offline_cache.format.schema import TensorSpec, shard_path
from te_thd.offline_cache.write.loops import lockstep_write
from te_thd.offline_cache.write.shardfile import ShardStream
from te_thd.offline_cache.record.run import ShardRecord
from te_thd.offline_cache.write.writer import WriteBehind, write_tensor_shard

LOG = logging.getLogger("test_offline_cache_stream")
DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.bool)
WAIT = 10.0  # seconds a test waits for the writer thread before failing (never hit when it works)


def _temps(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(".") and n.endswith(".tmp"))


def _rand(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(torch.uint8)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


# -- ShardStream -------------------------------------------------------------------------


@st.composite
def _shards(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[int]]:
    keys = draw(
        st.lists(
            st.sampled_from(["a", "b", "input_ids", "hidden", "z"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    rows = draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tensors = {}
    for k in keys:
        dtype = draw(st.sampled_from(DTYPES))
        trailing = tuple(
            draw(st.lists(st.integers(0, 3), max_size=2))
        )  # a 0 in it: zero-width rows
        tensors[k] = _rand(dtype, (rows, *trailing), g)
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1)) if rows > 1 else set())
    return tensors, [0, *cuts, rows]


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {k: TensorSpec(t.dtype, tuple(t.shape[1:])) for k, t in tensors.items()}


def _stream(path: str, tensors: dict[str, torch.Tensor], bounds: list[int]) -> ShardRecord:
    rows = bounds[-1]
    s = ShardStream(path, _specs(tensors), rows)
    for lo, hi in pairwise(bounds):
        s.write({k: t[lo:hi] for k, t in tensors.items()})
    return s.finish()


@given(shard=_shards())
@settings(max_examples=80)
def test_shard_stream_writes_the_bytes_of_write_shard_file(shard) -> None:
    tensors, bounds = shard
    with tempfile.TemporaryDirectory() as d:
        streamed, whole = os.path.join(d, "streamed"), os.path.join(d, "whole")
        rec = _stream(streamed, tensors, bounds)
        assert rec == write_shard_file(whole, tensors)
        data = Path(streamed).read_bytes()
        assert data == Path(whole).read_bytes()
        sums = read_shard_header(streamed).sums
        assert (
            sums is not None and rec.bytes == len(data) and rec.checksum == f"xxh3_64:{sums.digest}"
        )
        back = load_file(streamed)
        assert back.keys() == tensors.keys()
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and torch.equal(back[k], t)
        # and so the bytes of safetensors' own save_file, given the same metadata
        with safe_open(streamed, "pt") as f:
            meta = f.metadata()
        plain = os.path.join(d, "plain")
        save_file(tensors, plain, metadata=meta)
        assert Path(plain).read_bytes() == data


def test_shard_stream_zero_width_key_and_uneven_pieces(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"empty": torch.zeros(7, 0, dtype=torch.bfloat16), "ids": _rand(torch.int64, (7, 3), g),
               "mask": _rand(torch.bool, (7, 2, 0), g), "h": _rand(torch.float32, (7, 5), g)}  # fmt: skip
    rec = _stream(str(tmp_path / "s"), tensors, [0, 1, 6, 7])
    assert rec == write_shard_file(str(tmp_path / "w"), tensors)
    assert (tmp_path / "s").read_bytes() == (tmp_path / "w").read_bytes()
    assert verify_shard_loads(tmp_path / "s", tensors)


def verify_shard_loads(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    back = load_file(str(path))
    return back.keys() == tensors.keys() and all(
        torch.equal(back[k], t) for k, t in tensors.items()
    )


def _two_keys(rows: int = 4) -> dict[str, torch.Tensor]:
    return {
        "a": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3),
        "b": torch.arange(rows),
    }


def test_the_writer_checks_each_piece_once_and_stays_usable(tmp_path: Path) -> None:
    """Pieces are checked at the writer's boundary (the stream trusts it): a rejected piece names
    the key and queues nothing, so the shard completes as if it never came."""
    t = _two_keys()
    d = str(tmp_path / "d")
    with DurableShardWriter(("a", "b"), schema=_specs(t), pipelined=False) as w:
        with pytest.raises(
            SchemaError,
            match=r"key 'a' is float64\[n, 3\] but the cache schema says float32\[n, 3\]",
        ):
            w.write_piece(d, 0, 4, {"a": t["a"][:2].double(), "b": t["b"][:2]})
        with pytest.raises(
            SchemaError,
            match=r"key 'a' is float32\[n, 4\] but the cache schema says float32\[n, 3\]",
        ):
            w.write_piece(d, 0, 4, {"a": torch.zeros(2, 4), "b": t["b"][:2]})
        with pytest.raises(
            SchemaError,
            match=r"key 'b' has 1 samples on dim 0 but 'a' has 2; every key must hold one row per sample",
        ):
            w.write_piece(d, 0, 4, {"a": t["a"][:2], "b": t["b"][:1]})
        w.write_piece(d, 0, 4, {"a": t["a"][:3], "b": t["b"][:3]})
        with pytest.raises(ValueError, match=r"shard 0 holds 4 rows; 2 more after 3 overflow it"):
            w.write_piece(d, 0, 4, {"a": t["a"][:2], "b": t["b"][:2]})
        w.write_piece(d, 0, 4, {"a": t["a"][3:], "b": t["b"][3:]})
        w.finish_shard(d, 0)
    s = ShardStream(str(tmp_path / "s"), _specs(t), 4)
    s.write({"a": t["a"][:3], "b": t["b"][:3]})
    with pytest.raises(ValueError, match=r"got 3 of its 4 rows; write the rest first"):
        s.finish()
    s.write({"a": t["a"][3:], "b": t["b"][3:]})
    rec = s.finish()
    assert rec == write_shard_file(str(tmp_path / "w"), t)
    assert (tmp_path / "s").read_bytes() == (tmp_path / "w").read_bytes()
    assert (tmp_path / "d" / "shard-000000.safetensors").read_bytes() == (
        tmp_path / "w"
    ).read_bytes()
    with pytest.raises(ValueError, match=r"is closed; start a new one"):
        s.write({"a": t["a"][:1], "b": t["b"][:1]})
    with pytest.raises(ValueError, match=r"is closed"):
        s.finish()


def test_shard_stream_rows_must_be_an_int_and_the_file_new(tmp_path: Path) -> None:
    for rows in (-1, True, 2.0):
        with pytest.raises(ValueError, match=rf"rows={rows!r} must be an int >= 0"):
            ShardStream(str(tmp_path / "s"), _specs(_two_keys()), rows)
    assert os.listdir(tmp_path) == []
    empty = ShardStream(str(tmp_path / "empty"), _specs(_two_keys()), 0)  # an empty shard is valid
    empty.write({k: v[:0] for k, v in _two_keys().items()})
    empty.finish()
    assert verify_shard_loads(tmp_path / "empty", {k: v[:0] for k, v in _two_keys().items()})
    os.unlink(tmp_path / "empty")
    (tmp_path / "s").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        ShardStream(str(tmp_path / "s"), _specs(_two_keys()), 4)


def test_shard_stream_abort_removes_the_file(tmp_path: Path) -> None:
    t = _two_keys()
    fresh = ShardStream(str(tmp_path / "fresh"), _specs(t), 4)
    assert (tmp_path / "fresh").exists()
    fresh.abort()
    written = ShardStream(str(tmp_path / "written"), _specs(t), 4)
    written.write({k: v[:2] for k, v in t.items()})
    assert (tmp_path / "written").stat().st_size > 0
    written.abort()
    written.abort()  # twice: a no-op
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="is closed"):
        written.write({k: v[2:] for k, v in t.items()})


# -- DurableShardWriter, streaming ------------------------------------------------------


def _ids_shard(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (rows, 6), generator=g)
    keep = torch.randint(0, 7, (rows,), generator=g)  # non-padding length of each row
    ids[torch.arange(6)[None, :] >= keep[:, None]] = 0
    return {"hidden": torch.randn(rows, 4, generator=g).to(torch.bfloat16), "input_ids": ids}


def _expected_lengths(ids: torch.Tensor) -> tuple[int, ...]:
    return tuple(
        int(max((j + 1 for j in range(ids.shape[1]) if row[j] != 0), default=0)) for row in ids
    )


@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 10**6),
       data=st.data(), with_rule=st.booleans())  # fmt: skip
@settings(max_examples=12)
def test_streamed_shards_equal_whole_shards(
    sizes: list[int], seed: int, data: st.DataObject, with_rule: bool
) -> None:
    keys = ("hidden", "input_ids")
    rule = LengthRule("input_ids") if with_rule else None
    shards = [_ids_shard(n, seed + i) for i, n in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as d:
        sd, wd = Path(d, "streamed"), Path(d, "whole")
        with DurableShardWriter(keys, length_rule=rule, write_behind=True) as streamed:
            for i, sh in enumerate(shards):
                n = sizes[i]
                cuts = sorted(
                    data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set()
                )
                for lo, hi in pairwise([0, *cuts, n]):
                    streamed.write_piece(str(sd), i, n, {k: v[lo:hi] for k, v in sh.items()})
                assert streamed.finish_shard(str(sd), i) == shard_path(str(sd), i)
            streamed.flush()
            s_fields = streamed.manifest_fields(str(sd))
        with DurableShardWriter(keys, length_rule=rule) as whole:
            for i, sh in enumerate(shards):
                whole(str(wd), i, sh)
            whole.flush()
            w_fields = whole.manifest_fields(str(wd))
        assert streamed.records == whole.records and s_fields == w_fields
        assert (
            sorted(os.listdir(sd))
            == sorted(os.listdir(wd))
            == [f"shard-{i:06d}.safetensors" for i in range(len(sizes))]
        )
        for name in os.listdir(sd):
            assert (sd / name).read_bytes() == (wd / name).read_bytes()
        for i, sh in enumerate(shards):
            assert streamed.records[i].lengths == (
                _expected_lengths(sh["input_ids"]) if with_rule else None
            )
        if with_rule:
            assert s_fields["length_rule"] == {
                "key": "input_ids",
                "kind": "last_nonpad",
                "pad_token_id": 0,
            }


def test_every_writer_mode_streams_the_same_shard(tmp_path: Path) -> None:
    """write_piece + finish_shard on the caller's thread, with background commits, and behind the
    caller all write the bytes of a whole-shard call and of the reference write_tensor_shard."""
    t = _two_keys(5)
    write_tensor_shard(str(tmp_path / "ref"), 0, {**t, "extra": torch.zeros(5)}, ("a", "b"), "test")
    want = (tmp_path / "ref" / "shard-000000.safetensors").read_bytes()
    for i, kw in enumerate(({"pipelined": False}, {}, {"write_behind": True})):
        d = tmp_path / f"mode{i}"
        with DurableShardWriter(("a", "b"), **kw) as w:
            w.write_piece(str(d), 0, 5, {k: v[:2] for k, v in t.items()})
            w.write_piece(str(d), 0, 5, {k: v[2:] for k, v in t.items()})
            w.finish_shard(str(d), 0)
            w(str(d), 1, t)
            w.flush()
        assert (
            (d / "shard-000000.safetensors").read_bytes()
            == want
            == (d / "shard-000001.safetensors").read_bytes()
        )
        assert w.records[0] == w.records[1] and _temps(d) == []


def test_streaming_writer_rejects_bad_calls_before_queuing(tmp_path: Path) -> None:
    t = _two_keys(4)
    d = str(tmp_path)
    with DurableShardWriter(("a", "b"), write_behind=True) as w:
        with pytest.raises(ValueError, match=r"shard 7 has no pieces; call write_piece first"):
            w.finish_shard(d, 7)
        for bad in (0, -1, True, 2.0):
            with pytest.raises(
                ValueError,
                match=r"rows=.* must be an int >= 1: the number of rows shard 0 will hold",
            ):
                w.write_piece(d, 0, bad, {k: v[:1] for k, v in t.items()})
        # a first piece that overflows its shard does not open it: a retry with the right rows works
        with pytest.raises(ValueError, match=r"shard 0 holds 1 rows; 2 more after 0 overflow it"):
            w.write_piece(d, 0, 1, {k: v[:2] for k, v in t.items()})
        w.write_piece(d, 0, 4, {k: v[:2] for k, v in t.items()})
        with pytest.raises(ValueError, match=r"shard 0 got 2 of its 4 rows; queue the rest first"):
            w.finish_shard(d, 0)
        with pytest.raises(ValueError, match=r"shard 0 was started with rows=4, not 5"):
            w.write_piece(d, 0, 5, {k: v[2:3] for k, v in t.items()})
        with pytest.raises(ValueError, match=r"shard 0 holds 4 rows; 3 more after 2 overflow it"):
            w.write_piece(d, 0, 4, {k: v[:3] for k, v in t.items()})
        # none of the refused calls queued anything: the shard completes as if they never happened
        w.write_piece(d, 0, 4, {k: v[2:] for k, v in t.items()})
        w.finish_shard(d, 0)
        with pytest.raises(ValueError, match=r"shard 0 has no pieces"):
            w.finish_shard(d, 0)  # finished: no longer open
    write_shard_file(str(tmp_path / "ref"), t)
    assert (tmp_path / "shard-000000.safetensors").read_bytes() == (tmp_path / "ref").read_bytes()
    sums = read_shard_header(str(tmp_path / "ref")).sums
    assert sums is not None and w.records[0] == ShardRecord(
        os.path.getsize(tmp_path / "ref"), f"xxh3_64:{sums.digest}"
    )


def test_close_removes_an_unfinished_streamed_shard(tmp_path: Path) -> None:
    t = _two_keys(4)
    w = DurableShardWriter(("a", "b"), write_behind=True)
    w.write_piece(str(tmp_path), 0, 2, {k: v[:2] for k, v in t.items()})
    w.finish_shard(str(tmp_path), 0)
    w.write_piece(str(tmp_path), 1, 2, {k: v[2:3] for k, v in t.items()})
    w.flush()
    assert len(_temps(tmp_path)) == 1  # shard 1's temp file, half written
    w.close()
    assert os.listdir(tmp_path) == ["shard-000000.safetensors"]


def test_close_removes_an_unfinished_shard_never_written(tmp_path: Path) -> None:
    w = DurableShardWriter(("a", "b"), write_behind=True)
    gate = threading.Event()
    w._thread.submit(gate.wait)  # the thread is busy: the piece below is still queued at close
    w.write_piece(str(tmp_path), 0, 4, {k: v[:1] for k, v in _two_keys().items()})
    threading.Timer(0.1, gate.set).start()
    w.close()
    assert os.listdir(tmp_path) == []


def _piece_mb(rows: int) -> dict[str, torch.Tensor]:
    return {"a": torch.ones(rows, 1 << 16, dtype=torch.float32)}  # 256 KiB a row


def test_a_write_error_on_the_thread_is_raised_and_leaves_no_temp_file(tmp_path: Path) -> None:
    """A real EFBIG: the file size limit lets the first piece in, not the second."""
    assert (
        signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    )  # Python ignores it: pwrite fails instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    w = DurableShardWriter(("a",), write_behind=True)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, hard))
        w.write_piece(str(tmp_path), 0, 4, _piece_mb(1))
        w.write_piece(str(tmp_path), 0, 4, _piece_mb(3))
        w.finish_shard(str(tmp_path), 0)
        with pytest.raises(OSError) as info:
            w.flush()
        assert info.value.errno == errno.EFBIG
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with pytest.raises(OSError) as later:
        w.write_piece(str(tmp_path), 1, 4, _piece_mb(1))  # every later call raises it too
    assert later.value is info.value
    with pytest.raises(OSError) as at_close:
        w.close()
    assert at_close.value is info.value
    assert os.listdir(tmp_path) == [] and w.records == {}


def _flush_errors(flush: Callable[[], None]) -> list[BaseException] | None:
    """Run ``flush`` on a thread: the errors it raised, or ``None`` if it still waits after WAIT s."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            flush()
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(WAIT)
    return None if th.is_alive() else errors


def test_a_shard_dir_that_is_a_file_raises_and_does_not_hang_the_writer(tmp_path: Path) -> None:
    """Regression: the dropped pieces' clean-up raised on the thread (NotADirectoryError), ended it,
    and the next flush() waited forever."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    t = _two_keys(4)
    w = DurableShardWriter(("a", "b"), write_behind=True)
    gate = threading.Event()
    w._thread.submit(gate.wait)  # queue all of the shard before its first piece fails
    w.write_piece(str(not_a_dir), 0, 4, {k: v[:2] for k, v in t.items()})
    w.write_piece(str(not_a_dir), 0, 4, {k: v[2:] for k, v in t.items()})
    w.finish_shard(str(not_a_dir), 0)
    gate.set()
    errors = _flush_errors(w.flush)
    assert errors is not None, "flush() hangs: the writer thread died"
    assert len(errors) == 1 and isinstance(
        errors[0], FileExistsError
    )  # makedirs of the shard's directory
    with pytest.raises(FileExistsError):
        w.close()
    assert os.listdir(tmp_path) == ["file"]


def test_close_after_a_write_error_removes_every_open_stream(tmp_path: Path) -> None:
    """Regression: shard 0's stream was open (half written) when shard 1 failed; close() left its
    temp file (and its descriptor) behind."""
    good = tmp_path / "good"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    t = _two_keys(4)
    w = DurableShardWriter(("a", "b"), write_behind=True)
    w.write_piece(str(good), 0, 4, {k: v[:2] for k, v in t.items()})
    w.flush()
    assert len(_temps(good)) == 1
    fds = len(os.listdir("/proc/self/fd"))
    w.write_piece(str(not_a_dir), 1, 4, {k: v[:2] for k, v in t.items()})
    with pytest.raises(FileExistsError):
        w.flush()
    with pytest.raises(FileExistsError):
        w.close()
    assert os.listdir(good) == []
    assert len(os.listdir("/proc/self/fd")) == fds - 1  # shard 0's descriptor closed


# -- WriteBehind --------------------------------------------------------------------------


def test_write_behind_runs_jobs_in_order_on_its_own_named_thread() -> None:
    log: list[str] = []
    with WriteBehind() as c:
        for i in range(5):
            c.submit(lambda i=i: log.append(f"{i} on {threading.current_thread().name}"))
        c.flush()
        assert log == [f"{i} on te_thd-write-behind" for i in range(5)]
        assert c.running
    assert not c.running


def test_write_behind_drops_every_job_after_a_failure() -> None:
    log: list[str] = []
    gate = threading.Event()

    def fails() -> None:
        gate.wait(WAIT)
        raise RuntimeError("disk on fire")

    c = WriteBehind()
    c.submit(lambda: log.append("ran 1"))
    c.submit(fails, on_drop=lambda: log.append("dropped: fails"))
    c.submit(lambda: log.append("ran 3"), on_drop=lambda: log.append("dropped 3"))
    c.submit(lambda: log.append("ran 4"))  # no on_drop: dropped silently
    gate.set()
    with pytest.raises(RuntimeError, match="disk on fire"):
        c.flush()
    assert log == ["ran 1", "dropped 3"]
    with pytest.raises(RuntimeError, match="disk on fire"):
        c.submit(lambda: log.append("late"))
    with pytest.raises(RuntimeError, match="disk on fire"):
        c.close()
    assert log == ["ran 1", "dropped 3"] and not c.running


def test_a_failing_clean_up_of_a_dropped_job_does_not_end_the_thread() -> None:
    """A dropped job's on_drop that raises is ignored: the thread keeps draining the queue, so
    flush() returns (with the first error) instead of waiting forever."""
    log: list[str] = []

    def bad_clean_up() -> None:
        log.append("clean-up raised")
        raise OSError("clean-up failed")

    c = WriteBehind()
    c.submit(lambda: (_ for _ in ()).throw(RuntimeError("first error")))
    c.submit(lambda: None, on_drop=bad_clean_up)
    c.submit(lambda: None, on_drop=lambda: log.append("dropped after"))
    errors = _flush_errors(c.flush)
    assert errors is not None, "flush() hung: the writer thread ended on the clean-up's error"
    assert [str(e) for e in errors] == ["first error"]
    assert log == ["clean-up raised", "dropped after"] and c.running
    with pytest.raises(RuntimeError, match="first error"):
        c.close()


def _submit_in_thread(c: WriteBehind, nbytes: int) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def go() -> None:
        try:
            c.submit(lambda: None, nbytes=nbytes)
            out.append("returned")
        except BaseException as exc:
            out.append(exc)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th, out


def test_write_behind_byte_budget_blocks_a_submit_until_memory_is_released() -> None:
    gate, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(WAIT)

    c = WriteBehind(max_pending_bytes=100)
    try:
        c.submit(hold, nbytes=60)
        assert started.wait(WAIT)
        c.submit(lambda: None, nbytes=40)  # 60 + 40 = 100 fits: returns at once
        th, out = _submit_in_thread(c, 1)  # 101 does not
        th.join(0.3)
        assert th.is_alive() and out == [], "a submit over the byte budget must wait"
        gate.set()
        th.join(WAIT)
        assert out == ["returned"]
        c.flush()
    finally:
        gate.set()
        c.close()


def test_write_behind_budget_wait_ends_with_the_thread_error() -> None:
    gate = threading.Event()

    def fails() -> None:
        gate.wait(WAIT)
        raise RuntimeError("write failed")

    c = WriteBehind(max_pending_bytes=100)
    c.submit(fails, nbytes=80)
    th, out = _submit_in_thread(c, 80)
    th.join(0.3)
    assert th.is_alive()
    gate.set()
    th.join(WAIT)
    assert len(out) == 1 and isinstance(out[0], RuntimeError) and str(out[0]) == "write failed"
    with pytest.raises(RuntimeError, match="write failed"):
        c.close()


def test_write_behind_runs_a_job_larger_than_the_budget_alone() -> None:
    ran: list[int] = []
    c = WriteBehind(max_pending_bytes=10)
    try:
        for i in (1, 2):  # the second waits for the first, then runs alone
            th, out = _submit_in_thread(c, 1000)
            th.join(WAIT)
            assert out == ["returned"], (
                "a job over the budget must run when nothing else is pending"
            )
            ran.append(i)
        c.flush()
    finally:
        c.close()
    assert ran == [1, 2]


def test_write_behind_thread_ends_with_its_owner_and_is_a_daemon() -> None:
    """Dropped without close(), the writer's thread still ends: it holds no reference to its owner."""
    import gc

    c = WriteBehind()
    c.submit(lambda: None)
    c.flush()
    thread = c._thread
    assert thread.daemon and thread.name == "te_thd-write-behind"
    del c
    gc.collect()
    thread.join(WAIT)
    assert not thread.is_alive()


def test_a_closed_write_behind_refuses_work() -> None:
    c = WriteBehind()
    c.close()
    with pytest.raises(RuntimeError, match="this write-behind writer is closed; create a new one"):
        c.submit(lambda: None)


# -- the accumulator and produce_cache ---------------------------------------------------

KEYS = ("hidden", "input_ids")


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    idx = batch["idx"]
    ids = idx[:, None] * 10 + torch.arange(1, 5)
    ids[torch.arange(4)[None, :] >= (idx % 5)[:, None]] = 0  # lengths 0..4
    return {"hidden": idx[:, None].float() * torch.ones(1, 3) + 0.5, "input_ids": ids, "extra": idx}


def _produce(
    out: Path, n: int, shard_size: int, batch_size: int, compute=_compute, collate_fn=None, **kw
):
    loader = DataLoader(IndexDataset(n), batch_size=batch_size, collate_fn=collate_fn)
    return produce_cache(
        loader, str(out), shard_size, compute, KEYS, {"cp_size": 1}, progress=False, **kw
    )


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


class _CountingWriter(DurableShardWriter):
    """A real write-behind writer that counts the streaming calls it gets and the batches it checks."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.pieces = self.whole = self.checked = 0

    def validate(self, *a, **kw):
        self.checked += 1
        return super().validate(*a, **kw)

    def queue(self, *a, **kw) -> None:
        self.pieces += 1
        super().queue(*a, **kw)

    def __call__(self, *a, **kw) -> str:
        self.whole += 1
        return super().__call__(*a, **kw)


@pytest.mark.parametrize(
    ("n", "shard_size", "batch_size"), [(11, 4, 3), (8, 4, 2), (5, 8, 2), (9, 2, 4)]
)
def test_streaming_output_equals_the_non_streaming_path(
    tmp_path: Path, n: int, shard_size: int, batch_size: int
) -> None:
    default = _produce(tmp_path / "default", n, shard_size, batch_size)
    assert verify_cache(str(tmp_path / "default"), deep=True)["checksums_verified"]

    # the reference loop (the accumulator's buffering path, the run's length unknown): writers are
    # handed each full shard's batches as pieces, any other write_shard_fn the joined shard
    shards = {k: v for k, v in _bytes(tmp_path / "default").items() if k.startswith("shard-")}
    run = read_shard_header(
        str(tmp_path / "default" / "shard-000000.safetensors")
    ).sums.run  # produce_cache's record
    for write_behind in (True, False):
        ref = tmp_path / f"ref-{write_behind}"
        with _CountingWriter(
            KEYS, length_rule=LengthRule("input_ids"), write_behind=write_behind, run_record=run
        ) as w:
            loader = DataLoader(IndexDataset(n), batch_size=batch_size)
            write_cache_shards(loader, str(ref), shard_size, 0, _compute, w, LOG)
            w.flush()
            fields = w.manifest_fields(str(ref))
        assert w.whole == 0 and w.pieces >= -(-n // shard_size)
        assert w.checked == -(-n // batch_size)  # each batch checked once, at the writer's boundary
        assert shards == _bytes(ref)
        assert {
            k: default[k] for k in fields
        } == fields  # schema, shards (bytes, checksum, lengths), length_rule
    plain, joined = (
        tmp_path / "ref-plain",
        tmp_path / "ref-fn",
    )  # without a run record: write_tensor_shard's bytes
    with _CountingWriter(KEYS, length_rule=LengthRule("input_ids")) as w:
        write_cache_shards(
            DataLoader(IndexDataset(n), batch_size=batch_size),
            str(plain),
            shard_size,
            0,
            _compute,
            w,
            LOG,
        )
    write_cache_shards(DataLoader(IndexDataset(n), batch_size=batch_size), str(joined), shard_size, 0, _compute,
                       lambda d, i, t: write_tensor_shard(d, i, t, KEYS, "test"), LOG)  # fmt: skip
    assert _bytes(plain) == _bytes(joined)
    lengths = [x for s in default["shards"] for x in s["lengths"]]
    assert lengths == [i % 5 for i in range(n)]

    # lockstep_write with total_samples: the streaming path, piece by piece
    streamed = tmp_path / "streamed"
    with _CountingWriter(
        KEYS, length_rule=LengthRule("input_ids"), write_behind=True, run_record=run
    ) as w:
        lockstep_write(DataLoader(IndexDataset(n), batch_size=batch_size), str(streamed), shard_size,
                       [(0, 0, n)], _compute, w, LOG)  # fmt: skip
        w.flush()
        assert w.manifest_fields(str(streamed)) == fields
    assert w.whole == 0 and w.pieces >= -(-n // batch_size) and w.checked == -(-n // batch_size)
    assert _bytes(streamed) == shards


def test_compute_error_mid_shard_leaves_no_temp_file_and_resume_is_identical(
    tmp_path: Path,
) -> None:
    _produce(tmp_path / "whole", 11, 4, 3)
    calls = {"n": 0}

    def dies(batch):
        calls["n"] += 1
        if calls["n"] == 3:  # batch [6, 7, 8]: shard 1 holds rows 4, 5 by now
            raise RuntimeError("compute died")
        return _compute(batch)

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="compute died"):
        _produce(out, 11, 4, 3, compute=dies)
    assert _temps(out) == []
    assert [p for p in os.listdir(out) if p.startswith("shard-")] == ["shard-000000.safetensors"]
    _produce(out, 11, 4, 3)
    assert _bytes(out) == _bytes(tmp_path / "whole")
    assert read_manifest(str(out), "offline", 1)["num_samples"] == 11


def test_a_dataloader_short_of_its_dataset_is_refused(tmp_path: Path) -> None:
    def drop_one(rows):  # drops the last row of every full batch
        return default_collate(rows[:-1] if len(rows) > 1 else rows)

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^compute_batch returned 2 rows for a batch of 3 samples \(0\.\.2 of the "
                                         r"dataset\): it must return one row per sample of its batch, in order, as "
                                         r"must the loader's collate_fn \(shards are cut by sample index\)$"):  # fmt: skip
        _produce(out, 10, 4, 3, collate_fn=drop_one)
    assert _temps(out) == [] and "manifest.json" not in os.listdir(out)


def test_a_compute_batch_short_of_its_batch_is_named_with_the_counts(tmp_path: Path) -> None:
    """Not blamed on the dataloader: the message names compute_batch, the batch's samples and the rows."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^compute_batch returned 2 rows for a batch of 3 samples \(3\.\.5 of the "
                                         r"dataset\): it must return one row per sample"):  # fmt: skip
        _produce(out, 10, 4, 3, compute=lambda b: {k: v[:2] if int(b["idx"][0]) == 3 else v
                                                   for k, v in _compute(b).items()})  # fmt: skip
    assert _temps(out) == [] and "manifest.json" not in os.listdir(out)


def test_a_dataloader_beyond_its_dataset_is_refused(tmp_path: Path) -> None:
    def repeat_one(rows):
        return default_collate(rows + rows[:1])

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^compute_batch returned 4 rows for a batch of 3 samples \(0\.\.2 of the "
                                         r"dataset\)"):  # fmt: skip
        _produce(out, 6, 4, 3, collate_fn=repeat_one)
    assert _temps(out) == [] and "manifest.json" not in os.listdir(out)


def test_an_accumulator_given_more_or_fewer_rows_than_its_run_names_the_loader(
    tmp_path: Path,
) -> None:
    """Driven directly (the producer's own loops name a short batch first): rows past the run's
    samples, and a run that ends short of its last shard, each end with the same sentence."""
    from te_thd.offline_cache.write.loops import ShardAccumulator

    rows = {"a": torch.arange(3, dtype=torch.float32).unsqueeze(1)}
    one_pass = (
        r"Shards are cut by sample index, so a producer's loader must yield each sample of its "
        r"dataset once, in order\.$"
    )
    more = (
        r"^compute_batch returned 1 rows beyond the 2 samples of this run: the dataloader yields "
        r"more samples than its dataset holds, e\.g\. a collate_fn or sampler that adds samples\. "
    )
    fewer = (
        r"^the run ended with 3 of shard 0's 4 rows: the dataloader yielded fewer samples than "
        r"its dataset holds \(e\.g\. drop_last, or a collate_fn that drops samples\)\. "
    )
    with DurableShardWriter(("a",), pipelined=False) as writer:
        acc = ShardAccumulator(str(tmp_path / "more"), 4, 0, writer, LOG, total_samples=2)
        with pytest.raises(RuntimeError, match=more + one_pass):
            acc.add_batch(rows)
        acc = ShardAccumulator(str(tmp_path / "fewer"), 4, 0, writer, LOG, total_samples=6)
        acc.add_batch(rows)
        with pytest.raises(RuntimeError, match=fewer + one_pass):
            acc.finalize()
