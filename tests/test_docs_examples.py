"""The documented examples are this code's real output.

In each page below, every ```python block that is directly followed by a ```text
block is run (one namespace per page, blocks in order) and what it prints must equal
the text block. Python blocks without an output block are sketches (they need a GPU,
a process group or a model) and are not run.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: pages whose examples run on the CPU as written
PAGES = ("README.md", "docs/packing.md", "docs/thd_utils.md", "docs/layout.md", "docs/balance.md")


def example_pairs(text: str) -> list[tuple[str, str]]:
    """(code, expected output) for each python block directly followed by a text block."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
    return [
        (code, expected)
        for (kind, code), (next_kind, expected) in zip(blocks, blocks[1:], strict=False)
        if kind == "python" and next_kind == "text"
    ]


@pytest.mark.parametrize("page", PAGES)
def test_documented_examples_print_their_output(page: str) -> None:
    path = REPO / page
    pairs = example_pairs(path.read_text())
    assert pairs, f"{page} lost its example code/output blocks"
    namespace: dict = {}
    for code, expected in pairs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - our own docs
        assert buf.getvalue() == expected, f"{page}: example output drifted:\n{buf.getvalue()}"


def test_thd_utils_page_keeps_both_worked_examples() -> None:
    assert len(example_pairs((REPO / "docs/thd_utils.md").read_text())) >= 2
