"""Shared plumbing of the reliability fuzz suites (tests/test_reliability_fuzz_*.py).

* :data:`FUZZ` - the hypothesis settings every fuzz test uses; the number of
  examples comes from ``TE_THD_FUZZ_EXAMPLES`` (default: the CI budget).
* :func:`count` - every example records which target it exercised and whether the
  target returned (checked against the oracle) or raised ``ValueError``; with
  ``TE_THD_FUZZ_COUNTS=path`` the totals are written there as JSON at exit, which is
  how ``scripts/reliability_figures.py`` reports "fuzz examples run".
* :func:`expect` - the one rule of the fuzz suites: the call either returns a result
  (checked by the caller against its loop oracle) or raises ``ValueError``; anything
  else propagates and fails the test. ``verdict`` says what the oracle allows.
"""

from __future__ import annotations

import atexit
import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

#: Examples per fuzz test. CI default keeps the whole reliability suite inside its budget.
EXAMPLES = int(os.environ.get("TE_THD_FUZZ_EXAMPLES", "150"))

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)

#: Oracle verdicts: the input is well-formed (a result is required), malformed (a
#: ValueError is required), or in a documented grey zone (either is acceptable, but
#: a result must still satisfy the oracle's invariants).
VALID, INVALID, EITHER = "valid", "invalid", "either"

COUNTS: Counter[str] = Counter()


def count(target: str, outcome: str) -> None:
    COUNTS[f"{target}:{outcome}"] += 1


def _dump() -> None:
    path = os.environ.get("TE_THD_FUZZ_COUNTS")
    if path and COUNTS:
        old: dict[str, int] = {}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
        merged = Counter(old) + COUNTS
        with open(path, "w") as f:
            json.dump(dict(sorted(merged.items())), f, indent=1)


atexit.register(_dump)


def expect(target: str, verdict: str, fn: Callable[[], Any], why: str = "") -> Any:
    """Call ``fn``; enforce ``verdict``; return its result, or None when it raised ValueError.

    ``why`` describes the oracle's reason (shown when the verdict is violated).
    """
    try:
        out = fn()
    except ValueError as e:
        assert verdict != VALID, f"{target}: well-formed input rejected ({why}): {e}"
        assert str(e).strip(), f"{target}: ValueError without a message"
        count(target, "ValueError")
        return None
    assert verdict != INVALID, f"{target}: malformed input accepted silently ({why})"
    count(target, "result")
    return out
