"""Limits on the shape of ``te_thd/offline_cache``, so that a later change cannot quietly undo them.

Only the storage layer knows that object stores exist: at most :data:`MAX_CLIENT_MODULES`
modules of the package import an object-store client, or a te_thd module that does. An
import counts wherever it is written (also inside a function), and so does a module named
by a dotted string (the storage's scheme table imports its implementations by name).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "te_thd" / "offline_cache"
#: the object-store clients: the Python distributions' top-level modules
CLIENTS = frozenset({"obstore", "boto3", "botocore", "s3fs", "multi_storage_client"})
#: the storage interface and its one object-store implementation
MAX_CLIENT_MODULES = 2
_DOTTED = re.compile(r"^(te_thd(?:\.\w+)+)(?::\w+)?$")


def _module_name(path: Path, root: Path = REPO) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def imports_of(path: Path, root: Path = REPO) -> set[str]:
    """Every module ``path`` (under ``root``) imports: absolute names; function-level imports and
    ``"te_thd.x.y"`` / ``"te_thd.x.y:Name"`` strings included."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # ``from pkg import module``
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := _DOTTED.match(node.value)):
            out.add(m.group(1))
    return out


def client_modules() -> dict[str, set[str]]:
    """``{module of the package: what it imports that counts}``: a client, or a te_thd module importing one."""
    te_thd = {_module_name(p): imports_of(p) for p in (REPO / "te_thd").rglob("*.py")}
    direct = {m for m, deps in te_thd.items() if any(d.split(".")[0] in CLIENTS for d in deps)}
    out: dict[str, set[str]] = {}
    for p in sorted(PACKAGE.glob("*.py")):
        deps = te_thd[_module_name(p)]
        why = {d for d in deps if d.split(".")[0] in CLIENTS} | (deps & direct)
        if why:
            out[_module_name(p)] = why
    return out


def test_at_most_two_modules_of_the_cache_know_object_stores() -> None:
    found = client_modules()
    assert len(found) <= MAX_CLIENT_MODULES, (
        f"{len(found)} modules of te_thd/offline_cache import an object-store client or a module that does "
        f"(at most {MAX_CLIENT_MODULES}: storage.py and s3.py): {found}. Reach the store through "
        "te_thd.offline_cache.storage.open_storage instead"
    )


def test_the_count_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The graph counts a function-level import, a relative one and a module named by a string."""
    src = tmp_path / "te_thd" / "offline_cache" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "from . import s3\n"
        "def f():\n    import obstore\n"
        "TABLE = {'s3': 'te_thd.offline_cache.s3:S3Prefix'}\n"
    )
    assert {"obstore", "te_thd.offline_cache.s3"} <= imports_of(src, tmp_path)
    # today's two: the client's module, and the storage that names it in its scheme table
    assert set(client_modules()) == {"te_thd.offline_cache.s3", "te_thd.offline_cache.storage"}
