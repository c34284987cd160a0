"""The top-level ``te-thd`` command: options after ``bench`` reach perf/run.py; a stopped or
killed ``te-thd bench`` leaves no benchmark running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from te_thd._demo_jobs import descendants


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


#: what a help or a bad argument must not wait for: the cache imports these when a command runs
HEAVY = ("torch", "numpy", "safetensors", "obstore", "multistorageclient", "te_thd.offline_cache")


def test_cache_help_and_bad_arguments_import_no_heavy_module():
    code = (
        "import sys\n"
        "from te_thd.cli import main\n"
        "for argv in (['cache', '--help'], ['cache', 'info', '--help'], ['cache', 'plan', '--help'],\n"
        "             ['cache', 'unlock'], ['cache', 'nope']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print([m for m in sys.modules if m.startswith({HEAVY!r})])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]", out.stdout.splitlines()[-1]
    assert "usage: te-thd cache info [-h] [--json] dir" in out.stdout  # their help is all there


def test_a_cache_command_runs_what_it_parsed(tmp_path):
    out = _run("cache", "unlock", str(tmp_path / "nothing"))
    assert out.returncode == 1 and out.stderr.startswith("te-thd cache unlock: "), out.stderr


def _bench_running(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """``te-thd bench`` of a bench that runs for many seconds, once its bench child runs; every
    process below it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "te_thd.cli", "bench", "--quick", "--only", "tokens"]
        + ["--results-dir", str(tmp_path), "--no-latest"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        below = descendants(proc.pid)
        if any("--child" in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in below):
            return proc, below
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the bench child never started")


def _all_gone(pids: list[int], timeout: float = 20) -> list[int]:
    """The processes of ``pids`` still running after ``timeout`` seconds (none: all stopped)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in pids:
            try:
                left += (
                    [p]
                    if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                    else []
                )
            except (OSError, IndexError):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_bench_stops_its_benchmarks_and_says_so_in_one_line(tmp_path, sig):
    proc, below = _bench_running(tmp_path)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    name = signal.Signals(sig).name
    assert err.splitlines()[-1] == (
        f"te-thd bench: stopped by {name}; its benchmarks were stopped too"
    ), err
    assert "Traceback" not in err
    assert not _all_gone(below)


def test_a_bench_killed_with_sigkill_leaves_nothing_running(tmp_path):
    proc, below = _bench_running(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    left = _all_gone(below)
    for p in left:  # leave nothing behind even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left
