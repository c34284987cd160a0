"""The top-level ``te-thd`` command: options after ``bench`` reach perf/run.py."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "te_thd.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_bench_forwards_leading_options():
    # `--list` must reach perf/run.py rather than be rejected by te-thd's own parser
    for args in (("bench", "--list"), ("bench", "--", "--list")):
        out = _run(*args)
        assert out.returncode == 0, out.stderr
        assert "goal cp-shard-vs-index-select" in out.stdout
        assert "thd" in out.stdout.split()


def test_unknown_command_is_an_error():
    out = _run("nope")
    assert out.returncode == 2
    assert "invalid choice: 'nope'" in out.stderr
