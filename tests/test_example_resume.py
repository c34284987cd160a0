"""Crash and resume of the EP + CP training example, with real processes.

``torchrun`` runs ``examples/train_ep_cp.py`` on 2 CPU ranks (CP=2, EP=2, the
cached dataloader with a worker process per rank). A second run is killed with
SIGKILL -- every process of the job at once, as when a node dies -- after it has
published a checkpoint and gone past it; ``--resume`` then finishes it. The loss
trajectory of killed + resumed must equal the uninterrupted run's, step for step
(deterministic on CPU: same data order, optimizer and LR state, RNG).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _example_support import EXAMPLES, small_cache_argv

STEPS = 14
SAVE_EVERY = 4


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("resume_cache") / "cache")
    cmd = [sys.executable, str(EXAMPLES / "precompute_cache.py"), *small_cache_argv(out, 48)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=_env())
    return out


def _env() -> dict[str, str]:
    # Python's default warning filters (no PYTHONWARNINGS): the runs show what a user sees.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    return env


@pytest.fixture(scope="module")
def reference_run(cache_dir: str, tmp_path_factory) -> tuple[Path, str, list[dict]]:
    """An uninterrupted run: its directory, its output and its metrics."""
    out = tmp_path_factory.mktemp("resume_ref") / "ref"
    ref = _train(cache_dir, out)
    ref_out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_out
    return out, ref_out, _metrics(out)


def _train(cache_dir: str, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / "train_ep_cp.py"),
        "--cache-dir",
        cache_dir,
        "--out",
        str(out),
        "--cp",
        "2",
        "--ep",
        "2",
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--batch-size",
        "4",
        "--num-workers",
        "1",
        "--log-every",
        "100",
        *extra,
    ]
    # Own session: the test can kill the whole job without touching pytest.
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=_env(),
    )


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (Linux /proc): torchrun's workers and theirs."""
    found: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            found.append(k)
            stack.append(k)
    return found


def _kill_job(proc: subprocess.Popen) -> None:
    victims = [*_descendants(proc.pid), proc.pid]
    for pid in victims:  # collected first, then killed back to back: no survivor reacts
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_then_resume_matches_uninterrupted_run(
    cache_dir: str, reference_run: tuple[Path, str, list[dict]], tmp_path: Path
):
    _, ref_out, expected = reference_run
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    assert "summary:" in ref_out

    run = tmp_path / "crash"
    job = _train(cache_dir, run)
    deadline = time.monotonic() + 300
    latest = run / "ckpt" / "latest.json"
    while True:  # kill once a checkpoint is published and the run has gone past it
        done = _metrics(run)
        if latest.exists() and done and done[-1]["step"] > json.loads(latest.read_text())["step"]:
            break
        assert job.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting for a checkpoint"
        time.sleep(0.02)
    _kill_job(job)
    job.communicate(timeout=60)
    assert job.returncode == -signal.SIGKILL
    killed_at = _metrics(run)[-1]["step"]
    assert killed_at < STEPS, "the kill came too late to test anything"

    resumed = _train(cache_dir, run, "--resume")
    res_out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, res_out
    m = re.search(r"resumed from step (\d+)", res_out)
    assert m is not None, res_out
    assert 0 < int(m.group(1)) <= killed_at and int(m.group(1)) % SAVE_EVERY == 0

    got = _metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, expected, strict=True):
        for key in ("loss", "kl", "mse", "aux", "grad_norm", "lr", "tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert got[-1]["loss"] < got[0]["loss"]  # and it trains


def test_examples_print_no_megatron_te_apex_warning(reference_run: tuple[Path, str, list[dict]]):
    _, ref_out, _ = reference_run
    # megatron-core warns this at import on every rank without TE/Apex; the example
    # filters exactly that message (its other warnings would still show)
    assert "Transformer Engine and Apex are not installed" not in ref_out
    assert "resumed from step" not in ref_out


def test_resume_past_the_end_keeps_the_checkpoints_lr_schedule(
    cache_dir: str, reference_run: tuple[Path, str, list[dict]], tmp_path: Path
):
    ref_dir, _, expected = reference_run
    run = tmp_path / "extended"
    shutil.copytree(ref_dir, run)
    longer = STEPS + 4
    job = _train(cache_dir, run, "--resume", "--steps", str(longer))
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out
    floor = 3e-3 * 0.1  # --lr's default x --min-lr-ratio's default
    assert f"resumed from step {STEPS}" in out
    assert (
        "--resume: keeping the checkpoint's LR schedule (lr 3.00e-03, warm-up 10, cosine to "
        f"3.00e-04 over {STEPS} steps); --steps {longer} does not change it; steps "
        f"{STEPS + 1}-{longer} run at its floor lr 3.00e-04. For a new schedule, train into a "
        "new --out"
    ) in out, out
    got = _metrics(run)
    assert [r["step"] for r in got] == list(range(1, longer + 1))
    assert got[:STEPS] == expected
    # a schedule recomputed over the new --steps would put step 15 back up at 1.65e-03
    assert [r["lr"] for r in got[STEPS:]] == pytest.approx([floor] * 4, rel=1e-12)
