"""Fuzz of the cache's batch assembly, ``collate_cached``, with arbitrary sample lists.

``collate_cached(features, keys)`` (the reference API) must either return, for each
key, the samples stacked on a new dim 0 -- exactly ``torch.stack`` over a Python
loop -- or raise ``ValueError`` naming the key; never ``KeyError`` / ``RuntimeError``.
Both input forms are fuzzed: a list of per-sample dicts, and the already-stacked
``CachedBatch`` that ``CachedTensorDataset.__getitems__`` returns.
"""

from __future__ import annotations

from typing import Any

import torch
from _fuzz_support import FUZZ, INVALID, VALID, expect
from hypothesis import given
from hypothesis import strategies as st

from te_thd.offline_cache import CachedBatch, collate_cached

KEYS = ("hidden", "input_ids", "loss_mask")


@st.composite
def feature_lists(draw) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    n = draw(st.integers(0, 4))
    feats: list[dict[str, Any]] = []
    for i in range(n):
        f = {
            "hidden": torch.full((3,), float(i)),
            "input_ids": torch.arange(4) + i,
            "loss_mask": torch.ones(4, dtype=torch.bool),
        }
        feats.append(f)
    keys = tuple(
        draw(st.lists(st.sampled_from(KEYS + ("logits",)), min_size=1, max_size=3, unique=True))
    )
    if feats:
        j = draw(st.integers(0, n - 1))
        m = draw(st.sampled_from([None, None, "drop", "shape", "dtype"]))
        k = draw(st.sampled_from(KEYS))
        if m == "drop":
            feats[j].pop(k)
        elif m == "shape":
            feats[j][k] = torch.zeros(7)
        elif m == "dtype":
            feats[j][k] = feats[j][k].to(torch.float64)
    return feats, keys


def oracle(feats: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str, str]:
    if not feats:
        return INVALID, "no samples"
    for k in keys:
        if any(k not in f for f in feats):
            return INVALID, f"key {k} missing"
        shapes = {tuple(f[k].shape) for f in feats}
        if len(shapes) > 1:
            return INVALID, f"key {k} shapes {shapes}"
    return VALID, "stackable"


@FUZZ
@given(feature_lists())
def test_fuzz_collate_cached_list(case) -> None:
    feats, keys = case
    verdict, why = oracle(feats, keys)
    out = expect("cache.collate_cached(list)", verdict, lambda: collate_cached(feats, keys), why)
    if out is None:
        return
    assert set(out) == set(keys)
    for k in keys:
        want = torch.stack([f[k].to(out[k].dtype) for f in feats])
        assert torch.equal(out[k], want), k


@FUZZ
@given(feature_lists())
def test_fuzz_collate_cached_batch(case) -> None:
    feats, keys = case
    if not feats or oracle(feats, tuple(feats[0]))[0] != VALID:
        return
    stacked = {k: torch.stack([f[k] for f in feats]) for k in feats[0]}
    batch = CachedBatch(stacked, len(feats))
    verdict = VALID if all(k in stacked for k in keys) else INVALID
    out = expect(
        "cache.collate_cached(CachedBatch)",
        verdict,
        lambda: collate_cached(batch, keys),
        "keys read",
    )
    if out is not None:
        assert all(out[k] is stacked[k] for k in keys)


def test_fuzz_finding_B6_collate_cached_list_missing_key_is_a_value_error() -> None:
    """The list path raised KeyError / RuntimeError where the CachedBatch path raises ValueError."""
    cases = (
        ([{"a": torch.zeros(2)}], ("b",)),  # was KeyError: 'b'
        (
            [{"a": torch.zeros(2)}, {"a": torch.zeros(3)}],
            ("a",),
        ),  # was RuntimeError: stack expects ...
        ([], ("a",)),  # was RuntimeError: stack expects a non-empty TensorList
    )
    for feats, keys in cases:
        try:
            collate_cached(feats, keys)
        except ValueError as e:
            assert "collate_cached" in str(e), e
        else:
            raise AssertionError(f"collate_cached({feats}, {keys}) accepted")
