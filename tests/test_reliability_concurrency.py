"""Concurrency on one cache directory, with real processes.

* Two producers: while one producer process writes, a second producer is refused
  with ``CacheLockError`` naming the holder's pid; the first one's cache is then
  byte-identical to a clean run's (the refused producer touched nothing).
* Readers during a resume: two reader processes open the cache in a loop while an
  interrupted (SIGKILLed) producer is resumed, and then while a producer re-runs
  over the finished cache. Every open sees either the old state (the "not
  finished" ``ManifestNotFoundError``) or the new, complete cache with every sample
  right; never a partial shard, a partial manifest, or any other error.

The scenario (a deterministic "model", 12 shards of ~2 MiB) and the reader process
are those of ``scripts/crash_test.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from te_thd.offline_cache import CacheError, CacheLockError, produce_cache, verify_cache

REPO_ROOT = Path(__file__).resolve().parents[1]


def _crash_test_module():
    spec = importlib.util.spec_from_file_location(
        "crash_test", REPO_ROOT / "scripts" / "crash_test.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


CT = _crash_test_module()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    d = tmp_path_factory.mktemp("clean") / "cache"
    CT.produce(str(d))
    return str(d), CT.read_dir(str(d))


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _shards(d: Path) -> int:
    return sum(1 for n in os.listdir(d) if CT.SHARD_RE.match(n)) if d.exists() else 0


def _second_producer(d: Path, resume: bool = True):
    from torch.utils.data import DataLoader

    loader = DataLoader(CT.IndexDataset(CT.NUM_SAMPLES), batch_size=CT.BATCH_SIZE)
    return produce_cache(
        loader,
        str(d),
        CT.SHARD_SIZE,
        CT._compute_batch,
        CT.KEYS,
        CT.OPTIONS,
        progress=False,
        resume=resume,
    )


def test_second_producer_is_refused_while_the_first_writes(tmp_path: Path, clean) -> None:
    _, clean_files = clean
    d = tmp_path / "cache"
    first = CT._Proc(["_produce", "--out", str(d), "--sleep", "0.15"], tmp_path / "first.log")
    try:
        assert first.wait_line("READY", 300), (tmp_path / "first.log").read_text()
        _wait_for(lambda: _shards(d) >= 1, 120, "the first producer's first shard")
        with pytest.raises(
            CacheLockError, match=rf"held by another producer \(pid {first.p.pid} on host"
        ):
            _second_producer(d)
        assert first.poll() is None, "the refusal must not disturb the running producer"
        assert first.wait_line("DONE", 300), (tmp_path / "first.log").read_text()
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
    assert CT.read_dir(str(d)) == clean_files, "the refused producer changed the cache"
    verify_cache(str(d), deep=True)
    # lock released: a producer now reuses the finished cache, or refuses to overwrite it
    assert _second_producer(d)["num_samples"] == CT.NUM_SAMPLES
    with pytest.raises(CacheError, match="already holds a finished cache"):
        _second_producer(d, resume=False)
    assert CT.read_dir(str(d)) == clean_files


def test_readers_during_a_resume_see_the_old_or_the_new_state(tmp_path: Path, clean) -> None:
    clean_dir, clean_files = clean
    d = tmp_path / "cache"
    # an interrupted run: SIGKILL after a few shards
    victim = CT._Proc(["_produce", "--out", str(d), "--sleep", "0.05"], tmp_path / "victim.log")
    try:
        assert victim.wait_line("READY", 300)
        _wait_for(lambda: _shards(d) >= 3, 120, "3 shards")
    finally:
        assert victim.kill(), "the producer finished before it could be interrupted"
    assert not (d / "manifest.json").exists()

    readers = []
    for r in range(2):
        stop, out = tmp_path / f"r{r}.stop", tmp_path / f"r{r}.json"
        p = CT._Proc(
            [
                "_poll",
                "--dir",
                str(d),
                "--clean",
                clean_dir,
                "--stop",
                str(stop),
                "--out",
                str(out),
                "--open-every",
                "0.05",
            ],
            tmp_path / f"r{r}.log",
        )
        readers.append((p, stop, out))
    try:
        for p, _, _ in readers:
            assert p.wait_line("READY", 300), "reader process failed to start"
        time.sleep(0.3)  # readers observe the interrupted state first
        resumer = CT._Proc(
            ["_produce", "--out", str(d), "--sleep", "0.02"], tmp_path / "resume.log"
        )
        assert resumer.wait_line("DONE", 600), (tmp_path / "resume.log").read_text()
        assert resumer.wait(timeout=60) == 0
        time.sleep(0.3)
        _second_producer(d)  # a re-run over the finished cache while readers read: a no-op
        time.sleep(0.3)
    finally:
        results = []
        for p, stop, out in readers:
            stop.touch()
            p.wait(timeout=120)
            results.append(json.loads(out.read_text()))
    for res in results:
        assert res["n_violations"] == 0, res["violations"]
        assert res["unfinished_opens"] > 0, f"a reader never saw the interrupted state: {res}"
        assert res["full_reads"] > 0, f"a reader never read the finished cache: {res}"
    assert CT.read_dir(str(d)) == clean_files
