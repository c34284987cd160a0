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
