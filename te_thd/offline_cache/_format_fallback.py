"""TEMPORARY minimal manifest/shard helpers used by the reader until ``format.py`` lands.

Deleted as soon as the producer's ``te_thd.offline_cache.format`` is committed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")


def load_safetensors(cache_name: str):
    from safetensors import safe_open
    from safetensors.torch import save_file

    return save_file, safe_open


def shard_path(cache_dir: str, shard_index: int) -> str:
    return os.path.join(cache_dir, f"shard-{shard_index:06d}.safetensors")


def read_manifest(cache_dir: str, cache_name: str, format_version: int, producer_name: str | None = None, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    path = os.path.join(cache_dir, "manifest.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{cache_name} cache manifest not found at {path}. Was the cache fully written?")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != format_version:
        raise ValueError(f"{cache_name} cache at {cache_dir} has format_version={manifest.get('format_version')}, expected {format_version}.")
    return {**(defaults or {}), **manifest}


def validate_contiguous_shards(cache_dir: str, cache_name: str, num_samples: int, shard_size: int) -> list[int]:
    indices = sorted(int(m.group(1)) for n in os.listdir(cache_dir) if (m := SHARD_RE.match(n)))
    expected = list(range((num_samples + shard_size - 1) // shard_size))
    if indices != expected:
        raise ValueError(f"{cache_name} cache at {cache_dir} declares {num_samples} samples but found shard indices {indices}.")
    return indices
