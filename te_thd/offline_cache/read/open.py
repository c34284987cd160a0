"""Open a cache for reading, once: its storage, its manifest and the check of its shard files.

:class:`~te_thd.offline_cache.read.dataset.CachedTensorDataset` is the entry point that opens a
cache; it
holds the :class:`OpenedCache` this module returns and hands its storage and manifest to what
reads. Opening an object store's cache costs one manifest request and one listing: the manifest's
bytes and the listing are read here once and passed on (the shard check, the read-through copy's
sync), never fetched again by the layers below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from te_thd.offline_cache.format.schema import num_shards
from te_thd.offline_cache.read.follow import Follower, open_followed
from te_thd.offline_cache.record.files import check_listed_files
from te_thd.offline_cache.record.manifest import (
    check_format_version_arg,
    check_manifest,
    fetch_manifest,
    producer_command,
)
from te_thd.offline_cache.storage.base import Storage
from te_thd.offline_cache.storage.schemes import open_storage


@dataclass
class OpenedCache:
    """What opening a cache found: where it lives, its manifest, the command that rebuilds it, its
    shard indices ``0..N-1`` and, while its producer still runs, the :class:`Follower`."""

    storage: Storage
    manifest: dict[str, Any]
    producer_name: str
    shard_indices: list[int]
    follower: Follower | None


def open_cache(
    cache_dir: str | os.PathLike[str],
    cache_name: str,
    format_version: int,
    producer_name: str | None,
    *,
    follow: bool,
    follow_timeout: float,
    read_cache_dir: str | None,
    read_cache_bytes: int | None,
) -> OpenedCache:
    """Open the cache at ``cache_dir`` for reading (the arguments are the dataset's).

    Its storage is opened once; the manifest is read and checked (with ``follow``: the producer's
    record while the manifest is not written yet); the shard files are checked against the
    manifest by one listing; the storage is then prepared for reads (an object store's
    read-through copy, made from the same manifest bytes and listing).
    """
    # where the cache lives; the reads open local files (of an s3:// cache: its read-through copy)
    storage = open_storage(
        cache_dir, read_cache_dir=read_cache_dir, read_cache_bytes=read_cache_bytes
    )
    cache_dir = os.fspath(cache_dir)  # open_storage took it: a str or an os.PathLike
    check_format_version_arg(format_version)
    run, raw = None, None
    # a cache whose producer may still run: its manifest, else the producer's follow record
    if follow:
        manifest, run, producer_name, raw = open_followed(
            storage, cache_dir, cache_name, format_version, producer_name, follow_timeout
        )
    else:
        raw = fetch_manifest(storage)
        manifest = check_manifest(storage, raw, cache_name, format_version, producer_name)
    producer = producer_command(cache_dir, manifest, producer_name)
    follower, known = None, None
    if run is None:  # presence of shards 0..N-1 and, when the manifest records them, their sizes
        listing = storage.list()
        indices = check_listed_files(storage, listing, manifest, cache_name, producer)
        known = (raw, listing) if raw is not None else None
    else:  # each shard is waited for, then checked, when first read
        n = num_shards(int(manifest["num_samples"]), int(manifest["shard_size"]))
        indices = list(range(n))
        follower = Follower(storage, cache_dir, cache_name, run, follow_timeout, producer)
    # before any DataLoader worker starts: they share what it prepares
    storage.prepare_reads(known)
    return OpenedCache(storage, manifest, producer, indices, follower)
