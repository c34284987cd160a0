"""The shard files a manifest lists, checked against one listing of the cache: names exactly
``0..N-1``, each of the byte size the manifest records. Every open runs it (one listing, no
reads); the producer's resume and ``te-thd cache verify`` share it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from te_thd.args import is_int
from te_thd.offline_cache.format.integrity import SHARD_LAYOUT
from te_thd.offline_cache.format.schema import (
    CacheIntegrityError,
    cache_command,
    format_indices,
    manifest_path,
    num_shards,
    producer_hint,
    repair_hint,
    shard_name,
    shard_path,
)
from te_thd.offline_cache.record.manifest import (
    listed_shards,
    shard_records,
    validate_manifest,
)
from te_thd.offline_cache.storage.base import Storage
from te_thd.offline_cache.storage.schemes import as_storage


def validate_contiguous_shards(
    cache_dir: str | Storage,
    cache_name: str,
    num_samples: int,
    shard_size: int,
    *,
    producer: str | None = None,
) -> list[int]:
    """Return shard indices, requiring exactly ``0..N-1`` for the manifest size.

    Raises :class:`CacheIntegrityError` naming the missing files (gaps) and the
    extra ones (indices ``>= N``, e.g. left over from a larger earlier run).
    ``producer`` (te_thd extension): the command that re-runs the producer, named in the message.
    ``cache_dir``: a path, a URL or the cache's opened storage.
    """
    storage = as_storage(cache_dir)
    return contiguous_shards(
        storage.name, storage.list(), cache_name, num_samples, shard_size, producer
    )


def contiguous_shards(
    cache_dir: str,
    listing: Mapping[str, int],
    cache_name: str,
    num_samples: int,
    shard_size: int,
    producer: str | None = None,
) -> list[int]:
    """:func:`validate_contiguous_shards` over ``listing``, one listing of the cache
    (``Storage.list``)."""
    expected = num_shards(num_samples, shard_size)
    present = listed_shards(listing)
    missing = sorted(set(range(expected)) - present)
    extra = sorted(i for i in present if i >= expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"missing shard indices {format_indices(missing)} (e.g. {shard_name(missing[0])})"
            )
        if extra:
            parts.append(
                f"extra shard indices {format_indices(extra)} beyond the declared {expected} "
                f"(e.g. {shard_name(extra[0])})"
            )
        first = missing[0] if missing else extra[0]
        # a missing shard is restored or recomputed; an extra one is moved away (repair sets it
        # aside)
        repair = cache_command("repair", cache_dir)
        if not extra:
            fix = (
                f"Restore the missing shards from a copy, or recompute them: run {repair} (it "
                "reopens"
            )
        elif not missing:
            fix = f"Move the extra shards away, or run {repair} (it sets them aside and reopens"
        else:
            fix = (
                "Restore the missing shards from a copy and move the extra ones away, or run "
                f"{repair} (it sets the extra ones aside and reopens"
            )
        raise CacheIntegrityError(
            f"{cache_name} cache at {cache_dir} declares {num_samples} samples in {expected} "
            f"shards of {shard_size}, but has {'; '.join(parts)}. {fix} the cache for a "
            f"resume), then re-run {producer_hint(producer)}.",
            path=shard_path(cache_dir, first),
        )
    return list(range(expected))


def check_cache_files(
    cache_dir: str | Storage,
    manifest: Mapping[str, Any],
    cache_name: str = "offline",
    producer: str | None = None,
) -> list[int]:
    """Cheap open-time check; returns the shard indices ``[0, ..., N-1]``.

    ``manifest`` is what :func:`read_manifest` returned for ``cache_dir``. Raises
    :class:`CacheIntegrityError` (a ``ValueError``; ``.path`` is the file) when a
    shard is missing, an extra shard index exists, or a shard's size differs from
    the manifest's record. Manifests of the reference producer carry no records;
    for them only presence is checked. Temp files and foreign files are ignored. ``cache_dir``: a
    path, a URL or the cache's opened storage.
    """
    storage = as_storage(cache_dir)
    validate_manifest(manifest, manifest_path(storage.name), producer)
    return check_listed_files(storage, storage.list(), manifest, cache_name, producer)


def check_listed_files(
    storage: Storage,
    listing: Mapping[str, int],
    manifest: Mapping[str, Any],
    cache_name: str = "offline",
    producer: str | None = None,
) -> list[int]:
    """:func:`check_cache_files` over ``listing``, one listing of the cache (``Storage.list``),
    for a ``manifest`` already validated
    (:func:`~te_thd.offline_cache.record.manifest.check_manifest` does it when it reads one)."""
    num_samples, shard_size = int(manifest["num_samples"]), int(manifest["shard_size"])
    indices = contiguous_shards(
        storage.name, listing, cache_name, num_samples, shard_size, producer
    )
    errors = shard_size_errors(storage, listing, manifest, indices, producer)
    if errors:
        raise errors[min(errors)]
    return indices


def shard_size_errors(
    storage: Storage,
    sizes: Mapping[str, int],
    manifest: Mapping[str, Any],
    indices: Sequence[int],
    producer: str | None = None,
) -> dict[int, CacheIntegrityError]:
    """``{index: error}`` of the shards ``indices`` that are missing or whose size differs from the
    manifest's record (none for a manifest without records), by ``sizes``: one listing of the
    cache."""
    records = shard_records(manifest)
    errors: dict[int, CacheIntegrityError] = {}
    if records is None:
        return errors
    for i in indices:
        name = shard_name(i)
        path, size, expected = storage.display(name), sizes.get(name), int(records[i]["bytes"])
        repair = repair_hint(os.path.dirname(path) or ".", producer)
        if size is None:
            errors[i] = CacheIntegrityError(
                f"shard {path} is missing (the manifest lists it). Restore it from a copy. "
                f"{repair}",
                path=path,
            )
        elif size != expected:
            errors[i] = CacheIntegrityError(
                f"shard {path} has {size} bytes, the manifest records {expected}: the file was "
                f"truncated or replaced. Restore it from a copy. {repair}",
                path=path,
            )
    return errors


def requires_shard_sums(manifest: Mapping[str, Any]) -> bool:
    """True when the manifest's layout promises te_thd checksums in every shard."""
    layout = manifest.get("layout_version")
    return is_int(layout, SHARD_LAYOUT)
