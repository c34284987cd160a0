"""Run metadata shared by the reliability scripts (crash_test.py, corruption_test.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """The commit the run measured (``+dirty`` when te_thd/ has uncommitted changes)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "te_thd"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
