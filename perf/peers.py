"""The caches a user would pick instead of te_thd's, written from their public format descriptions.

Benchmark code, not part of the package: ``bench_peers.py`` writes every peer's cache
from the same samples and reads it back through the reader below. Each reader is kept
to its own design, with none of te_thd's tricks and nothing taken away:

- **DeepSpec-style** (deepseek-ai/DeepSpec, ``deepspec/data/target_cache_dataset.py``):
  each sample's real tokens only, appended as raw bytes to large shard files
  (``shard-NNNNN.bin``): ``input_ids`` int32, ``loss_mask`` uint8, then the hidden
  states (bf16, or a plain ``float8_e4m3fn`` cast with no scale). ``samples.idx`` holds
  one 56-byte record per sample, struct ``<QIIQQQQQ``: sample id, shard id, sequence
  length, then five byte offsets (``input_ids``, ``loss_mask``, the hidden states, and
  two slots this workload leaves 0). Reading memory-maps the index and the shards
  (an LRU of open shards); every tensor is ``np.frombuffer(...)``-ed out of its
  mapping and copied. No checksums.
- **SpecForge-style** (sgl-project/SpecForge offline data): one ``torch.save`` file per
  sample holding a dict of tensors, read by ``torch.load`` per sample.

Samples are dicts ``{"input_ids": int32 [n], "loss_mask": uint8 [n],
"aux_hidden_states": [n, W]}`` (``W`` = 3 captured layers x hidden size, bf16), the
keys and layout of an EAGLE-3 cache. Two deliveries of a batch, the peers' own
collators: :func:`pad_batch` (``[B, L_max, ...]``, zero padding to the batch's longest
sample) and :func:`concat_batch` (``[T, ...]`` with ``cu_seqlens``).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

#: the per-token keys of a sample, in the order DeepSpec appends them
TOKEN_KEYS = ("input_ids", "loss_mask", "aux_hidden_states")
HIDDEN_KEY = "aux_hidden_states"
Sample = dict[str, torch.Tensor]

#: one ``samples.idx`` record: sample id, shard id, length, five byte offsets
INDEX_RECORD = struct.Struct("<QIIQQQQQ")
INDEX_DTYPE = np.dtype(
    [
        ("sample_id", "<u8"),
        ("shard_id", "<u4"),
        ("seq_len", "<u4"),
        ("off_input_ids", "<u8"),
        ("off_loss_mask", "<u8"),
        ("off_hidden", "<u8"),
        ("off_spare0", "<u8"),
        ("off_spare1", "<u8"),
    ]
)
assert INDEX_DTYPE.itemsize == INDEX_RECORD.size == 56
DEEPSPEC_META = "meta.json"
_HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


# --------------------------------------------------------------------------- deliveries


def pad_batch(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """The peers' padded batch: each key ``[B, L_max, ...]`` zero-padded to the longest sample.

    Returns the token keys plus ``seq_len`` int64 ``[B]``.
    """
    lens = [int(s["input_ids"].shape[0]) for s in samples]
    longest = max(lens)
    out: dict[str, torch.Tensor] = {}
    for key in TOKEN_KEYS:
        first = samples[0][key]
        dst = torch.zeros((len(samples), longest, *first.shape[1:]), dtype=first.dtype)
        for b, s in enumerate(samples):
            dst[b, : lens[b]] = s[key]
        out[key] = dst
    out["seq_len"] = torch.tensor(lens, dtype=torch.int64)
    return out


def concat_batch(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """The peers' packed THD batch: each key ``[T, ...]`` (the samples back to back).

    Returns the token keys plus ``cu_seqlens`` int32 ``[B + 1]``.
    """
    out = {key: torch.cat([s[key] for s in samples]) for key in TOKEN_KEYS}
    lens = torch.tensor([int(s["input_ids"].shape[0]) for s in samples], dtype=torch.int32)
    out["cu_seqlens"] = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return out


# --------------------------------------------------------------------------- DeepSpec-style


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes as stored (bf16 and fp8 through an integer view numpy knows)."""
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        t = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.uint8)
    return t.numpy().tobytes()


def write_deepspec(
    out_dir: str, samples: Iterable[Sample], shard_bytes: int, fp8: bool = False
) -> None:
    """Write a DeepSpec-style cache of ``samples`` in ``out_dir``.

    Args:
        shard_bytes: a new shard file starts once the current one holds this many bytes.
        fp8: store the hidden states as a plain ``float8_e4m3fn`` cast (no scale).
    """
    os.makedirs(out_dir, exist_ok=True)
    hidden = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shard_id, shard, width = -1, None, None
    with open(os.path.join(out_dir, "samples.idx"), "wb") as index:
        for i, s in enumerate(samples):
            if shard is None or shard.tell() >= shard_bytes:
                if shard is not None:
                    shard.close()
                shard_id += 1
                shard = open(os.path.join(out_dir, f"shard-{shard_id:05d}.bin"), "wb")  # noqa: SIM115
            width = int(s[HIDDEN_KEY].shape[1])
            offsets = []
            for key, dtype in zip(TOKEN_KEYS, (torch.int32, torch.uint8, hidden), strict=True):
                offsets.append(shard.tell())
                shard.write(_raw(s[key].to(dtype)))
            n = int(s["input_ids"].shape[0])
            index.write(INDEX_RECORD.pack(i, shard_id, n, *offsets, 0, 0))
        if shard is not None:
            shard.close()
    meta = {"hidden_width": width, "hidden_dtype": str(hidden).removeprefix("torch.")}
    with open(os.path.join(out_dir, DEEPSPEC_META), "w") as f:
        json.dump(meta, f)


class DeepSpecDataset(Dataset):
    """Per-sample reads of a DeepSpec-style cache (the index and the shards memory-mapped).

    Args:
        cache_dir: what :func:`write_deepspec` wrote.
        max_open_shards: mapped shard files kept open (least recently used closed first).

    ``self[i]`` is a sample dict (``input_ids`` int32 ``[n]``, ``loss_mask`` uint8
    ``[n]``, the hidden states ``[n, W]`` in their stored dtype), each tensor copied
    out of its mapping.
    """

    def __init__(self, cache_dir: str, max_open_shards: int = 8) -> None:
        self.cache_dir = cache_dir
        with open(os.path.join(cache_dir, DEEPSPEC_META)) as f:
            meta = json.load(f)
        self.width = int(meta["hidden_width"])
        self.hidden_dtype = _HIDDEN_DTYPES[meta["hidden_dtype"]]
        self.index = np.memmap(os.path.join(cache_dir, "samples.idx"), dtype=INDEX_DTYPE, mode="r")
        self.max_open_shards = max_open_shards
        self._shards: OrderedDict[int, tuple[object, mmap.mmap]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def _shard(self, shard_id: int) -> mmap.mmap:
        hit = self._shards.get(shard_id)
        if hit is not None:
            self._shards.move_to_end(shard_id)
            return hit[1]
        f = open(os.path.join(self.cache_dir, f"shard-{shard_id:05d}.bin"), "rb")  # noqa: SIM115
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._shards[shard_id] = (f, mm)
        while len(self._shards) > self.max_open_shards:
            _, (old_f, old_mm) = self._shards.popitem(last=False)
            old_mm.close()
            old_f.close()  # type: ignore[attr-defined]
        return mm

    def __getitem__(self, i: int) -> Sample:
        rec = self.index[i]
        n = int(rec["seq_len"])
        mm = self._shard(int(rec["shard_id"]))
        ids = np.frombuffer(mm, np.int32, n, int(rec["off_input_ids"])).copy()
        mask = np.frombuffer(mm, np.uint8, n, int(rec["off_loss_mask"])).copy()
        raw_dtype = np.int16 if self.hidden_dtype == torch.bfloat16 else np.uint8
        hidden = np.frombuffer(mm, raw_dtype, n * self.width, int(rec["off_hidden"])).copy()
        return {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            HIDDEN_KEY: torch.from_numpy(hidden).view(self.hidden_dtype).view(n, self.width),
        }

    def close(self) -> None:
        """Unmap and close every open shard (a mapped page stays in the page cache)."""
        while self._shards:
            _, (f, mm) = self._shards.popitem()
            mm.close()
            f.close()  # type: ignore[attr-defined]
        del self.index


# --------------------------------------------------------------------------- SpecForge-style


def specforge_path(out_dir: str, i: int) -> str:
    """The file of sample ``i``."""
    return os.path.join(out_dir, f"data_{i:08d}.ckpt")


def write_specforge(out_dir: str, samples: Iterable[Sample]) -> None:
    """Write one ``torch.save`` dict per sample in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    for i, s in enumerate(samples):
        torch.save({key: s[key].contiguous() for key in TOKEN_KEYS}, specforge_path(out_dir, i))


class SpecForgeDataset(Dataset):
    """Per-sample ``torch.load`` of a SpecForge-style cache: ``self[i]`` is sample ``i``'s dict."""

    def __init__(self, cache_dir: str) -> None:
        names = sorted(f for f in os.listdir(cache_dir) if f.endswith(".ckpt"))
        self.paths = [os.path.join(cache_dir, f) for f in names]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Sample:
        return torch.load(self.paths[i], weights_only=True)
