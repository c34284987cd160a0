"""Durability of the offline cache: atomic writes, the producer lock, SIGKILL + resume.

The crash tests run a real producer process (``_offline_cache_producer_script.py``)
that SIGKILLs itself at a chosen instant, then resume it, and require the finished
directory to equal, file for file and byte for byte, a cache produced without
interruption.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import te_thd.offline_cache.storage.base as storage
from te_thd.offline_cache import (
    CacheLockError,
    DurableShardWriter,
    ManifestNotFoundError,
    ProducerLock,
    atomic_write,
    check_cache_files,
    existing_shard_indices,
    produce_cache,
    read_manifest,
    remove_stale_temp_files,
    verify_cache,
)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_offline_cache_producer_script.py"
sys.path.insert(0, str(HERE))
import _offline_cache_producer_script as prod  # noqa: E402


def _dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _lock_pid(out: Path) -> int:
    """The pid a killed producer recorded in the lock file it left."""
    return int(json.loads((out / storage.LOCK_NAME).read_text())["pid"])


def _run_script(out: Path, crash: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), crash], capture_output=True, text=True, timeout=120
    )


# -- atomic_write -----------------------------------------------------------------------


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    atomic_write(str(target), lambda tmp: Path(tmp).write_bytes(b"new content"))
    assert target.read_bytes() == b"new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_write_failure_keeps_old_file_and_removes_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    seen: list[str] = []

    def failing(tmp: str) -> None:
        seen.append(tmp)
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(str(target), failing)
    assert target.read_bytes() == b"old"
    assert not Path(seen[0]).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_temp_names_are_unique_dot_prefixed_and_match_temp_re(tmp_path: Path) -> None:
    names = {storage.temp_path_for(str(tmp_path / "shard-000000.safetensors")) for _ in range(200)}
    assert len(names) == 200
    for n in names:
        base = os.path.basename(n)
        assert base.startswith(".shard-000000.safetensors.") and f".{os.getpid()}-" in base
        assert storage.TEMP_RE.match(base)


def test_remove_stale_temp_files_only_removes_temp_files(tmp_path: Path) -> None:
    stale = Path(storage.temp_path_for(str(tmp_path / "shard-000003.safetensors")))
    stale.write_bytes(b"x")
    keep = ["shard-000000.safetensors", "notes.txt", ".hidden", "manifest.json"]
    for k in keep:
        (tmp_path / k).write_bytes(b"y")
    assert remove_stale_temp_files(str(tmp_path)) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


# -- producer lock --------------------------------------------------------------------------


def test_lock_refuses_second_holder_and_names_the_first(tmp_path: Path) -> None:
    with ProducerLock(str(tmp_path)):
        with pytest.raises(
            CacheLockError,
            match=rf"held by another producer \(pid {os.getpid()} on host .*wait for it to finish",
        ):
            ProducerLock(str(tmp_path)).acquire()
    # released: lock file removed, a new holder gets it
    assert not (tmp_path / storage.LOCK_NAME).exists()
    with ProducerLock(str(tmp_path)) as lock:
        assert lock.held


def test_second_producer_process_is_refused_and_sigkill_releases_the_lock(tmp_path: Path) -> None:
    """A real process holds the lock; produce_cache refuses; SIGKILL of the holder frees it."""
    code = (
        "import sys, time; from te_thd.offline_cache.storage.base import ProducerLock; "
        "ProducerLock(sys.argv[1]).acquire(); print('LOCKED', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "LOCKED"
        with pytest.raises(
            CacheLockError,
            match=rf"output_dir {tmp_path} is held by another producer \(pid {holder.pid} ",
        ):
            produce_cache(
                prod.loader(), str(tmp_path), 4, prod.compute_batch, ("hidden",), progress=False
            )
        assert existing_shard_indices(str(tmp_path)) == set()  # refused before writing anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # the stale lock FILE is still there, but the kernel dropped the flock with the process
    assert (tmp_path / storage.LOCK_NAME).exists()
    m = produce_cache(
        prod.loader(), str(tmp_path), 4, prod.compute_batch, ("hidden",), progress=False
    )
    assert m["num_samples"] == prod.NUM_SAMPLES
    assert not (tmp_path / storage.LOCK_NAME).exists()


def test_lock_survives_unlink_race(tmp_path: Path) -> None:
    """A holder that opened the old inode before it was unlinked must not win the lock."""
    first = ProducerLock(str(tmp_path)).acquire()
    stale_fd = os.open(first.path, os.O_RDWR)  # opened before release unlinks the file
    first.release()
    second = ProducerLock(str(tmp_path)).acquire()
    try:
        import fcntl

        fcntl.flock(stale_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the orphan inode is lockable...
        with pytest.raises(CacheLockError):  # ...but the live lock file is not
            ProducerLock(str(tmp_path)).acquire()
    finally:
        os.close(stale_fd)
        second.release()


# -- SIGKILL + resume -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("reference")
    p = prod.PARAMS
    produce_cache(
        prod.loader(),
        str(out),
        p["shard_size"],
        prod.compute_batch,
        p["keys"],
        p["options"],
        progress=False,
    )
    return _dir_bytes(out)


def test_killed_producer_resumes_to_a_byte_identical_cache(
    tmp_path: Path, reference_cache: dict[str, bytes]
) -> None:
    out = tmp_path / "cache"
    # 11 samples, shard_size 4 -> shards 0, 1, 2 (4, 4, 3 samples)
    assert sorted(reference_cache) == [
        "manifest.json",
        "shard-000000.safetensors",
        "shard-000001.safetensors",
        "shard-000002.safetensors",
    ]

    # 1. killed in the middle of shard 1's file write
    r = _run_script(out, "mid_write:1")
    assert r.returncode == -signal.SIGKILL, r.stderr
    temps = [p.name for p in out.iterdir() if storage.TEMP_RE.match(p.name)]
    assert any(t.startswith(".shard-000001.safetensors.") for t in temps)
    # the torn file is invisible to readers; shard 0 is visible if its (pipelined) commit
    # finished before the kill, and then complete
    visible = existing_shard_indices(str(out))
    assert visible <= {0}
    for i in visible:
        name = f"shard-{i:06d}.safetensors"
        assert (out / name).read_bytes() == reference_cache[name]
    # the reader says what the lock the killed producer left tells: it stopped, and what resumes it
    with pytest.raises(
        ManifestNotFoundError,
        match=rf"its producer stopped before it finished \(host \S+, pid {_lock_pid(out)} no longer holds its lock\); resume with: the `te_thd\.offline_cache\.produce_cache",
    ):
        read_manifest(str(out), "test", 1)

    # 2. resumed, killed between shards (right after shard 1 landed)
    r = _run_script(out, "between:1")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert existing_shard_indices(str(out)) == {0, 1}
    # run 1's torn temp was removed by the resume (run 2 may leave its own: it was
    # killed while the pipelined writer was already writing shard 2's temp file)
    assert not set(temps) & set(os.listdir(out))

    # 3. resumed, killed inside the manifest write (all shards on disk)
    r = _run_script(out, "mid_manifest")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert existing_shard_indices(str(out)) == {0, 1, 2}
    assert not (out / "manifest.json").exists()
    assert any(n.startswith(".manifest.json.") for n in os.listdir(out))

    # 4. resumed, killed after verifying the shards, before the manifest write starts
    r = _run_script(out, "before_manifest")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not (out / "manifest.json").exists()

    # 5. resumed to completion
    r = _run_script(out, "none")
    assert r.returncode == 0 and "FINISHED" in r.stdout, r.stderr
    assert _dir_bytes(out) == reference_cache  # no temp, lock or progress file either
    verify_cache(str(out), deep=True)


def test_resume_after_exception_recomputes_only_missing_shards(
    tmp_path: Path, reference_cache: dict[str, bytes]
) -> None:
    p = prod.PARAMS
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 5:  # batches 1-4 filled shards 0 and 1
            raise RuntimeError("GPU fell off the bus")
        return prod.compute_batch(batch)

    with pytest.raises(RuntimeError, match="fell off"):
        produce_cache(
            prod.loader(),
            str(tmp_path),
            p["shard_size"],
            flaky,
            p["keys"],
            p["options"],
            progress=False,
        )
    assert existing_shard_indices(str(tmp_path)) == {0, 1}
    assert not (tmp_path / storage.LOCK_NAME).exists()  # released on the way out

    counted = {"n": 0}

    def counting(batch):
        counted["n"] += 1
        return prod.compute_batch(batch)

    produce_cache(
        prod.loader(),
        str(tmp_path),
        p["shard_size"],
        counting,
        p["keys"],
        p["options"],
        progress=False,
    )
    assert counted["n"] == 2  # shard 2: 3 samples, batch size 2
    assert _dir_bytes(tmp_path) == reference_cache


def test_resume_detects_a_damaged_existing_shard(tmp_path: Path) -> None:
    p = prod.PARAMS
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("stop")
        return prod.compute_batch(batch)

    with pytest.raises(RuntimeError):
        produce_cache(
            prod.loader(),
            str(tmp_path),
            p["shard_size"],
            flaky,
            p["keys"],
            p["options"],
            progress=False,
        )
    shard = tmp_path / "shard-000000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])  # truncated behind the producer's back
    with pytest.raises(
        ValueError,
        match=r"shard-000000.safetensors is not a valid safetensors file: the header describes \d+ bytes but the file has",
    ):
        produce_cache(
            prod.loader(),
            str(tmp_path),
            p["shard_size"],
            prod.compute_batch,
            p["keys"],
            p["options"],
            progress=False,
        )


def test_killed_writer_temp_is_ignored_by_checks_of_a_finished_cache(
    tmp_path: Path, reference_cache: dict[str, bytes]
) -> None:
    for name, data in reference_cache.items():
        (tmp_path / name).write_bytes(data)
    Path(storage.temp_path_for(str(tmp_path / "shard-000001.safetensors"))).write_bytes(b"torn")
    (tmp_path / storage.LOCK_NAME).write_bytes(b"{}")
    manifest = read_manifest(str(tmp_path), "test", 1)
    assert check_cache_files(str(tmp_path), manifest) == [0, 1, 2]
    assert verify_cache(str(tmp_path), deep=True)["checksums_verified"]


def test_fsync_is_called_for_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The durability protocol's order: data fsync, then rename, then directory fsync."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(a, b):
        events.append("replace")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(str(tmp_path / "x"), lambda tmp: Path(tmp).write_bytes(b"data"))
    assert events == ["fsync-file", "replace", "fsync-dir"]


# -- pipelined commits ----------------------------------------------------------------------


def test_pipelined_writer_fsyncs_before_rename_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards committed on the writer's thread: each file's data is flushed before its name
    appears, in shard order, and the renames are persisted by a directory fsync before flush returns."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append(f"fsync:{os.path.basename(target) if not os.path.isdir(target) else 'dir'}")
        real_fsync(fd)

    def replace(a, b):
        events.append(f"rename:{os.path.basename(a)}->{os.path.basename(b)}")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    names = [f"shard-{i:06d}.safetensors" for i in range(3)]
    for mode in ({}, {"write_behind": True}):
        events.clear()
        d = tmp_path / str(len(mode))
        with DurableShardWriter(("x",), **mode) as w:
            for i in range(3):
                w(str(d), i, {"x": torch.full((2, 3), float(i))})
            w.flush()
            assert sorted(p.name for p in d.iterdir()) == names
        renames = [e for e in events if e.startswith("rename")]
        assert [r.split("->")[1] for r in renames] == names
        for r in renames:
            tmp = r.split(":", 1)[1].split("->")[0]
            assert events.index(f"fsync:{tmp}") < events.index(r)
        assert events[-1] == "fsync:dir"


def test_pipelined_writer_surfaces_commit_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that fails on the thread is raised by flush, by every later call and by close; the
    shard is not visible and its temp file is gone."""
    real_replace = os.replace

    def replace(a, b):
        if b.endswith("shard-000000.safetensors"):
            raise OSError(errno.EIO, "rename failed")
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace)
    w = DurableShardWriter(("x",))
    w(str(tmp_path), 0, {"x": torch.ones(2, 3)})
    with pytest.raises(OSError, match="rename failed"):
        w.flush()
    with pytest.raises(OSError, match="rename failed"):  # a failed writer refuses further work
        w(str(tmp_path), 1, {"x": torch.ones(2, 3)})
    with pytest.raises(OSError, match="rename failed"):
        w.close()
    assert os.listdir(tmp_path) == []
