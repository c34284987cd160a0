"""Lengths of a cache that does not record them: one scan, kept beside the cache in a side file.

:func:`cache_lengths` returns every sample's real length: the producer's record
(:mod:`~te_thd.offline_cache.lengths`) when its rule is the one asked for, else the
side file ``lengths.<key>.json`` when it belongs to the current manifest, else a
scan of the cache (reading only the key), kept in that side file for the next run.
The side file is checksummed and tied to the manifest's checksum: a changed
manifest makes it stale, and it is recomputed. Readers ignore it.
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np

from te_thd.offline_cache.durable import atomic_write_bytes
from te_thd.offline_cache.errors import CacheError
from te_thd.offline_cache.format import json_crc32
from te_thd.offline_cache.lengths import (
    DEFAULT_LENGTH_KEY,
    LengthRule,
    for_tensor_spec,
    recorded_lengths,
    recorded_rule,
    rule_for_key,
    scan_rule,
)
from te_thd.offline_cache.manifest import cache_schema, load_manifest, manifest_checksum
from te_thd.offline_cache.reader import CachedTensorDataset


def side_file_path(cache_dir: str, rule: LengthRule) -> str:
    """``lengths.<key>[.nonzero][.pad<id>].json`` in ``cache_dir``: one file per rule."""
    suffix = "" if rule.kind != "nonzero" else ".nonzero"
    pad = f".pad{rule.pad_token_id}" if rule.kind == "last_nonpad" and rule.pad_token_id else ""
    return os.path.join(cache_dir, f"lengths.{rule.key}{suffix}{pad}.json")


def read_side_file(path: str, rule: LengthRule, manifest_sum: str, num_samples: int) -> np.ndarray | None:
    """The lengths kept in ``path`` when it is intact and belongs to this manifest and rule, else ``None``."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        body = {k: v for k, v in obj.items() if k != "checksum"}
        ok = (
            obj.get("checksum") == json_crc32(body)
            and body.get("manifest_checksum") == manifest_sum
            and body.get("rule") == rule.to_json()
            and isinstance(body.get("lengths"), list)
            and len(body["lengths"]) == num_samples
        )
    except (OSError, ValueError, AttributeError):
        return None
    return np.asarray(body["lengths"], dtype=np.int64) if ok else None


def write_side_file(path: str, rule: LengthRule, manifest_sum: str, lengths: np.ndarray) -> None:
    body = {"manifest_checksum": manifest_sum, "rule": rule.to_json(), "lengths": [int(v) for v in lengths]}
    atomic_write_bytes(path, (json.dumps({**body, "checksum": json_crc32(body)}, sort_keys=True) + "\n").encode("ascii"))


def cache_lengths(
    cache_dir: str,
    cache_name: str = "offline",
    length_key: str | None = None,
    *,
    rule: LengthRule | None = None,
    block: int = 4096,
) -> np.ndarray:
    """Every sample's real length in the cache at ``cache_dir``: int64 ``[num_samples]``.

    Under ``rule``, else under ``length_key``'s (its value when it holds one
    number per sample, else its non-padding length), else under the rule the
    cache records, else ``input_ids``' non-padding length. The lengths the
    producer recorded when their rule is that one; else the side file
    ``lengths.<key>.json`` when it belongs to the current manifest; else a scan of
    the cache (reading only the key), kept in that side file for the next run.
    Raises :class:`CacheError` when the scan's result cannot be kept because the
    directory is read-only (saying how to add the lengths).
    """
    manifest = load_manifest(cache_dir, cache_name)
    recorded = recorded_rule(manifest)
    if recorded is not None and rule is None and length_key in (None, recorded.key):
        return recorded_lengths(manifest)
    key = rule.key if rule is not None else (length_key or DEFAULT_LENGTH_KEY)
    schema = cache_schema(cache_dir, manifest, strict=True)
    assert schema is not None
    if key not in schema:
        raise ValueError(
            f"length_key={key!r}: the {cache_name} cache at {cache_dir} has no such key (it holds "
            f"{sorted(schema)}); pass length_key= naming the key with each sample's length or tokens"
        )
    rule = for_tensor_spec(rule, schema[key]) if rule is not None else rule_for_key(key, schema[key])
    num_samples = int(manifest["num_samples"])
    if rule == recorded:
        return recorded_lengths(manifest)
    if rule.kind == "row":  # known from the schema: nothing to scan or keep
        return np.full(num_samples, int(np.prod(schema[key].shape, dtype=np.int64)), dtype=np.int64)
    path = side_file_path(cache_dir, rule)
    msum = manifest_checksum(manifest)
    kept = read_side_file(path, rule, msum, num_samples)
    if kept is not None:
        return kept
    if not os.access(cache_dir, os.W_OK):
        raise CacheError(_read_only_message(cache_dir, key))
    dataset = CachedTensorDataset(cache_dir, cache_name, manifest["format_version"], (key,))
    lengths = scan_rule(dataset, rule, block)
    try:
        write_side_file(path, rule, msum, lengths)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise CacheError(_read_only_message(cache_dir, key)) from None
        raise
    return lengths


def _read_only_message(cache_dir: str, key: str) -> str:
    return (
        f"the cache at {cache_dir} records no per-sample lengths and its directory is read-only, so the "
        f"lengths scanned from {key!r} cannot be kept beside it. Either rebuild it with "
        f"produce_cache(..., length_key={key!r}) (which records them in the manifest), or run "
        f"`te_thd.offline_cache.length_scan.cache_lengths({cache_dir!r}, length_key={key!r})` once where the "
        "directory is writable, or pass lengths=scan_lengths(...) to build_cached_dataloader on every run."
    )
