"""Per-sample lengths in the cache: recorded by the producer, covered by the manifest
checksum, checked by verify, scanned once and kept beside a cache without them, and
used by the balanced loader without ``lengths=``. Real files throughout."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _offline_cache_support import CACHE_NAME, FORMAT_VERSION, _Rows, make_cache, sample_tensors

from te_thd.offline_cache import (
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    produce_cache,
    verify_cache,
    write_manifest,
)
from te_thd.offline_cache.format.lengths import LengthRule, recorded_lengths
from te_thd.offline_cache.format.schema import (
    CacheIntegrityError,
    ManifestError,
    UnverifiedCacheWarning,
)
from te_thd.offline_cache.record.manifest import load_manifest, manifest_checksum
from te_thd.offline_cache.storage.schemes import open_storage
from te_thd.offline_cache.train.loader import (
    cache_lengths,
    read_side_file,
    side_file_name,
    write_side_file,
)
from te_thd.offline_cache.train.sampler import scan_lengths

ROOT = Path(__file__).resolve().parents[1]


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def test_produce_cache_records_input_ids_lengths_by_default(tmp_path: Path) -> None:
    tensors = make_cache(str(tmp_path), 23, 5)
    m = _manifest(tmp_path)
    assert m["length_rule"] == {"key": "input_ids", "kind": "last_nonpad", "pad_token_id": 0}
    assert [len(r["lengths"]) for r in m["shards"]] == [5, 5, 5, 5, 3]
    np.testing.assert_array_equal(recorded_lengths(m), tensors["length"].numpy())
    # the loader's lengths are the recorded ones: no scan, no side file
    np.testing.assert_array_equal(cache_lengths(str(tmp_path)), tensors["length"].numpy())
    assert not list(tmp_path.glob("lengths.*"))
    result = verify_cache(str(tmp_path), deep=True)
    assert result["lengths_verified"] and result["lengths_recorded"].startswith(
        "the non-padding length"
    )
    assert any("recorded length" in line for line in result["checked"])
    assert not verify_cache(str(tmp_path))["lengths_verified"]  # quick: recorded, not read


def test_length_key_with_one_value_per_sample_and_resume(tmp_path: Path) -> None:
    tensors = sample_tensors(17, seed=3)
    calls = {"n": 0}

    def dies_on_third(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("node lost")
        return batch

    def run(fn):
        loader = torch.utils.data.DataLoader(_Rows(tensors), batch_size=4)
        return produce_cache(
            loader, str(tmp_path), 4, fn, tuple(tensors), length_key="length", progress=False
        )

    with pytest.raises(RuntimeError):
        run(dies_on_third)
    m = run(lambda b: b)  # resume: shards 0-1 are read back for their lengths
    assert m["length_rule"]["kind"] == "value" and m["length_rule"]["key"] == "length"
    np.testing.assert_array_equal(recorded_lengths(m), tensors["length"].numpy())
    assert verify_cache(str(tmp_path), deep=True)["lengths_verified"]
    with pytest.raises(ValueError, match="length_key='nope'"):
        produce_cache(torch.utils.data.DataLoader(_Rows(tensors), batch_size=4), str(tmp_path / "x"), 4,
                      lambda b: b, tuple(tensors), length_key="nope", progress=False)  # fmt: skip


def test_tampered_length_is_detected(tmp_path: Path) -> None:
    make_cache(str(tmp_path), 12, 4)
    raw = (tmp_path / "manifest.json").read_text()
    m = json.loads(raw)
    old = m["shards"][1]["lengths"][2]
    # an edit of the file alone breaks the manifest's own checksum
    m_edit = json.loads(raw)
    m_edit["shards"][1]["lengths"][2] = old + 1
    (tmp_path / "manifest.json").write_text(json.dumps(m_edit, indent=2, sort_keys=True))
    with pytest.raises(ManifestError, match="does not match its own checksum"):
        verify_cache(str(tmp_path))
    # rewritten with a fresh checksum, the deep verify compares against the data
    m.pop("manifest_checksum")
    m["shards"][1]["lengths"][2] = old + 1
    write_manifest(str(tmp_path), m, m["format_version"])
    verify_cache(str(tmp_path))  # quick verify does not read the data
    with pytest.raises(
        CacheIntegrityError,
        match=rf"sample 6 \(row 2 of the shard\): the manifest records length {old + 1}, the data gives {old}",
    ):
        verify_cache(str(tmp_path), deep=True)
    # a malformed lengths list is a damaged manifest
    m["shards"][0]["lengths"] = [1, 2]
    with pytest.raises(ManifestError, match="'lengths' must be a list of 4 ints"):
        write_manifest(str(tmp_path), m, m["format_version"])


@pytest.mark.filterwarnings("always::te_thd.offline_cache.format.schema.UnverifiedCacheWarning")
def test_reference_cache_scanned_once_kept_reused_and_invalidated(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """A reference-format cache (no checksums: its reads warn, asserted at the end) is scanned once."""
    tensors = make_cache(str(tmp_path), 19, 6, producer=False)
    want = tensors["length"].numpy()
    assert verify_cache(str(tmp_path), deep=True)["lengths_recorded"] is None
    got = cache_lengths(str(tmp_path), CACHE_NAME)
    np.testing.assert_array_equal(got, want)
    rule = LengthRule("input_ids")
    side, store = tmp_path / side_file_name(rule), open_storage(str(tmp_path))
    assert side.name == "lengths.input_ids.json" and side.exists()
    msum = manifest_checksum(load_manifest(str(tmp_path)))
    np.testing.assert_array_equal(read_side_file(store, rule, msum, 19), want)
    # the next run reads the side file (proved by planting other valid content in it)
    write_side_file(store, rule, msum, want + 1)
    np.testing.assert_array_equal(cache_lengths(str(tmp_path), CACHE_NAME), want + 1)
    # a damaged side file is ignored and rewritten by a new scan
    side.write_bytes(side.read_bytes().replace(b'"lengths": [', b'"lengths": [7, ', 1))
    np.testing.assert_array_equal(cache_lengths(str(tmp_path), CACHE_NAME), want)
    # a changed manifest makes the kept lengths stale
    write_side_file(store, rule, msum, want + 1)
    write_manifest(
        str(tmp_path), {"num_samples": 19, "shard_size": 6, "note": "edited"}, FORMAT_VERSION
    )
    np.testing.assert_array_equal(cache_lengths(str(tmp_path), CACHE_NAME), want)
    new_sum = manifest_checksum(load_manifest(str(tmp_path)))
    assert new_sum != msum and read_side_file(store, rule, new_sum, 19) is not None
    # another key: its own side file, its own rule (one value per sample)
    np.testing.assert_array_equal(cache_lengths(str(tmp_path), CACHE_NAME, "length"), want)
    assert (tmp_path / "lengths.length.json").exists()
    with pytest.raises(ValueError, match="length_key='nope'"):
        cache_lengths(str(tmp_path), CACHE_NAME, "nope")
    unverified = [w for w in recwarn if issubclass(w.category, UnverifiedCacheWarning)]
    assert unverified and all("carries no checksums" in str(w.message) for w in unverified)


_READ_ONLY = """
import sys
from te_thd.offline_cache.format.schema import CacheError
from te_thd.offline_cache.train.loader import cache_lengths
try:
    cache_lengths(sys.argv[1], "test")
except CacheError as exc:
    print(exc)
    sys.exit(3)
"""


def _without_dac_override() -> None:
    """In the child, before exec: drop root's power to write where permissions forbid it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (
        1,
        2,
    ):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, from the bounding set (PR_CAPBSET_DROP)
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_read_only_cache_without_lengths_says_how_to_add_them(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    make_cache(str(cache), 9, 4, producer=False)
    os.chmod(cache, 0o555)  # a real read-only directory (root runs the child without DAC override)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        demote = _without_dac_override if os.getuid() == 0 else None
        proc = subprocess.run([sys.executable, "-c", _READ_ONLY, str(cache)], capture_output=True, text=True,
                              env=env, preexec_fn=demote, timeout=120)  # fmt: skip
    finally:
        os.chmod(cache, 0o755)
    assert proc.returncode == 3, proc.stderr
    assert (
        "read-only" in proc.stdout and "produce_cache(..., length_key='input_ids')" in proc.stdout
    )
    assert not [n for n in os.listdir(cache) if n.startswith("lengths.")]


@pytest.mark.parametrize("producer", [True, False])
@pytest.mark.filterwarnings("always::te_thd.offline_cache.format.schema.UnverifiedCacheWarning")
def test_balanced_loader_uses_recorded_or_kept_lengths(
    tmp_path: Path, producer: bool, recwarn
) -> None:
    tensors = sample_tensors(24, seed=5)
    if producer:  # lengths recorded from the key the collator packs by
        loader = torch.utils.data.DataLoader(_Rows(tensors), batch_size=6)
        produce_cache(loader, str(tmp_path), 6, lambda b: b, tuple(tensors), format_version=FORMAT_VERSION,
                      cache_name=CACHE_NAME, length_key="length", progress=False)  # fmt: skip
    else:
        make_cache(str(tmp_path), 24, 6, seed=5, producer=False)
    keys = ("input_ids", "length")
    data = CachedTensorDataset(str(tmp_path), CACHE_NAME, FORMAT_VERSION, keys)

    def batches(**kw):
        out = []
        for rank in range(2):
            collate = CachedThdCollator(16, keys=keys, length_key="length")
            loader = build_cached_dataloader(
                data, 4, True, collate, dp_rank=rank, dp_size=2, balance=True, **kw
            )
            out.append([b["input_ids"].tolist() for b in loader])
        return out

    assert batches() == batches(lengths=scan_lengths(data, length_key="length"))
    assert (tmp_path / "lengths.length.json").exists() == (not producer)
    np.testing.assert_array_equal(
        cache_lengths(str(tmp_path), CACHE_NAME, "length"), tensors["length"].numpy()
    )
    # a collator without length information packs full rows: planned as such, nothing scanned
    full = CachedThdCollator(16, keys=keys)
    assert len(list(build_cached_dataloader(data, 4, True, full, balance=True))) == 6
    assert sorted(p.name for p in tmp_path.glob("lengths.*")) == (
        [] if producer else ["lengths.length.json"]
    )
    with pytest.raises(ValueError, match="not a CachedTensorDataset"):
        build_cached_dataloader(list(range(4)), 2, False, CachedThdCollator(16), balance=True)
    unverified = [w for w in recwarn if issubclass(w.category, UnverifiedCacheWarning)]
    assert bool(unverified) == (not producer)  # only the reference-format cache reads unverified


def test_reference_loop_with_durable_writer_records_lengths(tmp_path: Path) -> None:
    import logging

    from te_thd.offline_cache import DurableShardWriter, write_cache_shards

    tensors = sample_tensors(11, seed=8)
    with DurableShardWriter(
        tuple(tensors), CACHE_NAME, length_rule=LengthRule("input_ids")
    ) as writer:
        loader = torch.utils.data.DataLoader(_Rows(tensors), batch_size=3)
        write_cache_shards(
            loader, str(tmp_path), 4, 0, lambda b: b, writer, logging.getLogger("test")
        )
        writer.flush()
    write_manifest(str(tmp_path), {"num_samples": 11, "shard_size": 4, "layout_version": 3,
                                   **writer.manifest_fields(str(tmp_path))}, FORMAT_VERSION)  # fmt: skip
    m = load_manifest(str(tmp_path))
    np.testing.assert_array_equal(recorded_lengths(m), tensors["length"].numpy())
    assert verify_cache(str(tmp_path), deep=True)["lengths_verified"]
