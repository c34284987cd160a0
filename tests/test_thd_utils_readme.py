"""The README's worked example is this code's real output.

Runs every ```python block of the README section "Worked example" in order (one
namespace) and compares what the blocks print with the ```text block after each.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def worked_example_blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text.split("## Worked example", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(python|text)\n(.*?)```", section, flags=re.S)
    pairs: list[tuple[str, str]] = []
    for (kind, code), (next_kind, expected) in zip(blocks, blocks[1:], strict=False):
        if kind == "python" and next_kind == "text":
            pairs.append((code, expected))
    return pairs


def test_readme_worked_example_outputs_are_exact() -> None:
    pairs = worked_example_blocks()
    assert len(pairs) >= 2, "the worked example lost its code/output blocks"
    namespace: dict = {}
    for code, expected in pairs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
        assert buf.getvalue() == expected, f"README output drifted:\n{buf.getvalue()}"
