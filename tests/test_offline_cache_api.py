"""The reference page's names and signatures exist in te_thd.offline_cache, with the same parameters.

Transcribed from the reference module's API page (the reference module is not imported in
tests): for each function the ordered parameter names and defaults. te_thd may add
keyword parameters after them, never rename, reorder or drop one.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

import te_thd.offline_cache as oc

_ = inspect.Parameter.empty
SEED_FUNCTIONS: dict[str, list[tuple[str, object]]] = {
    "_sequential_subset_loader": [("dataloader", _), ("start", _), ("end", _)],
    "atomic_write": [("path", _), ("write_fn", _)],
    "build_cached_dataloader": [
        ("dataset", _),
        ("batch_size", _),
        ("shuffle", _),
        ("collate_fn", _),
        ("num_workers", 0),
        ("distributed", False),
    ],
    "collate_cached": [("features", _), ("keys", _)],
    "dataloader_from_sample": [("dataloader", _), ("start_sample", _)],
    "ensure_supervision_options_match": [
        ("manifest", _),
        ("expected", _),
        ("cache_name", _),
        ("cache_dir", _),
        ("producer_name", _),
    ],
    "existing_shard_indices": [("cache_dir", _)],
    "load_safetensors": [("cache_name", _)],
    "manifest_path": [("cache_dir", _)],
    "partition_cache_shards": [
        ("num_samples", _),
        ("shard_size", _),
        ("world_size", _),
        ("rank", _),
    ],
    "read_manifest": [
        ("cache_dir", _),
        ("cache_name", _),
        ("format_version", _),
        ("producer_name", None),
        ("defaults", None),
    ],
    "resume_start_sample": [("existing_shards", _), ("shard_size", _)],
    "shard_path": [("cache_dir", _), ("shard_index", _)],
    "validate_contiguous_shards": [
        ("cache_dir", _),
        ("cache_name", _),
        ("num_samples", _),
        ("shard_size", _),
    ],
    "write_cache_shards": [
        ("dataloader", _),
        ("output_dir", _),
        ("shard_size", _),
        ("start_shard_index", _),
        ("compute_batch", _),
        ("write_shard_fn", _),
        ("logger", _),
    ],
    "write_cache_shards_distributed": [
        ("dataloader", _),
        ("output_dir", _),
        ("shard_size", _),
        ("world_size", _),
        ("rank", _),
        ("compute_batch", _),
        ("write_shard_fn", _),
        ("logger", _),
        ("sync_max_steps", None),
    ],
    "write_manifest": [("cache_dir", _), ("manifest", _), ("format_version", _)],
    "write_tensor_shard": [
        ("cache_dir", _),
        ("shard_index", _),
        ("samples", _),
        ("keys", _),
        ("cache_name", _),
    ],
}
SEED_CLASSES: dict[str, list[tuple[str, object]]] = {
    "CachedTensorDataset": [
        ("cache_dir", _),
        ("cache_name", _),
        ("format_version", _),
        ("disk_keys", _),
    ],
    "_ShardAccumulator": [
        ("output_dir", _),
        ("shard_size", _),
        ("start_shard_index", _),
        ("write_shard_fn", _),
        ("logger", _),
    ],
}


def _params(obj) -> list[inspect.Parameter]:
    return list(inspect.signature(obj).parameters.values())


@pytest.mark.parametrize("name", sorted(SEED_FUNCTIONS) + sorted(SEED_CLASSES))
def test_seed_signature(name: str) -> None:
    expected = SEED_FUNCTIONS.get(name) or SEED_CLASSES[name]
    obj = getattr(oc, name)
    params = _params(obj)
    assert [(p.name, p.default) for p in params[: len(expected)]] == expected
    for p in params[
        : len(expected)
    ]:  # callable by keyword (as reference callers do) and by position
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (name, p.name)
    for p in params[len(expected) :]:  # extensions never take a positional slot a caller could fill
        assert (
            p.default is not inspect.Parameter.empty or p.kind is inspect.Parameter.VAR_KEYWORD
        ), (name, p.name)


def test_seed_constants_and_methods() -> None:
    assert oc.MANIFEST_NAME == "manifest.json"
    assert oc.SHARD_RE.pattern == r"^shard-(\d{6})\.safetensors$"
    acc = oc._ShardAccumulator("d", 2, 0, lambda *a: "p", logging.getLogger("t"))
    assert acc._buffered == 0 and acc._chunks == []
    assert [p.name for p in _params(acc._flush)] == ["max_samples"] and _params(acc._flush)[
        0
    ].default is None
    assert [p.name for p in _params(acc.add)] == ["batch_cache"]
    assert _params(acc.finalize) == []
    for m in ("__getitem__", "__len__", "_handle"):
        assert callable(getattr(oc.CachedTensorDataset, m))


def test_every_public_seed_name_is_in___all__() -> None:
    """Public reference names are listed; the reference's private helpers stay importable only."""
    for name in [*SEED_FUNCTIONS, *SEED_CLASSES, "MANIFEST_NAME", "SHARD_RE"]:
        assert hasattr(oc, name), name
        assert (name in oc.__all__) is not name.startswith("_"), name


def test_reference_style_keyword_calls(tmp_path) -> None:
    """Calls exactly as the reference's own call sites spell them."""
    p = oc.write_tensor_shard(
        cache_dir=str(tmp_path),
        shard_index=0,
        samples={"a": torch.ones(2, 1)},
        keys=("a",),
        cache_name="t",
    )
    assert p.endswith("shard-000000.safetensors")
    oc.write_manifest(
        cache_dir=str(tmp_path), manifest={"num_samples": 2, "shard_size": 2}, format_version=1
    )
    m = oc.read_manifest(
        str(tmp_path), cache_name="t", format_version=1, producer_name="x", defaults={"f": 1}
    )
    assert m["f"] == 1
    assert oc.validate_contiguous_shards(str(tmp_path), "t", m["num_samples"], m["shard_size"]) == [
        0
    ]


def test_a_reference_style_subclass_reads_disk_keys_through_its_handle(tmp_path) -> None:
    """The reference's EAGLE-3 dataset subclasses ``CachedTensorDataset`` and reads
    ``self._disk_keys`` and ``self._handle(shard)`` in its own ``__getitem__``."""
    rows = {"a": torch.arange(12.0).reshape(4, 3), "b": torch.arange(4).reshape(4, 1)}
    for shard in range(2):
        oc.write_tensor_shard(
            cache_dir=str(tmp_path),
            shard_index=shard,
            samples={k: v[2 * shard : 2 * shard + 2] for k, v in rows.items()},
            keys=("a", "b"),
            cache_name="t",
        )
    oc.write_manifest(str(tmp_path), {"num_samples": 4, "shard_size": 2}, format_version=1)

    class Subclass(oc.CachedTensorDataset):
        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            handle = self._handle(index // self.shard_size)
            offset = index % self.shard_size
            return {key: handle.get_slice(key)[offset] for key in self._disk_keys}

    ds = Subclass(cache_dir=str(tmp_path), cache_name="t", format_version=1, disk_keys=("a", "b"))
    for i in range(4):
        got = ds[i]
        assert list(got) == ["a", "b"]
        assert torch.equal(got["a"], rows["a"][i]) and torch.equal(got["b"], rows["b"][i])
