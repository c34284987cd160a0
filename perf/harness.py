"""Shared timing harness for te_thd benchmarks.

Every benchmark compares te_thd against baselines measured *in the same run*:
candidates are timed interleaved (A B C A B C ...) so machine noise hits all of
them alike, and the median of the trials is reported. Ratios, not absolute
times, are what ``perf/run.py --check`` compares to the goals in
``perf/thresholds.json``.

A bench module ``perf/bench_<name>.py`` exposes ``run(quick: bool) -> list[Record]``
and can also be run on its own (``python perf/bench_<name>.py [--quick]``).
Baselines from the reference implementation come from :func:`reference_thd_utils`
/ :func:`reference_offline_cache`, which return None when it is not installed:
a bench then reports its remaining baselines instead of failing.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

#: The file naming the reference implementation every "reference" baseline means;
#: ``scripts/setup.sh`` installs it with ``--no-deps`` (benches must run without it).
REFERENCE_REQUIREMENTS_FILE = Path(__file__).resolve().parent / "reference-requirements.txt"


def _reference_requirement(path: Path = REFERENCE_REQUIREMENTS_FILE) -> str:
    """The one ``name==version`` line of ``path`` (comments and blank lines skipped)."""
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(reqs) != 1 or "==" not in reqs[0]:
        raise ValueError(f"{path} must hold exactly one 'name==version' line, got {reqs}")
    return reqs[0]


REFERENCE_REQUIREMENT = _reference_requirement()
REFERENCE_VERSION = REFERENCE_REQUIREMENT.split("==", 1)[1]


@dataclass
class Record:
    """One benchmark case.

    ``metric`` is ``"time"`` (seconds per call, lower is better) or
    ``"throughput"`` (items per second, higher is better). ``ratios[name]`` is
    always oriented so that > 1 means te_thd is better than baseline ``name``
    (speed-up for time, throughput quotient for throughput).
    """

    bench: str
    case: str
    metric: str
    unit: str
    ours: float
    baselines: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratios(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, base in self.baselines.items():
            if self.metric == "time":
                out[name] = base / self.ours if self.ours > 0 else float("inf")
            else:
                out[name] = self.ours / base if base > 0 else float("inf")
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"] = self.ratios
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        """Inverse of :meth:`to_json` (the derived ``ratios`` key is ignored).

        A None figure (how strict JSON stores inf/nan) reads back as NaN.
        """

        def num(v: Any) -> float:
            return float("nan") if v is None else float(v)

        return cls(
            bench=str(d["bench"]),
            case=str(d["case"]),
            metric=str(d["metric"]),
            unit=str(d["unit"]),
            ours=num(d["ours"]),
            baselines={str(k): num(v) for k, v in dict(d.get("baselines") or {}).items()},
            extra=dict(d.get("extra") or {}),
        )


#: set to 1 (``perf/run.py --no-reference``) to run every bench as if the reference
#: were not installed, which is how the suite behaves where it cannot be installed
NO_REFERENCE_ENV = "TE_THD_PERF_NO_REFERENCE"


def _reference_version() -> str | None:
    if os.environ.get(NO_REFERENCE_ENV) == "1":
        return None
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - stdlib since 3.8
        return None
    try:
        return version("nemo-automodel")
    except PackageNotFoundError:
        return None


def reference_thd_utils() -> ModuleType | None:
    """The reference ``thd_utils`` module, or None when it is not installed.

    Only the pinned version counts: a different release may behave (and time)
    differently, and the goals were set against this one.
    """
    if _reference_version() != REFERENCE_VERSION:
        return None
    try:
        return importlib.import_module("nemo_automodel.components.distributed.thd_utils")
    except Exception:  # noqa: BLE001 - any import failure means "no reference baseline"
        return None


def reference_offline_cache() -> ModuleType | None:
    """The reference ``offline_cache`` module loaded by file path, or None.

    Its package ``__init__`` imports ``datasets`` (not installed with
    ``--no-deps``), so the module file is loaded on its own.
    """
    if _reference_version() != REFERENCE_VERSION:
        return None
    try:
        spec0 = importlib.util.find_spec("nemo_automodel")
        if spec0 is None or spec0.origin is None:
            return None
        path = os.path.join(
            os.path.dirname(spec0.origin), "components", "datasets", "llm", "offline_cache.py"
        )
        spec = importlib.util.spec_from_file_location("ref_offline_cache", path)
        if spec is None or spec.loader is None:
            return None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    except Exception:  # noqa: BLE001 - any import failure means "no reference baseline"
        return None


def finite_or_none(x: float) -> float | None:
    """JSON-safe number: ``inf``/``nan`` become None."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def time_interleaved(
    candidates: dict[str, Callable[[], Any]],
    *,
    trials: int = 7,
    inner: int = 1,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds per call of each candidate, timed round-robin.

    Each trial calls every candidate ``inner`` times back to back; the trial's
    time divided by ``inner`` is one sample. ``clock``: wall time by default;
    ``time.thread_time`` counts only this thread's CPU time (for single-threaded
    work on a machine other processes keep busy). Returns ``{name: median_seconds}``.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing in one candidate's trial is noise, not cost
    # The per-trial collection below should only walk what the candidates allocated:
    # with torch (+ the reference) imported a full collection takes ~0.25 s, which
    # would dominate a quick run. freeze() parks every existing object outside the
    # collector until unfreeze().
    gc.freeze()
    try:
        for _ in range(trials):
            for name, fn in candidates.items():
                t0 = clock()
                for _ in range(inner):
                    fn()
                samples[name].append((clock() - t0) / inner)
            gc.collect()
    finally:
        gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def split_even(pieces: Sequence[T], parts: int, size: Callable[[T], int]) -> list[list[T]]:
    """Cut ``pieces`` (in order) into at most ``parts`` consecutive groups of about equal ``size``.

    Group ``g`` ends at the first piece whose cumulative size reaches ``(g + 1) / parts``
    of the total; empty groups are dropped. The static split of the raw multi-thread
    read loops (one group per thread); te_thd's reader instead lets its threads take
    pieces one at a time, so a late thread holds nothing up.
    """
    total = sum(size(p) for p in pieces)
    groups: list[list[T]] = [[]]
    done = 0
    for piece in pieces:
        if done * parts >= total * len(groups) and len(groups) < parts and groups[-1]:
            groups.append([])
        groups[-1].append(piece)
        done += size(piece)
    return groups


def print_records(records: list[Record]) -> None:
    """Human-readable one-line-per-case summary."""
    for r in records:
        ratios = ", ".join(f"{k}: {v:.2f}x" for k, v in r.ratios.items())
        print(f"[{r.bench}] {r.case}: ours={r.ours:.6g} {r.unit}  ({ratios})")
