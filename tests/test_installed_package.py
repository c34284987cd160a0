"""A regular (non-editable) install runs nothing from a source checkout.

The package is built and installed for real (``pip install --no-deps --target``, from a
copy of the package sources so the checkout gets no build files), then its ``te-thd``
console script runs from a directory outside any checkout, with the test environment's
dependencies. ``demo --help`` works; ``demo`` and ``bench`` say how to point them at a
checkout; with ``TE_THD_SOURCE`` set, ``bench`` runs the checkout's perf/run.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("installed")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "te_thd", src / "te_thd", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shutil.rmtree(src)  # the installed copy must not need its sources
    env = {k: v for k, v in os.environ.items() if k != "TE_THD_SOURCE"}
    env["PYTHONPATH"] = str(target)  # the installed copy first, dependencies from this venv
    return target, env


def _te_thd(
    installed: tuple[Path, dict[str, str]], *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    target, base = installed
    script = target / "bin" / "te-thd"
    assert script.is_file(), "pip installed no te-thd console script"
    cwd = target.parent  # outside any checkout
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_installed_copy_is_the_one_imported(installed) -> None:
    target, env = installed
    out = subprocess.run(
        [sys.executable, "-c", "import te_thd; print(te_thd.__file__)"],
        cwd=target.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()).is_relative_to(target)


def test_demo_help_runs_from_an_install(installed) -> None:
    out = _te_thd(installed, "demo", "--help")
    assert out.returncode == 0, out.stderr
    assert "TE_THD_SOURCE" in out.stdout and "--nproc" in out.stdout


def test_demo_and_bench_say_where_the_scripts_are(installed) -> None:
    for cmd, what in (("demo", "examples/precompute_cache.py"), ("bench", "perf/run.py")):
        out = _te_thd(installed, cmd)
        assert out.returncode == 2, (cmd, out.stdout, out.stderr)
        assert f"te-thd {cmd}: needs {what}" in out.stderr
        assert "set TE_THD_SOURCE to the clone's root" in out.stderr


def test_help_always_works_from_an_install(installed) -> None:
    """``--help`` needs no checkout: it says what the command does; what is missing is said when it runs."""
    for args in (("--help",), ("bench", "--help"), ("bench", "-h"), ("cache", "--help")):
        out = _te_thd(installed, *args)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout.startswith("usage: te-thd"), (args, out.stdout)
    top = _te_thd(installed, "--help").stdout
    assert "inspect, verify or repair an offline cache directory" in top


def test_bench_runs_the_checkout_named_by_te_thd_source(installed) -> None:
    out = _te_thd(installed, "bench", "--list", TE_THD_SOURCE=str(REPO))
    assert out.returncode == 0, out.stderr
    assert "goal cp-shard-vs-index-select" in out.stdout
