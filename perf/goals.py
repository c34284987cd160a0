"""Goals of the perf suite: load ``perf/thresholds.json`` and judge ratios against it.

A goal names a bench module (``bench_<name>.py`` -> ``name``), an ``fnmatch``
pattern over its records' ``case`` and one over baseline names, and
``min_ratio``: the smallest acceptable :attr:`harness.Record.ratios` value
(oriented so > 1 means te_thd is better; "at most 2x the time of X" is
``min_ratio = 0.5``). Every record the patterns match must meet the goal.

Noise: a ratio below ``min_ratio`` but within ``noise_margin`` of it
(``ratio >= min_ratio * (1 - noise_margin)``) is reported as ``noise`` — shown
as short of the goal, but not failing ``--check``. The goal itself stays what
the issue says.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness import Record

#: statuses that make ``--check`` fail (``known-miss`` is reported, never hidden, but
#: does not gate: see ``Goal.known_miss``)
FAILING = ("missed", "error", "no-data")


@dataclass(frozen=True)
class Goal:
    """One line of ``thresholds.json``."""

    id: str
    bench: str
    case: str
    baseline: str
    min_ratio: float
    noise_margin: float
    statement: str
    #: what the goal protects, in the repository's own words
    purpose: str = ""
    needs_reference: bool = False
    #: why a miss of this goal cannot be fixed in code on the machine it is measured on
    #: (e.g. a physical bound). A miss is then reported as ``known-miss`` with this
    #: reason in every table instead of failing ``--check``; the goal itself is kept
    #: and a gating goal that the code *can* be held to should stand beside it.
    known_miss: str = ""

    @property
    def floor(self) -> float:
        """The lowest ratio ``--check`` accepts (goal less the noise margin)."""
        return self.min_ratio * (1.0 - self.noise_margin)


@dataclass
class GoalResult:
    """One goal judged on one (record, baseline) pair, or on no data at all."""

    goal: str
    bench: str
    case: str
    baseline: str
    ratio: float | None
    min_ratio: float
    floor: float
    status: str  # met | noise | missed | known-miss | skipped | error | no-data | not-run
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["ratio"] is not None and not math.isfinite(d["ratio"]):
            d["ratio"] = None if math.isnan(d["ratio"]) else 1e300
        return d


def load_goals(path: str | Path) -> list[Goal]:
    """Parse ``thresholds.json``; raise ValueError naming the file and the bad entry."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"thresholds file {path}: cannot read it as JSON ({e})") from e
    default_margin = float(data.get("noise_margin", 0.0))
    goals: list[Goal] = []
    seen: set[str] = set()
    for i, g in enumerate(data.get("goals", [])):
        missing = [k for k in ("id", "bench", "baseline", "min_ratio", "statement") if k not in g]
        if missing:
            raise ValueError(
                f"thresholds file {path}: goal #{i} lacks {missing}; every goal needs "
                "id, bench, baseline, min_ratio and statement"
            )
        if g["id"] in seen:
            raise ValueError(
                f"thresholds file {path}: goal id {g['id']!r} appears twice; ids must be unique"
            )
        seen.add(g["id"])
        margin = float(g.get("noise_margin", default_margin))
        if not 0.0 <= margin < 1.0 or float(g["min_ratio"]) <= 0:
            raise ValueError(
                f"thresholds file {path}: goal {g['id']!r} has min_ratio={g['min_ratio']} "
                f"noise_margin={margin}; need min_ratio > 0 and 0 <= noise_margin < 1"
            )
        goals.append(
            Goal(
                id=str(g["id"]),
                bench=str(g["bench"]),
                case=str(g.get("case", "*")),
                baseline=str(g["baseline"]),
                min_ratio=float(g["min_ratio"]),
                noise_margin=margin,
                statement=str(g["statement"]),
                purpose=str(g.get("purpose", "")),
                needs_reference=bool(g.get("needs_reference", False)),
                known_miss=str(g.get("known_miss", "")),
            )
        )
    return goals


def judge(ratio: float, goal: Goal) -> str:
    """``met`` / ``noise`` / ``missed`` (``known-miss``) for one ratio (NaN counts as missed)."""
    if ratio >= goal.min_ratio:
        return "met"
    if ratio >= goal.floor:
        return "noise"
    return "known-miss" if goal.known_miss else "missed"


def evaluate(
    goals: list[Goal],
    records: dict[str, list[Record]],
    errors: dict[str, str],
    *,
    selected: set[str],
    reference_available: bool,
) -> list[GoalResult]:
    """Judge every goal.

    ``records`` maps bench module name -> its records; ``errors`` maps bench
    module name -> error text for benches that raised or died; ``selected`` is
    the set of bench names this run was asked to run (goals of others are
    ``not-run``). A goal whose bench ran but matched no record is ``no-data``
    (a renamed case must not silently drop its goal) unless it needs the
    reference and the reference is not installed (``skipped``).
    """
    out: list[GoalResult] = []
    for g in goals:
        base = dict(goal=g.id, bench=g.bench, min_ratio=g.min_ratio, floor=g.floor)
        if g.bench not in selected:
            out.append(
                GoalResult(
                    **base,
                    case=g.case,
                    baseline=g.baseline,
                    ratio=None,
                    status="not-run",
                    detail="bench not selected",
                )
            )
            continue
        if g.bench in errors:
            out.append(
                GoalResult(
                    **base,
                    case=g.case,
                    baseline=g.baseline,
                    ratio=None,
                    status="error",
                    detail=f"bench {g.bench} failed",
                )
            )
            continue
        if g.bench not in records:
            out.append(
                GoalResult(
                    **base,
                    case=g.case,
                    baseline=g.baseline,
                    ratio=None,
                    status="no-data",
                    detail=f"no bench module bench_{g.bench}.py",
                )
            )
            continue
        hits = 0
        for r in records[g.bench]:
            if not fnmatch.fnmatchcase(r.case, g.case):
                continue
            for name, ratio in r.ratios.items():
                if not fnmatch.fnmatchcase(name, g.baseline):
                    continue
                hits += 1
                out.append(
                    GoalResult(
                        **base, case=r.case, baseline=name, ratio=ratio, status=judge(ratio, g)
                    )
                )
        if hits == 0:
            if g.needs_reference and not reference_available:
                out.append(
                    GoalResult(
                        **base,
                        case=g.case,
                        baseline=g.baseline,
                        ratio=None,
                        status="skipped",
                        detail="reference implementation not installed",
                    )
                )
            else:
                out.append(
                    GoalResult(
                        **base,
                        case=g.case,
                        baseline=g.baseline,
                        ratio=None,
                        status="no-data",
                        detail=f"no record of bench {g.bench!r} matches case "
                        f"{g.case!r} with a baseline matching {g.baseline!r}",
                    )
                )
    return out


def failures(results: list[GoalResult]) -> list[GoalResult]:
    """The results that make ``--check`` exit 1."""
    return [r for r in results if r.status in FAILING]
