"""Crash consistency, quick mode of scripts/crash_test.py (the full mode is >= 50 kills).

Real producer processes (single-process and 2-rank gloo) are SIGKILLed at random
points and resumed; every resumed cache must be byte-identical to a clean run's,
pass ``verify_cache(deep=True)``, leave no temp file, and a reader process polling
the directory must never see a partial shard or manifest. See the script's
docstring for every check.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _crash_test_module():
    spec = importlib.util.spec_from_file_location(
        "crash_test", REPO_ROOT / "scripts" / "crash_test.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_sigkilled_producers_resume_to_a_byte_identical_cache(tmp_path: Path) -> None:
    seed = int(os.environ.get("TE_THD_CRASH_SEED", time.time_ns() % 2**31))
    res = _crash_test_module().run(quick=True, seed=seed, workdir=str(tmp_path))
    where = f"(seed {seed}; rerun: python scripts/crash_test.py --quick --seed {seed} -v)"
    assert res["ok"], f"crash consistency violated {where}:\n" + "\n".join(res["violations"])
    assert res["kills"]["single"] >= 3 and res["kills"]["distributed"] >= 2, (res["kills"], where)
    assert res["kills_survived"] == res["kills"]["single"] + res["kills"]["distributed"]
    assert res["poller"]["observations"] > 0, "the reader process never saw a file"
