"""Shared timing harness for te_thd benchmarks.

Every benchmark compares te_thd against baselines measured *in the same run*:
candidates are timed interleaved (A B C A B C ...) so machine noise hits all of
them alike, and the median of the trials is reported. Ratios, not absolute
times, are what ``perf/run.py --check`` compares to the goals in
``perf/thresholds.json``.

A bench module ``perf/bench_<name>.py`` exposes ``run(quick: bool) -> list[Record]``
and can also be run on its own (``python perf/bench_<name>.py [--quick]``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


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


def time_interleaved(
    candidates: dict[str, Callable[[], Any]],
    *,
    trials: int = 7,
    inner: int = 1,
    warmup: int = 1,
) -> dict[str, float]:
    """Median seconds per call of each candidate, timed round-robin.

    Each trial calls every candidate ``inner`` times back to back; the trial's
    time divided by ``inner`` is one sample. Returns ``{name: median_seconds}``.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing in one candidate's trial is noise, not cost
    try:
        for _ in range(trials):
            for name, fn in candidates.items():
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                samples[name].append((time.perf_counter() - t0) / inner)
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def print_records(records: list[Record]) -> None:
    """Human-readable one-line-per-case summary."""
    for r in records:
        ratios = ", ".join(f"{k}: {v:.2f}x" for k, v in r.ratios.items())
        print(f"[{r.bench}] {r.case}: ours={r.ours:.6g} {r.unit}  ({ratios})")
