"""Rules about where code runs from, checked over the source files themselves.

- ``sys.path`` is changed only by test helpers (``tests/``) and by the examples' own
  entry points (``examples/*.py``); scripts and benchmarks rely on Python putting their
  own directory first when they run.
- Nothing outside ``tests/`` imports from ``tests/``.
- The package looks at the directory around its own files in one place only,
  ``te_thd/_checkout.py`` (which finds a source checkout for ``te-thd demo`` / ``bench``).
- Comments and docstrings cite no spec section, issue number or unbuilt work, and
  every function they cite as code exists.
- No package module runs past 600 lines.
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


# ------------------------------------------------------------- comments say what the code does

#: what a comment or docstring must not cite: the project's spec file (the repository has
#: none), its issue tracker, planning notes, or work "not built yet". An upstream bug is
#: cited as ``owner/repo#N`` (e.g. ``NVIDIA/TransformerEngine#3331``), which these allow.
STALE_REFERENCES = {
    "a spec section": r"\bSPEC\b|§",
    "an issue number": r"(?i)\bissues?\s*#?\d+",
    "a pull request number": r"(?i)\bPR\s*#?\d+",
    "the session's shared notes": r"\bshared/(seeds|SPEC)",
    "unbuilt work": r"(?i)not (yet )?built( yet)?\b|\bTODO\b|\bFIXME\b",
}


def test_no_references_to_missing_specs_issues_or_unbuilt_work() -> None:
    files = [p for p in _python_files(*SOURCE_DIRS) if p != Path(__file__).resolve()]
    found = {what: _hits(rx, files) for what, rx in STALE_REFERENCES.items()}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


#: names that docstrings cite from libraries the tests do not import (TE, flash-attn,
#: transformers) or that are not Python names (big-O, environment variables)
EXTERNAL_NAMES = {
    "DotProductAttention",
    "flash_attn_varlen_func",
    "from_pretrained",
    "O",
    "LOCAL_RANK",
    "sync_file_range",
}


def _defined_names() -> set[str]:
    """Every function, class, variable, parameter and attribute name the repository defines."""
    import ast
    import builtins

    import numpy as np
    import safetensors
    import torch
    import tqdm

    names = {"te_thd"} | set(dir(builtins)) | set(dir(torch)) | set(dir(torch.Tensor))
    names |= set(dir(torch.cuda)) | set(dir(np)) | set(dir(np.ndarray)) | set(dir(np.random))
    names |= set(dir(np.random.Generator)) | set(dir(safetensors.safe_open)) | set(dir(tqdm.tqdm))
    for path in _python_files(*SOURCE_DIRS):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
    return names


def _importable(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_cited_functions_exist() -> None:
    """A name a docstring cites as code (``f(...)``, ``f``'s, :func:`f`) is one that exists."""
    cite = re.compile(
        r":(?:func|meth|class|attr|data|obj):`~?([\w.]+)`|``([A-Za-z_][\w.]*)\(|``([A-Za-z_][\w.]*)``'s"
    )
    defined = _defined_names() | EXTERNAL_NAMES
    missing = []
    for path in _python_files("te_thd", "scripts", "perf", "examples"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in cite.finditer(line):
                name = next(g for g in m.groups() if g)
                if name.split(".")[-1] not in defined and not _importable(name):
                    missing.append(f"{path.relative_to(REPO)}:{n}: {name}")
    assert not missing, f"docstrings cite names that do not exist: {missing}"


# ------------------------------------------------------------- the package's own boundaries


def _package_imports() -> dict[str, list[tuple[str, str | None, int]]]:
    """``{module: [(imported module, imported name or None, line)]}`` of every te_thd import in te_thd."""
    import ast

    modules = {}
    for p in _python_files("te_thd"):
        rel = p.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = p
    found: dict[str, list[tuple[str, str | None, int]]] = {}
    for name, p in modules.items():
        package = name if p.name == "__init__.py" else name.rpartition(".")[0]
        out = found.setdefault(name, [])
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "te_thd":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.append(
                        (sub, None, node.lineno)
                        if sub in modules
                        else (target, alias.name, node.lineno)
                    )
            elif isinstance(node, ast.Import):
                out += [
                    (a.name, None, node.lineno)
                    for a in node.names
                    if a.name.split(".")[0] == "te_thd"
                ]
    return found


def test_no_import_cycles_in_the_package() -> None:
    """No module of te_thd imports (at any depth, also inside functions) a module that imports it."""
    imports = _package_imports()
    packages = {m for m in imports if (REPO / m.replace(".", "/") / "__init__.py").exists()}
    graph = {
        m: {t for t, _, _ in deps if t in imports and t not in packages and t != m}
        for m, deps in imports.items()
    }
    cycles = []
    for start in graph:
        if start in packages:
            continue
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, cycles


def test_no_module_imports_an_underscore_name_from_another() -> None:
    bad = [
        f"{m}:{line}: {name} from {target}"
        for m, deps in _package_imports().items()
        for target, name, line in deps
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    assert not bad, bad


def test_no_torch_private_apis_in_the_package() -> None:
    files = _python_files("te_thd")
    assert not _hits(
        r"torch\._C\b|\._cdata\b|_typed_storage\(|_new_shared\(|torch\.utils\.data\._utils", files
    )


#: no package module over this many lines (formatted, docstrings included): a module holds one
#: concept, and one that grows past this holds two
MODULE_LINES = 600


def test_no_package_module_runs_past_the_module_limit() -> None:
    long = [
        f"{p.relative_to(REPO)} ({n} lines)"
        for p in _python_files("te_thd")
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    ]
    assert not long, f"over {MODULE_LINES} lines, split each by concept: {long}"


def test_the_package_is_formatted_as_ruff_writes_it() -> None:
    """``ruff format`` (line length 100, from pyproject.toml) leaves the package unchanged, and no
    line opts out of it."""
    import subprocess
    import sys

    assert not _hits(r"#\s*fmt:\s*(skip|off)", _python_files("te_thd"))
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "te_thd"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"run `ruff format te_thd`:\n{run.stdout}{run.stderr}"


def test_the_package_passes_ruff_check_with_lines_within_100() -> None:
    """``ruff check`` (pyproject.toml's rules, E501 at 100 characters included) finds nothing in
    the package: a long message is built from parts, a long comment wraps."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "te_thd"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"ruff check te_thd:\n{run.stdout}{run.stderr}"
