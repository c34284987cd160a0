"""Bad flags of the example scripts and of ``te-thd demo``: clear errors naming the fix."""

from __future__ import annotations

import argparse

import pytest
from _example_support import REPO  # noqa: F401  (puts examples/ on sys.path)


def _train_args(*argv: str) -> argparse.Namespace:
    from train_ep_cp import build_parser

    return build_parser().parse_args(["--cache-dir", "unused", *argv])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--steps", "0"], r"--steps=0 must be >= 1"),
        (["--batch-size", "-2"], r"--batch-size=-2 must be >= 1"),
        (["--save-every", "-1"], r"--save-every=-1 must be >= 0"),
        (["--topk-experts", "5"], r"--topk-experts=5 exceeds --experts=4; lower it"),
        (["--lr", "0"], r"--lr=0.0 must be > 0"),
    ],
)
def test_train_flag_errors(argv: list[str], match: str):
    from train_ep_cp import check_args

    with pytest.raises(ValueError, match=match):
        check_args(_train_args(*argv))


@pytest.mark.parametrize(
    ("world", "cp", "ep", "experts", "match"),
    [
        (
            4,
            3,
            1,
            4,
            r"--cp=3 must divide the number of processes \(4\); launch with --nproc-per-node a multiple of 3",
        ),
        (4, 1, 3, 3, r"--ep=3 must divide the number of processes \(4\)"),
        (
            4,
            1,
            4,
            6,
            r"--ep=4 must divide the number of experts \(6\); choose --ep among the divisors of 6",
        ),
        (4, 0, 1, 4, r"--cp=0 must be an integer >= 1"),
    ],
)
def test_parallel_layout_errors(world: int, cp: int, ep: int, experts: int, match: str):
    from ep_cp.parallel import check_layout

    with pytest.raises(ValueError, match=match):
        check_layout(world, cp, ep, experts)
    check_layout(4, 2, 2, 4)  # the demo's layout is fine


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--cp", "2", "--pack-seq-len", "130"],
            r"--pack-seq-len=130 must be a multiple of 2\*cp=4 .* use --pack-seq-len 132",
        ),
        (
            ["--max-len", "300", "--pack-seq-len", "256"],
            r"hold the longest sample padded to that multiple \(300 slots for --max-len=300\); use --pack-seq-len 300",
        ),
        (["--topk", "1000"], r"--topk=1000 exceeds the vocabulary \(256\)"),
        (["--shard-size", "0"], r"--shard-size=0 must be >= 1"),
    ],
)
def test_precompute_flag_errors(argv: list[str], match: str):
    from precompute_cache import build_parser, check_args

    with pytest.raises(ValueError, match=match):
        check_args(build_parser().parse_args(["--out", "unused", *argv]))


def test_student_config_errors():
    from ep_cp.config import StudentConfig

    with pytest.raises(ValueError, match=r"hidden_size=30 must be divisible by num_heads=4"):
        StudentConfig(hidden_size=30)
    with pytest.raises(ValueError, match=r"router_topk=5 must be in \[1, num_experts=4\]"):
        StudentConfig(router_topk=5)


def _demo_args(*argv: str) -> argparse.Namespace:
    from te_thd._demo import add_demo_arguments

    p = argparse.ArgumentParser()
    add_demo_arguments(p)
    return p.parse_args(list(argv))


def test_demo_rejects_a_layout_that_does_not_fit_the_processes(capsys):
    from te_thd._demo import run_demo

    assert run_demo(_demo_args("--nproc", "4", "--cp", "3")) == 2
    assert "--cp=3 must divide --nproc=4" in capsys.readouterr().err


def test_demo_pointed_at_a_directory_without_the_examples_says_what_to_do(
    monkeypatch, tmp_path, capsys
):
    import te_thd._demo as demo

    monkeypatch.setenv("TE_THD_SOURCE", str(tmp_path))
    assert demo.run_demo(_demo_args()) == 2
    err = capsys.readouterr().err
    assert (
        f"TE_THD_SOURCE={tmp_path} has no examples/precompute_cache.py, examples/train_ep_cp.py"
        in err
    )
    assert "set it to the root of a te_thd checkout" in err


def test_cli_exposes_the_demo():
    from te_thd.cli import build_parser

    args = build_parser().parse_args(["demo", "--steps", "7", "--out", "x"])
    assert args.steps == 7 and args.cp == 2 and args.ep == 2 and args.nproc == 4


def test_train_batch_larger_than_the_replicas_share_of_the_cache():
    """docs/own-model.md's command 3 on the 24-sample chat file: 2 replicas, --batch-size 16 by
    default. One line naming the numbers and the flag to change, not StopIteration."""
    from train_ep_cp import check_batch_fits

    args = _train_args()
    assert args.batch_size == 16
    with pytest.raises(
        ValueError,
        match=r"^--batch-size 16: the cache at unused holds 24 samples, too few for 2 data-parallel replicas at 16 samples each \(a step takes 32\); pass --batch-size 12 or less, or build a cache of at least 32 samples$",
    ):
        check_batch_fits(args, 24, 2)
    check_batch_fits(_train_args("--batch-size", "12"), 24, 2)
    # more replicas than samples: no batch size helps
    with pytest.raises(
        ValueError,
        match=r"^the cache at unused holds 1 samples, too few for 2 data-parallel replicas \(each step gives every replica at least one\); build a cache of at least 2 samples, or run fewer replicas$",
    ):
        check_batch_fits(args, 1, 2)


@pytest.mark.parametrize("script", ["train_ep_cp", "precompute_cache"])
def test_example_help_shows_the_defaults(script, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit) as done:
        module.build_parser().parse_args(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: " in out
    if script == "train_ep_cp":
        assert "samples per data-parallel replica and step (default: 16)" in out


def test_precompute_device_cuda_without_cuda_is_one_line_per_job(tmp_path):
    """``--device cuda`` where CUDA is not available: one ``error:`` line for the whole job (2 ranks
    here), before any CUDA call, and no traceback."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the flag is valid here")
    env = {k: v for k, v in os.environ.items() if k != "TE_THD_TRACEBACK"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "examples" / "precompute_cache.py"), "--device", "cuda", "--out", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=180, env=env, cwd=REPO,
    )  # fmt: skip
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --device cuda was given but CUDA is not available; use --device cpu"
    ], run.stderr
    # (torchrun itself still reports that its children failed: that report is the launcher's)
    assert "_cuda_setDevice" not in run.stderr and "Torch not compiled with CUDA" not in run.stderr
    assert 'File "' + str(REPO / "examples") not in run.stderr  # no traceback from the script


def _help_text(script: str, capsys) -> str:
    module = __import__(script)
    with pytest.raises(SystemExit):
        module.build_parser().parse_args(["--help"])
    return capsys.readouterr().out


def test_precompute_help_shows_each_default_once_and_none_for_required_flags(capsys):
    import precompute_cache

    raw = _help_text("precompute_cache", capsys)
    out = " ".join(raw.split())
    assert "(default: None)" not in out
    assert "JSONL key of plain text (default: text) --messages-key" in out  # once, not twice
    assert (
        "--out OUT cache directory (required unless --plan) --target" in out
    )  # required: no default to show
    assert "(default: cpu)" in out and "where the target runs: cpu" in out
    # the docstring's shell line continuation is shown as written, not joined into one line
    assert "--target hf:models/my-llm \\\n        --data jsonl:chats.jsonl" in raw
    for action in precompute_cache.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
        assert action.help.count("(default") <= 1


def test_train_help_has_no_empty_or_none_defaults(capsys):
    import train_ep_cp

    out = " ".join(_help_text("train_ep_cp", capsys).split())
    assert "(default: None)" not in out
    assert "--cache-dir CACHE_DIR cache written by examples/precompute_cache.py --out" in out
    assert "--device {cpu,cuda} cpu: gloo" in out
    assert "an earlier run's with --resume (default: runs/train)" in out
    assert all(a.help for a in train_ep_cp.build_parser()._actions), "an option without help"


def test_a_recorded_producer_script_is_named_by_its_absolute_path(monkeypatch, tmp_path):
    """Cache hints print the producer the manifest records (relative to the checkout) by its
    absolute path, so the command runs from any directory."""
    from te_thd._checkout import SOURCE_ENV, checkout_file

    monkeypatch.delenv(SOURCE_ENV, raising=False)
    assert checkout_file("examples/precompute_cache.py") == str(
        REPO / "examples" / "precompute_cache.py"
    )
    other = tmp_path / "checkout"
    (other / "examples").mkdir(parents=True)
    (other / "examples" / "precompute_cache.py").write_text("")
    monkeypatch.setenv(SOURCE_ENV, str(other))
    assert checkout_file("examples/precompute_cache.py") == str(
        other / "examples" / "precompute_cache.py"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    assert checkout_file("mine.py") == str(tmp_path / "mine.py")  # a user's own producer, run here
    assert checkout_file("gone.py") == "gone.py" and checkout_file("/abs/p.py") == "/abs/p.py"
