"""The codec table (``te_thd.offline_cache.format.codecs``): a recorded name parses once into its
codec, and no other module of the cache names a codec (so none can branch on one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from te_thd.offline_cache.format.codecs import CODECS, check_codec

PACKAGE = Path(__file__).resolve().parents[1] / "te_thd" / "offline_cache"


@pytest.mark.parametrize("base", sorted(CODECS))
def test_a_recorded_name_parses_once_into_its_codec(base: str) -> None:
    name = CODECS[base].full_name(151936)
    assert name is not None
    codec = check_codec("k", name)
    assert type(codec) is CODECS[base] and codec.name == name
    assert check_codec("other", name) is codec  # parsed once per process


def _strings_outside_docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_module_but_the_table_names_a_codec() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "format" / "codecs.py"
        for line, text in _strings_outside_docstrings(path)
        if any(base in text for base in CODECS)
    ]
    assert not found, found
