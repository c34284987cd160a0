"""Limits on the shape of ``te_thd/offline_cache``, checked over its source, so that a change
cannot quietly undo them.

- Nothing in the package exists only for tests or benchmarks: every function, class and
  method it defines is used by the package itself (or the examples), unless it is public API.
- Comments and docstrings say why, never a measured figure: times, rates, percentages and
  speed-ups live in docs/performance-io.md, next to the command that measures them.
- Only the storage layer knows that object stores exist: at most ``MAX_CLIENT_MODULES``
  modules of the package (the interface and one module per kind of store) import an
  object-store client, or a te_thd module that does (an import counts wherever it is written,
  and so does a module named by a dotted string).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import te_thd.offline_cache as oc

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "te_thd" / "offline_cache"

#: Public API that the package does not call itself, beyond ``__all__`` and the reference's
#: names: documented for users (each must appear in docs/, checked below).
DOCUMENTED_API = {
    "CachedTensorDataset.start_read": "offline_cache.md",
    "DurableShardWriter.write_piece": "offline_cache.md",
    "DurableShardWriter.manifest_fields": "integrity.md",
    "scan_lengths": "balance.md",
}
#: The reference module's names (tests/test_offline_cache_api.py checks their signatures).
REFERENCE_API = {"_ShardAccumulator", "_sequential_subset_loader", "CachedTensorDataset._handle"}


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _definitions() -> dict[str, str]:
    """``{name or Class.method: module}`` of every function, class and method the package defines
    (dunder methods aside: Python calls them)."""
    out: dict[str, str] = {}
    for path in _package_files():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out[node.name] = _rel(path)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(
                        member, ast.FunctionDef | ast.AsyncFunctionDef
                    ) and not member.name.startswith("__"):
                        out[f"{node.name}.{member.name}"] = _rel(path)
    return out


def _names_used(paths: list[Path]) -> set[str]:
    """Every name these files refer to: names, attributes, imported names, identifier strings
    (``getattr(obj, "name")``) and ``"te_thd.module:Name"`` strings (``storage.SCHEMES``), but not a
    module's own ``__all__`` (listing a name is no use of it)."""
    used: set[str] = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        listed = {
            id(const)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for const in ast.walk(node.value)
        }
        for node in ast.walk(tree):
            if id(node) in listed:
                continue
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.rsplit(".", 1)[-1])
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.isidentifier()
            ):
                used.add(node.value)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and ":" in node.value
                and _DOTTED.match(node.value)
            ):
                used.add(node.value.rpartition(":")[2])
    return used


def test_structure_documented_api_is_documented() -> None:
    for name, page in DOCUMENTED_API.items():
        assert name.rsplit(".", 1)[-1] in (REPO / "docs" / page).read_text(), (name, page)


def test_structure_nothing_in_offline_cache_is_used_only_by_tests_or_benches() -> None:
    """A function, class or method of the package that the package (or an example) never uses is
    there for tests or benches: a test helper belongs in tests/, a tuning knob is a module
    constant that a bench patches. Public API (``__all__``, the reference's names, what docs/
    documents) is exempt."""
    users = [p for d in ("te_thd", "examples") for p in (REPO / d).rglob("*.py")]
    used = _names_used(users)
    public = set(oc.__all__) | REFERENCE_API | set(DOCUMENTED_API)
    unused = {
        name: module
        for name, module in _definitions().items()
        if name not in public and name.rsplit(".", 1)[-1] not in used
    }
    assert not unused, (
        f"defined in te_thd/offline_cache but used only by tests/, perf/ or scripts/ (or nowhere): {unused}"
    )


#: a measured time, rate, percentage or speed-up: "~2 us", "5-20%", "14.4 GB/s", "1.3x"
FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s*(?:us|µs|ms|ns|s|sec|seconds|[GMK]i?B/s|%)(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?x\b"
)


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring line of ``path``."""
    source = path.read_text()
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
        ):
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out += [
                    (first.lineno + i, line)
                    for i, line in enumerate(first.value.value.splitlines())
                ]
    return out


def test_structure_figure_pattern_catches_measured_figures() -> None:
    for text in (
        "costs ~2 us each",
        "5-20% slower on 2 cores",
        "1.3x the reference",
        "14.4 GB/s",
        "10-25 % of a read",
    ):
        assert FIGURE.search(text), text
    for text in (
        "4 MiB batches",
        "int64 [n, 3]",
        "shard-000001",
        "the 8-byte length",
        "xxh3_64",
        "0x1F",
    ):
        assert not FIGURE.search(text), text


def test_structure_no_measured_figures_in_offline_cache_comments() -> None:
    """Comments and docstrings say why; the figures behind a choice go to docs/performance-io.md,
    each with the command that measures it (a figure in code goes stale when the hardware changes)."""
    found = [
        f"{_rel(path)}:{line}: {text.strip()}"
        for path in _package_files()
        for line, text in _comments_and_docstrings(path)
        if FIGURE.search(text)
    ]
    assert not found, "move these figures to docs/performance-io.md:\n" + "\n".join(found)


# -- only the storage layer knows that object stores exist --

#: the object-store clients: the Python distributions' top-level modules
CLIENTS = frozenset({"obstore", "boto3", "botocore", "s3fs", "multistorageclient"})
#: the storage interface and its object-store implementations: s3:// (obstore), msc:// (multi-storage-client)
MAX_CLIENT_MODULES = 3
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
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (m := _DOTTED.match(node.value))
        ):
            out.add(m.group(1))
    return out


def client_modules() -> dict[str, set[str]]:
    """``{module of the package: what it imports that counts}``: a client, or a te_thd module importing one."""
    te_thd = {_module_name(p): imports_of(p) for p in (REPO / "te_thd").rglob("*.py")}
    direct = {m for m, deps in te_thd.items() if any(d.split(".")[0] in CLIENTS for d in deps)}
    out: dict[str, set[str]] = {}
    for p in _package_files():
        deps = te_thd[_module_name(p)]
        why = {d for d in deps if d.split(".")[0] in CLIENTS} | (deps & direct)
        if why:
            out[_module_name(p)] = why
    return out


def test_only_the_storage_modules_of_the_cache_know_object_stores() -> None:
    found = client_modules()
    assert len(found) <= MAX_CLIENT_MODULES, (
        f"{len(found)} modules of te_thd/offline_cache import an object-store client or a module that does "
        f"(at most {MAX_CLIENT_MODULES}: storage/schemes.py, s3.py and msc.py): {found}. Reach the store through "
        "te_thd.offline_cache.storage.schemes.open_storage instead"
    )


def test_the_count_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The graph counts a function-level import, a relative one and a module named by a string."""
    src = tmp_path / "te_thd" / "offline_cache" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "from . import s3\n"
        "def f():\n    import obstore\n"
        "TABLE = {'s3': 'te_thd.offline_cache.storage.s3:S3Prefix'}\n"
    )
    assert {"obstore", "te_thd.offline_cache.storage.s3"} <= imports_of(src, tmp_path)
    # today's three: the clients' modules, and the storage that names them in its scheme table
    assert set(client_modules()) == {
        "te_thd.offline_cache.storage.s3",
        "te_thd.offline_cache.storage.msc",
        "te_thd.offline_cache.storage.schemes",
    }


# -- the package's size: the seams keep it small --


# -- one storage per open: a cache is opened by its entry point, which passes the storage down --

#: ``{(module, function): why}``: the only places that call ``open_storage``. Everything below an
#: entry point takes the ``Storage`` it opened.
OPENERS = {
    ("storage/schemes.py", "as_storage"): "the storage layer itself",
    ("read/open.py", "open_cache"): "the dataset's open (CachedTensorDataset)",
    ("write/producer.py", "produce_cache"): "the producer",
    ("tools/cli.py", "_cmd_unlock"): "a CLI command that needs nothing but the storage",
    ("tools/repair.py", "_kept_aside"): "the folder repairs set aside is a place of its own",
}
#: The public functions that take a path, a URL or an opened storage (``as_storage``): a caller
#: that opened the cache passes its storage, a user passes the path.
PATH_OR_STORAGE = {
    ("record/manifest.py", "existing_shard_indices"),
    ("record/manifest.py", "write_manifest"),
    ("record/manifest.py", "load_manifest"),
    ("record/manifest.py", "read_manifest"),
    ("record/files.py", "validate_contiguous_shards"),
    ("record/files.py", "check_cache_files"),
    ("tools/verify.py", "verify_cache"),
    ("tools/verify.py", "cache_info"),
    ("tools/repair.py", "repair_cache"),
    ("train/loader.py", "cache_lengths"),
    ("write/writer.py", "DurableShardWriter._storage"),
}


def calls_of(name: str, root: Path = PACKAGE) -> set[tuple[str, str]]:
    """``{(module file, enclosing function or Class.method)}`` of every call of ``name`` (by name or
    as an attribute) in the package; ``"<module>"`` for a call outside any function."""
    found: set[tuple[str, str]] = set()

    def walk(node: ast.AST, where: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = child.name if where == "<module>" else f"{where}.{child.name}"
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == name) or (
                    isinstance(f, ast.Attribute) and f.attr == name
                ):
                    found.add((path.relative_to(root).as_posix(), where))
            walk(child, inner, path)

    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        walk(ast.parse(path.read_text()), "<module>", path)
    return found


def test_only_the_entry_points_open_a_cache() -> None:
    found = calls_of("open_storage")
    assert found == set(OPENERS), (
        f"open_storage is called in {sorted(found - set(OPENERS))} (allowed: {sorted(OPENERS)}). "
        "Take the Storage the entry point opened as an argument instead of opening the cache again"
        if found - set(OPENERS)
        else f"update OPENERS: these no longer call open_storage: {sorted(set(OPENERS) - found)}"
    )
    found = calls_of("as_storage")
    assert found <= PATH_OR_STORAGE, (
        f"as_storage is called in {sorted(found - PATH_OR_STORAGE)}: only public functions that "
        "take a path or an opened storage may; below them, take the Storage"
    )


def test_the_open_count_sees_every_kind_of_call(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text(
        "from . import storage\n"
        "def f():\n    storage.open_storage('d')\n"
        "class C:\n    def m(self):\n        return open_storage('d')\n"
        "X = open_storage('d')\n"
    )
    assert calls_of("open_storage", tmp_path) == {
        ("x.py", "f"),
        ("x.py", "C.m"),
        ("x.py", "<module>"),
    }


# -- layers: imports run one way, down ----------------------------------------------------------

#: The package's folders, each with its floor: a module imports its own folder and lower floors.
#: ``read`` and ``write`` share a floor and never import each other; so do ``tools`` and ``train``.
FLOORS = {
    "format": 0,
    "storage": 1,
    "record": 2,
    "read": 3,
    "write": 3,
    "tools": 4,
    "train": 4,
}
#: ``{module: why}``: the modules that look a name up on the package itself, at call time. The
#: reference's own tests patch ``DataLoader`` and ``safe_import_from`` on the package, so these
#: lookups go through it and see the patch.
PATCH_POINTS = {
    "te_thd.offline_cache.format.schema": "safetensors is imported through safe_import_from",
    "te_thd.offline_cache.write.loops": "the reference loops make their DataLoader",
}
ROOT = "te_thd.offline_cache"


def layer_violations(root: Path = REPO) -> list[str]:
    """``"module -> import"`` for every import of a package module that goes up a floor, across
    ``read``/``write`` or ``tools``/``train``, or to the package itself."""
    bad = []
    for path in sorted((root / "te_thd" / "offline_cache").rglob("*.py")):
        name = _module_name(path, root)
        parts = name.split(".")
        if len(parts) < 4:  # the package's and the folders' __init__
            continue
        for dep in sorted(imports_of(path, root)):
            dp = dep.split(".")
            if dep == ROOT:
                if name not in PATCH_POINTS:
                    bad.append(f"{name} -> {dep}")
            elif dp[:2] == ROOT.split(".") and len(dp) > 2 and dp[2] != parts[2]:
                if dp[2] not in FLOORS or FLOORS[dp[2]] >= FLOORS[parts[2]]:
                    bad.append(f"{name} -> {dep}")
    return bad


def test_every_module_of_the_package_sits_in_a_layer_folder() -> None:
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not loose, f"modules outside the layer folders: {loose}; move each into its layer"
    assert folders == set(FLOORS), (folders, set(FLOORS))


def test_imports_run_down_the_layers() -> None:
    bad = layer_violations()
    assert not bad, (
        "imports up a floor or across read/write (move the shared piece down a floor): "
        + "; ".join(bad)
    )


def test_the_layer_check_catches_an_import_up(tmp_path: Path) -> None:
    pkg = tmp_path / "te_thd" / "offline_cache"
    for folder in ("format", "read", "write"):
        (pkg / folder).mkdir(parents=True)
    (pkg / "format" / "a.py").write_text("def f():\n    from te_thd.offline_cache.read import x\n")
    (pkg / "read" / "x.py").write_text("from ..write import y\nfrom ..format import a\n")
    (pkg / "write" / "y.py").write_text("import te_thd.offline_cache\n")
    assert layer_violations(tmp_path) == [
        "te_thd.offline_cache.format.a -> te_thd.offline_cache.read",
        "te_thd.offline_cache.format.a -> te_thd.offline_cache.read.x",
        "te_thd.offline_cache.read.x -> te_thd.offline_cache.write",
        "te_thd.offline_cache.read.x -> te_thd.offline_cache.write.y",
        "te_thd.offline_cache.write.y -> te_thd.offline_cache",
    ]


def import_cycles(modules: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected groups of two or more) of ``{module: imports}``; an
    import of ``pkg.name`` counts as one of the module ``pkg.name`` when it exists, else of
    ``pkg``."""
    graph = {
        m: {d if d in modules else d.rpartition(".")[0] for d in deps} & set(modules) - {m}
        for m, deps in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                out.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    """No module of te_thd imports one that imports it back, directly or through others (imports
    inside functions count; the package's patch points and the package ``__init__`` files, which
    gather names for users, do not)."""
    modules = {
        _module_name(p): imports_of(p)
        for p in (REPO / "te_thd").rglob("*.py")
        if p.name != "__init__.py"
    }
    for name in PATCH_POINTS:
        modules[name] = modules[name] - {ROOT}
    assert not import_cycles(modules)
    assert import_cycles({"a": {"b.f"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
