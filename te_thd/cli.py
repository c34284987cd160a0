"""``te-thd`` command line: inspect, verify or repair a cache, run the demo, run the benchmarks.

Each subcommand is a thin shell over a library function so that everything the
CLI does is also callable (and tested) from Python.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from te_thd._cache_parser import PRODUCER_FLAGS, add_cache_commands


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the README's main job (the checkout's examples/, see te_thd._checkout)."""
    from te_thd._demo import run_demo

    return run_demo(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run perf/run.py of a source checkout (see te_thd._checkout) with the remaining arguments."""
    from te_thd._checkout import find_checkout

    try:
        root = find_checkout("perf/run.py")
    except FileNotFoundError as exc:
        print(f"te-thd bench: {exc}", file=sys.stderr)
        return 2
    from te_thd import _demo_jobs as jobs_

    # perf/run.py names itself after the command that ran it (usage, errors)
    env = {**os.environ, "TE_THD_BENCH_PROG": "te-thd bench"}
    # its own process group, dying with us: a stopped or killed bench leaves no bench process
    job = jobs_.start([sys.executable, str(root / "perf" / "run.py"), *args.rest], env=env)
    try:
        with jobs_.stopping([job]):
            return job.wait()
    except jobs_.Stopped as stop:
        line = jobs_.stopped_line(stop.signum, "te-thd bench", "its benchmarks")
        print(line, file=sys.stderr)
        return 128 + stop.signum


def _cmd_plan_example(rest: list[str]) -> int:
    """``te-thd cache plan --target ... --data ...``: ``examples/precompute_cache.py --plan`` of a
    source checkout (see te_thd._checkout), which reads the samples and the model's config as it
    produces."""
    from te_thd._checkout import find_checkout

    try:
        root = find_checkout("examples/precompute_cache.py")
    except FileNotFoundError as exc:
        print(
            (
                "te-thd cache plan: --target/--data read the samples as "
                f"examples/precompute_cache.py does: {exc}"
            ),
            file=sys.stderr,
        )
        return 2
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "precompute_cache.py"), "--plan", *rest],
        capture_output=True,
        text=True,
    )
    # through this process's streams: what captures them sees the plan
    sys.stdout.write(done.stdout)
    # a bad flag: the producer's one line ("error: ..." or argparse's, after its usage), as ours
    last = (done.stderr.strip().splitlines() or [""])[-1]
    said = re.match(r"^(?:error|\S+\.py: error): (.+)$", last)
    if done.returncode in (1, 2) and said is not None:
        print(f"te-thd cache plan: {said.group(1)}", file=sys.stderr)
        return 2
    sys.stderr.write(done.stderr)
    return done.returncode


def _has_checkout(*required: str) -> bool:
    from te_thd._checkout import find_checkout

    try:
        find_checkout(*required)
    except FileNotFoundError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    """The ``te-thd`` parser. Nothing it imports imports torch: a command imports what it runs, so
    ``--help`` and a bad argument do not wait for it."""
    p = argparse.ArgumentParser(prog="te-thd", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the CPU demo (README's first command)")
    from te_thd._demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench",
        help="run the perf suite (perf/run.py of the checkout in $TE_THD_SOURCE or of an "
        "editable install); extra args pass through",
        description="Run the perf suite: perf/run.py of a te_thd source checkout, from "
        "$TE_THD_SOURCE or the editable install's own tree; every argument after 'bench' is "
        "passed to it (inside a checkout, `te-thd bench --help` shows perf/run.py's options).",
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)

    cache = sub.add_parser(
        "cache", help="inspect, verify or repair an offline cache directory; plan one"
    )
    add_cache_commands(cache)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if (
        argv[:1] == ["bench"]
        and argv[1:2] in (["-h"], ["--help"])
        and not _has_checkout("perf/run.py")
    ):
        # help always works; what is missing is said when the command runs
        build_parser().parse_args(["bench", "--help"])
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER does not capture a leading option (`te-thd bench --quick`),
        # so everything after `bench` goes to perf/run.py untouched
        rest = argv[1:]
        return _cmd_bench(argparse.Namespace(rest=rest[1:] if rest[:1] == ["--"] else rest))
    if argv[:2] == ["cache", "plan"] and any(a.split("=")[0] in PRODUCER_FLAGS for a in argv[2:]):
        return _cmd_plan_example(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        # here, not at exit: a reader that went away (`| head -1`) shows up at the flush
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # as any Unix tool whose reader closed the pipe: no traceback; what is left unwritten goes
        # nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
