"""Data wait of the demo's training loop (goal ``demo-data-wait`` in thresholds.json).

Runs the README's main job (``te-thd demo``: distributed cache precompute, then
``torchrun`` 4 ranks with CP=2, EP=2 on the CPU) into a temporary directory and
reads the run's own report (``<out>/train/summary.json``): the share of step time
each step spent waiting for its batch (loader + THD kwargs + transfer). The goal is
"under 5% of step time"; as a ratio oriented like every other (> 1 is better) it is
``5% / data_wait_pct``, so ``--check`` asks for >= 1.

This is a check of the loop, not of a kernel: it measures one real run, not a
median of interleaved trials, so it rides on the suite's noise margin and
confirmation re-runs like every other goal.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from harness import Record, print_records

BENCH = "demo"
GOAL_PCT = 5.0


def run(quick: bool) -> list[Record]:
    import argparse

    from te_thd._demo import add_demo_arguments, run_demo

    steps = 40 if quick else 100
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_demo_") as tmp:
        args = parser.parse_args(["--out", tmp, "--steps", str(steps)])
        rc = run_demo(args)
        if rc != 0:
            raise RuntimeError(f"te-thd demo exited {rc}")
        summary = json.loads((Path(tmp) / "train" / "summary.json").read_text())
    wait = max(float(summary["data_wait_pct"]), 1e-6)
    return [
        Record(
            bench=BENCH,
            case=f"data_wait cp={summary['cp']} ep={summary['ep']} ranks={summary['world_size']}",
            metric="time",
            unit="% of step time",
            ours=wait,
            baselines={"goal_5pct": GOAL_PCT},
            extra={
                "steps": summary["steps"],
                "tokens_per_s": summary["tokens_per_s"],
                "loss_first": summary["loss_first"],
                "loss_last": summary["loss_last"],
                "goal": f"data wait <= {GOAL_PCT}% of step time (ratio goal_5pct >= 1)",
            },
        )
    ]


if __name__ == "__main__":
    print_records(run("--quick" in sys.argv))
