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
import subprocess
import sys
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


def test_follow_page_snippet_trains_beside_its_producer(tmp_path: Path) -> None:
    """docs/follow.md's loader snippet runs as printed (its cache path aside) while the page's producer
    command (fewer samples) writes the cache; without its length_key the loader is refused in one line."""
    page = (REPO / "docs/follow.md").read_text()
    code = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)[0]
    producer_line = next(ln for ln in page.splitlines() if "torchrun" in ln and "precompute" in ln)
    assert "--out /tmp/cache --cp 2" in producer_line and '"/tmp/cache"' in code
    cache = tmp_path / "cache"
    code = code.replace('"/tmp/cache"', repr(str(cache)))
    command = ["examples/precompute_cache.py", "--out", str(cache), "--cp", "2"]
    producer = subprocess.Popen(
        [sys.executable, *command, "--num-samples", "96", "--shard-size", "16"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        namespace: dict = {}
        exec(compile(code, "docs/follow.md", "exec"), namespace)  # noqa: S102 - our own docs
    finally:
        out, _ = producer.communicate(timeout=300)
    assert producer.returncode == 0, out
    thd = namespace["thd"]  # the epoch's last batch
    assert thd["hidden"].shape == (thd["input_ids"].numel(), 64) and thd["num_samples"] >= 1
    assert len(namespace["loader"]) == 96 // 8

    bare = code.replace('CachedThdCollator(256, length_key="seq_len")', "CachedThdCollator(256)")
    assert bare != code
    with pytest.raises(ValueError) as e:
        exec(compile(bare, "docs/follow.md", "exec"), {})  # noqa: S102 - our own docs
    assert str(e.value).endswith("pass CachedThdCollator(..., length_key='seq_len')"), e.value
