"""Cache integrity checks: cheap on open, deep on request, and a summary for humans.

- :func:`check_cache_files` (every reader calls it when opening a cache): shard
  names are exactly ``0..N-1`` and each file has the byte size the manifest
  records. One ``stat`` per shard, no reads.
- :func:`verify_cache` with ``deep=True``: additionally re-reads every shard,
  compares its CRC-32 with the manifest and checks its safetensors header
  against the manifest schema (keys, dtypes, trailing shapes, samples in the
  shard). Reports every bad shard, not only the first.
- :func:`cache_info`: what ``te-thd cache info`` prints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from te_thd.offline_cache.errors import CacheIntegrityError
from te_thd.offline_cache.format import (
    CHECKSUM_ALGORITHM,
    RESERVED_MANIFEST_KEYS,
    CacheSchema,
    TensorSpec,
    check_integrity_entry,
    load_manifest,
    manifest_path,
    manifest_schema,
    num_shards,
    shard_num_samples,
    shard_path,
    shard_records,
    validate_contiguous_shards,
    validate_manifest,
)
from te_thd.offline_cache.shardfile import file_checksum, read_header


def check_cache_files(cache_dir: str, manifest: Mapping[str, Any], cache_name: str = "offline") -> list[int]:
    """Cheap open-time check; returns the shard indices ``[0, ..., N-1]``.

    ``manifest`` is what :func:`read_manifest` returned for ``cache_dir``. Raises
    :class:`CacheIntegrityError` (a ``ValueError``; ``.path`` is the file) when a
    shard is missing, an extra shard index exists, or a shard's size differs from
    the manifest's record. Manifests of the reference producer carry no records;
    for them only presence is checked. Temp files and foreign files are ignored.
    """
    validate_manifest(manifest, manifest_path(cache_dir))
    indices = validate_contiguous_shards(
        cache_dir, cache_name, int(manifest["num_samples"]), int(manifest["shard_size"])
    )
    records = shard_records(manifest)
    if records is not None:
        for i, rec in zip(indices, records, strict=True):
            check_integrity_entry(shard_path(cache_dir, i), int(rec["bytes"]))
    return indices


def check_shard_header(path: str, schema: CacheSchema, expected_samples: int) -> list[str]:
    """Problems of one shard's header against ``schema`` (empty list = sound)."""
    entries = read_header(path)
    problems = []
    missing = [k for k in schema if k not in entries]
    extra = [k for k in entries if k not in schema]
    if missing:
        problems.append(f"lacks keys {missing}")
    if extra:
        problems.append(f"has keys {extra} the schema does not list")
    for key, spec in schema.items():
        e = entries.get(key)
        if e is None:
            continue
        got = TensorSpec(e.dtype, e.shape[1:])
        if not e.shape or got != spec:
            shape = list(e.shape)
            problems.append(f"key {key!r} is {e.dtype}{shape}, the schema says {spec.describe()}")
        elif e.shape[0] != expected_samples:
            problems.append(f"key {key!r} holds {e.shape[0]} samples, expected {expected_samples}")
    return problems


def _schema_from_header(path: str) -> CacheSchema:
    return {k: TensorSpec(e.dtype, e.shape[1:]) for k, e in read_header(path).items() if e.shape}


def verify_cache(cache_dir: str, deep: bool = False, cache_name: str = "offline") -> dict[str, Any]:
    """Check a finished cache; returns a summary dict, raises on the first class of problem.

    ``deep=False``: manifest + :func:`check_cache_files`. ``deep=True``: also every
    shard's header against the schema and its CRC-32 against the manifest. A
    manifest without checksums (written by the reference producer) gets the
    header checks, with the schema taken from shard 0, and
    ``checksums_verified=False`` in the result.

    Raises :class:`ManifestError` or :class:`CacheIntegrityError`; the latter's
    message lists every bad shard by path and ``.path`` is the first of them.
    """
    manifest = load_manifest(cache_dir, cache_name)
    indices = check_cache_files(cache_dir, manifest, cache_name)
    num_samples, shard_size = int(manifest["num_samples"]), int(manifest["shard_size"])
    records = shard_records(manifest)
    result: dict[str, Any] = {
        "cache_dir": cache_dir,
        "num_samples": num_samples,
        "num_shards": len(indices),
        "deep": deep,
        "checksums_verified": False,
        "headers_verified": False,
    }
    if not deep:
        return result
    schema = manifest_schema(manifest)
    if schema is None and indices:
        schema = _schema_from_header(shard_path(cache_dir, 0))
    problems: list[tuple[str, str]] = []
    for i in indices:
        path = shard_path(cache_dir, i)
        try:
            header_problems = check_shard_header(path, schema or {}, shard_num_samples(i, num_samples, shard_size))
        except CacheIntegrityError as exc:
            header_problems = [str(exc).split(": ", 1)[-1]]
        problems.extend((path, p) for p in header_problems)
        if records is not None:
            expected = records[i]["checksum"]
            algo = expected.split(":", 1)[0]
            if algo != CHECKSUM_ALGORITHM:
                problems.append((path, f"checksum algorithm {algo!r} is not supported (expected {CHECKSUM_ALGORITHM!r})"))
                continue
            got = file_checksum(path)
            if got != expected:
                problems.append((path, f"checksum {got} differs from the manifest's {expected}: the file is corrupt"))
    if problems:
        listed = "\n".join(f"  {p}: {what}" for p, what in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        bad_files = sorted({p for p, _ in problems})
        raise CacheIntegrityError(
            f"{cache_name} cache at {cache_dir}: {len(bad_files)} bad shard(s):\n{listed}{more}\n"
            "Restore these files from a copy, or delete them and re-run the producer with "
            "resume=True to recompute them.",
            path=bad_files[0],
        )
    result["headers_verified"] = True
    result["checksums_verified"] = records is not None
    return result


def cache_info(cache_dir: str) -> dict[str, Any]:
    """Summary of a cache from its manifest (no shard reads unless the manifest lacks a schema).

    Keys: ``cache_dir``, ``format_version``, ``layout_version`` (``None`` for a
    reference-format manifest), ``num_samples``, ``shard_size``, ``num_shards``,
    ``bytes`` (total shard bytes), ``checksum`` (algorithm or ``None``),
    ``schema`` (``{key: {"dtype", "shape"}}``, per-sample shape), ``options``
    (every other manifest field: the producer options).
    """
    manifest = load_manifest(cache_dir)
    n = num_shards(int(manifest["num_samples"]), int(manifest["shard_size"]))
    records = shard_records(manifest)
    if records is not None:
        total = sum(int(r["bytes"]) for r in records)
    else:
        total = sum(
            os.stat(p).st_size for p in (shard_path(cache_dir, i) for i in range(n)) if os.path.exists(p)
        )
    schema = manifest_schema(manifest)
    if schema is None and os.path.exists(shard_path(cache_dir, 0)):
        schema = _schema_from_header(shard_path(cache_dir, 0))
    return {
        "cache_dir": cache_dir,
        "format_version": manifest.get("format_version"),
        "layout_version": manifest.get("layout_version"),
        "num_samples": int(manifest["num_samples"]),
        "shard_size": int(manifest["shard_size"]),
        "num_shards": n,
        "bytes": total,
        "checksum": records[0]["checksum"].split(":", 1)[0] if records else None,
        "schema": {k: s.to_json() for k, s in (schema or {}).items()},
        "options": {k: v for k, v in manifest.items() if k not in RESERVED_MANIFEST_KEYS},
    }
