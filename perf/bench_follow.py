"""Training while the cache is produced (``--follow``, docs/follow.md): the pipeline against its parts.

At the demo's sizes (1024 samples in shards of 128, cp = 2, ep = 2, 4 training ranks on the
CPU; ``--quick``: 256 samples in shards of 32, cp = 2 on 2 ranks), one epoch of training (``--steps`` = samples /
(dp x batch)), every figure from this one run:

1. ``train_alone``: the trainer (``examples/train_ep_cp.py --follow``) on a finished cache
   (made first by the fast producer): its wall time, and its start-up (launch to first step,
   read from the time its ``metrics.jsonl`` first grows);
2. the producer's compute is then slowed (``perf/slow_producer.py``: a sleep per
   ``compute_batch``, as a GPU forward looks to the host) so that producing alone takes
   :data:`SLOWER` x the trainer's time: ``producer_alone`` is its wall time;
3. ``pipeline``: the slowed producer and the trainer started together into a new cache:
   the wall time until both exit, and the time from the start to the first training step.

The producer runs on one rank: a producer of several ranks commits one block of shards per
rank at a time, which epoch 0's index order does not follow (docs/follow.md, "What is not").

Records (``metric = "time"``, so a ratio > 1 means the pipeline is better):

- ``first_step``: start to first training step vs ``two_commits_plus_startup`` (the time
  of the producer's second shard commit in the pipeline run + the trainer's start-up); goal >= 1;
- ``pipeline_wall`` vs ``producer_alone`` (goal: at most 1.15x its time, ratio >= 1/1.15) and
  vs ``produce_then_train`` (producer alone + trainer alone; goal >= 1.5x faster).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Record, print_records

BENCH = "follow"
REPO = Path(__file__).resolve().parents[1]
PRODUCER = REPO / "examples" / "precompute_cache.py"
TRAINER = REPO / "examples" / "train_ep_cp.py"
SLOW = REPO / "perf" / "slow_producer.py"
#: the slowed producer alone takes this many times the trainer's time (it is the slower one)
SLOWER = 1.2
#: train_ep_cp.py's --batch-size default and the demo's context-parallel size
BATCH, CP = 16, 2


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


class _Job:
    """A started process whose output goes to a log file; ``wait()`` raises on failure."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        self.f = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen(
            cmd, env=_env(), stdout=self.f, stderr=subprocess.STDOUT, cwd=REPO
        )

    def wait(self) -> float:
        rc = self.p.wait()
        wall = time.perf_counter() - self.t0
        self.f.close()
        if rc != 0:
            raise RuntimeError(f"{self.p.args[5:7]} exited {rc}: {self.log.read_text()[-2000:]}")
        return wall


def _first_step(metrics: Path, job: _Job, t0: float) -> float:
    """Seconds from ``t0`` until the trainer logs its first step (polled; the trainer still runs)."""
    while not (metrics.exists() and metrics.stat().st_size > 0):
        if job.p.poll() is not None:
            raise RuntimeError(
                f"the trainer exited {job.p.returncode} before its first step: {job.log.read_text()[-2000:]}"
            )
        time.sleep(0.02)
    return time.perf_counter() - t0


def run(quick: bool) -> list[Record]:
    # --quick: the smallest job that still has 8 shards (its figures are not the demo's)
    n, shard, nproc, ep = (256, 32, 2, 1) if quick else (1024, 128, 4, 2)
    steps = n // (nproc // CP * BATCH)  # one epoch
    cache_args = ["--cp", str(CP), "--num-samples", str(n), "--shard-size", str(shard), "--device", "cpu"]  # fmt: skip
    train_args = ["--cp", str(CP), "--ep", str(ep), "--steps", str(steps), "--device", "cpu", "--follow", "--save-every", "0"]  # fmt: skip
    batches = n // 32  # precompute_cache.py's --batch-size default: 32 samples per compute_batch
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_follow_") as tmp_s:
        tmp = Path(tmp_s)
        _Job(
            [sys.executable, str(PRODUCER), "--out", str(tmp / "ref"), *cache_args], tmp / "ref.log"
        ).wait()
        # 1. the trainer alone on the finished cache
        t0 = time.perf_counter()
        cmd = _torchrun(
            nproc, TRAINER, "--cache-dir", str(tmp / "ref"), "--out", str(tmp / "t1"), *train_args
        )
        job = _Job(cmd, tmp / "t1.log")
        startup = _first_step(tmp / "t1" / "metrics.jsonl", job, t0)
        train_alone = job.wait()
        # 2. the producer alone, its compute slowed to take SLOWER x the trainer's time
        slow = [sys.executable, str(SLOW), f"{SLOWER * train_alone / batches:.4f}"]
        prod_alone = _Job([*slow, "--out", str(tmp / "p"), *cache_args], tmp / "p.log").wait()
        shutil.rmtree(tmp / "p")
        # 3. both at once
        t0, t0_wall = time.perf_counter(), time.time()
        producer = _Job([*slow, "--out", str(tmp / "c"), *cache_args], tmp / "c.log")
        cmd = _torchrun(
            nproc, TRAINER, "--cache-dir", str(tmp / "c"), "--out", str(tmp / "t2"), *train_args
        )
        trainer = _Job(cmd, tmp / "t2.log")
        first = _first_step(tmp / "t2" / "metrics.jsonl", trainer, t0)
        producer.wait()
        producer_end = time.perf_counter() - t0
        trainer.wait()
        pipeline = time.perf_counter() - t0
        second_commit = (tmp / "c" / "shard-000001.safetensors").stat().st_mtime - t0_wall
    extra = {"samples": n, "shard_size": shard, "train_ranks": nproc, "steps": steps,
             "delay_s_per_batch": float(slow[2]), "train_alone_s": round(train_alone, 3),
             "trainer_startup_s": round(startup, 3), "producer_alone_s": round(prod_alone, 3),
             "pipeline_s": round(pipeline, 3), "pipeline_producer_end_s": round(producer_end, 3),
             "second_commit_s": round(second_commit, 3), "first_step_s": round(first, 3)}  # fmt: skip
    return [
        Record(
            BENCH,
            "first_step",
            "time",
            "s",
            first,
            {"two_commits_plus_startup": second_commit + startup},
            extra,
        ),
        Record(
            BENCH,
            "pipeline_wall",
            "time",
            "s",
            pipeline,
            {"producer_alone": prod_alone, "produce_then_train": prod_alone + train_alone},
            extra,
        ),  # fmt: skip
    ]


if __name__ == "__main__":
    print_records(run(quick="--quick" in sys.argv))
