"""What a cache will cost before it is produced: its bytes, its shards, and each CP rank's reads per
epoch.

:func:`plan_cache` takes every sample's real length and the logical schema (token keys
``[L, ...]`` per sample, as ``compute_batch`` returns them) and lays the cache out with the
writers' own rules -- not a formula of its own, so the plan cannot drift from what they
write -- for every way it can be stored: ``padded``, ``ragged``, and ``ragged+<codec>`` for
each codec of :data:`~te_thd.offline_cache.format.codecs.CODECS` on every token key it can store
(what a codec stores per token comes from
:meth:`~te_thd.offline_cache.format.ragged.TokenLayout.stored`,
so a new codec is planned with no change here). A CP rank's bytes are what the reader fetches
for ``CachedThdCollator(cp_size=C, cp_rank=r)`` over one sequential epoch, planned by the
reader's own :func:`~te_thd.offline_cache.format.ragged.plan_token_reads`. What is counted and
what is not: docs/cache-plan.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from te_thd._cp_strategy import DUAL_CHUNK_SWAP, normalize_strategy
from te_thd.args import check_int
from te_thd.offline_cache.format.codecs import CODECS
from te_thd.offline_cache.format.integrity import shard_checksum
from te_thd.offline_cache.format.lengths import LengthRule, for_tensor_spec, producer_rule
from te_thd.offline_cache.format.ragged import (
    PAGE_BYTES,
    TokenLayout,
    check_token_keys,
)
from te_thd.offline_cache.format.schema import (
    TensorSpec,
    dtype_from_name,
    dtype_name,
    num_shards,
    shard_rows,
)
from te_thd.offline_cache.read.cp_reads import contiguous_ranges, cp_spans, cp_tokens_read
from te_thd.offline_cache.record.manifest import manifest_bytes
from te_thd.offline_cache.record.run import ShardRecord, build_manifest, run_params, run_record
from te_thd.offline_cache.write.shardfile import ShardStream

#: what a lossy codec's shard records in the manifest, and a figure of the width it usually has
_LOSS_FIGURES = ("max_rel_l2", "mean_rel_l2")
_LOSS_PLACEHOLDER = 0.012345


@dataclass(frozen=True)
class CacheSpec:
    """The cache to plan: ``schema`` (logical: a token key is ``[L, ...]`` per sample), the keys
    that can be stored ragged (``token_keys``), ``shard_size``, ``cp``, the producer's
    ``length_key`` (``None``: its default), the key the collator packs (``input_key``), the keys a
    codec may take (``codec_keys``; ``None``: every token key), the producer ``options`` every shard
    header records, how training packs a sequential epoch (``pack_seq_len``, ``batch_size``), the
    target's ``vocab_size``, which sizes an index codec (``None``: index codecs are not planned),
    and the collator's CP ``strategy`` (:func:`te_thd.cp.partition_indices`)."""

    schema: dict[str, TensorSpec]
    token_keys: tuple[str, ...]
    shard_size: int
    cp: int = 1
    length_key: str | None = None
    input_key: str = "input_ids"
    codec_keys: tuple[str, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    format_version: int = 1
    #: the collator's rows (``seq_len``) and samples per batch: a row's unused tail joins its last
    #: document, whose CP chunks grow with it; ``None``: each document alone, padded to ``2*cp``
    pack_seq_len: int | None = None
    batch_size: int = 16
    vocab_size: int | None = None
    strategy: str = DUAL_CHUNK_SWAP


@dataclass(frozen=True)
class LayoutCost:
    """One way to store the cache: ``name``, its codecs, shard bytes, shards, each CP rank's bytes
    per epoch."""

    name: str
    codecs: dict[str, str]
    num_samples: int
    total_bytes: int
    num_shards: int
    rank_bytes: tuple[int, ...]
    #: the manifest's bytes, as the producer writes it (not in ``total_bytes``)
    manifest_bytes: int = 0

    @property
    def bytes_per_sample(self) -> float:
        return self.total_bytes / self.num_samples if self.num_samples else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.name,
            "codecs": dict(self.codecs),
            "bytes_per_sample": self.bytes_per_sample,
            "total_bytes": self.total_bytes,
            "num_shards": self.num_shards,
            "cp_rank_bytes": list(self.rank_bytes),
            "manifest_bytes": self.manifest_bytes,
        }


def parse_key(text: str, max_len: int) -> tuple[str, TensorSpec]:
    """``"hidden=bfloat16:L,4096"`` -> ``("hidden", TensorSpec(bfloat16, (max_len, 4096)))``: a
    key's dtype and per-sample shape, ``L`` standing for the padded length; ``"seq_len=int64"``: one
    value."""
    name, eq, rest = text.partition("=")
    dtype_text, _, shape_text = rest.partition(":")
    try:
        if not (eq and name) or "@" in name:
            raise ValueError("no NAME=")
        dtype = dtype_from_name(dtype_text)
        shape = tuple(
            max_len if d.strip() == "L" else int(d) for d in shape_text.split(",") if d.strip()
        )
        if any(d < 0 for d in shape):
            raise ValueError("negative size")
    except ValueError:
        raise ValueError(
            f"--key {text!r} is not NAME=DTYPE[:SHAPE]; write e.g. --key "
            "hidden=bfloat16:L,4096 or --key seq_len=int64 "
            "(DTYPE a torch dtype name, SHAPE sizes per sample with L for the padded length)"
        ) from None
    return name, TensorSpec(dtype, shape)


def read_lengths(text: str, where: str) -> np.ndarray:
    """Lengths from the text of a lengths file: one integer ``>= 0`` per line (blank lines and lines
    starting with ``#`` are skipped); int64 ``[n]``. ``ValueError`` naming ``where`` and the
    line."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if not s.isdigit():
            raise ValueError(
                f"{where}:{n} holds {s[:40]!r}, not a length; write one integer >= 0 per line"
            )
        out.append(int(s))
    if not out:
        raise ValueError(
            f"{where} holds no lengths; write one integer >= 0 per line, one line per sample"
        )
    return np.asarray(out, dtype=np.int64)


def check_lengths(lengths: np.ndarray, spec: CacheSpec, flag: str = "lengths") -> int:
    """``L``, the token keys' padded length; ``ValueError`` when a length exceeds it."""
    widths = {spec.schema[k].shape[0] for k in spec.token_keys if spec.schema[k].shape}
    width = max(widths) if widths else 0
    if widths and lengths.size and int(lengths.max()) > width:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"{flag}: sample {i} has length {int(lengths[i])}, longer than L={width} of "
            "the token keys; "
            "raise the padded length (te-thd cache plan --max-len) to at least "
            f"{int(lengths.max())}, or "
            "truncate the samples"
        )
    return width


def layouts(spec: CacheSpec) -> list[tuple[str, TokenLayout | None]]:
    """``[(name, token layout)]``: padded, ragged, ragged with each codec on every key it can store,
    and (when two or more codecs apply) ragged with all of them together, each key in the first that
    takes it."""
    keys = tuple(spec.schema)
    out: list[tuple[str, TokenLayout | None]] = [("padded", None)]
    if not spec.token_keys:
        return out
    out.append(("ragged", check_token_keys(spec.token_keys, None, keys)))
    allowed = (
        spec.token_keys
        if spec.codec_keys is None
        else [k for k in spec.token_keys if k in spec.codec_keys]
    )
    for name, kind in CODECS.items():
        codec = kind.full_name(spec.vocab_size)
        codecs = {k: codec for k in allowed if codec and spec.schema[k].dtype in kind.DTYPES}
        if codecs:
            out.append((f"ragged+{name}", check_token_keys(spec.token_keys, codecs, keys)))
    if len(out) > 3:  # the codecs combined, as a producer asking for several stores them
        every: dict[str, str] = {}
        for _, layout in reversed(out[2:]):
            every.update(layout.codecs)  # type: ignore[union-attr]
        names = "+".join(n.removeprefix("ragged+") for n, _ in out[2:])
        out.append((f"ragged+{names}", check_token_keys(spec.token_keys, every, keys)))
    return out


def shard_bytes(
    spec: CacheSpec,
    layout: TokenLayout | None,
    lengths: np.ndarray,
    run: Mapping[str, Any],
    rule: LengthRule | None,
) -> int:
    """Bytes of the shard holding samples of ``lengths`` (int64 ``[rows]``), as its writer lays it
    out (:meth:`~te_thd.offline_cache.write.shardfile.ShardStream.file_bytes`)."""
    return ShardStream(None, spec.schema, int(lengths.size), run, layout, rule).file_bytes(lengths)


def manifest_size(
    spec: CacheSpec,
    layout: TokenLayout | None,
    lengths: np.ndarray,
    sizes: Sequence[int],
    params: Mapping[str, Any],
    rule: LengthRule | None,
) -> int:
    """Bytes of the manifest a producer writes for shards of ``sizes`` bytes holding samples of
    ``lengths``: the manifest its own functions assemble and serialise, with each checksum and codec
    loss figure a placeholder of the width the writer records."""
    fidelity = {
        k: dict.fromkeys(_LOSS_FIGURES, _LOSS_PLACEHOLDER)
        for k in (layout.lossy_keys if layout else ())
    }
    recs = {
        i: ShardRecord(
            size,
            shard_checksum("0" * 16),
            tuple(lengths[a:b].tolist()) if rule is not None else None,
            fidelity or None,
        )
        for i, (size, (a, b)) in enumerate(
            zip(sizes, _shards(lengths.size, spec.shard_size), strict=True)
        )
    }
    manifest = build_manifest(params, spec.options, rule, spec.schema, recs)
    return len(manifest_bytes("", manifest, spec.format_version))


def rank_bytes(
    spec: CacheSpec, layout: TokenLayout | None, lengths: np.ndarray, total: int
) -> tuple[int, ...]:
    """Each CP rank's bytes fetched in one epoch over every sample (``total``: the shards'
    bytes)."""
    if layout is None or spec.cp == 1:
        return (total,) * spec.cp  # every key's rows, or every token, on every rank
    whole = {spec.input_key, spec.length_key or ""}
    shared = [s for s in layout.stored(spec.schema) if s.key not in whole]  # split across ranks
    # every rank reads the rest whole: headers, fixed rows, the whole keys' tokens, the block sums
    common = total - int(lengths.sum()) * sum(s.token_bytes for s in shared)
    strategy = normalize_strategy(spec.strategy)
    spans = cp_spans(lengths, spec.cp, spec.pack_seq_len, spec.batch_size, strategy)
    index = np.arange(lengths.size)
    groups = index // spec.batch_size * (lengths.size + 1) + index // spec.shard_size
    ranges = None
    out = []
    for rank in range(spec.cp):
        if strategy != DUAL_CHUNK_SWAP:
            ranges = contiguous_ranges(
                spans, spec.cp, rank, spec.pack_seq_len, spec.batch_size, lengths
            )
        got = common
        for s in shared:
            gap = PAGE_BYTES // max(1, s.token_bytes)  # a gap of a page or less is read through
            got += (
                cp_tokens_read(lengths, spans, groups, spec.cp, rank, s.block_tokens, gap, ranges)
                * s.token_bytes
            )
        out.append(got)
    return tuple(out)


def _shards(num_samples: int, shard_size: int) -> list[tuple[int, int]]:
    """``[(first sample, end)]`` of every shard."""
    count = num_shards(num_samples, shard_size)
    return [
        (i * shard_size, i * shard_size + shard_rows(i, num_samples, shard_size))
        for i in range(count)
    ]


def plan_cache(lengths: Sequence[int] | np.ndarray, spec: CacheSpec) -> list[LayoutCost]:
    """Every layout of the cache of samples with real ``lengths`` (:func:`layouts`), costed."""
    lengths = np.asarray(lengths, dtype=np.int64)
    check_int("cp", spec.cp, 1, meaning=" (context-parallel size)")
    normalize_strategy(spec.strategy)
    check_lengths(lengths, spec)
    keys = tuple(spec.schema)
    rule = producer_rule(spec.length_key, keys)
    shard_rule = for_tensor_spec(rule, spec.schema[rule.key]) if rule is not None else None
    shards = _shards(lengths.size, spec.shard_size)
    out = []
    for name, layout in layouts(spec):
        if layout is not None and rule is None:
            raise ValueError(
                "a ragged cache needs each sample's length: pass length_key (a stored "
                "key) or store input_ids"
            )
        params = run_params(
            spec.format_version, int(lengths.size), spec.shard_size, keys, spec.options, layout
        )
        run = run_record(params, rule)
        sizes = [shard_bytes(spec, layout, lengths[a:b], run, shard_rule) for a, b in shards]
        total = sum(sizes)
        out.append(
            LayoutCost(
                name,
                dict(layout.codecs) if layout else {},
                int(lengths.size),
                total,
                len(shards),
                rank_bytes(spec, layout, lengths, total),
                manifest_size(spec, layout, lengths, sizes, params, rule),
            )
        )
    return out


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (``"512 B"`` below a KiB; TiB at most)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        value /= 1024
    return f"{value:.1f} TiB"


def plan_json(
    costs: Sequence[LayoutCost],
    spec: CacheSpec,
    lengths: np.ndarray,
    produced: str | None = None,
) -> dict[str, Any]:
    """What ``te-thd cache plan --json`` prints: the inputs and every layout's figures
    (``produced``: the layout a producer's flags ask for, recorded as ``"produced_layout"``)."""
    return {
        **({"produced_layout": produced} if produced is not None else {}),
        "num_samples": int(lengths.size),
        "real_tokens": int(lengths.sum()),
        "shard_size": spec.shard_size,
        "cp": spec.cp,
        **({"cp_strategy": spec.strategy} if spec.strategy != DUAL_CHUNK_SWAP else {}),
        "schema": {k: s.to_json() for k, s in spec.schema.items()},
        "token_keys": list(spec.token_keys),
        "layouts": [c.to_json() for c in costs],
    }


def format_plan(
    costs: Sequence[LayoutCost],
    spec: CacheSpec,
    lengths: np.ndarray,
    produced: str | None = None,
) -> str:
    """The table ``te-thd cache plan`` prints: one column per layout (``produced``: the layout a
    producer's flags ask for, named under the table)."""
    head = [
        f"samples: {lengths.size}, real tokens: {int(lengths.sum())} (mean length "
        f"{lengths.mean() if lengths.size else 0:.1f}, "
        f"L = {check_lengths(lengths, spec)}), shard_size {spec.shard_size}, cp {spec.cp}"
        + (f" ({spec.strategy})" if spec.strategy != DUAL_CHUNK_SWAP else ""),
        "keys: "
        + ", ".join(
            f"{k} {dtype_name(s.dtype)}{list(s.shape)}"
            + (" (token key)" if k in spec.token_keys else "")
            for k, s in spec.schema.items()
        ),
    ]
    rows: list[tuple[str, list[str]]] = [
        ("bytes per sample", [human_bytes(c.bytes_per_sample) for c in costs]),
        ("total (shards)", [human_bytes(c.total_bytes) for c in costs]),
        ("", [f"{c.total_bytes} B" for c in costs]),
        ("manifest", [human_bytes(c.manifest_bytes) for c in costs]),
        ("shards", [str(c.num_shards) for c in costs]),
        (
            "vs padded",
            [
                f"{c.total_bytes / costs[0].total_bytes:.3f}x" if costs[0].total_bytes else "-"
                for c in costs
            ],
        ),
    ]
    for r in range(spec.cp):
        rows.append((f"CP rank {r} reads/epoch", [human_bytes(c.rank_bytes[r]) for c in costs]))
    width = max(12, *(len(c.name) for c in costs), *(len(v) for _, vals in rows for v in vals))
    label = max(len(n) for n, _ in rows)
    lines = [*head, "", " " * label + "".join(f"  {c.name:>{width}}" for c in costs)]
    lines += [f"{n:<{label}}" + "".join(f"  {v:>{width}}" for v in vals) for n, vals in rows]
    codecs = [
        f"{c.name}: " + ", ".join(f"{k} as {v}" for k, v in c.codecs.items())
        for c in costs
        if c.codecs
    ]
    if codecs:
        lines += ["", *codecs]
    if produced is not None:
        lines += ["", f"the producer's flags as given write: {produced}"]
    lines += [
        "",
        "Total: the shards; the manifest beside them is priced as the producer writes it. "
        "CP rank bytes: one epoch of every sample through CachedThdCollator(cp_size, "
        "cp_rank); divide by the "
        "data-parallel replicas for one replica's share.",
    ]
    return "\n".join(lines)


def default_token_keys(schema: Mapping[str, TensorSpec], max_len: int) -> tuple[str, ...]:
    """The keys shaped ``[max_len, ...]`` per sample: those a ragged layout can store ragged."""
    return tuple(k for k, s in schema.items() if s.shape and s.shape[0] == max_len)


__all__ = [
    "CacheSpec",
    "LayoutCost",
    "check_lengths",
    "default_token_keys",
    "format_plan",
    "human_bytes",
    "layouts",
    "parse_key",
    "plan_cache",
    "plan_json",
    "rank_bytes",
    "read_lengths",
    "shard_bytes",
]
