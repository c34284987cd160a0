"""Code lines of a package: the lines that hold code, not docstrings, comments or blank lines
(counted over the AST and the tokens, so formatting decides the count, not comment density).

    .venv/bin/python scripts/code_lines.py [PACKAGE_DIR] [-v]

``PACKAGE_DIR`` defaults to ``te_thd/offline_cache``; ``-v`` lists every module.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_SKIP = (
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not (isinstance(body, list) and body and isinstance(body[0], ast.Expr)):
            continue
        value = body[0].value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def code_lines(path: Path) -> int:
    """How many lines of ``path`` hold a code token outside a docstring."""
    source = path.read_text()
    docs = _docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _SKIP:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def main(argv: list[str]) -> None:
    args = [a for a in argv if a != "-v"]
    root = Path(args[0] if args else "te_thd/offline_cache")
    files = sorted(root.rglob("*.py"))
    total = 0
    for f in files:
        n = code_lines(f)
        total += n
        if "-v" in argv:
            print(f"{n:6d} {f}")
    longest = max(len(f.read_text().splitlines()) for f in files)
    print(f"{total} code lines in {len(files)} modules; the longest module has {longest} lines")


if __name__ == "__main__":
    main(sys.argv[1:])
