"""Every sample's real length: the rule, its record in the manifest, and the side file.

A balanced loader plans each step from its samples' real token counts. The
producer records them per shard (``"lengths"`` in each shard record, the rule in
the manifest's ``"length_rule"``), so the manifest checksum covers them and
``verify_cache(deep=True)`` checks them against the data. For a cache without
them (the reference producer's, an older te_thd's) :func:`cache_lengths` scans
the cache once and keeps the result beside it in ``lengths.<key>.json``, a
checksummed file tied to the manifest's checksum: a changed manifest makes it
stale, and it is recomputed.

The rule (:class:`LengthRule`), one implementation for the producer, the scan
and ``verify``:

- ``value``: the key holds one integer per sample (``[n]`` or ``[n, 1]``);
- ``nonzero``: the nonzero count of a per-token mask;
- ``last_nonpad``: up to and including the last entry that is not
  ``pad_token_id`` (the non-padding length of right-padded ``input_ids``);
- ``row``: the key's full per-sample width (what a collator without length
  information packs).

The balanced loader plans with the lengths its collator packs
(:func:`collator_rule`), so it uses the recorded ones when the rules agree and
otherwise the side file of its own rule.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd.offline_cache.durable import atomic_write_bytes
from te_thd.offline_cache.errors import CacheError
from te_thd.offline_cache.format import TensorSpec, json_crc32, shard_path

#: The manifest field naming the rule the recorded per-shard lengths follow.
LENGTH_RULE_KEY = "length_rule"
#: The shard-record field holding that shard's lengths (int, one per row).
LENGTHS_KEY = "lengths"
#: The key a cache's lengths come from when the user names none.
DEFAULT_LENGTH_KEY = "input_ids"
_KINDS = ("value", "nonzero", "last_nonpad", "row")


@dataclass(frozen=True)
class LengthRule:
    """How a sample's length is read from key ``key`` (see the module docstring)."""

    key: str
    kind: str = "last_nonpad"
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"LengthRule kind={self.kind!r} is not one of {_KINDS}")

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "pad_token_id": self.pad_token_id}

    @classmethod
    def from_json(cls, obj: Any) -> LengthRule:
        if not isinstance(obj, dict) or not isinstance(obj.get("key"), str) or obj.get("kind") not in _KINDS:
            raise ValueError(f"length rule {obj!r} is not {{'key': str, 'kind': one of {_KINDS}, 'pad_token_id': int}}")
        pad = obj.get("pad_token_id", 0)
        if isinstance(pad, bool) or not isinstance(pad, int):
            raise ValueError(f"length rule {obj!r}: pad_token_id must be an int")
        return cls(obj["key"], obj["kind"], pad)

    def describe(self) -> str:
        if self.kind == "value":
            return f"the value of {self.key!r}"
        if self.kind == "nonzero":
            return f"the nonzero count of {self.key!r}"
        if self.kind == "row":
            return f"the full row width of {self.key!r}"
        return f"the non-padding length of {self.key!r} (pad {self.pad_token_id})"

    def lengths(self, t: torch.Tensor) -> np.ndarray:
        """Lengths of the ``n`` samples of ``t`` (``[n, ...]``, the key's rows): int64 ``[n]``."""
        t = t.reshape(t.shape[0], -1)
        if self.kind == "value":
            out = t[:, 0]
        elif self.kind == "row":
            out = torch.full((t.shape[0],), t.shape[1], dtype=torch.int64)
        elif self.kind == "nonzero":
            out = (t != 0).sum(1)
        else:
            real = t != self.pad_token_id
            last = t.shape[1] - torch.flip(real, [1]).to(torch.int8).argmax(1)  # after the last real entry
            out = torch.where(real.any(1), last, torch.zeros_like(last))
        return out.to(torch.int64).numpy()


def rule_for_key(length_key: str, spec: TensorSpec | None) -> LengthRule:
    """The rule for a key the user names: its value when it holds one number per sample, else its non-padding length."""
    if spec is not None and int(np.prod(spec.shape, dtype=np.int64)) == 1:
        return LengthRule(length_key, "value")
    return LengthRule(length_key, "last_nonpad")


def producer_rule(length_key: str | None, keys: Sequence[str]) -> LengthRule | None:
    """The rule ``produce_cache`` records with: ``length_key``'s, else ``input_ids``' when stored, else none.

    The kind is fixed by the stored tensor's trailing shape (:func:`for_tensor`).
    """
    if length_key is not None:
        if length_key not in keys:
            raise ValueError(
                f"length_key={length_key!r} is not one of the stored keys {list(keys)}; name the key that "
                "holds each sample's length (one int per sample) or its tokens, or add it to keys"
            )
        return LengthRule(length_key)
    return LengthRule(DEFAULT_LENGTH_KEY) if DEFAULT_LENGTH_KEY in keys else None


def for_tensor_spec(rule: LengthRule, spec: TensorSpec) -> LengthRule:
    """``rule`` with its kind fixed by its key's per-sample shape, unless it counts a mask or a width."""
    return rule if rule.kind in ("nonzero", "row") else rule_for_key(rule.key, spec)


def collator_rule(collate_fn: Any) -> LengthRule:
    """The lengths a ``CachedThdCollator`` packs: its ``length_key``'s value, its ``mask_key``'s
    nonzero count, else the full row of its ``input_key``."""
    if getattr(collate_fn, "length_key", None) is not None:
        return LengthRule(collate_fn.length_key, "value")
    if getattr(collate_fn, "mask_key", None) is not None:
        return LengthRule(collate_fn.mask_key, "nonzero")
    return LengthRule(getattr(collate_fn, "input_key", DEFAULT_LENGTH_KEY), "row")


def for_tensor(rule: LengthRule, t: torch.Tensor) -> LengthRule:
    """:func:`for_tensor_spec` for the key's rows ``t`` (``[n, ...]``)."""
    return for_tensor_spec(rule, TensorSpec(t.dtype, tuple(t.shape[1:])))


def recorded_rule(manifest: Mapping[str, Any]) -> LengthRule | None:
    """The rule of the lengths ``manifest`` records, or ``None`` when every shard record lacks them."""
    obj = manifest.get(LENGTH_RULE_KEY)
    recs = manifest.get("shards")
    if obj is None or not isinstance(recs, list) or not all(isinstance(r, dict) and LENGTHS_KEY in r for r in recs):
        return None
    return LengthRule.from_json(obj)


def recorded_lengths(manifest: Mapping[str, Any]) -> np.ndarray:
    """The manifest's per-shard lengths, concatenated: int64 ``[num_samples]``."""
    parts = [np.asarray(r[LENGTHS_KEY], dtype=np.int64) for r in manifest["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def check_lengths_record(rec: Mapping[str, Any], rows: int) -> str | None:
    """What is wrong with a shard record's ``lengths`` for a shard of ``rows`` rows, or ``None``."""
    if LENGTHS_KEY not in rec:
        return None
    got = rec[LENGTHS_KEY]
    if not isinstance(got, list) or len(got) != rows:
        return f"'lengths' must be a list of {rows} ints (one per row)"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got):
        return "'lengths' must hold ints >= 0"
    return None


def read_shard_lengths(path: str, rule: LengthRule) -> np.ndarray:
    """Lengths of every row of one shard file under ``rule`` (reads only the rule's key)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return rule.lengths(f.get_tensor(rule.key))


def scan_rule(dataset: Any, rule: LengthRule, block: int = 4096) -> np.ndarray:
    """Every sample's length under ``rule``, int64 ``[len(dataset)]``, reading ``block`` samples at a time."""
    n = len(dataset)
    out = np.empty(n, dtype=np.int64)
    read = getattr(dataset, "__getitems__", None)
    for begin in range(0, n, block):
        idx = list(range(begin, min(begin + block, n)))
        batch = read(idx) if read is not None else [dataset[i] for i in idx]
        tensors = getattr(batch, "tensors", None)
        t = tensors[rule.key] if tensors is not None else torch.stack([s[rule.key] for s in batch])
        out[begin : begin + len(idx)] = rule.lengths(t.reshape(len(idx), -1))
    return out


# -- the side file of a cache without recorded lengths ------------------------------------


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
    from te_thd.offline_cache.manifest import load_manifest, manifest_checksum, manifest_schema
    from te_thd.offline_cache.reader import CachedTensorDataset

    manifest = load_manifest(cache_dir, cache_name)
    recorded = recorded_rule(manifest)
    if recorded is not None and rule is None and length_key in (None, recorded.key):
        return recorded_lengths(manifest)
    key = rule.key if rule is not None else (length_key or DEFAULT_LENGTH_KEY)
    schema = manifest_schema(manifest)
    if schema is None:
        from te_thd.offline_cache.shardfile import read_shard_header, schema_of_header

        schema = schema_of_header(read_shard_header(shard_path(cache_dir, 0))) if manifest["num_samples"] else {}
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
        f"`te_thd.offline_cache.lengths.cache_lengths({cache_dir!r}, length_key={key!r})` once where the "
        "directory is writable, or pass lengths=scan_lengths(...) to build_cached_dataloader on every run."
    )
