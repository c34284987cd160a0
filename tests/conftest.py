"""Shared pytest configuration.

Hypothesis: no per-example deadline (2-core CI machines are noisy; speed lives in
perf/), and a derandomised profile under CI so a red run reproduces exactly.

``scripts/`` goes on ``sys.path`` so tests import the reliability scripts' modules
(``bad_inputs``, ``crash_test``, ...) as those scripts import each other when run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

_SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)
