"""A lost or damaged ``manifest.json``: every shard ``produce_cache`` writes records its run, so
``te-thd cache repair`` / ``repair_cache`` rebuild the manifest from the shards alone.

The oracle is the manifest the producer wrote: the rebuilt one must be the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from te_thd.offline_cache import CachedTensorDataset, CacheIntegrityError, produce_cache
from te_thd.offline_cache.producer import PROGRESS_NAME
from te_thd.offline_cache.shardfile import read_shard_header
from te_thd.offline_cache.writer import write_tensor_shard

W = 6
KEYS = ("input_ids", "hidden", "length")
OPTIONS = {"cp_size": 2, "mask_prompt": True, "notes": {"run": "x", "ü": [1, 2]}}


class _Samples(torch.utils.data.Dataset):
    """``n`` samples: right-padded ids ``[W]``, a per-token ``hidden`` ``[W, 3]`` and the ``length``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        length = 1 + (i * 7) % W
        ids = torch.zeros(W, dtype=torch.int64)
        ids[:length] = torch.arange(1, length + 1) + i
        hidden = torch.arange(W * 3, dtype=torch.float32).reshape(W, 3) * (i + 1) * (ids != 0).unsqueeze(1)
        return {"input_ids": ids, "hidden": hidden, "length": torch.tensor(length)}


def produce(out: Path | str, n: int = 10, shard_size: int = 4, **kw) -> dict:
    """The tests' cache: ``n`` samples in shards of ``shard_size``, through ``produce_cache``."""
    kw.setdefault("options", OPTIONS)
    return produce_cache(DataLoader(_Samples(n), batch_size=2), str(out), shard_size, lambda b: b, KEYS,
                         format_version=3, progress=False, **kw)  # fmt: skip


def _record(path: Path) -> dict | None:
    sums = read_shard_header(str(path)).sums
    assert sums is not None
    return sums.run


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_every_shard_records_the_producer_run(tmp_path: Path, ragged: bool) -> None:
    kw = {"token_keys": ("input_ids", "hidden"), "length_key": "length"} if ragged else {}
    produce(tmp_path / "c", **kw)
    want = {
        "format_version": 3, "num_samples": 10, "shard_size": 4, "keys": sorted(KEYS), "options": OPTIONS,
        "length_rule": {"key": "length" if ragged else "input_ids", "kind": "last_nonpad", "pad_token_id": 0},
    }  # fmt: skip
    if ragged:
        want["token_layout"] = {"keys": ["input_ids", "hidden"], "codecs": {}}
    shards = sorted((tmp_path / "c").glob("shard-*"))
    assert len(shards) == 3 and all(_record(p) == want for p in shards)
    # the record is the producer's run parameters (what a resume compares) plus its length rule
    with pytest.raises(FileNotFoundError):  # removed once the manifest is written
        (tmp_path / "c" / PROGRESS_NAME).read_text()


def test_a_resumed_run_records_the_same_and_writes_the_same_bytes(tmp_path: Path) -> None:
    produce(tmp_path / "a")
    produce(tmp_path / "b")
    (tmp_path / "b" / "manifest.json").unlink()
    (tmp_path / "b" / "shard-000001.safetensors").unlink()
    # without a manifest, with shards that carry their run: the producer record is what a resume needs
    (tmp_path / "b" / PROGRESS_NAME).write_text(json.dumps({k: v for k, v in _record(tmp_path / "a" / "shard-000000.safetensors").items() if k != "length_rule"}))
    produce(tmp_path / "b")
    for name in ("manifest.json", "shard-000000.safetensors", "shard-000001.safetensors", "shard-000002.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_the_run_record_is_one_metadata_entry_covered_by_the_header_digest(tmp_path: Path) -> None:
    produce(tmp_path / "c")
    shard = tmp_path / "c" / "shard-000000.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert list(metadata) == ["te_thd"] and '"run":' in metadata["te_thd"]
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)  # still save_file's bytes
    assert (tmp_path / "ref.safetensors").read_bytes() == shard.read_bytes()
    data = shard.read_bytes()
    pos = data.index(b'cp_size\\":2') + len(b'cp_size\\":')
    shard.write_bytes(data[:pos] + b"4" + data[pos + 1 :])  # a flipped option value, still valid JSON
    with pytest.raises(CacheIntegrityError, match=r"header checksum mismatch"):
        read_shard_header(str(shard))


def test_shards_without_a_run_record_read_as_before(tmp_path: Path) -> None:
    """Shards of the low-level writer (and of te_thd before the record) carry no ``run``: same bytes as
    ``save_file`` with the checksum entry alone, read and verified as always."""
    d = tmp_path / "c"
    rows = {k: torch.stack([_Samples(4)[i][k] for i in range(4)]) for k in KEYS}
    write_tensor_shard(str(d), 0, rows, KEYS, "test")
    shard = d / "shard-000000.safetensors"
    assert _record(shard) is None
    with safe_open(str(shard), framework="pt") as f:
        assert '"run"' not in f.metadata()["te_thd"]
    from te_thd.offline_cache import write_manifest
    from te_thd.offline_cache.writer import DurableShardWriter

    with DurableShardWriter(KEYS, "test") as w:
        os.unlink(shard)
        w(str(d), 0, rows)
        w.flush()
        write_manifest(str(d), {"num_samples": 4, "shard_size": 4, "layout_version": 3, **w.manifest_fields(str(d))}, 3)
    ds = CachedTensorDataset(str(d), "test", 3, KEYS)
    assert torch.equal(ds[2]["hidden"], rows["hidden"][2])
