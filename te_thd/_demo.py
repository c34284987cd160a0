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

The commands are printed before they run, so they can be copied and changed. With
``--follow`` both run at the same time (the trainer follows the producer, docs/follow.md):
their output goes to logs beside the runs, and the demo shows one progress bar for each,
read from what they write (the cache's shards, the run's ``metrics.jsonl``). Both
use ``sys.executable -m torch.distributed.run`` (``torchrun`` of this interpreter),
so the demo works from a virtual environment without activating it. SIGTERM or Ctrl-C
stops both jobs and every process they started (:mod:`te_thd._demo_jobs`), and so does
the demo's death by any signal.

Every run is kept: the first trains into ``<out>/train``, a later one into the next
free ``<out>/train-N``, and ``--resume`` continues the newest run that saved a
checkpoint. Runs share the cache built for their ``--cp`` and ``--num-samples``
(:func:`cache_dir`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from te_thd import _demo_jobs as jobs_
from te_thd._checkout import find_checkout

#: the two scripts the demo runs, relative to the checkout root
SCRIPTS = ("examples/precompute_cache.py", "examples/train_ep_cp.py")
#: train_ep_cp.py's ``--experts`` and ``--batch-size`` defaults, which the demo keeps:
#: ``--ep`` must divide the experts, every replica needs one step's batch of samples
EXPERTS, BATCH_SIZE = 4, 16
#: the defaults of --cp and --num-samples: their cache is ``<out>/cache``
DEFAULT_CP, DEFAULT_SAMPLES = 2, 1024
#: a run directory of the demo: ``train``, then ``train-2``, ``train-3``, ...
RUN_DIR = re.compile(r"train(?:-([2-9]|[1-9][0-9]+))?")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Precompute an offline cache, then train an EP + CP student on it with torchrun. Runs "
        "examples/precompute_cache.py and examples/train_ep_cp.py of a te_thd source checkout: "
        "the directory in $TE_THD_SOURCE, else the tree of an editable install (scripts/setup.sh)."
    )
    p.add_argument(
        "--out",
        default="runs/demo",
        help="working directory: caches in <out>/cache*, runs in <out>/train, <out>/train-2, "
        "... (every run is kept) (default: runs/demo)",
    )
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks) to launch (default: 4)")
    p.add_argument(
        "--cp", type=int, default=DEFAULT_CP, help=f"context-parallel size (default: {DEFAULT_CP})"
    )
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (default: 2)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo (default); cuda: NCCL + TE",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help=f"samples in the synthetic dataset (default: {DEFAULT_SAMPLES})",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest run under --out that saved a checkpoint (keeping its LR "
        "schedule) instead of starting a new one",
    )
    p.add_argument(
        "--balance",
        action="store_true",
        help="work-balanced steps (train_ep_cp.py --balance): equal rows and near-equal "
        "compute on every data-parallel replica",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="run the producer and the trainer at the same time (train_ep_cp.py --follow): "
        "training starts after the first shard; the demo shows a progress bar for each and "
        "keeps their output in <out>/<cache>.log and <out>/<run>.log",
    )


def layout_problems(nproc: int, cp: int, ep: int, num_samples: int) -> list[str]:
    """What keeps the demo's flags (all >= 1) from forming a job; empty when they do."""
    problems = [
        f"--{n}={v} must divide --nproc={nproc}" for n, v in (("cp", cp), ("ep", ep)) if nproc % v
    ]
    if EXPERTS % ep:
        problems.append(f"--ep={ep} must divide the student's {EXPERTS} experts")
    if not problems and num_samples // (nproc // cp) < BATCH_SIZE:
        problems.append(
            f"--num-samples={num_samples} gives each of the {nproc // cp} data-parallel replicas "
            f"(--nproc / --cp) fewer than one step's {BATCH_SIZE} samples"
        )
    return problems


def suggest_layout(nproc: int, cp: int, ep: int, num_samples: int) -> tuple[int, int, int, int]:
    """``(nproc, cp, ep, num_samples)`` closest to the given ones (all >= 1) that form a job.

    Keeps ``cp``; ``ep`` becomes the largest divisor of the experts not above it; ``nproc``
    the multiple of both nearest to it (the larger on a tie); ``num_samples`` grows to one
    step's batch per data-parallel replica. Flags that already form a job come back as given.
    """
    ep = max(d for d in range(1, min(ep, EXPERTS) + 1) if EXPERTS % d == 0)
    step = math.lcm(cp, ep)
    below = nproc // step * step
    nproc = below if below and nproc - below < below + step - nproc else below + step
    return nproc, cp, ep, max(num_samples, BATCH_SIZE * (nproc // cp))


def _check(args: argparse.Namespace) -> None:
    for name in ("nproc", "cp", "ep", "steps", "num_samples"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    given = (args.nproc, args.cp, args.ep, args.num_samples)
    problems = layout_problems(*given)
    if problems:
        fit = suggest_layout(*given)
        flags = f"--nproc {fit[0]} --cp {fit[1]} --ep {fit[2]}"
        if fit[3] != args.num_samples:
            flags += f" --num-samples {fit[3]}"
        raise ValueError(f"{'; '.join(problems)}; this combination satisfies all: {flags}")


def cache_dir(out: Path, cp: int, num_samples: int) -> Path:
    """The demo's cache for ``cp`` and ``num_samples``: ``out/cache`` for the defaults, else
    ``out/cache-cp{cp}-n{num_samples}``.

    The producer reuses a finished cache only for the options that built it, so each
    setting gets its own directory and a run with other flags never meets a refusal.
    """
    default = (cp, num_samples) == (DEFAULT_CP, DEFAULT_SAMPLES)
    return out / ("cache" if default else f"cache-cp{cp}-n{num_samples}")


def run_dirs(out: Path) -> list[Path]:
    """The demo's run directories under ``out`` (``train``, ``train-2``, ...), oldest first."""
    found = [
        (int(m.group(1) or 1), d) for d in out.glob("train*") if (m := RUN_DIR.fullmatch(d.name))
    ]
    return [d for _, d in sorted(found)]


def new_run_dir(out: Path) -> Path:
    """Where a new run trains: ``out/train`` unless a run is there, else the next ``train-N``."""
    held = [d for d in run_dirs(out) if not d.is_dir() or any(d.iterdir())]
    if not held:
        return out / "train"
    return out / f"train-{int(RUN_DIR.fullmatch(held[-1].name).group(1) or 1) + 1}"


def resume_run_dir(out: Path) -> Path | None:
    """The newest run under ``out`` that published a checkpoint, or None."""
    saved = [d for d in run_dirs(out) if (d / "ckpt" / "latest.json").is_file()]
    return saved[-1] if saved else None


def _run(title: str, cmd: list[str], cwd: Path, jobs: list[subprocess.Popen]) -> int:
    """Run ``cmd`` (appended to ``jobs`` while it runs) with the demo's console; its exit status."""
    print(f"\n== {title}\n$ {shlex.join(cmd)}", flush=True)
    # torchrun sets one OpenMP thread per rank anyway and prints a banner saying so when
    # the variable is unset; setting it here keeps that value (unless the user chose one)
    # without the banner
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    jobs.append(jobs_.start(cmd, cwd=cwd, env=env))
    return jobs[-1].wait()


def resume_hint(name: str, train: Path) -> str:
    """How to go on after job ``name`` (``precompute`` or ``train``) was killed."""
    if name == "precompute":
        return "run the same command again to resume"
    if (train / "ckpt" / "latest.json").is_file():
        return "run the same command with --resume to continue from its last checkpoint"
    return "it saved no checkpoint: run the same command again to train anew"


#: how often ``--follow`` reads the two jobs' progress (seconds)
POLL_S = 0.5
#: the lines of a job's log the concurrent demo prints at the end: its result, or its error
RESULT_LINE = re.compile(r"^(cache ready|summary:|error:|nothing to do|resumed from)")


def shards_done(cache: Path) -> tuple[int, int | None]:
    """``(shards committed, shards in all)`` of the cache being produced at ``cache``; the total is
    None until the producer has recorded its plan (its follow record, or the manifest)."""
    done = len(list(cache.glob("shard-*.safetensors")))
    for name in ("manifest.json", ".te_thd-follow.json"):
        try:
            record = json.loads((cache / name).read_text())
        except (OSError, ValueError):
            continue
        run = record.get("run", record)
        n, size = run.get("num_samples"), run.get("shard_size")
        if isinstance(n, int) and isinstance(size, int) and size > 0:
            return done, -(-n // size)
    return done, None


def steps_done(train: Path) -> int:
    """Training steps the run in ``train`` has logged (``metrics.jsonl``: one line per step, kept on
    resume)."""
    try:
        with open(train / "metrics.jsonl") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def run_concurrently(
    produce: list[str],
    train_cmd: list[str],
    cache: Path,
    train: Path,
    steps: int,
    cwd: Path,
    jobs: list[subprocess.Popen],
) -> int:
    """Run the producer and the trainer (which follows it) at the same time, each logging to a file
    beside its directory, with a progress bar for each; the first non-zero exit status (1 for a job
    a signal killed), else 0. A producer that fails stops the trainer (it would wait for shards
    nobody writes). Both are appended to ``jobs``; whatever ends this function early stops them."""
    from tqdm.auto import tqdm

    logs = (cache.parent / f"{cache.name}.log", train.parent / f"{train.name}.log")
    print(
        f"\n== precompute and train at the same time (the trainer follows the producer)\n"
        f"$ {shlex.join(produce)}\n$ {shlex.join(train_cmd)}\nlogs: {logs[0]}, {logs[1]}",
        flush=True,
    )
    cache.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(logs[0], "w") as plog, open(logs[1], "w") as tlog:
        for cmd, log in ((produce, plog), (train_cmd, tlog)):
            jobs.append(jobs_.start(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
        pair = (producer, trainer) = jobs[-2:]
        bars = [
            tqdm(desc="produce", unit="shard", position=0, disable=None, file=sys.stderr),
            tqdm(total=steps, desc="train", unit="step", position=1, disable=None, file=sys.stderr),
        ]
        try:
            while True:
                running = [j.poll() is None for j in pair]
                if producer.returncode not in (None, 0) and running[1]:
                    trainer.terminate()
                done, total = shards_done(cache)
                bars[0].total = total
                bars[0].n = done
                bars[1].n = steps_done(train)
                for bar in bars:
                    bar.refresh()
                if not any(running):
                    break
                time.sleep(POLL_S)
        except jobs_.Stopped:
            jobs_.ignore_stop_signals()  # a second Ctrl-C does not cut the stopping short
            raise
        finally:
            jobs_.stop(list(pair))
            for bar in bars:
                bar.close()
    for job, log, name in zip(pair, logs, ("precompute", "train"), strict=True):
        lines = log.read_text(errors="replace").splitlines()
        shown = [ln for ln in lines if RESULT_LINE.match(ln)]  # its result, or its one error line
        if job.returncode and job is trainer and producer.returncode:
            shown = [f"{name}: stopped, the producer failed (log: {log})"]
        elif job.returncode < 0:
            # a signal ended it: its log says nothing (torchrun had no time to)
            shown = [jobs_.killed_line(name, -job.returncode, log, resume_hint(name, train))]
        elif job.returncode and not any(ln.startswith("error:") for ln in shown):
            sig = jobs_.rank_signal(lines)
            hint = resume_hint(name, train)
            shown = [jobs_.killed_line(name, sig, log, hint, rank=True)] if sig else lines[-20:]
        print("\n".join(shown), flush=True)
    return next((max(j.returncode, 1) for j in pair if j.returncode), 0)


def _run_jobs(
    args: argparse.Namespace,
    produce: list[str],
    train_cmd: list[str],
    cache: Path,
    train: Path,
    root: Path,
    jobs: list[subprocess.Popen],
) -> int:
    """The two torchrun jobs, one after the other or (``--follow``) at once; 0, or the first
    failure's status (1 for a job a signal killed, after one line saying so)."""
    if args.follow:
        return run_concurrently(
            produce, [*train_cmd, "--follow"], cache, train, args.steps, root, jobs
        )
    steps = (
        (
            "precompute",
            (
                f"1/2 precompute the offline cache ({args.nproc} ranks, resumable; reused "
                "when it exists)"
            ),
            produce,
        ),
        (
            "train",
            (
                f"2/2 train the MoE student: {args.nproc} ranks, CP={args.cp}, EP={args.ep}, "
                f"{args.device}"
            ),
            train_cmd,
        ),
    )
    for name, title, cmd in steps:
        rc = _run(title, cmd, root, jobs)
        if rc < 0:
            print(jobs_.killed_line(name, -rc, None, resume_hint(name, train)), flush=True)
            return 1
        if rc != 0:
            return rc
    return 0


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
    cache, earlier = cache_dir(out, args.cp, args.num_samples), run_dirs(out)
    if args.resume:
        train = resume_run_dir(out)
        if train is None:
            print(
                f"te-thd demo: --resume: nothing to resume, no checkpoint in {out}/train*/ckpt "
                f"(looked in {', '.join(d.name for d in earlier) or 'no run directory'}); run "
                "te-thd demo without --resume to start a run",
                file=sys.stderr,
            )
            return 2
        print(f"resuming the run in {train}", flush=True)
    else:
        train = new_run_dir(out)
        if earlier and train not in earlier:
            print(
                f"earlier runs kept ({', '.join(str(d) for d in earlier)}); this run trains into "
                f"{train} (te-thd demo --resume continues the newest run instead)",
                flush=True,
            )
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
    ]
    t0 = time.perf_counter()
    if args.follow and args.balance:
        print(
            "te-thd demo: --follow with --balance: balancing plans from the lengths the "
            "finished cache "
            "records; drop one of the two",
            file=sys.stderr,
        )
        return 2
    produce = [
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
    ]
    train_cmd = [
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
    ]
    jobs: list[subprocess.Popen] = []
    try:
        with jobs_.stopping(jobs):
            rc = _run_jobs(args, produce, train_cmd, cache, train, root, jobs)
    except jobs_.Stopped as stop:
        print(jobs_.stopped_line(stop.signum), file=sys.stderr, flush=True)
        return 128 + stop.signum
    if rc == 0:
        print(
            (
                f"\ndemo finished in {time.perf_counter() - t0:.0f} s; per-step metrics: "
                f"{train / 'metrics.jsonl'}"
            ),
            flush=True,
        )
    return rc
