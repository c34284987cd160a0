"""The README's main job: precompute the offline cache, then EP + CP training on it.

``te-thd demo`` runs the example scripts of a source checkout (found by
:func:`te_thd._checkout.find_checkout`: ``TE_THD_SOURCE`` or the editable install's tree):

1. ``torchrun --nproc-per-node N examples/precompute_cache.py``: a frozen target
   transformer computes per-token supervision (top-k next-token distribution + final
   hidden states) for a synthetic variable-length dataset; every rank writes its own
   shards of the ``te_thd`` offline cache, rank 0 the manifest;
2. ``torchrun --nproc-per-node N examples/train_ep_cp.py``: a small MoE student is
   distilled on the cache with context parallelism (``--cp``) and expert parallelism
   (``--ep``) over real ``torch.distributed`` process groups (gloo on CPU).

The commands are printed before they run, so they can be copied and changed. Both
use ``sys.executable -m torch.distributed.run`` (``torchrun`` of this interpreter),
so the demo works from a virtual environment without activating it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from te_thd._checkout import find_checkout

#: the two scripts the demo runs, relative to the checkout root
SCRIPTS = ("examples/precompute_cache.py", "examples/train_ep_cp.py")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Precompute an offline cache, then train an EP + CP student on it with torchrun. Runs "
        "examples/precompute_cache.py and examples/train_ep_cp.py of a te_thd source checkout: "
        "the directory in $TE_THD_SOURCE, else the tree of an editable install (scripts/setup.sh)."
    )
    p.add_argument(
        "--out",
        default="runs/demo",
        help="working directory (cache in <out>/cache, run in <out>/train)",
    )
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks) to launch")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    p.add_argument("--steps", type=int, default=100, help="training steps")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL + TE"
    )
    p.add_argument("--num-samples", type=int, default=1024, help="samples in the synthetic dataset")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the previous demo run from its checkpoint (keeping its LR schedule)",
    )
    p.add_argument(
        "--balance",
        action="store_true",
        help="work-balanced steps (train_ep_cp.py --balance): equal rows and near-equal "
        "compute on every data-parallel replica",
    )


def _check(args: argparse.Namespace) -> None:
    for name in ("nproc", "cp", "ep", "steps", "num_samples"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    for name in ("cp", "ep"):
        v = getattr(args, name)
        if args.nproc % v:
            raise ValueError(
                f"--{name}={v} must divide --nproc={args.nproc}; e.g. --nproc {v * max(1, args.nproc // v)}"
            )


def _run(title: str, cmd: list[str], cwd: Path) -> int:
    print(f"\n== {title}\n$ {shlex.join(cmd)}", flush=True)
    # torchrun sets one OpenMP thread per rank anyway and prints a banner saying so when
    # the variable is unset; setting it here keeps that value (unless the user chose one)
    # without the banner
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, cwd=cwd, env=env)


def run_demo(args: argparse.Namespace) -> int:
    """Run precompute + training; returns the first non-zero exit status, else 0."""
    try:
        _check(args)
    except ValueError as exc:
        print(f"te-thd demo: {exc}", file=sys.stderr)
        return 2
    try:
        root = find_checkout(*SCRIPTS)
    except FileNotFoundError as exc:
        print(f"te-thd demo: {exc}", file=sys.stderr)
        return 2
    scripts = tuple(root / s for s in SCRIPTS)
    out = Path(args.out).resolve()
    cache, train = out / "cache", out / "train"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
    ]
    t0 = time.perf_counter()
    rc = _run(
        f"1/2 precompute the offline cache ({args.nproc} ranks, resumable; reused when it exists)",
        [
            *torchrun,
            str(scripts[0]),
            "--out",
            str(cache),
            "--cp",
            str(args.cp),
            "--num-samples",
            str(args.num_samples),
            "--device",
            args.device,
        ],
        root,
    )
    if rc != 0:
        return rc
    rc = _run(
        f"2/2 train the MoE student: {args.nproc} ranks, CP={args.cp}, EP={args.ep}, {args.device}",
        [
            *torchrun,
            str(scripts[1]),
            "--cache-dir",
            str(cache),
            "--out",
            str(train),
            "--cp",
            str(args.cp),
            "--ep",
            str(args.ep),
            "--steps",
            str(args.steps),
            "--device",
            args.device,
            *(["--resume"] if args.resume else []),
            *(["--balance"] if args.balance else []),
        ],
        root,
    )
    if rc == 0:
        print(
            f"\ndemo finished in {time.perf_counter() - t0:.0f} s; per-step metrics: {train / 'metrics.jsonl'}",
            flush=True,
        )
    return rc
