"""Rules about where code runs from, checked over the source files themselves.

- ``sys.path`` is changed only by test helpers (``tests/``) and by the examples' own
  entry points (``examples/*.py``); scripts and benchmarks rely on Python putting their
  own directory first when they run.
- Nothing outside ``tests/`` imports from ``tests/``.
- The package looks at the directory around its own files in one place only,
  ``te_thd/_checkout.py`` (which finds a source checkout for ``te-thd demo`` / ``bench``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("te_thd", "scripts", "perf", "examples", "tests")


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def _hits(pattern: str, files: list[Path]) -> list[str]:
    rx = re.compile(pattern)
    return [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]


def test_sys_path_changes_only_in_test_helpers_and_example_entry_points() -> None:
    allowed = {p for p in _python_files("tests")} | set((REPO / "examples").glob("*.py"))
    files = [p for p in _python_files(*SOURCE_DIRS) if p not in allowed]
    assert not _hits(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=", files)


def test_nothing_outside_tests_imports_from_tests() -> None:
    files = _python_files("te_thd", "scripts", "perf", "examples")
    # an import of tests' modules, or a path built to the tests/ directory
    assert not _hits(r"""^\s*(from|import)\s+tests\b|/\s*["']tests["']""", files)


def test_only_the_checkout_finder_looks_beside_the_package() -> None:
    files = [p for p in _python_files("te_thd") if p.name != "_checkout.py"]
    assert not _hits(r"__file__.*(parents\[|\.parent\.parent)", files)
