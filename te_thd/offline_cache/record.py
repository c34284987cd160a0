"""What identifies a producer run, and the manifest a run writes: each built here, once.

- A run's **parameters** (:func:`run_params`) are what two runs must share to write one cache;
  its **record** (:func:`run_record`) adds the producer's length rule. Every shard's header
  keeps the record, the follow record carries it, the producer record (``.te_thd-producer.json``)
  keeps the parameters. :func:`split_record` and :func:`params_of_manifest` read them back from
  a record and from a finished manifest, so a resume, a follower and ``te-thd cache repair``
  compare the same fields.
- The **manifest** (:func:`build_manifest`) of those parameters, the options and the shards'
  records: what the producer writes, what ``te-thd cache repair`` rebuilds from the shards, and
  (without schema and shards) what a follower knows of a run before its manifest exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from te_thd.offline_cache.format import CacheSchema, schema_to_json, shard_name
from te_thd.offline_cache.lengths import LENGTH_RULE_KEY, LengthRule, for_tensor_spec
from te_thd.offline_cache.manifest import LAYOUT_VERSION, RESERVED_MANIFEST_KEYS
from te_thd.offline_cache.ragged import TOKEN_LAYOUT_KEY, TokenLayout
from te_thd.offline_cache.shardfile import ShardRecord


def run_params(
    format_version: int,
    num_samples: int,
    shard_size: int,
    keys: Sequence[str],
    options: Mapping[str, Any],
    token_layout: TokenLayout | None = None,
) -> dict[str, Any]:
    """What must be equal for shards of two runs to belong to one cache (JSON values)."""
    params = {
        "format_version": format_version,
        "num_samples": num_samples,
        "shard_size": shard_size,
        "keys": sorted(keys),
        "options": dict(options),
    }
    if token_layout is not None:
        params[TOKEN_LAYOUT_KEY] = token_layout.to_json()
    return params


def run_record(params: Mapping[str, Any], length_rule: LengthRule | None) -> dict[str, Any]:
    """What every shard of a run keeps in its header (``run``): :func:`run_params` and the
    producer's length rule, so ``te-thd cache repair`` rebuilds the manifest from the shards
    alone."""
    record = dict(params)
    if length_rule is not None:
        record[LENGTH_RULE_KEY] = length_rule.to_json()
    return record


def split_record(record: Mapping[str, Any]) -> tuple[dict[str, Any], LengthRule | None]:
    """``(params, length rule)`` of a :func:`run_record`."""
    rule = LengthRule.from_json(record[LENGTH_RULE_KEY]) if LENGTH_RULE_KEY in record else None
    return {k: v for k, v in record.items() if k != LENGTH_RULE_KEY}, rule


def layout_of(params: Mapping[str, Any]) -> TokenLayout | None:
    """The token layout a run's :func:`run_params` record (``None``: every key stored whole)."""
    return TokenLayout.from_json(params[TOKEN_LAYOUT_KEY]) if TOKEN_LAYOUT_KEY in params else None


def params_of_manifest(manifest: Mapping[str, Any], keys: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`run_params` of the run that wrote ``manifest`` (``keys``: for an empty cache, which
    has no schema)."""
    return run_params(
        manifest.get("format_version"),  # type: ignore[arg-type]
        manifest.get("num_samples"),  # type: ignore[arg-type]
        manifest.get("shard_size"),  # type: ignore[arg-type]
        list(manifest.get("schema") or {}) if manifest.get("num_samples") else keys,
        {k: v for k, v in manifest.items() if k not in RESERVED_MANIFEST_KEYS},
        layout_of(manifest),
    )


def manifest_fields(
    schema: CacheSchema | None,
    records: Mapping[int, ShardRecord] | None,
    length_rule: LengthRule | None,
    token_layout: TokenLayout | None,
) -> dict[str, Any]:
    """The manifest's fields of the shards: ``schema`` and ``shards`` (in index order; both left
    out when ``records`` is ``None``), ``length_rule`` and ``token_layout`` when given."""
    fields: dict[str, Any] = {}
    if records is not None:
        fields["schema"] = schema_to_json(schema or {})
        fields["shards"] = [records[i].to_json(shard_name(i)) for i in sorted(records)]
    if length_rule is not None:
        fields[LENGTH_RULE_KEY] = length_rule.to_json()
    if token_layout is not None:
        fields[TOKEN_LAYOUT_KEY] = token_layout.to_json()
    return fields


def build_manifest(
    params: Mapping[str, Any],
    options: Mapping[str, Any],
    length_rule: LengthRule | None,
    schema: CacheSchema | None = None,
    records: Mapping[int, ShardRecord] | None = None,
) -> dict[str, Any]:
    """The manifest of the run of ``params`` (:func:`run_params`) and producer ``options``, for
    ``write_manifest``: with the shards' ``records`` (every shard of the run) and their
    ``schema``, what its producer writes; the length rule's kind is fixed by its key's shape, and
    a cache of no samples records none. Without ``records``: the manifest as far as the run's
    record knows it (no schema, no shards), what a follower reads before the manifest exists."""
    if records is not None and length_rule is not None:
        length_rule = for_tensor_spec(length_rule, schema[length_rule.key]) if schema else None
    return {
        **options,
        "num_samples": params["num_samples"],
        "shard_size": params["shard_size"],
        # te_thd's producer: every shard carries its checksums
        "layout_version": LAYOUT_VERSION,
        **manifest_fields(schema, records, length_rule, layout_of(params)),
    }
