"""Where ``te-thd demo`` and ``te-thd bench`` find the scripts of a source checkout.

The demo runs ``examples/`` and the benchmarks run ``perf/``; neither directory is
part of the installed package. Both commands take them from, in this order:

1. the directory named by the ``TE_THD_SOURCE`` environment variable (the root of a
   te_thd checkout: the directory holding ``pyproject.toml``, ``examples/``, ``perf/``);
2. the source tree this package is imported from, when it is one: an editable install
   (``pip install -e .``, which is what ``scripts/setup.sh`` makes) or ``PYTHONPATH``.

A regular install lives in ``site-packages`` with no checkout beside it, so without
``TE_THD_SOURCE`` these commands stop with a message saying how to point them at one.

Hints about a cache name its producer script the way the producer recorded it,
relative to the checkout (``examples/precompute_cache.py``); :func:`checkout_file`
turns that into the absolute path, so the printed command runs from any directory.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

SOURCE_ENV = "TE_THD_SOURCE"


def _own_source_tree() -> Path | None:
    """The checkout this package is imported from, or None for an installed copy."""
    root = Path(__file__).resolve().parent.parent
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if project.get("name") == "te_thd" else None


def find_checkout(*required: str) -> Path:
    """Root of the te_thd checkout to run scripts from; every ``required`` path must exist.

    Args:
        required: paths relative to the checkout root, e.g. ``"perf/run.py"``.

    Raises:
        FileNotFoundError: with the message to show the user (what is missing, the fix).
    """
    env = os.environ.get(SOURCE_ENV)
    if env:
        root = Path(env).expanduser().resolve()
        missing = [r for r in required if not (root / r).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{SOURCE_ENV}={env} has no {', '.join(missing)}; set it to the root of a te_thd "
                "checkout (the directory with pyproject.toml, examples/ and perf/)"
            )
        return root
    root = _own_source_tree()
    if root is not None and all((root / r).is_file() for r in required):
        return root
    raise FileNotFoundError(
        f"needs {', '.join(required)} from a te_thd source checkout, which the installed package "
        f"does not contain: clone the repository and set {SOURCE_ENV} to the clone's root, or run "
        "`bash scripts/setup.sh` in the clone (an editable install finds its own checkout)"
    )


def checkout_file(path: str) -> str:
    """``path`` made absolute when it names a file of a checkout or of the current directory.

    Looked up in ``TE_THD_SOURCE``, then this package's own source tree, then the
    current directory; an absolute ``path``, or one found in none of them, comes back
    unchanged.
    """
    if os.path.isabs(path):
        return path
    env = os.environ.get(SOURCE_ENV)
    for root in (Path(env).expanduser().resolve() if env else None, _own_source_tree(), Path.cwd()):
        if root is not None and (root / path).is_file():
            return str(root / path)
    return path
