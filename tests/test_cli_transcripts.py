"""The ``te-thd cache`` transcripts in docs/cli.md are what the commands print today.

``scripts/gen_cli_transcripts.py --check`` builds a small cache with the demo's
producer, runs ``te-thd cache info / verify / repair / unlock`` on it (one shard
damaged) and compares each transcript with its block in the page; it runs here as a
user runs it, in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gen_cli_transcripts as gen  # scripts/ is on sys.path (conftest.py)
from _docblock import read_block

REPO = Path(__file__).resolve().parents[1]
WRITE = ".venv/bin/python scripts/gen_cli_transcripts.py --write"


def test_cli_transcripts_are_what_the_commands_print() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cli_transcripts.py"), "--check"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"docs/cli.md transcripts drifted: run  {WRITE}\n{done.stderr}"


def test_a_stale_transcript_is_shown_with_the_command_that_rewrites_it() -> None:
    text = gen.PAGE.read_text()
    blocks = {name: read_block(text, *gen.markers(name)) for name in gen.BLOCKS}
    assert all(blocks.values()), "docs/cli.md lost a transcript's markers"
    assert gen.stale_report(text, blocks) is None
    name = "cli-transcript-sound"
    edited = text.replace("checksum:       xxh3_64", "checksum:       crc32", 1)
    report = gen.stale_report(edited, blocks)
    assert report is not None
    assert f"--- docs/cli.md {name}" in report
    assert "-checksum:       crc32" in report and "+checksum:       xxh3_64" in report
    assert report.endswith(f"docs/cli.md transcripts are stale: run  {WRITE}")
    begin, _ = gen.markers(name)
    report = gen.stale_report(text.replace(begin, ""), blocks)
    assert report is not None and f"docs/cli.md lacks the markers of {name}: {begin}" in report
