"""Corruption of a real offline cache: byte flips and truncations of shards and manifest.

The randomised sweep is ``scripts/corruption_test.py`` (its docstring lists the
rules); here it runs with >= 100 shard byte flips spread over the safetensors
header and data, shard truncations, manifest flips and manifest truncations, on a
``produce_cache`` cache, and with fewer trials on every other writer path. CI
uses a fixed seed (reproducible); set ``TE_THD_CORRUPTION_SEED`` to explore.

Below the sweep, the concrete findings it produced are pinned as deterministic
tests (see /work/notes/reliability_bugs.md), plus the cases that must hold for
every cache: each damaged shard is named by ``verify_cache(deep=True)`` and by
``te-thd cache verify --deep``; a truncated shard or manifest fails at open.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from te_thd.offline_cache import CachedTensorDataset, CacheError, verify_cache

REPO_ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "corruption_test", REPO_ROOT / "scripts" / "corruption_test.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


CT = _script()


@pytest.fixture(scope="module")
def clean_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean") / "cache"
    CT.make_clean_cache(d)
    return d


@pytest.fixture
def cache(clean_cache: Path, tmp_path: Path) -> Path:
    d = tmp_path / "cache"
    shutil.copytree(clean_cache, d)
    return d


def test_corruption_sweep(tmp_path: Path) -> None:
    seed = int(os.environ.get("TE_THD_CORRUPTION_SEED", "20240"))
    res = CT.run(quick=True, seed=seed, workdir=str(tmp_path))
    flips = res["by_kind"]["shard-flip"]
    assert flips["tried"] >= 100 and flips["header_flips"] >= 30 and flips["data_flips"] >= 30
    assert res["shard_corruptions_detected_by_deep_verify"] == "150/150"
    assert res["wrong_tensors_returned_undetected"] == 0
    # every writer path te_thd offers writes self-verifying shards: no read path (batched,
    # per-item, training loader) returns a wrong tensor from any damaged copy, and every flip
    # in tensor data is caught by reading alone. A path may return the clean value without
    # an error: a flipped byte of a bool that stays truthy is normalised by torch's copy,
    # and the batch's bytes are what is verified.
    for writer, w in res["by_writer"].items():
        flips = w["by_kind"]["shard-flip"]
        if writer in CT.UNVERIFIABLE:
            continue  # the reference implementation's writer: counted, not verifiable
        assert w["wrong_tensors_returned"] == 0, (writer, w)
        assert flips["data_flips"] >= 3, (writer, flips)
        assert flips["data_flips_caught_by_some_read_path"] == flips["data_flips"], (writer, flips)
    assert res["ok"], (
        f"{res['n_violations']} violations (seed {seed}; python scripts/corruption_test.py --quick "
        f"--seed {seed}):\n" + "\n".join(res["violations"][:20])
    )


# ------------------------------------------------------------------ pinned, every seed


def _flip(path: Path, pos: int, mask: int = 0x5A) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= mask
    path.write_bytes(bytes(data))


def _header_span(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return 8, 8 + int.from_bytes(data[:8], "little")


@pytest.mark.parametrize("shard", [0, 2])
@pytest.mark.parametrize("where", ["prefix", "header", "data", "last_byte"])
def test_deep_verify_and_cli_name_a_flipped_shard(cache: Path, shard: int, where: str) -> None:
    from bad_inputs import run_cli

    path = cache / f"shard-{shard:06d}.safetensors"
    lo, hi = _header_span(path)
    size = path.stat().st_size
    pos = {"prefix": 3, "header": (lo + hi) // 2, "data": (hi + size) // 2, "last_byte": size - 1}[
        where
    ]
    _flip(path, pos)
    with pytest.raises(CacheError, match=path.name):
        verify_cache(str(cache), deep=True)
    status, text = run_cli(["cache", "verify", "--deep", str(cache)])
    assert status == 1 and path.name in text


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_shard_fails_at_open_naming_it(cache: Path, keep: int) -> None:
    path = cache / "shard-000001.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep >= 0 else len(data) - 1])
    with pytest.raises(CacheError, match=path.name):
        CachedTensorDataset(str(cache), "offline", 1, CT.KEYS)


@pytest.mark.parametrize("keep", [0, 1, 40, -1])
def test_truncated_manifest_fails_at_open_naming_it(cache: Path, keep: int) -> None:
    path = cache / "manifest.json"
    data = path.read_bytes()
    cut = (
        keep if keep >= 0 else len(data) - 2
    )  # drop the closing brace (the last byte is a newline)
    path.write_bytes(data[:cut])
    with pytest.raises(CacheError, match="manifest.json"):
        CachedTensorDataset(str(cache), "offline", 1, CT.KEYS)
    with pytest.raises(CacheError, match="manifest.json"):
        verify_cache(str(cache), deep=True)


def _item_read_all(cache: Path) -> list[dict[str, torch.Tensor]]:
    ds = CachedTensorDataset(str(cache), "offline", 1, CT.KEYS)
    return [ds[i] for i in range(len(ds))]


def test_finding_B3_item_read_of_garbled_header_raises_cache_error_naming_shard(
    cache: Path,
) -> None:
    """``dataset[i]`` (the reference per-item path) on a shard whose header JSON is garbage."""
    path = cache / "shard-000001.safetensors"
    data = bytearray(path.read_bytes())
    data[9] = 0x01  # a control character inside the header's first key: invalid JSON
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=path.name):
        _item_read_all(cache)  # was: safetensors_rust.SafetensorError, no file named


def test_finding_B3_item_read_of_dtype_swapped_header_never_returns_wrong_tensors(
    cache: Path,
) -> None:
    """I64 -> F64 keeps the file valid safetensors; the batched path rejects it by schema."""
    path = cache / "shard-000001.safetensors"
    data = path.read_bytes()
    assert b'"I64"' in data
    path.write_bytes(data.replace(b'"I64"', b'"F64"', 1))
    ds = CachedTensorDataset(str(cache), "offline", 1, CT.KEYS)
    with pytest.raises(CacheError, match=path.name):
        ds.__getitems__([8, 9])
    try:
        got = _item_read_all(cache)
    except CacheError as e:
        assert path.name in str(e)
    else:  # was: sample 8's input_ids came back as float64 garbage, no error
        for i, sample in enumerate(got):
            assert sample["input_ids"].dtype == torch.int64, (
                f"sample {i}: {sample['input_ids'].dtype}"
            )


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"format_version"', b'"format_versiof"'),
        (b'"hidden":', b'"hidder":'),
    ],
)
def test_finding_B4_manifest_key_corruption_names_manifest(
    cache: Path, old: bytes, new: bytes
) -> None:
    """A corrupted key inside manifest.json must be reported against manifest.json."""
    path = cache / "manifest.json"
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    with pytest.raises(ValueError, match="manifest.json"):
        CachedTensorDataset(str(cache), "offline", 1, CT.KEYS)
