"""te_thd perf suite: every hot path against its baselines, in one run.

    python perf/run.py [--quick] [--check] [--only NAME ...]     (also: te-thd bench ...)

1. Looks for the reference implementation (``perf/reference-requirements.txt``,
   which ``scripts/setup.sh`` installs with ``--no-deps``); it never installs
   anything. When it is missing the suite says what to run, runs the rest, and
   reports the reference goals as skipped.
2. Discovers ``bench_*.py`` next to this file and runs each ``run(quick)`` in
   its own subprocess: a bench that raises, crashes or hangs is an error for
   that bench only, and no bench inherits another's memory or worker threads.
3. Judges the ratios against ``thresholds.json`` (see ``goals.py``), writes the
   JSON / markdown / PNG report under ``perf/results/`` (see ``report.py``) and
   prints the table.
4. ``--check``: exit 1 naming each goal that was missed, errored or produced no data.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from goals import GoalResult, evaluate, failures, load_goals
from harness import (
    NO_REFERENCE_ENV,
    REFERENCE_REQUIREMENT,
    REFERENCE_REQUIREMENTS_FILE,
    REFERENCE_VERSION,
    Record,
)

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent

#: --quick is meant to finish within this many seconds on 2 cores (whole suite)
QUICK_BUDGET_S = 120.0
DEFAULT_TIMEOUT_S = {"quick": 180.0, "full": 1800.0}
#: The name usage and errors show: ``te-thd bench`` sets it when it runs this script.
PROG_ENV = "TE_THD_BENCH_PROG"


# --------------------------------------------------------------------------- reference


def _installed_reference_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nemo-automodel")
    except PackageNotFoundError:
        return None


def install_reference_command() -> str:
    """The command that installs the reference baseline into this interpreter's environment."""
    return shlex.join(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-r",
            str(REFERENCE_REQUIREMENTS_FILE),
        ]
    )


def reference_status() -> dict[str, Any]:
    """Whether the reference baseline is usable; never installs anything.

    Returns ``{"available": bool, "version": str|None, "detail": str}``. Another
    installed version is reported as unavailable (the goals were set against the
    pinned one, so its ratios would not compare); ``detail`` then says what to run.
    """
    if os.environ.get(NO_REFERENCE_ENV) == "1":
        return {
            "available": False,
            "version": None,
            "detail": f"disabled ({NO_REFERENCE_ENV}=1 / --no-reference)",
        }
    have = _installed_reference_version()
    if have == REFERENCE_VERSION:
        return {"available": True, "version": have, "detail": "installed"}
    found = "not installed" if have is None else f"nemo-automodel {have} is installed"
    return {
        "available": False,
        "version": have,
        "detail": f"{found}; the baselines need {REFERENCE_REQUIREMENT}, installed without "
        f"its dependencies by scripts/setup.sh or `{install_reference_command()}`",
    }


# --------------------------------------------------------------------------- benches


def discover(bench_dir: Path) -> dict[str, Path]:
    """``{name: path}`` for every ``bench_<name>.py`` in ``bench_dir``, sorted by name."""
    return {p.stem[len("bench_") :]: p for p in sorted(bench_dir.glob("bench_*.py"))}


def _strict(x: Any) -> Any:
    """Recursively replace inf/nan by None and tensors/numpy scalars by Python numbers."""
    if isinstance(x, dict):
        return {str(k): _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, (int, float)):
        return x if math.isfinite(x) else None
    if hasattr(x, "item"):  # torch / numpy scalar
        try:
            return _strict(x.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(x)


def record_to_json(rec: Record) -> dict[str, Any]:
    """``Record.to_json`` as strict JSON (inf/nan -> None)."""
    return _strict(rec.to_json())


def _child(bench_path: Path, out: Path, quick: bool, threads: int | None) -> int:
    """Run one bench module in this (fresh) process and write its records to ``out``.

    ``threads`` reaches torch through ``OMP_NUM_THREADS`` (set by the parent, read
    when torch is imported), so a bench that never imports torch does not pay for it.
    """
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"records": [], "error": None}
    try:
        spec = importlib.util.spec_from_file_location(bench_path.stem, bench_path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[bench_path.stem] = mod
        spec.loader.exec_module(mod)
        if not callable(getattr(mod, "run", None)):
            raise TypeError(f"{bench_path.name} has no run(quick: bool) -> list[Record]")
        records = mod.run(quick=quick)
        if not isinstance(records, list):
            raise TypeError(
                f"{bench_path.name}: run() returned {type(records).__name__}, expected list[Record]"
            )
        recs: list[Record] = []
        for r in records:
            # duck-typed: a bench may import harness under another module name
            d = r if isinstance(r, dict) else r.to_json()
            recs.append(Record.from_json(d))
        from harness import print_records

        print_records(recs)
        result["records"] = [record_to_json(r) for r in recs]
    except BaseException as e:  # noqa: B036 - report everything, incl. SystemExit from a bench
        result["error"] = "".join(traceback.format_exception(e)).strip()
        print(result["error"], file=sys.stderr)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if "torch" in sys.modules:
        result["torch_threads"] = sys.modules["torch"].get_num_threads()
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out.write_text(json.dumps(result))
    return 0 if result["error"] is None else 1


def run_bench(
    name: str, path: Path, *, quick: bool, timeout_s: float, threads: int | None = None
) -> dict[str, Any]:
    """Run ``path`` in a child interpreter; return the bench entry of the run document."""
    entry: dict[str, Any] = {
        "name": name,
        "module": str(path.relative_to(path.parent.parent))
        if path.parent.parent in path.parents
        else str(path),
    }
    with tempfile.TemporaryDirectory(prefix=f"te_thd_perf_{name}_") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            str(path),
            "--out",
            str(out),
        ]
        if quick:
            cmd.append("--quick")
        env = dict(os.environ)
        cmd += ["--threads", str(threads or 0)]
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(path.parent), str(PERF_DIR), str(REPO_ROOT)]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        t0 = time.perf_counter()
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log, "wb") as logf:
            rc = _run_child(cmd, logf, env, timeout_s)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds of the bench and everything it spawned: unlike wall time this
        # hardly depends on how busy the machine is (the --quick budget is about it)
        entry["cpu_s"] = round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2)
        text = log.read_text(errors="replace")
        entry["log"] = text[-20000:]
        entry["wall_s"] = round(wall, 2)
        if out.exists():
            res = json.loads(out.read_text())
            entry["seconds"] = res.get("seconds")
            entry["peak_rss_mib"] = res.get("peak_rss_mib")
            entry["torch_threads"] = res.get("torch_threads")
            entry["records"] = res.get("records", [])
            entry["error"] = res.get("error")
        else:
            entry["records"] = []
            tail = "\n".join(text.strip().splitlines()[-15:])
            entry["error"] = (
                f"timed out after {timeout_s:.0f} s"
                if rc is None
                else f"child exited with code {rc} before reporting"
            ) + (f"\n{tail}" if tail else "")
        entry["status"] = "ok" if entry["error"] is None else ("timeout" if rc is None else "error")
    return entry


@functools.cache
def _demo_jobs() -> Any:
    """``te_thd/_demo_jobs.py`` of this checkout, loaded from its file (it needs only the standard
    library), so the suite runs where te_thd is not installed, as its benches do."""
    spec = importlib.util.spec_from_file_location(
        "te_thd_demo_jobs", REPO_ROOT / "te_thd" / "_demo_jobs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_child(cmd: list[str], logf: Any, env: dict[str, str], timeout_s: float) -> int | None:
    """Run one bench child to its end: its exit code, or None when it ran past ``timeout_s``.

    The child runs in a process group of its own that gets SIGTERM when this process dies, and a
    SIGTERM or SIGINT here stops it and everything it started before this process exits, so a
    stopped or killed suite (``te-thd bench`` included) leaves no bench running.
    """
    jobs_ = _demo_jobs()
    proc = jobs_.start(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
    try:
        with jobs_.stopping([proc]):
            try:
                return proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                jobs_.stop([proc])
                return None
    except jobs_.Stopped as stop:
        raise SystemExit(128 + stop.signum) from None


def merge_attempts(attempts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per case with the per-figure medians of several runs of a bench.

    Records are matched by ``case``; ``ours`` and every baseline become the median
    over the runs that reported them and the ratios are recomputed from those.
    ``extra["attempts"]`` keeps every run's figures.
    """
    import statistics

    def med(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.median(vals) if vals else None

    out = []
    for first in attempts[0]:
        same = [r for run in attempts for r in run if r["case"] == first["case"]]
        merged = dict(first)
        merged["ours"] = med([r["ours"] for r in same])
        merged["baselines"] = {
            k: med([r["baselines"].get(k) for r in same]) for k in first["baselines"]
        }
        merged["extra"] = {
            **first.get("extra", {}),
            "attempts": [{"ours": r["ours"], "baselines": r["baselines"]} for r in same],
        }
        out.append(record_to_json(Record.from_json(merged)))
    return out


# --------------------------------------------------------------------------- main


def _prog() -> str:
    return os.environ.get(PROG_ENV) or "perf/run.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `te-thd bench -- --quick` passes the separator through
        argv = argv[1:]
    ap = argparse.ArgumentParser(
        prog=_prog(),
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes, fewer trials: the whole suite in < {QUICK_BUDGET_S:.0f} s on 2 cores",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 naming every goal of thresholds.json that was missed (or has no data)",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only bench_NAME.py (repeatable; comma lists ok)",
    )
    ap.add_argument(
        "--confirm",
        type=int,
        default=2,
        metavar="N",
        help="with --check: re-run a bench that missed a goal N more times and judge "
        "the medians of all its runs (default 2; 0: judge the first run)",
    )
    ap.add_argument("--list", action="store_true", help="list the benches and goals, run nothing")
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="run as if the reference were not installed (benches skip its baselines)",
    )
    ap.add_argument("--bench-dir", type=Path, default=PERF_DIR, help=argparse.SUPPRESS)
    ap.add_argument(
        "--thresholds",
        type=Path,
        default=PERF_DIR / "thresholds.json",
        help="goals file (default: perf/thresholds.json)",
    )
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=PERF_DIR / "results",
        help="where the JSON/markdown/PNG go (default: perf/results)",
    )
    ap.add_argument(
        "--no-latest",
        action="store_true",
        help="do not update results/latest*.* (latest.* = last full run of every bench, "
        "latest-quick.* / latest-partial.* = last --quick / --only run)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per bench before it is killed (default 180 quick, 1800 full)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads in every bench (default 1, as in DataLoader workers "
        "and as every bench's standalone entry point sets; 0: torch's own default)",
    )
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return _child(args.child, args.out, args.quick, args.threads)

    started = time.time()
    mode = "quick" if args.quick else "full"
    try:
        goals = load_goals(args.thresholds)
    except ValueError as e:
        print(f"{_prog()}: {e}", file=sys.stderr)
        return 2
    benches = discover(args.bench_dir.resolve())
    wanted = {
        n.strip().removeprefix("bench_").removesuffix(".py")
        for item in args.only
        for n in item.split(",")
        if n.strip()
    }
    unknown = sorted(wanted - set(benches))
    if unknown:
        print(
            f"{_prog()}: --only {', '.join(unknown)}: no such bench in {args.bench_dir}; "
            f"available: {', '.join(benches) or '(none)'}",
            file=sys.stderr,
        )
        return 2
    selected = wanted or set(benches)
    # goals name bench modules that may not exist yet: they count as selected (-> no-data)
    # in a full run, so a deleted bench cannot silently drop its goal
    selected_for_goals = wanted or (set(benches) | {g.bench for g in goals})

    if args.list:
        for name, path in benches.items():
            print(f"{name:14s} {path}")
        for g in goals:
            print(
                f"goal {g.id}: {g.statement} [{g.bench}/{g.case} vs {g.baseline} >= {g.min_ratio:g}x, "
                f"noise margin {g.noise_margin:.0%}]"
            )
        return 0

    if args.no_reference:
        os.environ[NO_REFERENCE_ENV] = "1"  # inherited by every bench process
    reference = reference_status()
    if not reference["available"]:
        print(
            f"[perf] reference implementation unavailable: {reference['detail']}; "
            "running the other baselines only (its goals are reported as skipped)",
            flush=True,
        )

    timeout_s = args.timeout or DEFAULT_TIMEOUT_S[mode]
    entries: list[dict[str, Any]] = []
    for name, path in benches.items():
        if name not in selected:
            continue
        print(f"[perf] {name} ({mode}) ...", flush=True)
        entry = run_bench(name, path, quick=args.quick, timeout_s=timeout_s, threads=args.threads)
        for line in entry["log"].rstrip().splitlines():
            print(f"    {line}")
        print(
            f"[perf] {name}: {entry['status']}, {len(entry['records'])} records, "
            f"{entry['wall_s']:.1f} s wall, {entry['cpu_s']:.1f} CPU-s",
            flush=True,
        )
        entries.append(entry)

    def judge_all() -> list[GoalResult]:
        records = {
            e["name"]: [Record.from_json(r) for r in e["records"]]
            for e in entries
            if e["status"] == "ok"
        }
        errs = {e["name"]: e["error"] for e in entries if e["status"] != "ok"}
        return evaluate(
            goals,
            records,
            errs,
            selected=selected_for_goals,
            reference_available=reference["available"],
        )

    results = judge_all()
    if args.check and args.confirm > 0:
        # A miss is re-measured before it fails the check: the bench runs `confirm`
        # more times and the per-figure medians of all its runs are judged.
        by_name = {e["name"]: e for e in entries}
        for name in sorted({r.bench for r in results if r.status == "missed"}):
            entry = by_name[name]
            attempts = [entry["records"]]
            for i in range(args.confirm):
                print(
                    f"[perf] {name}: a goal was missed; confirmation run {i + 1}/{args.confirm} ...",
                    flush=True,
                )
                again = run_bench(
                    name, benches[name], quick=args.quick, timeout_s=timeout_s, threads=args.threads
                )
                entry["wall_s"] = round(entry["wall_s"] + again["wall_s"], 2)
                entry["cpu_s"] = round(entry["cpu_s"] + again["cpu_s"], 2)
                if again["status"] != "ok":
                    print(f"[perf] {name}: confirmation run failed: {again['error']}", flush=True)
                    continue
                attempts.append(again["records"])
            entry["records"] = merge_attempts(attempts)
            entry["runs"] = len(attempts)
            from harness import print_records

            print(f"[perf] {name}: medians of {len(attempts)} runs:")
            print_records([Record.from_json(r) for r in entry["records"]])
        results = judge_all()
    errors = {e["name"]: e["error"] for e in entries if e["status"] != "ok"}
    fails = failures(results)
    # a bench that errored fails --check even when no goal names it
    goal_benches = {g.bench for g in goals}
    bench_fail = [
        {"goal": f"bench:{n}", "detail": errors[n].strip().splitlines()[-1:]}
        for n in sorted(errors)
        if n not in goal_benches
    ]

    from report import build_run, render_markdown, write_docs_block, write_report

    run = build_run(
        mode=mode,
        argv=sys.argv if argv is None else argv,
        started=started,
        benches=entries,
        goals=[r.to_json() for r in results],
        goal_specs=[
            {
                "id": g.id,
                "statement": g.statement,
                "purpose": g.purpose,
                "min_ratio": g.min_ratio,
                "noise_margin": g.noise_margin,
            }
            for g in goals
        ],
        reference=reference,
        check_failures=[r.to_json() for r in fails] + bench_fail,
    )
    latest = "latest-partial" if wanted else "latest-quick" if args.quick else "latest"
    paths = write_report(run, args.results_dir, latest=None if args.no_latest else latest)
    published = args.results_dir.resolve() == (PERF_DIR / "results").resolve()
    if published and "latest_md" in paths and latest == "latest":
        write_docs_block(paths["latest_md"])  # docs/performance.md shows the committed latest.md
    print()
    print(render_markdown(run))
    print(
        "[perf] wrote " + ", ".join(str(p) for k, p in paths.items() if not k.startswith("latest"))
    )
    wall = time.time() - started
    if args.quick and wall > QUICK_BUDGET_S:
        print(f"[perf] warning: --quick took {wall:.0f} s, over its {QUICK_BUDGET_S:.0f} s budget")

    if args.check:
        for r in results:
            if r.status == "known-miss":
                print(
                    f"[perf] KNOWN MISS (reported, not gating): goal {r.goal} "
                    f"({r.bench}/{r.case} vs {r.baseline}): ratio {r.ratio:.3g}x < "
                    f"{r.min_ratio:g}x -- see perf/thresholds.json",
                    file=sys.stderr,
                )
        if fails or bench_fail:
            for r in fails:
                what = (
                    f"ratio {r.ratio:.3g}x < check floor {r.floor:.3g}x (goal {r.min_ratio:g}x)"
                    if r.ratio is not None
                    else r.detail
                )
                print(
                    f"[perf] CHECK FAILED: goal {r.goal} ({r.bench}/{r.case} vs {r.baseline}): "
                    f"{r.status}: {what}",
                    file=sys.stderr,
                )
            for b in bench_fail:
                print(
                    f"[perf] CHECK FAILED: {b['goal']} raised: {' '.join(b['detail'])}",
                    file=sys.stderr,
                )
            return 1
        print("[perf] check passed: every gating goal met (or within its documented noise margin)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
