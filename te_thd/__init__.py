"""te_thd: packed-sequence (THD) data layer for Transformer Engine and Megatron-Core.

The path a batch takes through the package, one public function per arrow::

    sample dicts -> te_thd.packing -> te_thd.thd_utils -> te_thd.cp -> te_thd.attention -> model

The contract between those arrows is :class:`te_thd.ThdLayout` (``te_thd.layout``):
the boundaries and host-side values of one packed stream, validated once.

Beside it, ``te_thd.offline_cache`` stores per-sample tensors a frozen model
produced (format -> writer -> reader) and feeds them to the same collate.

Submodules are imported lazily so ``import te_thd`` stays cheap (DataLoader
workers import it) and does not pull megatron-core unless it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("thd_utils", "layout", "cp", "packing", "attention", "offline_cache", "cli")
# Public names re-exported at the top level, each from the submodule that defines it.
_NAMES = {"ThdLayout": "layout", "check_te_thd_kwargs": "attention"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'te_thd' has no attribute {name!r}")


__all__ = [
    "ThdLayout",
    "check_te_thd_kwargs",
    *_SUBMODULES,
]  # __version__ is importable too; __all__ names public API only
