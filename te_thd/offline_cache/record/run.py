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

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from te_thd.offline_cache.format.integrity import SHARD_LAYOUT
from te_thd.offline_cache.format.lengths import LENGTH_RULE_KEY, LengthRule, for_tensor_spec
from te_thd.offline_cache.format.ragged import TOKEN_LAYOUT_KEY, TokenLayout
from te_thd.offline_cache.format.schema import (
    CacheSchema,
    command_record,
    schema_to_json,
    shard_name,
)
from te_thd.offline_cache.record.manifest import RESERVED_MANIFEST_KEYS


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
        "layout_version": SHARD_LAYOUT,
        **manifest_fields(schema, records, length_rule, layout_of(params)),
    }


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest records per shard: file size and checksum (``"xxh3_64:<header
    digest>"``)."""

    bytes: int
    checksum: str
    #: every row's real length (``te_thd.offline_cache.format.lengths``), when recorded
    lengths: tuple[int, ...] | None = None
    #: per codec key of a token-layout shard, what its codec lost: ``{key: {"max_rel_l2",
    #: "mean_rel_l2"}}``
    fidelity: dict[str, dict[str, float]] | None = None

    def to_json(self, file_name: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"file": file_name, "bytes": self.bytes, "checksum": self.checksum}
        if self.lengths is not None:
            rec["lengths"] = list(self.lengths)
        if self.fidelity is not None:
            rec["fidelity"] = self.fidelity
        return rec


def record_bytes(obj: Any) -> bytes:
    """The bytes of a producer record (JSON a person can read)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


_ABSENT = object()


def describe_diff(recorded: Mapping[str, Any], wanted: Mapping[str, Any], prefix: str = "") -> str:
    """``"options.cp_size: recorded 2, this run 4; ..."``: only the fields that differ, nested
    dicts field by field, each with both values (a field one side lacks: ``absent``). A long value
    (a recorded command line) is cut to where it differs and listed last: what changed comes
    first."""
    diffs = _diffs(recorded, wanted, prefix)
    # sorted is stable: field order within each group
    return "; ".join(text for _, text in sorted(diffs, key=lambda d: d[0]))


def _diffs(
    recorded: Mapping[str, Any], wanted: Mapping[str, Any], prefix: str
) -> list[tuple[bool, str]]:
    """``[(cut, text)]`` of :func:`describe_diff`, in field order (``cut``: a long value was
    cut)."""
    diffs: list[tuple[bool, str]] = []
    for k in sorted(set(recorded) | set(wanted), key=str):
        a, b = recorded.get(k, _ABSENT), wanted.get(k, _ABSENT)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs.extend(_diffs(a, b, f"{prefix}{k}."))
            continue
        text, more = f"{prefix}{k}: recorded {_show(a)}, this run {_show(b)}", ""
        if len(text) <= _LONG:
            diffs.append((False, text))
            continue
        # lists of one length: cut to the first item that differs
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            at = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            more = f" (and {len(at) - 1} more items)" if len(at) > 1 else ""
            a, b, k = a[at[0]], b[at[0]], f"{k}[{at[0]}]"
        diffs.append((True, f"{prefix}{k}: recorded {_show(a, 40)}, this run {_show(b, 40)}{more}"))
    return diffs


#: A difference longer than this (characters) is cut (:func:`describe_diff`).
_LONG = 120


def _show(value: Any, limit: int | None = None) -> str:
    text = "absent" if value is _ABSENT else repr(value)
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


_FOLLOW_VERSION = 1


def follow_record(run: Mapping[str, Any], producer_command: str | None) -> bytes:
    """The bytes of the follow record: ``run`` (:func:`run_record`) and the resume
    command (stored plain, as a shell takes it:
    :func:`~te_thd.offline_cache.format.schema.command_record`)."""
    command = command_record(producer_command)
    return record_bytes(
        {"follow_version": _FOLLOW_VERSION, "run": dict(run), "producer_command": command}
    )
