"""The example trainer keeps earlier runs: ``--out`` and ``--resume`` as a user meets them.

Real ``torchrun`` jobs of ``examples/train_ep_cp.py`` on 2 CPU ranks (CP = 2, EP = 2):
a second run into the same ``--out`` without ``--resume`` is refused with one line and
changes nothing; ``--resume`` with nothing to resume, or on another cache, is refused
with one line naming the fix, and the fix runs as printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _example_support import EXAMPLES, REPO, one_error, small_cache_argv


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TE_THD_TRACEBACK", None)
    return env


def _precompute(out: Path, num_samples: int) -> str:
    cmd = [
        sys.executable,
        str(EXAMPLES / "precompute_cache.py"),
        *small_cache_argv(str(out), num_samples),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180, env=_env())
    return str(out)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("runs_caches")
    return {"main": _precompute(root / "cache", 48), "other": _precompute(root / "other", 40)}


def _train(
    cache: str, out: Path, *extra: str, steps: int = 3, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "train_ep_cp.py"), "--cache-dir", cache, "--out", str(out), "--cp", "2",
        "--ep", "2", "--steps", str(steps), "--batch-size", "4", "--save-every", "0", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first_run(
    caches, tmp_path_factory
) -> tuple[Path, subprocess.CompletedProcess, dict[str, bytes]]:
    """A 3-step run: its ``--out``, its output, and its files as it left them."""
    out = tmp_path_factory.mktemp("runs") / "run"
    res = _train(caches["main"], out)
    assert res.returncode == 0, res.stdout + res.stderr
    return out, res, _snapshot(out)


def test_a_run_into_a_non_empty_out_is_refused_once_and_changes_nothing(first_run, caches):
    out, _, before = first_run
    assert _snapshot(out) == before
    assert "ckpt/iter_0000003/rank_00000.pt" in before
    msg = one_error(_train(caches["main"], out, steps=5))
    assert msg == (
        f"--out {out} already holds a run (ckpt, metrics.jsonl, summary.json); pass --resume to "
        "continue it, or a new --out to start another (nothing was changed)"
    )
    assert _snapshot(out) == before
    # the exit status of the script itself (torchrun reports its own): 2, a usage error
    direct = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_ep_cp.py"), "--cache-dir", caches["main"], "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert direct.returncode == 2 and direct.stderr.strip() == f"error: {msg}", direct.stderr
    assert _snapshot(out) == before


def test_resume_with_nothing_to_resume_is_refused(caches, tmp_path):
    fresh = tmp_path / "fresh"
    msg = one_error(_train(caches["main"], fresh, "--resume"))
    assert msg == (
        f"--resume: nothing to resume, no checkpoint in {fresh}/ckpt (no latest.json); drop "
        f"--resume to start a new run in {fresh}, or pass the --out of the run to continue"
    )
    assert not fresh.exists()


def _direct(cache: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``train_ep_cp.py`` without a launcher: enough for what it refuses before the process group."""
    return subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_ep_cp.py"),
            "--cache-dir",
            cache,
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )


def test_a_run_that_died_before_its_first_checkpoint_is_started_over(caches, tmp_path):
    """Nothing to protect and nothing to resume: ``--resume`` says to drop it, and without it the run
    starts over in the same ``--out``."""
    died = tmp_path / "died"
    died.mkdir()
    (died / "metrics.jsonl").write_text("")  # what a run that failed at its first batch leaves
    direct = _direct(caches["main"], died, "--resume")
    assert direct.returncode == 2, direct.stderr
    assert direct.stderr.strip() == (
        f"error: --resume: nothing to resume, no checkpoint in {died}/ckpt (no latest.json); the run "
        "there stopped before its first checkpoint: drop --resume to start it over"
    )
    assert (died / "metrics.jsonl").read_text() == ""
    res = _train(caches["main"], died)  # the same command without --resume
    assert res.returncode == 0, res.stdout + res.stderr
    steps = [json.loads(ln)["step"] for ln in (died / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_an_out_holding_other_files_and_no_checkpoint_is_refused_and_kept(caches, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for extra, fix in (
        ((), "which a run does not write; pass a new --out (nothing was changed)"),
        (("--resume",), "pass a new --out to start a new run"),
    ):
        direct = _direct(caches["main"], out, *extra)
        assert direct.returncode == 2 and fix in direct.stderr, direct.stderr
        assert "notes.txt" in direct.stderr
        assert len(direct.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resuming_a_follow_checkpoint_names_the_flag_and_resumes_nothing(caches, tmp_path):
    out = tmp_path / "followed"
    first = _train(caches["main"], out, "--follow", steps=2)
    assert first.returncode == 0, first.stdout + first.stderr
    msg = one_error(_train(caches["main"], out, "--resume", steps=3))
    assert msg == (
        f"--resume: the checkpoint in {out}/ckpt was trained with --follow, which orders epoch 0's "
        "samples; pass --follow to resume it, or train into a new --out"
    )
    res = _train(caches["main"], out, "--resume", "--follow", steps=3)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed from step 2" in res.stdout
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_resume_on_another_cache_names_the_original_and_that_fix_runs(first_run, caches, tmp_path):
    out, _, _ = first_run
    elsewhere = tmp_path / "elsewhere"  # the cache given relative to another directory
    elsewhere.mkdir()
    other = os.path.relpath(caches["other"], elsewhere)
    msg = one_error(_train(other, out, "--resume", steps=5, cwd=elsewhere))
    assert msg == (
        f"--resume: the checkpoint in {out}/ckpt was trained on a cache of 48 samples in shards of "
        f"8, but --cache-dir {other} holds 40 samples in shards of 8; resume with --cache-dir "
        f"{caches['main']}, or train on this cache into a new --out"
    )
    fix = re.search(r"resume with (--cache-dir \S+),", msg).group(1).split()[1]
    res = _train(fix, out, "--resume", steps=5, cwd=elsewhere)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed from step 3" in res.stdout
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_a_short_run_summary_compares_its_first_and_last_step(first_run):
    _, res, files = first_run
    metrics = [json.loads(ln) for ln in files["metrics.jsonl"].decode().splitlines()]
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert first != last
    assert (
        f"summary: steps 0->3 | loss {first:.4f} -> {last:.4f} (first vs last step) |" in res.stdout
    )
    summary = json.loads(files["summary.json"])
    assert (summary["loss_first"], summary["loss_last"], summary["loss_window"]) == (first, last, 1)


@pytest.mark.parametrize(
    ("n", "k", "how"),
    [
        (1, 1, "(a single step)"),
        (2, 1, "(first vs last step)"),
        (10, 5, "(mean of first/last 5 steps)"),
        (15, 7, "(mean of first/last 7 steps)"),
        (100, 10, "(mean of first/last 10 steps)"),
    ],
)
def test_loss_summary_windows_never_overlap(n: int, k: int, how: str):
    from train_ep_cp import loss_summary

    losses = [float(100 - i) for i in range(n)]  # strictly falling: any overlap would show
    first, last, window, text = loss_summary(losses)
    assert window == k and text.endswith(how)
    assert first == sum(losses[:k]) / k and last == sum(losses[-k:]) / k
    assert n == 1 or (2 * k <= n and first > last)
