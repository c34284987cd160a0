"""``te-thd demo`` as a user runs it: layout hints that agree, runs that are kept, ``--resume``.

The layout suggestion is a pure function, checked over many flag combinations with
hypothesis; the demo itself runs for real (``python -m te_thd.cli demo``: torchrun, gloo),
twice into the same ``--out`` and then with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _example_support import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd import _demo as demo


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TE_THD_SOURCE", None)
    return env


def _demo(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "te_thd.cli", "demo", *argv],
        capture_output=True, text=True, timeout=600, env=_env(), cwd=cwd,
    )  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    return p.parse_args(list(argv))


def _fits(nproc: int, cp: int, ep: int, num_samples: int) -> bool:
    """The constraints the demo's two scripts impose, written out independently of _demo."""
    return (
        nproc % cp == 0
        and nproc % ep == 0
        and demo.EXPERTS % ep == 0
        and num_samples // (nproc // cp) >= demo.BATCH_SIZE
    )


def test_the_demo_constants_are_the_trainers_defaults():
    from train_ep_cp import build_parser

    args = build_parser().parse_args(["--cache-dir", "unused"])
    assert (args.experts, args.batch_size) == (demo.EXPERTS, demo.BATCH_SIZE)


@settings(max_examples=400, deadline=None)
@given(
    nproc=st.integers(1, 64),
    cp=st.integers(1, 16),
    ep=st.integers(1, 16),
    num_samples=st.integers(1, 4096),
)
def test_the_suggested_layout_satisfies_every_constraint(nproc, cp, ep, num_samples):
    fit = demo.suggest_layout(nproc, cp, ep, num_samples)
    assert all(v >= 1 for v in fit) and fit[1] == cp
    assert _fits(*fit), fit
    assert demo.layout_problems(*fit) == []
    demo._check(
        _args(*f"--nproc {fit[0]} --cp {fit[1]} --ep {fit[2]} --num-samples {fit[3]}".split())
    )
    if _fits(nproc, cp, ep, num_samples):  # what already works is suggested unchanged
        assert fit == (nproc, cp, ep, num_samples)
        assert demo.layout_problems(nproc, cp, ep, num_samples) == []
    else:
        assert demo.layout_problems(nproc, cp, ep, num_samples)


@pytest.mark.parametrize(
    ("argv", "problems", "suggestion"),
    [
        (["--cp", "3"], "--cp=3 must divide --nproc=4", "--nproc 6 --cp 3 --ep 2"),
        (["--cp", "3", "--nproc", "3"], "--ep=2 must divide --nproc=3", "--nproc 6 --cp 3 --ep 2"),
        (
            ["--cp", "2", "--ep", "3"],
            "--ep=3 must divide --nproc=4; --ep=3 must divide the student's 4 experts",
            "--nproc 4 --cp 2 --ep 2",
        ),
        (
            ["--num-samples", "20"],
            "--num-samples=20 gives each of the 2 data-parallel replicas (--nproc / --cp) fewer "
            "than one step's 16 samples",
            "--nproc 4 --cp 2 --ep 2 --num-samples 32",
        ),
    ],
)
def test_a_layout_that_does_not_fit_gets_one_suggestion_that_does(
    tmp_path, argv, problems, suggestion
):
    run = _demo(*argv, "--out", str(tmp_path / "d"), cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"te-thd demo: {problems}; this combination satisfies all: {suggestion}\n"
    assert not (tmp_path / "d").exists()  # refused before anything ran
    demo._check(_args(*suggestion.split()))  # the suggestion passes the same check


def test_run_directories_are_numbered_and_the_newest_checkpoint_resumes(tmp_path):
    out = tmp_path / "demo"
    assert demo.new_run_dir(out) == out / "train" and demo.resume_run_dir(out) is None
    (out / "train").mkdir(parents=True)
    assert demo.new_run_dir(out) == out / "train"  # an empty directory loses nothing
    for name in ("train", "train-2", "train-10"):
        (out / name / "ckpt").mkdir(parents=True, exist_ok=True)
    (out / "train-x").mkdir()  # not a run directory of the demo
    (out / "train-1").mkdir()
    assert demo.run_dirs(out) == [out / "train", out / "train-2", out / "train-10"]
    assert demo.new_run_dir(out) == out / "train-11"
    assert demo.resume_run_dir(out) is None  # no checkpoint published anywhere
    (out / "train-2" / "ckpt" / "latest.json").write_text("{}")
    assert demo.resume_run_dir(out) == out / "train-2"


def test_each_cache_setting_has_its_own_directory(tmp_path):
    """The producer reuses a cache only for the options that built it: a demo with another
    --cp or --num-samples on the same --out builds its own cache instead of being refused."""
    defaults = _args()
    assert demo.cache_dir(tmp_path, defaults.cp, defaults.num_samples) == tmp_path / "cache"
    names = {demo.cache_dir(tmp_path, cp, n).name for cp in (1, 2, 3) for n in (64, 1024)}
    assert len(names) == 6 and "cache-cp3-n64" in names


def test_demo_resume_with_no_run_says_where_it_looked(tmp_path):
    run = _demo("--resume", "--out", "d", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (
        f"te-thd demo: --resume: nothing to resume, no checkpoint in {tmp_path}/d/train*/ckpt "
        "(looked in no run directory); run te-thd demo without --resume to start a run\n"
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_demo_run_twice_keeps_both_runs_and_resume_continues_the_newest(tmp_path):
    """The hint for ``--nproc 2 --cp 2 --ep 3``, run as printed, twice, then with --resume."""
    small = ["--out", "d", "--steps", "2", "--num-samples", "64"]
    hint = _demo("--nproc", "2", "--cp", "2", "--ep", "3", *small, cwd=tmp_path)
    assert hint.returncode == 2, hint.stderr
    fit = shlex.split(re.search(r"satisfies all: (.*)$", hint.stderr.strip()).group(1))
    assert fit == ["--nproc", "2", "--cp", "2", "--ep", "2"]
    out = tmp_path / "d"

    first = _demo(*fit, *small, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"--out {out}/cache-cp2-n64 " in first.stdout  # not the default settings' cache
    assert f"--out {out}/train " in first.stdout and "earlier runs kept" not in first.stdout
    kept = {p: p.read_bytes() for p in sorted((out / "train").rglob("*")) if p.is_file()}
    assert out / "train" / "ckpt" / "iter_0000002" / "rank_00000.pt" in kept

    second = _demo(*fit, *small, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (
        f"earlier runs kept ({out}/train); this run trains into {out}/train-2 (te-thd demo "
        "--resume continues the newest run instead)"
    ) in second.stdout
    assert f"per-step metrics: {out}/train-2/metrics.jsonl" in second.stdout
    assert {p: p.read_bytes() for p in sorted((out / "train").rglob("*")) if p.is_file()} == kept
    assert [r["step"] for r in _metrics(out / "train-2")] == [1, 2]

    resumed = _demo(
        *fit, *small[:2], "--steps", "3", "--num-samples", "64", "--resume", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming the run in {out}/train-2" in resumed.stdout
    assert f"resumed from step 2 ({out}/train-2/ckpt)" in resumed.stdout
    assert [r["step"] for r in _metrics(out / "train-2")] == [1, 2, 3]
    assert not (out / "train-3").exists()


def test_the_demo_with_follow_runs_the_producer_and_the_trainer_at_once(tmp_path):
    """``--follow``: one step starts both (the trainer follows the producer), their logs beside the runs,
    each job's result line at the end; a second run trains on the finished cache the same way."""
    small = [
        "--nproc",
        "2",
        "--cp",
        "2",
        "--ep",
        "1",
        "--steps",
        "4",
        "--num-samples",
        "64",
        "--out",
        "d",
    ]
    run = _demo(*small, "--follow", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "d"
    assert (
        "== precompute and train at the same time (the trainer follows the producer)" in run.stdout
    )
    assert (
        f"--cache-dir {out}/cache-cp2-n64 --out {out}/train " in run.stdout
        and " --follow\n" in run.stdout
    )
    assert f"logs: {out}/cache-cp2-n64.log, {out}/train.log" in run.stdout
    assert (
        f"cache ready: {out}/cache-cp2-n64 " in run.stdout and "summary: steps 0->4 " in run.stdout
    )
    assert [r["step"] for r in _metrics(out / "train")] == [1, 2, 3, 4]
    assert not (out / "cache-cp2-n64" / ".te_thd-follow.json").exists()
    again = _demo(*small, "--follow", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r["loss"] for r in _metrics(out / "train-2")] == [
        r["loss"] for r in _metrics(out / "train")
    ]


def test_the_demo_with_follow_stops_the_trainer_when_the_producer_fails(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "cache-cp2-n64").write_text("not a cache")
    small = [
        "--nproc",
        "2",
        "--cp",
        "2",
        "--ep",
        "1",
        "--steps",
        "4",
        "--num-samples",
        "64",
        "--out",
        "d",
    ]
    run = _demo(*small, "--follow", cwd=tmp_path)
    assert run.returncode != 0
    assert "is a file, not a directory" in run.stdout, run.stdout + run.stderr


def test_docs_cli_names_every_demo_flag_in_its_synopsis_and_its_table():
    """docs/cli.md: the synopsis and the flags table list what ``te-thd demo --help`` lists."""
    p = argparse.ArgumentParser()
    demo.add_demo_arguments(p)
    text = " ".join(p.format_help().split())
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", text)) - {"--help"}
    assert {"--follow", "--out", "--resume", "--balance"} <= flags
    doc = (REPO / "docs" / "cli.md").read_text()
    synopsis = next(ln for ln in doc.splitlines() if ln.startswith("| `te-thd demo ["))
    named = " ".join(ln.split("|")[1] for ln in doc.splitlines() if ln.startswith("| `--"))
    for flag in sorted(flags):
        assert f"{flag} " in synopsis or f"{flag}]" in synopsis, flag
        assert f"`{flag} " in named or f"`{flag}`" in named, flag
    # the --follow help ends in a sentence that says where the logs are
    assert "keeps their output in <out>/<cache>.log and <out>/<run>.log" in text
