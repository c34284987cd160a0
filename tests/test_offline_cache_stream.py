"""The streaming producer path: CRC-32 combine, ShardStream, the streaming DurableShardWriter,
the BackgroundCommitter's task jobs and byte budget, and produce_cache through all of it.

Every comparison is against the non-streaming writer (``write_shard_pieces``, a whole-shard
``DurableShardWriter``, ``write_cache_shards``) or against zlib / safetensors themselves.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import tempfile
import threading
import zlib
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from crash_test import IndexDataset
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, default_collate

from te_thd.offline_cache import (
    DurableShardWriter,
    produce_cache,
    read_manifest,
    verify_cache,
    write_cache_shards,
)
from te_thd.offline_cache import crc as crcmod
from te_thd.offline_cache.durable import TEMP_RE, BackgroundCommitter, start_writeback
from te_thd.offline_cache.format import TensorSpec, shard_path
from te_thd.offline_cache.lengths import LengthRule
from te_thd.offline_cache.loops import lockstep_write
from te_thd.offline_cache.shardfile import ShardRecord, format_checksum, write_shard_pieces
from te_thd.offline_cache.shardstream import ShardStream

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


# -- crc ---------------------------------------------------------------------------------


@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000))
@settings(max_examples=150)
def test_crc32_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    ca, cb = crcmod.crc32(a), crcmod.crc32(b)
    assert ca == zlib.crc32(a) and cb == zlib.crc32(b)
    want = zlib.crc32(a + b)
    assert crcmod.py_crc32_combine(ca, cb, len(b)) == want
    assert crcmod.crc32_combine(ca, cb, len(b)) == want


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 2**40))
@settings(max_examples=60)
def test_py_crc32_combine_matches_the_fast_one_at_any_length(seed: int, n: int) -> None:
    assert crcmod.py_crc32_combine(seed, seed ^ 0x5A5A5A5A, n) == crcmod.crc32_combine(seed, seed ^ 0x5A5A5A5A, n)


def test_crc32_combine_long_block_and_zero_length() -> None:
    a, zeros = b"te_thd shard header", bytes(300_000)
    assert crcmod.py_crc32_combine(zlib.crc32(a), zlib.crc32(zeros), len(zeros)) == zlib.crc32(a + zeros)
    for c in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert crcmod.py_crc32_combine(c, 0, 0) == c  # crc32(b"") == 0: appending nothing
        assert crcmod.crc32_combine(c, 0, 0) == c


def test_crc32_combine_rejects_a_negative_length() -> None:
    with pytest.raises(ValueError, match=r"len2=-1 must be >= 0"):
        crcmod.py_crc32_combine(0, 0, -1)


def test_crc_uses_isal_where_it_is_installed() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert crcmod.crc32 is isal_zlib.crc32 and crcmod.crc32_combine is isal_zlib.crc32_combine


# -- ShardStream -------------------------------------------------------------------------


@st.composite
def _shards(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[int]]:
    keys = draw(st.lists(st.sampled_from(["a", "b", "input_ids", "hidden", "z"]), min_size=1, max_size=3, unique=True))
    rows = draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tensors = {}
    for k in keys:
        dtype = draw(st.sampled_from(DTYPES))
        trailing = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))  # a 0 in it: zero-width rows
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
        assert s.rows_written == hi
    return s.finish()


@given(shard=_shards())
@settings(max_examples=80)
def test_shard_stream_writes_the_bytes_of_write_shard_pieces(shard) -> None:
    tensors, bounds = shard
    with tempfile.TemporaryDirectory() as d:
        streamed, whole = os.path.join(d, "streamed"), os.path.join(d, "whole")
        rec = _stream(streamed, tensors, bounds)
        assert rec == write_shard_pieces(whole, {k: [t] for k, t in tensors.items()})
        data = Path(streamed).read_bytes()
        assert data == Path(whole).read_bytes()
        assert rec.bytes == len(data) and rec.checksum == format_checksum(zlib.crc32(data))
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
    assert rec == write_shard_pieces(str(tmp_path / "w"), {k: [t[:3], t[3:]] for k, t in tensors.items()})
    assert (tmp_path / "s").read_bytes() == (tmp_path / "w").read_bytes()
    assert verify_shard_loads(tmp_path / "s", tensors)


def verify_shard_loads(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    back = load_file(str(path))
    return back.keys() == tensors.keys() and all(torch.equal(back[k], t) for k, t in tensors.items())


def _two_keys(rows: int = 4) -> dict[str, torch.Tensor]:
    return {"a": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3), "b": torch.arange(rows)}


def test_shard_stream_rejects_bad_pieces_naming_the_key_and_stays_usable(tmp_path: Path) -> None:
    t = _two_keys()
    s = ShardStream(str(tmp_path / "s"), _specs(t), 4)
    with pytest.raises(ValueError, match=r"key 'a' is float64\[2, 3\], the shard holds float32\[n, 3\] rows"):
        s.write({"a": t["a"][:2].double(), "b": t["b"][:2]})
    with pytest.raises(ValueError, match=r"key 'a' is float32\[2, 4\], the shard holds float32\[n, 3\] rows"):
        s.write({"a": torch.zeros(2, 4), "b": t["b"][:2]})
    # row counts are compared across keys first, naming every key's count
    with pytest.raises(ValueError, match=r"its keys hold different row counts \{'b': 1, 'a': 2\}; every key holds the same rows"):
        s.write({"a": t["a"][:2], "b": t["b"][:1]})
    assert s.rows_written == 0  # a rejected piece writes nothing
    s.write({"a": t["a"][:3], "b": t["b"][:3]})
    with pytest.raises(ValueError, match=r"2 rows after 3 overflow the shard's 4 rows"):
        s.write({"a": t["a"][:2], "b": t["b"][:2]})
    with pytest.raises(ValueError, match=r"got 3 of its 4 rows; write the rest first"):
        s.finish()
    s.write({"a": t["a"][3:], "b": t["b"][3:]})
    rec = s.finish()
    assert rec == write_shard_pieces(str(tmp_path / "w"), {k: [v] for k, v in t.items()})
    assert (tmp_path / "s").read_bytes() == (tmp_path / "w").read_bytes()
    with pytest.raises(ValueError, match=r"is closed; start a new one"):
        s.write({"a": t["a"][:1], "b": t["b"][:1]})
    with pytest.raises(ValueError, match=r"is closed"):
        s.finish()


def test_shard_stream_rows_must_be_positive_and_the_file_new(tmp_path: Path) -> None:
    for rows in (0, -1):
        with pytest.raises(ValueError, match=rf"rows={rows} must be >= 1"):
            ShardStream(str(tmp_path / "s"), _specs(_two_keys()), rows)
    assert os.listdir(tmp_path) == []
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
    return tuple(int(max((j + 1 for j in range(ids.shape[1]) if row[j] != 0), default=0)) for row in ids)


@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 10**6),
       data=st.data(), with_rule=st.booleans())  # fmt: skip
@settings(max_examples=12)
def test_streamed_shards_equal_whole_shards(sizes: list[int], seed: int, data: st.DataObject, with_rule: bool) -> None:
    keys = ("hidden", "input_ids")
    rule = LengthRule("input_ids") if with_rule else None
    shards = [_ids_shard(n, seed + i) for i, n in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as d:
        sd, wd = Path(d, "streamed"), Path(d, "whole")
        with DurableShardWriter(keys, length_rule=rule, write_behind=True) as streamed:
            assert streamed.takes_stream
            for i, sh in enumerate(shards):
                n = sizes[i]
                cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set())
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
        assert sorted(os.listdir(sd)) == sorted(os.listdir(wd)) == [f"shard-{i:06d}.safetensors" for i in range(len(sizes))]
        for name in os.listdir(sd):
            assert (sd / name).read_bytes() == (wd / name).read_bytes()
        for i, sh in enumerate(shards):
            assert streamed.records[i].lengths == (_expected_lengths(sh["input_ids"]) if with_rule else None)
        if with_rule:
            assert s_fields["length_rule"] == {"key": "input_ids", "kind": "last_nonpad", "pad_token_id": 0}


def test_write_piece_needs_a_write_behind_writer(tmp_path: Path) -> None:
    for kw in ({}, {"pipelined": False}):
        with DurableShardWriter(("a", "b"), **kw) as w:
            assert not w.takes_stream
            with pytest.raises(ValueError, match=r"write_piece needs a write-behind writer: DurableShardWriter\(\.\.\., write_behind=True\)"):
                w.write_piece(str(tmp_path), 0, 4, _two_keys())
    assert os.listdir(tmp_path) == []


def test_streaming_writer_rejects_bad_calls_before_queuing(tmp_path: Path) -> None:
    t = _two_keys(4)
    d = str(tmp_path)
    with DurableShardWriter(("a", "b"), write_behind=True) as w:
        with pytest.raises(ValueError, match=r"shard 7 has no pieces; call write_piece first"):
            w.finish_shard(d, 7)
        for bad in (0, -1, True, 2.0):
            with pytest.raises(ValueError, match=r"rows=.* must be an int >= 1: the number of rows shard 0 will hold"):
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
    write_shard_pieces(str(tmp_path / "ref"), {k: [v] for k, v in t.items()})
    assert (tmp_path / "shard-000000.safetensors").read_bytes() == (tmp_path / "ref").read_bytes()
    assert w.records[0] == ShardRecord(os.path.getsize(tmp_path / "ref"), format_checksum(zlib.crc32((tmp_path / "ref").read_bytes())))


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
    w._committer.submit_task(gate.wait)  # the thread is busy: the piece below is still queued at close
    w.write_piece(str(tmp_path), 0, 4, {k: v[:1] for k, v in _two_keys().items()})
    threading.Timer(0.1, gate.set).start()
    w.close()
    assert os.listdir(tmp_path) == []


def _piece_mb(rows: int) -> dict[str, torch.Tensor]:
    return {"a": torch.ones(rows, 1 << 16, dtype=torch.float32)}  # 256 KiB a row


def test_a_write_error_on_the_thread_is_raised_and_leaves_no_temp_file(tmp_path: Path) -> None:
    """A real EFBIG: the file size limit lets the first piece in, not the second."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # Python ignores it: pwrite fails instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    w = DurableShardWriter(("a",), write_behind=True, writer_priority="normal")
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
    w._committer.submit_task(gate.wait)  # queue all of the shard before its first piece fails
    w.write_piece(str(not_a_dir), 0, 4, {k: v[:2] for k, v in t.items()})
    w.write_piece(str(not_a_dir), 0, 4, {k: v[2:] for k, v in t.items()})
    w.finish_shard(str(not_a_dir), 0)
    gate.set()
    errors = _flush_errors(w.flush)
    assert errors is not None, "flush() hangs: the writer thread died"
    assert len(errors) == 1 and isinstance(errors[0], FileExistsError)  # makedirs of the shard's directory
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


# -- BackgroundCommitter -----------------------------------------------------------------


def test_committer_runs_tasks_writes_and_commits_in_order(tmp_path: Path) -> None:
    log: list[str] = []
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    tmp_b = tmp_path / ".b.bin.1-00000000.tmp"
    tmp_b.write_bytes(b"B")

    def write_a(tmp: str) -> None:
        log.append("write a")
        Path(tmp).write_bytes(b"A")

    def before_b() -> None:
        log.append(f"before b (a committed: {a.exists()}, b committed: {b.exists()})")

    with BackgroundCommitter(max_pending=8) as c:
        c.submit_task(lambda: log.append("task 1"))
        c.submit_write(str(a), write_a)
        c.submit_task(lambda: log.append("task 2"))
        c.submit(str(tmp_b), str(b), before=before_b)
        c.submit_task(lambda: log.append(f"task 3 (b committed: {b.exists()})"))
        c.flush()
    assert log == ["task 1", "write a", "task 2", "before b (a committed: True, b committed: False)",
                   "task 3 (b committed: True)"]  # fmt: skip
    assert a.read_bytes() == b"A" and b.read_bytes() == b"B"
    assert not [p for p in os.listdir(tmp_path) if TEMP_RE.match(p)]


def test_committer_drops_every_job_after_a_failure(tmp_path: Path) -> None:
    log: list[str] = []
    gate = threading.Event()
    tmp_x = tmp_path / ".x.bin.1-00000000.tmp"
    tmp_x.write_bytes(b"X")
    tmp_y = tmp_path / ".y.bin.1-00000000.tmp"
    tmp_y.write_bytes(b"Y")

    def fails() -> None:
        gate.wait(WAIT)
        raise RuntimeError("disk on fire")

    c = BackgroundCommitter(max_pending=16)
    c.submit_task(lambda: log.append("ran 1"))
    c.submit_task(fails, on_drop=lambda: log.append("dropped: fails"))
    c.submit_task(lambda: log.append("ran 3"), on_drop=lambda: log.append("dropped 3"))
    c.submit_task(lambda: log.append("ran 4"))  # no on_drop: dropped silently
    c.submit(str(tmp_x), str(tmp_path / "x.bin"))  # its temp file is removed
    c.submit(str(tmp_y), str(tmp_path / "y.bin"), before=lambda: log.append("before y"),
             on_drop=lambda: log.append("dropped y"))  # fmt: skip
    c.submit_write(str(tmp_path / "z.bin"), lambda tmp: log.append("write z"))
    gate.set()
    with pytest.raises(RuntimeError, match="disk on fire"):
        c.flush()
    assert log == ["ran 1", "dropped 3", "dropped y"]
    assert sorted(os.listdir(tmp_path)) == [tmp_y.name]  # on_drop replaced removing y's temp file
    with pytest.raises(RuntimeError, match="disk on fire"):
        c.submit_task(lambda: log.append("late"))
    with pytest.raises(RuntimeError, match="disk on fire"):
        c.close()
    assert log == ["ran 1", "dropped 3", "dropped y"] and not c.running


def test_a_failing_clean_up_of_a_dropped_job_does_not_end_the_thread() -> None:
    """A dropped job's on_drop that raises is ignored: the thread keeps draining the queue, so
    flush() returns (with the first error) instead of waiting forever."""
    log: list[str] = []

    def bad_clean_up() -> None:
        log.append("clean-up raised")
        raise OSError("clean-up failed")

    c = BackgroundCommitter(max_pending=16)
    c.submit_task(lambda: (_ for _ in ()).throw(RuntimeError("first error")))
    c.submit_task(lambda: None, on_drop=bad_clean_up)
    c.submit_task(lambda: None, on_drop=lambda: log.append("dropped after"))
    errors = _flush_errors(c.flush)
    assert errors is not None, "flush() hung: the writer thread ended on the clean-up's error"
    assert [str(e) for e in errors] == ["first error"]
    assert log == ["clean-up raised", "dropped after"] and c.running
    with pytest.raises(RuntimeError, match="first error"):
        c.close()


def _submit_in_thread(c: BackgroundCommitter, nbytes: int) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def go() -> None:
        try:
            c.submit_task(lambda: None, nbytes=nbytes)
            out.append("returned")
        except BaseException as exc:
            out.append(exc)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th, out


def test_committer_byte_budget_blocks_a_submit_until_memory_is_released() -> None:
    gate, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(WAIT)

    c = BackgroundCommitter(max_pending=16, max_pending_bytes=100)
    try:
        c.submit_task(hold, nbytes=60)
        assert started.wait(WAIT)
        c.submit_task(lambda: None, nbytes=40)  # 60 + 40 = 100 fits: returns at once
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


def test_committer_budget_wait_ends_with_the_thread_error() -> None:
    gate = threading.Event()

    def fails() -> None:
        gate.wait(WAIT)
        raise RuntimeError("write failed")

    c = BackgroundCommitter(max_pending=16, max_pending_bytes=100)
    c.submit_task(fails, nbytes=80)
    th, out = _submit_in_thread(c, 80)
    th.join(0.3)
    assert th.is_alive()
    gate.set()
    th.join(WAIT)
    assert len(out) == 1 and isinstance(out[0], RuntimeError) and str(out[0]) == "write failed"
    with pytest.raises(RuntimeError, match="write failed"):
        c.close()


def test_committer_runs_a_job_larger_than_the_budget_alone() -> None:
    ran: list[int] = []
    c = BackgroundCommitter(max_pending=16, max_pending_bytes=10)
    try:
        for i in (1, 2):  # the second waits for the first, then runs alone
            th, out = _submit_in_thread(c, 1000)
            th.join(WAIT)
            assert out == ["returned"], "a job over the budget must run when nothing else is pending"
            ran.append(i)
        c.flush()
    finally:
        c.close()
    assert ran == [1, 2]


def test_start_writeback_on_a_file_and_a_pipe(tmp_path: Path) -> None:
    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
        start_writeback(f.fileno(), 0, 100_000)
        start_writeback(f.fileno(), 4096, 0)
        start_writeback(f.fileno(), 0, 10**9)  # past the end
    r, w = os.pipe()
    try:
        os.write(w, b"abc")
        start_writeback(w, 0, 3)  # EINVAL (ESPIPE) from the kernel: ignored
        start_writeback(r, 0, 3)
        assert os.read(r, 3) == b"abc"
    finally:
        os.close(r)
        os.close(w)
    assert p.read_bytes() == b"x" * 100_000


# -- the accumulator and produce_cache ---------------------------------------------------

KEYS = ("hidden", "input_ids")


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    idx = batch["idx"]
    ids = idx[:, None] * 10 + torch.arange(1, 5)
    ids[torch.arange(4)[None, :] >= (idx % 5)[:, None]] = 0  # lengths 0..4
    return {"hidden": idx[:, None].float() * torch.ones(1, 3) + 0.5, "input_ids": ids, "extra": idx}


def _produce(out: Path, n: int, shard_size: int, batch_size: int, compute=_compute, collate_fn=None, **kw):
    loader = DataLoader(IndexDataset(n), batch_size=batch_size, collate_fn=collate_fn)
    return produce_cache(loader, str(out), shard_size, compute, KEYS, {"cp_size": 1}, progress=False, **kw)


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


class _CountingWriter(DurableShardWriter):
    """A real write-behind writer that counts the streaming calls it gets."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.pieces = self.whole = 0

    def write_piece(self, *a, **kw) -> None:
        self.pieces += 1
        super().write_piece(*a, **kw)

    def __call__(self, *a, **kw) -> str:
        self.whole += 1
        return super().__call__(*a, **kw)


@pytest.mark.parametrize(("n", "shard_size", "batch_size"), [(11, 4, 3), (8, 4, 2), (5, 8, 2), (9, 2, 4)])
def test_streaming_output_equals_the_non_streaming_path(tmp_path: Path, n: int, shard_size: int, batch_size: int) -> None:
    default = _produce(tmp_path / "default", n, shard_size, batch_size)
    plain = _produce(tmp_path / "plain", n, shard_size, batch_size, writer_priority="normal", retain_freed_memory=False)
    assert default == plain
    assert _bytes(tmp_path / "default") == _bytes(tmp_path / "plain")
    assert verify_cache(str(tmp_path / "default"), deep=True)["checksums_verified"]

    # the reference loop, whole shards (the accumulator's non-streaming path): a write-behind
    # writer (handed each shard's batches as pieces) and a plain one (handed joined shards)
    shards = {k: v for k, v in _bytes(tmp_path / "default").items() if k.startswith("shard-")}
    for write_behind in (True, False):
        ref = tmp_path / f"ref-{write_behind}"
        with _CountingWriter(KEYS, length_rule=LengthRule("input_ids"), write_behind=write_behind) as w:
            loader = DataLoader(IndexDataset(n), batch_size=batch_size)
            write_cache_shards(loader, str(ref), shard_size, 0, _compute, w, LOG)
            w.flush()
            fields = w.manifest_fields(str(ref))
        assert w.pieces == 0 and w.whole == -(-n // shard_size)
        assert shards == _bytes(ref)
        assert {k: default[k] for k in fields} == fields  # schema, shards (bytes, checksum, lengths), length_rule
    lengths = [x for s in default["shards"] for x in s["lengths"]]
    assert lengths == [i % 5 for i in range(n)]

    # lockstep_write with total_samples: the streaming path, piece by piece
    streamed = tmp_path / "streamed"
    with _CountingWriter(KEYS, length_rule=LengthRule("input_ids"), write_behind=True) as w:
        lockstep_write(DataLoader(IndexDataset(n), batch_size=batch_size), str(streamed), shard_size,
                       [(0, 0, n)], _compute, w, LOG)  # fmt: skip
        w.flush()
        assert w.manifest_fields(str(streamed)) == fields
    assert w.whole == 0 and w.pieces >= -(-n // batch_size)
    assert _bytes(streamed) == shards


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"writer_priority": "x"}, r"writer_priority='x' must be one of \('idle', 'normal'\)"),
    ({"writer_priority": None}, r"writer_priority=None must be one of"),
    ({"retain_freed_memory": "yes"}, r"retain_freed_memory='yes' must be True or False"),
    ({"retain_freed_memory": 1}, r"retain_freed_memory=1 must be True or False"),
])  # fmt: skip
def test_produce_cache_checks_the_new_arguments_before_touching_the_directory(tmp_path: Path, kwargs, match) -> None:
    out = tmp_path / "out"

    def never(batch):
        raise AssertionError("not computed")

    with pytest.raises(ValueError, match=match):
        _produce(out, 6, 2, 2, compute=never, **kwargs)
    assert not out.exists()


def test_compute_error_mid_shard_leaves_no_temp_file_and_resume_is_identical(tmp_path: Path) -> None:
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
    with pytest.raises(RuntimeError, match=r"the run ended with 3 of shard 1's 4 rows: the dataloader yielded fewer "
                                           r"samples than its dataset holds") as info:  # fmt: skip
        _produce(out, 10, 4, 3, collate_fn=drop_one)
    assert isinstance(info.value.__cause__, ValueError)
    assert _temps(out) == [] and "manifest.json" not in os.listdir(out)


def test_a_dataloader_beyond_its_dataset_is_refused(tmp_path: Path) -> None:
    def repeat_one(rows):
        return default_collate(rows + rows[:1])

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match=r"compute_batch returned 2 rows beyond the 6 samples of this run: "
                                           r"the dataloader yields more samples than its dataset holds"):  # fmt: skip
        _produce(out, 6, 4, 3, collate_fn=repeat_one)
    assert _temps(out) == [] and "manifest.json" not in os.listdir(out)
