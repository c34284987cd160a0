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

import pytest
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


@pytest.fixture(autouse=True)
def _restore_read_tuning():
    """The read path's tuning constants a test set (``_offline_cache_support.read_tuning``) are
    restored after it."""
    yield
    support = sys.modules.get("_offline_cache_support")
    if support is not None:
        support.restore_read_tuning()


def pytest_configure(config) -> None:
    """Every temporary file of the run -- the tests', their subprocesses' (torchrun's logs,
    multiprocessing's sockets), scripts' ``mkdtemp`` -- goes under one directory of this run,
    removed when the run ends: the suite leaves nothing behind in the system temp directory."""
    import shutil
    import tempfile

    # pytest's own tmp_path directories stay in the system temp directory, where its
    # retention policy (pyproject.toml: only failed tests') decides what is kept
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    # this process's multiprocessing directory is made first, where multiprocessing removes it
    # itself at exit (after this run's directory is gone)
    import multiprocessing.util

    multiprocessing.util.get_temp_dir()
    root = tempfile.mkdtemp(prefix="te_thd-tests-")
    config._te_thd_tmp = (root, os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = root
    tempfile.tempdir = root

    def _cleanup() -> None:
        shutil.rmtree(root, ignore_errors=True)

    config.add_cleanup(_cleanup)


def pytest_unconfigure(config) -> None:
    import tempfile

    saved = getattr(config, "_te_thd_tmp", None)
    if saved is None:
        return
    _, env, cached = saved
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    tempfile.tempdir = cached
