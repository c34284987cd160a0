"""``te-thd cache repair DIR``: set damaged shards aside and reopen the cache for its producer.

A shard that fails verification cannot be fixed in place (its bytes are the
producer's output); it has to be computed again. :func:`repair_cache` makes that
a plain resume of the producer that built the cache:

1. under the producer lock, every shard is verified completely
   (:func:`~te_thd.offline_cache.verify.verify_shard_file`);
2. the producer's run record (``.te_thd-producer.json``) is written from the
   manifest, so ``produce_cache`` with the same arguments resumes instead of
   refusing the directory;
3. damaged shards, and shards beyond the manifest's count, are moved to
   ``DIR/.te_thd-damaged/`` (kept for inspection, never read), and
   ``manifest.json`` is removed: the cache is unfinished until the producer ran.

Re-running the producer then verifies the shards that remain, computes the
missing ones and writes a new manifest. A damaged manifest cannot be repaired
this way (it is the only record of the producer's options): restore it from a
copy, or rebuild the cache.
"""

from __future__ import annotations

from typing import Any

from te_thd.offline_cache.errors import CacheIntegrityError, producer_hint
from te_thd.offline_cache.format import (
    existing_shard_indices,
    num_shards,
    shard_name,
    shard_rows,
)
from te_thd.offline_cache.manifest import (
    cache_schema,
    load_manifest,
    recorded_producer,
    shard_records,
)
from te_thd.offline_cache.producer_state import reopen_for_resume
from te_thd.offline_cache.storage import open_storage
from te_thd.offline_cache.verify import requires_shard_sums, shard_problem, verify_shard_file


def find_bad(cache_dir: str, manifest: dict[str, Any]) -> tuple[dict[int, str], list[int], list[int]]:
    """``({index: problem} of damaged shards, missing indices, extra indices)``."""
    num_samples, shard_size = int(manifest["num_samples"]), int(manifest["shard_size"])
    count = num_shards(num_samples, shard_size)
    storage = open_storage(cache_dir)
    present = existing_shard_indices(cache_dir)
    records = shard_records(manifest)
    schema = cache_schema(cache_dir, manifest)
    bad: dict[int, str] = {}
    for i in sorted(present):
        if i >= count:
            continue
        path = storage.whole(shard_name(i))  # every byte is read: an object is fetched into a local copy
        try:
            verify_shard_file(
                path, schema, shard_rows(i, num_samples, shard_size),
                records[i] if records is not None else None, requires_shard_sums(manifest),
            )  # fmt: skip
        except CacheIntegrityError as exc:
            bad[i] = shard_problem(exc, path)
    missing = sorted(set(range(count)) - present)
    extra = sorted(i for i in present if i >= count)
    return bad, missing, extra


def repair_cache(cache_dir: str, cache_name: str = "offline") -> dict[str, Any]:
    """Verify every shard; set the damaged ones aside and reopen the cache for a resume.

    Returns ``{"cache_dir", "damaged": {file: problem}, "missing": [file],
    "extra": [file], "set_aside_in": dir or None, "reopened": bool, "producer": str}``.
    ``reopened`` is False when every shard is sound (nothing is changed then).
    Raises :class:`ManifestError` when the manifest itself is damaged and
    :class:`CacheLockError` while a producer holds the directory.
    """
    lock = open_storage(cache_dir).lock()
    lock.acquire()
    try:
        manifest = load_manifest(cache_dir, cache_name)
        bad, missing, extra = find_bad(cache_dir, manifest)
        result: dict[str, Any] = {
            "cache_dir": cache_dir,
            "damaged": {shard_name(i): why for i, why in bad.items()},
            "missing": [shard_name(i) for i in missing],
            "extra": [shard_name(i) for i in extra],
            "set_aside_in": None,
            "reopened": False,
            "producer": recorded_producer(cache_dir, manifest) or producer_hint(None),
        }
        if not (bad or missing or extra):
            return result
        result["set_aside_in"] = reopen_for_resume(cache_dir, manifest, [*bad, *extra])
        result["reopened"] = True
        return result
    finally:
        lock.release()
