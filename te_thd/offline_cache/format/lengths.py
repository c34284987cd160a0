"""Every sample's real length: the rule and its record in the manifest.

A balanced loader plans each step from its samples' real token counts. The
producer records them per shard (``"lengths"`` in each shard record, the rule in
the manifest's ``"length_rule"``), so the manifest checksum covers them and
``verify_cache(deep=True)`` checks them against the data. For a cache without
them :func:`~te_thd.offline_cache.train.loader.cache_lengths` scans the cache once and
keeps the result beside it.

The rule (:class:`LengthRule`), one implementation for the producer, the scan,
``verify`` and the THD collate:

- ``value``: the key holds one integer per sample (``[n]`` or ``[n, 1]``);
- ``nonzero``: the nonzero count of a per-token mask;
- ``last_nonpad``: up to and including the last entry that is not
  ``pad_token_id`` (the non-padding length of right-padded ``input_ids``);
- ``row``: the key's full per-sample width (what a collator without length
  information packs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd.args import is_int
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.schema import TensorSpec

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
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("key"), str)
            or obj.get("kind") not in _KINDS
        ):
            raise ValueError(
                f"length rule {obj!r} is not {{'key': str, 'kind': one of {_KINDS}, "
                f"'pad_token_id': int}}"
            )
        pad = obj.get("pad_token_id", 0)
        if not is_int(pad):
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
            # after the last real entry
            last = t.shape[1] - torch.flip(real, [1]).to(torch.int8).argmax(1)
            out = torch.where(real.any(1), last, torch.zeros_like(last))
        return out.to(torch.int64).numpy()


def producer_rule(length_key: str | None, keys: Sequence[str]) -> LengthRule | None:
    """The rule ``produce_cache`` records with: ``length_key``'s, else ``input_ids``' when stored,
    else none.

    The kind is fixed by the stored tensor's trailing shape (:func:`for_tensor`).
    """
    if length_key is not None:
        if length_key not in keys:
            raise ValueError(
                f"length_key={length_key!r} is not one of the stored keys {list(keys)}; "
                "name the key that "
                "holds each sample's length (one int per sample) or its tokens, or add it to keys"
            )
        return LengthRule(length_key)
    return LengthRule(DEFAULT_LENGTH_KEY) if DEFAULT_LENGTH_KEY in keys else None


def for_tensor_spec(rule: LengthRule, spec: TensorSpec) -> LengthRule:
    """``rule`` with its kind fixed by its key's per-sample shape, unless it counts a mask or a
    width: the key's value when it holds one number per sample, else its non-padding length."""
    if rule.kind in ("nonzero", "row"):
        return rule
    return LengthRule(
        rule.key, "value" if int(np.prod(spec.shape, dtype=np.int64)) == 1 else "last_nonpad"
    )


def keyed_rule(length_key: str | None, mask_key: str | None, otherwise: LengthRule) -> LengthRule:
    """The rule a pair of length options names: ``length_key``'s value, else ``mask_key``'s nonzero
    count, else ``otherwise`` (the order of ``CachedThdCollator`` and ``scan_lengths``)."""
    if length_key is not None:
        return LengthRule(length_key, "value")
    if mask_key is not None:
        return LengthRule(mask_key, "nonzero")
    return otherwise


def collator_rule(collate_fn: Any) -> LengthRule:
    """The lengths a ``CachedThdCollator`` packs: its ``length_key``'s value, its ``mask_key``'s
    nonzero count, else the full row of its ``input_key``."""
    return keyed_rule(
        getattr(collate_fn, "length_key", None),
        getattr(collate_fn, "mask_key", None),
        LengthRule(getattr(collate_fn, "input_key", DEFAULT_LENGTH_KEY), "row"),
    )


def for_tensor(rule: LengthRule, t: torch.Tensor) -> LengthRule:
    """:func:`for_tensor_spec` for the key's rows ``t`` (``[n, ...]``)."""
    return for_tensor_spec(rule, TensorSpec(t.dtype, tuple(t.shape[1:])))


def recorded_rule(manifest: Mapping[str, Any]) -> LengthRule | None:
    """The rule of the lengths ``manifest`` records, or ``None`` when every shard record lacks
    them."""
    obj = manifest.get(LENGTH_RULE_KEY)
    recs = manifest.get("shards")
    if (
        obj is None
        or not isinstance(recs, list)
        or not all(isinstance(r, dict) and LENGTHS_KEY in r for r in recs)
    ):
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
    if not all(is_int(v, 0) for v in got):
        return "'lengths' must hold ints >= 0"
    return None


def read_shard_lengths(path: str, rule: LengthRule) -> np.ndarray:
    """Lengths of every row of one shard file under ``rule`` (reads only the rule's key).

    A token-layout shard stored exactly those lengths (its row offsets, by its producer's rule):
    they are read from its header when ``rule`` is that rule.
    """
    from safetensors import safe_open

    header = read_shard_header(path)
    tokens = header.tokens
    if tokens is not None and LengthRule.from_json(tokens.length_rule) == rule:
        return np.diff(tokens.offsets)

    with safe_open(path, "pt") as f:
        return rule.lengths(f.get_tensor(rule.key))
