"""Outputs of a perf run: JSON (history), a markdown table and a PNG chart.

``perf/run.py`` builds one run document (:func:`build_run`) and hands it to
:func:`write_report`, which writes ``perf/results/run-<time>-<commit>-<mode>.{json,md,png}``
(the history: one file set per run, git-ignored) and copies them to
``perf/results/latest.*`` for a full run of every bench (committed; the README links
them), ``latest-quick.*`` / ``latest-partial.*`` for ``--quick`` / ``--only`` runs (not
committed), so a CI or subset run never replaces the README's figures.

Run on its own, ``python perf/report.py RUN.json`` re-renders the markdown and
chart of a stored run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1

#: distributions whose versions every run records
VERSIONED = (
    "te_thd",
    "torch",
    "numpy",
    "safetensors",
    "megatron-core",
    "nemo-automodel",
    "matplotlib",
)

STATUS_MARK = {
    "met": "met",
    "noise": "short, within noise",
    "missed": "**MISSED**",
    "known-miss": "**MISSED** (known, not gating: see thresholds.json)",
    "error": "**ERROR**",
    "no-data": "**NO DATA**",
    "skipped": "skipped",
    "not-run": "not run",
}


# --------------------------------------------------------------------------- facts


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, memory and load: what makes two runs comparable."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in VERSIONED:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def git_info(repo: Path = REPO_ROOT) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                               timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }


def build_run(
    *,
    mode: str,
    argv: list[str],
    started: float,
    benches: list[dict[str, Any]],
    goals: list[dict[str, Any]],
    goal_specs: list[dict[str, Any]],
    reference: dict[str, Any],
    check_failures: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run document: every figure plus what is needed to reproduce or compare it."""
    return {
        "schema": SCHEMA,
        "mode": mode,
        "argv": argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 2),
        "git": git_info(),
        "machine": machine_info(),
        "versions": package_versions(),
        "reference": reference,
        "benches": benches,
        "goals": goals,
        "goal_specs": goal_specs,
        "check": {"passed": not check_failures, "failures": check_failures},
    }


# --------------------------------------------------------------------------- formatting


def fmt_value(value: float | None, unit: str) -> str:
    """``0.000123 s`` -> ``123 us``; throughputs get k/M suffixes."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "s" or unit.startswith("s/"):  # seconds, or seconds per something
        per = unit[1:]
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
            if abs(value) >= scale or name == "ns":
                return f"{value / scale:.3g} {name}{per}"
    for scale, name in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{name} {unit}"
    return f"{value:.3g} {unit}"


def fmt_ratio(r: float | None, goal: float | None = None) -> str:
    """``3.14x``; more digits when rounding would hide that ``r`` is below ``goal``."""
    if r is None:
        return "-"
    if math.isinf(r):
        return "inf"
    if goal is not None and r < goal and round(r, 2) >= goal:
        return f"{r:.4f}x"
    return f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


def _is_scaling(rec: dict[str, Any]) -> bool:
    return "axis" in (rec.get("extra") or {})


def _goal_index(run: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(g["bench"], g["case"], g["baseline"]): g for g in run["goals"] if g.get("ratio") is not None}


def previous_ratios(results_dir: Path, run: dict[str, Any], exclude: Path | None) -> dict[tuple, float]:
    """Ratios of the most recent earlier run of the same mode (the history column)."""
    candidates = sorted(results_dir.glob(f"run-*-{run['mode']}.json"))
    for path in reversed(candidates):
        if exclude is not None and path.resolve() == exclude.resolve():
            continue
        try:
            prev = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out: dict[tuple, float] = {}
        for b in prev.get("benches", []):
            for rec in b.get("records", []):
                for name, ratio in (rec.get("ratios") or {}).items():
                    if ratio is not None:
                        out[(b["name"], rec["case"], name)] = ratio
        return out
    return {}


def render_markdown(run: dict[str, Any], prev: dict[tuple, float] | None = None) -> str:
    """Goals summary, the full ratio table, bench errors and the scaling table."""
    prev = prev or {}
    m = run["machine"]
    git = run["git"]
    lines: list[str] = []
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    lines.append(
        f"Run `{run['mode']}` of {run['started']} at commit {commit}; "
        f"{m.get('cpu_model', m.get('machine'))}, {m.get('usable_cpus')} usable cores; "
        f"torch {run['versions'].get('torch')}; reference: "
        + (f"nemo-automodel {run['versions'].get('nemo-automodel')}" if run["reference"].get("available")
           else f"not available ({run['reference'].get('detail', '')})")
        + f"; {run['wall_s']:.0f} s in all."
    )
    load = m.get("loadavg")
    times = ", ".join(f"{b['name']} {b.get('wall_s', 0):.0f} s ({b.get('cpu_s', 0):.0f} CPU-s"
                      + (f", median of {b['runs']} runs after a miss" if b.get("runs", 1) > 1 else "")
                      + ")" for b in run["benches"])
    if times:
        lines.append("")
        lines.append(f"Bench wall time (CPU time): {times}"
                     + (f"; load average at start {load[0]:.1f}." if load else "."))
    lines.append("")

    # goals: one line per goal, worst result shown
    lines.append("| goal | statement | worst ratio | goal | check floor | status |")
    lines.append("|---|---|---|---|---|---|")
    by_goal: dict[str, list[dict[str, Any]]] = {}
    for g in run["goals"]:
        by_goal.setdefault(g["goal"], []).append(g)
    statements = {s["id"]: s for s in run.get("goal_specs", [])}
    order = ("error", "no-data", "missed", "known-miss", "noise", "met", "skipped", "not-run")
    for gid, rows in by_goal.items():
        worst = min(rows, key=lambda r: (order.index(r["status"]),
                                         r["ratio"] if r["ratio"] is not None else 0.0))
        spec = statements.get(gid, {})
        where = f" ({worst['case']} vs {worst['baseline']})" if worst["ratio"] is not None else ""
        lines.append(
            f"| `{gid}` | {spec.get('statement', '')} | {fmt_ratio(worst['ratio'], worst['min_ratio'])}{where} | "
            f">= {worst['min_ratio']:g}x | {worst['floor']:.3g}x | {STATUS_MARK[worst['status']]}"
            + (f": {worst['detail']}" if worst.get("detail") else "") + " |"
        )
    lines.append("")

    # every figure
    goals = _goal_index(run)
    lines.append("| bench | case | te_thd | baseline | baseline figure | ratio | previous run | goal |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for b in run["benches"]:
        for rec in b.get("records", []):
            if _is_scaling(rec):
                continue
            ours = fmt_value(rec["ours"], rec["unit"])
            if not rec["baselines"]:
                lines.append(f"| {b['name']} | {rec['case']} | {ours} | - | - | - | - | - |")
            for name, base in rec["baselines"].items():
                ratio = rec["ratios"].get(name)
                g = goals.get((b["name"], rec["case"], name))
                gtxt = f">= {g['min_ratio']:g}x: {STATUS_MARK[g['status']]}" if g else "-"
                lines.append(
                    f"| {b['name']} | {rec['case']} | {ours} | {name} | {fmt_value(base, rec['unit'])} "
                    f"| {fmt_ratio(ratio, g['min_ratio'] if g else None)} "
                    f"| {fmt_ratio(prev.get((b['name'], rec['case'], name)))} | {gtxt} |"
                )
    lines.append("")
    lines.append("Ratios are oriented so that > 1 means te_thd is better (time: baseline / te_thd; "
                 "throughput: te_thd / baseline); each is the median of interleaved trials "
                 "measured in this run.")

    errs = [b for b in run["benches"] if b.get("status") != "ok"]
    if errs:
        lines.append("")
        lines.append("Bench errors:")
        lines.append("")
        for b in errs:
            last = (b.get("error") or "").strip().splitlines()[-1:] or ["(no message)"]
            lines.append(f"- `{b['name']}`: {b.get('status')}: {last[0]}")

    scaling = render_scaling(run)
    if scaling:
        lines.append("")
        lines.append(scaling)
    return "\n".join(lines) + "\n"


def growth_exponent(sizes: list[float], times: list[float]) -> float | None:
    """Least-squares k in ``time ∝ size**k`` over the points (log-log slope)."""
    pts = [(math.log(s), math.log(t)) for s, t in zip(sizes, times, strict=True) if s > 0 and t > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def render_scaling(run: dict[str, Any]) -> str:
    """Per-series tables of records carrying ``extra['axis']`` (perf/bench_scaling.py)."""
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for b in run["benches"]:
        for rec in b.get("records", []):
            if _is_scaling(rec):
                key = (str(rec["extra"].get("series", b["name"])), str(rec["extra"]["axis"]))
                series.setdefault(key, []).append(rec)
    if not series:
        return ""
    lines = ["| cost | axis | size | work | te_thd per call | te_thd per unit | baseline per unit | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for (name, _axis), recs in series.items():
        recs = sorted(recs, key=lambda r: r["extra"]["size"])
        for rec in recs:
            ex = rec["extra"]
            work = float(ex["work"])
            unit = ex.get("work_unit", "unit")
            base_txt, ratio_txt = "-", "-"
            if rec["baselines"]:
                bname, bval = next(iter(rec["baselines"].items()))
                base_txt = f"{fmt_value(bval / work, 's')}/{unit} ({bname})"
                ratio_txt = fmt_ratio(rec["ratios"].get(bname))
            lines.append(
                f"| {name} | {ex['axis']} | {ex['size']:g} | {work:g} {unit}s | "
                f"{fmt_value(rec['ours'], 's')} | {fmt_value(rec['ours'] / work, 's')}/{unit} | "
                f"{base_txt} | {ratio_txt} |"
            )
        k = growth_exponent([r["extra"]["size"] for r in recs], [r["ours"] for r in recs])
        per_unit = [r["ours"] / float(r["extra"]["work"]) for r in recs]
        expect = recs[0]["extra"].get("expect", "")
        if k is not None:
            notes.append(
                f"- **{name}** vs {recs[0]['extra']['axis']}: time ∝ size^{k:.2f} "
                f"(expected: {expect}); per-{recs[0]['extra'].get('work_unit', 'unit')} cost "
                f"{fmt_value(per_unit[0], 's')} at the smallest size, {fmt_value(per_unit[-1], 's')} "
                f"at the largest."
            )
    return "Scaling (te_thd; baseline measured alongside):\n\n" + "\n".join(lines) + "\n\n" + "\n".join(notes)


# --------------------------------------------------------------------------- chart


_COLORS = {"met": "#2e7d32", "noise": "#f9a825", "missed": "#c62828", "known-miss": "#c62828"}


def render_chart(run: dict[str, Any], path: Path) -> bool:
    """Horizontal bars of every non-scaling ratio (log scale) with its goal marked.

    Returns False (and writes nothing) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    goals = _goal_index(run)
    rows: list[tuple[str, float, dict[str, Any] | None]] = []
    for b in run["benches"]:
        for rec in b.get("records", []):
            if _is_scaling(rec):
                continue
            for name, ratio in rec["ratios"].items():
                if ratio is None or not math.isfinite(ratio) or ratio <= 0:
                    continue
                rows.append((f"{b['name']} · {rec['case']}  vs {name}", ratio,
                             goals.get((b["name"], rec["case"], name))))
    fig_h = max(2.5, 0.28 * len(rows) + 1.4)
    fig, ax = plt.subplots(figsize=(11, fig_h))
    if not rows:
        ax.text(0.5, 0.5, "no ratios in this run", ha="center", va="center")
        ax.set_axis_off()
    else:
        ys = list(range(len(rows)))[::-1]
        for y, (_, ratio, g) in zip(ys, rows, strict=True):
            color = _COLORS.get(g["status"], "#9e9e9e") if g else "#b0bec5"
            ax.barh(y, ratio, color=color, height=0.7)
            ax.text(ratio * 1.04, y, fmt_ratio(ratio, g["min_ratio"] if g else None), va="center",
                    fontsize=7)
            if g:
                ax.plot([g["min_ratio"]] * 2, [y - 0.45, y + 0.45], color="black", lw=2)
                ax.plot([g["floor"]] * 2, [y - 0.45, y + 0.45], color="black", lw=0.8, ls=":")
        ax.set_yticks(ys)
        ax.set_yticklabels([r[0] for r in rows], fontsize=7)
        ax.set_xscale("log")
        lo = min(min(r[1] for r in rows), min((r[2]["floor"] for r in rows if r[2]), default=1.0))
        hi = max(max(r[1] for r in rows), max((r[2]["min_ratio"] for r in rows if r[2]), default=1.0))
        ax.set_xlim(lo / 1.6, hi * 2.2)
        ax.axvline(1.0, color="#616161", lw=0.8)
        ax.set_xlabel("ratio (> 1: te_thd better than the baseline; log scale)")
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        ax.legend(
            handles=[Patch(color=_COLORS["met"], label="goal met"),
                     Patch(color=_COLORS["noise"], label="short, within noise margin"),
                     Patch(color=_COLORS["missed"], label="goal missed"),
                     Patch(color="#b0bec5", label="no goal (informational)"),
                     Line2D([], [], color="black", lw=2, label="goal"),
                     Line2D([], [], color="black", lw=0.8, ls=":", label="--check floor")],
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
        )
    commit = (run["git"].get("commit") or "unknown")[:10]
    ax.set_title(f"te_thd perf ({run['mode']}, {run['started']}, {commit})", fontsize=9)
    tmp = path.with_suffix(".png.tmp")
    # bbox "tight": long case labels on the left and the legend on the right stay in frame
    fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return True


# --------------------------------------------------------------------------- files


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(run: dict[str, Any], results_dir: Path, *, latest: str | None = "latest") -> dict[str, Path]:
    """Write the run's JSON, markdown and PNG; copy them to ``<latest>.*`` unless None."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.strptime(run["started"][:19], "%Y-%m-%dT%H:%M:%S"))
    commit = (run["git"].get("commit") or "nogit")[:8]
    stem = results_dir / f"run-{stamp}-{commit}-{run['mode']}"
    n = 1
    while stem.with_suffix(".json").exists():  # two runs in one second keep both files
        n += 1
        stem = results_dir / f"run-{stamp}.{n}-{commit}-{run['mode']}"
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"),
             "png": stem.with_suffix(".png")}
    prev = previous_ratios(results_dir, run, exclude=paths["json"])
    _atomic_text(paths["json"], json.dumps(run, indent=1, allow_nan=False) + "\n")
    _atomic_text(paths["md"], render_markdown(run, prev))
    if not render_chart(run, paths["png"]):
        del paths["png"]
    if latest:
        for kind, p in list(paths.items()):
            dst = results_dir / f"{latest}.{kind}"
            shutil.copyfile(p, dst)
            paths[f"latest_{kind}"] = dst
    return paths


def ratio_spread(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How much each ratio moved over repeated runs of the same code.

    For every (bench, case, baseline) present in at least two runs: the median
    ratio and the largest relative deviation of any run from that median — the
    figure the noise margins in ``thresholds.json`` are set against.
    """
    import statistics

    seen: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        for b in run.get("benches", []):
            for rec in b.get("records", []):
                for name, r in (rec.get("ratios") or {}).items():
                    if r is not None and r > 0:
                        seen.setdefault((b["name"], rec["case"], name), []).append(float(r))
    out = []
    for (bench, case, base), rs in seen.items():
        if len(rs) < 2:
            continue
        med = statistics.median(rs)
        out.append({"bench": bench, "case": case, "baseline": base, "runs": len(rs), "median": med,
                    "min": min(rs), "max": max(rs),
                    "max_rel_dev": max(abs(r / med - 1.0) for r in rs)})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Re-render the markdown and chart of a stored run, or "
                                 "(--spread) show how ratios moved across several runs.")
    ap.add_argument("run_json", type=Path, nargs="+")
    ap.add_argument("--spread", action="store_true",
                    help="print each ratio's median and largest deviation over the given runs")
    args = ap.parse_args(argv)
    if args.spread:
        runs = [json.loads(p.read_text()) for p in args.run_json]
        goals = {(g["bench"], g["case"], g["baseline"]) for r in runs for g in r.get("goals", [])
                 if g.get("ratio") is not None}
        print("| bench | case | baseline | runs | median | min | max | max deviation | has goal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in ratio_spread(runs):
            key = (row["bench"], row["case"], row["baseline"])
            print(f"| {row['bench']} | {row['case']} | {row['baseline']} | {row['runs']} | "
                  f"{row['median']:.3g} | {row['min']:.3g} | {row['max']:.3g} | "
                  f"{row['max_rel_dev']:.1%} | {'yes' if key in goals else ''} |")
        return 0
    if len(args.run_json) != 1:
        ap.error("re-rendering takes one run JSON (or pass --spread)")
    args.run_json = args.run_json[0]
    run = json.loads(args.run_json.read_text())
    md = args.run_json.with_suffix(".md")
    _atomic_text(md, render_markdown(run, previous_ratios(args.run_json.parent, run, args.run_json)))
    render_chart(run, args.run_json.with_suffix(".png"))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
