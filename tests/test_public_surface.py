"""The public surface: what ``__all__`` lists in every te_thd module.

``__all__`` names the public API only: no underscore names, no internals that other
modules of the package share. The reference implementation's names (its private
helpers included) stay importable from the modules users import them from.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import te_thd

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(te_thd.__path__, "te_thd.")
    if not m.name.endswith("__main__")
)

#: shared internals that must not be listed as public anywhere
INTERNALS = {
    "attend_slots",
    "all_gather_cp",
    "check_te_thd_boundaries",
    "ProducerLock",
    "remove_stale_temp_files",
    "check_cache_files",
    "TensorSpec",
}

#: reference names that stay importable where the reference has them (te_thd.offline_cache's
#: are checked, with their signatures, by test_offline_cache_api.py)
REFERENCE_NAMES = {
    "te_thd.thd_utils": (
        "process_input_for_thd",
        "split_batch_into_thd_chunks",
        "thd_padding_mask_from_token_ids",
        "_thd_padding_mask",
    ),
}


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_public_names_that_exist(name: str) -> None:
    mod = importlib.import_module(name)
    listed = getattr(mod, "__all__", None)
    if listed is None:
        return
    assert not [n for n in listed if n.startswith("_")], f"{name}.__all__ lists underscore names"
    assert not INTERNALS & set(listed), f"{name}.__all__ lists internals {INTERNALS & set(listed)}"
    missing = [n for n in listed if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what the module lacks: {missing}"
    assert len(set(listed)) == len(listed), f"{name}.__all__ repeats a name"


@pytest.mark.parametrize("module", sorted(REFERENCE_NAMES))
def test_reference_names_stay_importable(module: str) -> None:
    mod = importlib.import_module(module)
    for name in REFERENCE_NAMES[module]:
        assert hasattr(mod, name), f"{module}.{name} is a reference name and must stay importable"
        assert (name in mod.__all__) is not name.startswith("_"), (module, name)


def test_walk_found_the_package() -> None:
    assert {"te_thd.thd_utils", "te_thd.cp", "te_thd.attention", "te_thd.offline_cache"} <= set(
        MODULES
    )
