"""te_thd.offline_cache: sharded safetensors cache of per-sample tensors (format -> writer -> reader)."""

from __future__ import annotations

from .loader import CachedDataLoader, build_cached_dataloader, collate_cached, to_device
from .reader import CachedBatch, CachedTensorDataset
from .sampler import CacheShardSampler, shard_block_order

__all__ = [
    "CacheShardSampler",
    "CachedBatch",
    "CachedDataLoader",
    "CachedTensorDataset",
    "build_cached_dataloader",
    "collate_cached",
    "shard_block_order",
    "to_device",
]
