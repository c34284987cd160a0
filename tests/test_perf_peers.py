"""The peer caches of perf/bench_peers.py read back the very samples te_thd's cache does.

A differential test at tiny size: the same generated EAGLE-3-shaped samples are
written as te_thd's ragged cache, a DeepSpec-style cache, a SpecForge-style cache and
(for the reference) te_thd's padded cache; every reader must return each sample bit
for bit as te_thd's reader does, and the peers' two deliveries must hold the same
tokens as te_thd's samples.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PERF = Path(__file__).resolve().parents[1] / "perf"
sys.path.insert(0, str(PERF))

import bench_peers  # noqa: E402
import peers  # noqa: E402
from harness import reference_offline_cache  # noqa: E402

from te_thd.offline_cache import CachedTensorDataset  # noqa: E402

LENGTHS = np.array([16, 41, 3, 100, 64, 1, 77, 250, 9, 33], dtype=np.int64)
HIDDEN = 8


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[peers.Sample], dict[str, str]]:
    root = tmp_path_factory.mktemp("peers")
    samples = [bench_peers.make_sample(i, int(n), HIDDEN) for i, n in enumerate(LENGTHS)]
    dirs = {k: str(root / k) for k in ("ragged", "padded", "deepspec", "deepspec_fp8", "specforge")}
    bench_peers.write_tethd(dirs["ragged"], samples, LENGTHS, token_keys=bench_peers.TOKEN_KEYS)
    bench_peers.write_tethd(dirs["padded"], samples, LENGTHS)
    # a shard limit a few samples long, so the reader crosses shards and its LRU closes some
    peers.write_deepspec(dirs["deepspec"], samples, shard_bytes=4096)
    peers.write_deepspec(dirs["deepspec_fp8"], samples, shard_bytes=4096, fp8=True)
    peers.write_specforge(dirs["specforge"], samples)
    return samples, dirs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (bf16 and fp8 compared bit for bit)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in peers.TOKEN_KEYS:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(_bits(a[key]), _bits(b[key])), key


def _tethd_samples(cache_dir: str) -> list[dict[str, torch.Tensor]]:
    ds = CachedTensorDataset(cache_dir, "bench", 1, bench_peers.KEYS)
    out = []
    for i in range(len(ds)):
        row = ds[i]
        n = int(row["seq_len"])
        out.append({key: row[key][:n] for key in peers.TOKEN_KEYS})
    return out


def test_every_reader_returns_te_thds_samples(caches) -> None:
    samples, dirs = caches
    ours = _tethd_samples(dirs["ragged"])
    assert len(ours) == len(samples)
    deepspec = peers.DeepSpecDataset(dirs["deepspec"], max_open_shards=2)
    specforge = peers.SpecForgeDataset(dirs["specforge"])
    for i in np.random.default_rng(0).permutation(len(samples)).tolist():  # shuffled, as read
        _same(ours[i], samples[i])
        _same(deepspec[i], ours[i])
        _same(specforge[i], ours[i])
    assert len(deepspec._shards) <= 2
    deepspec.close()
    for a, b in zip(_tethd_samples(dirs["padded"]), ours, strict=True):
        _same(a, b)


def test_deepspec_layout_is_the_published_one(caches) -> None:
    samples, dirs = caches
    index = Path(dirs["deepspec"], "samples.idx").read_bytes()
    assert len(index) == 56 * len(samples)
    records = [peers.INDEX_RECORD.unpack_from(index, 56 * i) for i in range(len(samples))]
    assert [r[0] for r in records] == list(range(len(samples)))
    assert [r[2] for r in records] == LENGTHS.tolist()
    assert len({r[1] for r in records}) > 1  # the samples span several shards
    sid, shard, n, off_ids, off_mask, off_hidden, spare0, spare1 = records[3]
    raw = Path(dirs["deepspec"], f"shard-{shard:05d}.bin").read_bytes()
    assert raw[off_ids : off_ids + 4 * n] == samples[3]["input_ids"].numpy().tobytes()
    assert raw[off_mask : off_mask + n] == samples[3]["loss_mask"].numpy().tobytes()
    assert off_hidden == off_mask + n and (spare0, spare1) == (0, 0)
    # real tokens only: the shards hold exactly the samples' bytes
    shards = [f for f in os.listdir(dirs["deepspec"]) if f.endswith(".bin")]
    per_token = 4 + 1 + 3 * HIDDEN * 2
    assert (
        sum(os.path.getsize(os.path.join(dirs["deepspec"], f)) for f in shards)
        == per_token * LENGTHS.sum()
    )


def test_deepspec_fp8_is_a_plain_cast(caches) -> None:
    samples, dirs = caches
    ds = peers.DeepSpecDataset(dirs["deepspec_fp8"])
    for i, s in enumerate(samples):
        got = ds[i][peers.HIDDEN_KEY]
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(_bits(got), _bits(s[peers.HIDDEN_KEY].to(torch.float8_e4m3fn)))
    ds.close()


def test_deliveries_hold_the_same_tokens(caches) -> None:
    samples, dirs = caches
    ours = _tethd_samples(dirs["ragged"])
    deepspec = peers.DeepSpecDataset(dirs["deepspec"])
    batch = [deepspec[i] for i in (7, 2, 5, 3)]
    padded = peers.pad_batch(batch)
    assert padded["seq_len"].tolist() == [250, 3, 1, 100]
    assert padded[peers.HIDDEN_KEY].shape == (4, 250, 3 * HIDDEN)
    for b, i in enumerate((7, 2, 5, 3)):
        n = int(LENGTHS[i])
        row = {key: padded[key][b, :n] for key in peers.TOKEN_KEYS}
        _same(row, ours[i])
        assert not padded[peers.HIDDEN_KEY][b, n:].any()
    thd = peers.concat_batch(batch)
    assert thd["cu_seqlens"].tolist() == [0, 250, 253, 254, 354]
    _same(thd, {k: torch.cat([ours[i][k] for i in (7, 2, 5, 3)]) for k in peers.TOKEN_KEYS})
    deepspec.close()


def test_reference_reads_te_thds_padded_cache(caches) -> None:
    ref = reference_offline_cache()
    if ref is None:
        pytest.skip(
            "the reference (nemo-automodel, perf/reference-requirements.txt) is not installed"
        )
    samples, dirs = caches
    loader = bench_peers._reference_loader(ref, dirs["padded"], "thd", 0)
    seen = 0
    for batch in loader:
        seen += int(batch["cu_seqlens"].numel()) - 1
    assert seen == len(samples)
    ds = ref.CachedTensorDataset(
        cache_dir=dirs["padded"], cache_name="bench", format_version=1, disk_keys=bench_peers.KEYS
    )
    for i, s in enumerate(samples):
        row = ds[i]
        n = int(row["seq_len"])
        _same({k: row[k][:n] for k in peers.TOKEN_KEYS}, s)
