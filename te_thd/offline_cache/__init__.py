"""te_thd.offline_cache: sharded safetensors cache of per-sample tensors (format -> writer -> reader).

Every name of the reference module (NeMo AutoModel's
``components/datasets/llm/offline_cache``) is here with the same signature, so
only the import changes. Modules: ``format`` (paths, manifest, schema),
``durable`` (atomic writes, producer lock), ``shardfile`` (shard bytes +
checksum), ``writer`` (seed producer loops), ``producer`` (``produce_cache``:
resume, lock, distributed, manifest), ``verify`` (integrity checks), ``reader`` /
``sampler`` / ``loader`` (reading side), ``cli`` (``te-thd cache ...``).
"""

from __future__ import annotations

from .durable import ProducerLock, atomic_write, remove_stale_temp_files
from .errors import (
    CacheError,
    CacheIntegrityError,
    CacheLockError,
    ManifestError,
    ManifestNotFoundError,
    SchemaError,
)
from .format import (
    MANIFEST_NAME,
    SHARD_RE,
    TensorSpec,
    ensure_supervision_options_match,
    existing_shard_indices,
    load_safetensors,
    manifest_path,
    read_manifest,
    shard_path,
    validate_contiguous_shards,
    write_manifest,
)
from .loader import CachedDataLoader, build_cached_dataloader, collate_cached, to_device
from .reader import CachedBatch, CachedTensorDataset
from .sampler import CacheShardSampler, shard_block_order
from .thd_collate import CachedThdCollator
from .verify import cache_info, check_cache_files, verify_cache

__all__ = [
    "MANIFEST_NAME",
    "SHARD_RE",
    "CacheError",
    "CacheIntegrityError",
    "CacheLockError",
    "CacheShardSampler",
    "CachedBatch",
    "CachedDataLoader",
    "CachedTensorDataset",
    "CachedThdCollator",
    "ManifestError",
    "ManifestNotFoundError",
    "ProducerLock",
    "SchemaError",
    "TensorSpec",
    "atomic_write",
    "build_cached_dataloader",
    "cache_info",
    "check_cache_files",
    "collate_cached",
    "ensure_supervision_options_match",
    "existing_shard_indices",
    "load_safetensors",
    "manifest_path",
    "read_manifest",
    "remove_stale_temp_files",
    "shard_block_order",
    "shard_path",
    "to_device",
    "validate_contiguous_shards",
    "verify_cache",
    "write_manifest",
]
