"""Generated blocks in the docs pages: text between a begin and an end marker comment.

Shared by the scripts that render a table into ``docs/`` (gen_bad_input_table.py,
reliability_figures.py): each owns its markers, this module finds and replaces the block.
"""

from __future__ import annotations

from pathlib import Path


def read_block(text: str, begin: str, end: str) -> str | None:
    """The block between the markers (surrounding newlines stripped), or None without them."""
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def write_block(page: Path, begin: str, end: str, body: str) -> bool:
    """Replace the block of ``page`` with ``body``; False (page untouched) without markers."""
    text = page.read_text()
    if read_block(text, begin, end) is None:
        return False
    head, rest = text.split(begin, 1)
    page.write_text(f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}")
    return True
