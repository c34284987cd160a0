"""te_thd.offline_cache: sharded safetensors cache of per-sample tensors (format -> writer ->
reader).

Every name of the reference module (NeMo AutoModel's
``components/datasets/llm/offline_cache``) is here with the same signature, so
only the import changes. The package is one folder per layer; each imports only the
layers below it (docs/offline_cache.md, "Layers: where each rule lives"):

- ``format/``: the on-disk format: names, dtypes, schema and the errors (``schema``), checksums
  and the shard header (``integrity``), the token layout (``ragged``), the codec table
  (``codecs``), a ragged shard's index (``token_index``), one shard checked whole
  (``shard_check``), the length rule (``lengths``);
- ``storage/``: the interface and the local directory (``base``), the scheme table
  (``schemes``), ``s3``, ``msc``;
- ``record/``: the manifest, the run that writes it (``run``), the files it lists (``files``);
- ``read/``: the open (``open``, ``source``), the batch plan and its executor (``planner``,
  ``executor``), ragged reads (``tokens``, ``token_place``), the dataset (``dataset``),
  ``follow`` (reading while the producer runs);
- ``write/``: ``shardfile``, ``writer``, the reference producer loops (``loops``), ``resume``
  and ``producer`` (``produce_cache``);
- ``tools/``: ``verify``, ``repair``, ``plan`` (``te-thd cache plan``), ``cli``;
- ``train/``: ``sampler`` (with the balanced plan), ``collate``, ``loader``.

``__all__`` lists the public API. The reference's private helpers
(``_ShardAccumulator``, ``_sequential_subset_loader``) and the file-layout plumbing the
producer and readers share (``ProducerLock``, ``remove_stale_temp_files``,
``check_cache_files``, ``TensorSpec``) are importable from here but not listed. So
are ``DataLoader`` and ``safe_import_from``, the reference module's patch points: the
producer loops build their loaders with ``te_thd.offline_cache.DataLoader`` and
``load_safetensors`` imports through ``te_thd.offline_cache.safe_import_from``, both
looked up at call time, so tests that patch them here take effect.
"""

from __future__ import annotations

from torch.utils.data import DataLoader as DataLoader

from te_thd.offline_cache.format.schema import (
    MANIFEST_NAME,
    SHARD_RE,
    CacheError,
    CacheIntegrityError,
    CacheLockError,
    ManifestError,
    ManifestNotFoundError,
    SchemaError,
    UnverifiedCacheWarning,
    load_safetensors,
    manifest_path,
    shard_path,
)
from te_thd.offline_cache.format.schema import TensorSpec as TensorSpec
from te_thd.offline_cache.format.schema import safe_import_from as safe_import_from
from te_thd.offline_cache.read.dataset import CachedBatch, CachedTensorDataset, PendingBatch
from te_thd.offline_cache.read.follow import FollowTimeoutError
from te_thd.offline_cache.record.files import check_cache_files as check_cache_files
from te_thd.offline_cache.record.files import validate_contiguous_shards
from te_thd.offline_cache.record.manifest import (
    ensure_supervision_options_match,
    existing_shard_indices,
    read_manifest,
    write_manifest,
)
from te_thd.offline_cache.storage.base import ProducerLock as ProducerLock
from te_thd.offline_cache.storage.base import atomic_write
from te_thd.offline_cache.storage.base import remove_stale_temp_files as remove_stale_temp_files
from te_thd.offline_cache.tools.repair import repair_cache
from te_thd.offline_cache.tools.verify import cache_info, verify_cache
from te_thd.offline_cache.train.collate import CachedThdCollator, collate_cached
from te_thd.offline_cache.train.loader import CachedDataLoader, build_cached_dataloader, to_device
from te_thd.offline_cache.train.sampler import CacheShardSampler, shard_block_order
from te_thd.offline_cache.write.loops import (
    ShardAccumulator,
    dataloader_from_sample,
    partition_cache_shards,
    resume_start_sample,
    sequential_subset_loader,
    write_cache_shards,
    write_cache_shards_distributed,
)
from te_thd.offline_cache.write.producer import produce_cache
from te_thd.offline_cache.write.writer import DurableShardWriter, write_tensor_shard

# the reference module's private names, kept importable for its consumers
_ShardAccumulator = ShardAccumulator
_sequential_subset_loader = sequential_subset_loader

__all__ = [
    "MANIFEST_NAME",
    "SHARD_RE",
    "CacheError",
    "CacheIntegrityError",
    "CacheLockError",
    "FollowTimeoutError",
    "CacheShardSampler",
    "CachedBatch",
    "CachedDataLoader",
    "CachedTensorDataset",
    "CachedThdCollator",
    "DurableShardWriter",
    "ManifestError",
    "ManifestNotFoundError",
    "PendingBatch",
    "SchemaError",
    "UnverifiedCacheWarning",
    "atomic_write",
    "build_cached_dataloader",
    "cache_info",
    "collate_cached",
    "dataloader_from_sample",
    "ensure_supervision_options_match",
    "existing_shard_indices",
    "load_safetensors",
    "manifest_path",
    "partition_cache_shards",
    "produce_cache",
    "read_manifest",
    "repair_cache",
    "resume_start_sample",
    "shard_block_order",
    "shard_path",
    "to_device",
    "validate_contiguous_shards",
    "verify_cache",
    "write_cache_shards",
    "write_cache_shards_distributed",
    "write_manifest",
    "write_tensor_shard",
]
