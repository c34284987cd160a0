"""Cache integrity checks on request, and a summary for humans.

Built on the checks of the layers below: the cheap one every reader makes on open (shard names
``0..N-1``, each file of the size the manifest records; :mod:`~te_thd.offline_cache.record.files`)
and :func:`~te_thd.offline_cache.format.shard_check.verify_shard_file`, everything one shard can
be checked for (its header against the cache schema and row count, every row of every key
against the checksums the shard carries, the whole file against the manifest's record).

- :func:`verify_shards`: the one walk over a cache's shards that ``verify_cache(deep=True)`` and
  ``repair_cache`` share (the producer's resume checks its own shards with
  :func:`~te_thd.offline_cache.write.resume.existing_record`).
- :func:`verify_cache`: the whole cache; says exactly what it checked and what it
  could not (a reference-format cache carries no checksums).
- :func:`cache_info`: what ``te-thd cache info`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from te_thd.offline_cache.format.integrity import (
    HASH_NAME,
    name_row,
)
from te_thd.offline_cache.format.lengths import LengthRule, read_shard_lengths, recorded_rule
from te_thd.offline_cache.format.ragged import describe_stored
from te_thd.offline_cache.format.schema import (
    CacheIntegrityError,
    cache_command,
    num_shards,
    repair_hint,
    shard_name,
    shard_rows,
)
from te_thd.offline_cache.format.shard_check import verify_shard_file
from te_thd.offline_cache.record.files import (
    contiguous_shards,
    requires_shard_sums,
    shard_size_errors,
)
from te_thd.offline_cache.record.manifest import (
    RESERVED_MANIFEST_KEYS,
    cache_schema,
    load_manifest,
    producer_command,
    shard_records,
)
from te_thd.offline_cache.record.run import layout_of
from te_thd.offline_cache.storage.base import Storage
from te_thd.offline_cache.storage.schemes import as_storage


def _what_was_checked(
    cache_dir: str, deep: bool, records: bool, sums: int, n: int
) -> tuple[list[str], list[str]]:
    checked = [
        "manifest fields (and its own checksum when it records one)",
        "shard files 0..N-1 present",
    ]
    not_checked = []
    checked.append(
        "shard sizes against the manifest"
        if records
        else "shard presence only (the manifest records no sizes)"
    )
    if not deep:
        not_checked.append(
            "shard headers and contents (a full verify reads them: "
            f"{cache_command('verify', cache_dir)})"
        )
        return checked, not_checked
    checked.append("every shard header against the schema and row counts")
    if sums == n:
        checked.append(
            f"every row of every key against the {HASH_NAME} checksums each shard carries"
        )
    elif sums:
        checked.append(f"the rows of the {sums} of {n} shards that carry {HASH_NAME} checksums")
        not_checked.append(
            f"tensor bytes of {n - sums} shard(s) without checksums (written by the reference "
            "implementation or te_thd before layout 3): a flipped byte there cannot be detected"
        )
    else:
        not_checked.append(
            "tensor bytes: no shard carries checksums (written by the reference implementation or "
            "te_thd before layout 3), so a flipped byte in tensor data cannot be detected; rewrite "
            "the cache with te_thd's writers to make it verifiable"
        )
    if records:
        checked.append(
            "every shard's checksum (header digest, or whole-file CRC-32 in older "
            "caches) against the manifest"
        )
    else:
        not_checked.append(
            "whether a shard was swapped for another valid shard (the manifest records "
            "no per-shard checksums)"
        )
    return checked, not_checked


def verify_cache(
    cache_dir: str | Storage,
    deep: bool = False,
    cache_name: str = "offline",
    producer_name: str | None = None,
) -> dict[str, Any]:
    """Check a finished cache; returns a summary dict, raises when anything is wrong.

    ``deep=False``: manifest + :func:`check_cache_files` (sizes). ``deep=True``:
    also :func:`verify_shard_file` on every shard (header, every row's checksum,
    the manifest's record of the shard). The result says what was verified: ``checked`` and
    ``not_checked`` (lists of sentences), ``checksums_verified`` (every tensor
    byte was checked against a checksum), ``headers_verified``,
    ``shards_with_checksums``, ``lengths_recorded`` (the rule of the per-sample
    lengths the manifest records, or ``None``), ``lengths_verified`` (deep: each
    recorded length matched the data) and ``lengths`` (a sentence).

    Raises :class:`ManifestError` or :class:`CacheIntegrityError`; the latter's
    message lists every bad shard by path, ends with the repair command, and
    ``.path`` is the first bad shard.
    """
    storage = as_storage(cache_dir)  # a path, a URL or the cache's opened storage
    cache_dir = storage.name
    manifest = load_manifest(storage, cache_name, producer_name)
    producer_name = producer_command(cache_dir, manifest, producer_name)
    num_samples, shard_size = int(manifest["num_samples"]), int(manifest["shard_size"])
    # presence of 0..N-1 (a gap or an extra shard is a problem of the set: raised at once)
    listing = storage.list()
    indices = contiguous_shards(
        cache_dir, listing, cache_name, num_samples, shard_size, producer_name
    )
    records, rule = shard_records(manifest), recorded_rule(manifest)
    size_errors = shard_size_errors(storage, listing, manifest, indices, producer_name)
    shown = {
        i: storage.display(shard_name(i)) for i in indices
    }  # what messages name: the file or the object
    problems = [(shown[i], shard_problem(exc, shown[i])) for i, exc in size_errors.items()]
    with_sums = 0
    if deep:  # only the shards of the right size are read
        bad, with_sums = verify_shards(
            storage, manifest, [i for i in indices if i not in size_errors], rule
        )
        problems += [(shown[i], why) for i, why in bad.items()]
    _raise_problems(sorted(problems), cache_dir, cache_name, producer_name)
    checked, not_checked = _what_was_checked(
        cache_dir, deep, records is not None, with_sums, len(indices)
    )
    if deep and rule is not None:
        checked.append(f"every sample's recorded length against {rule.describe()}")
    return {
        "cache_dir": cache_dir,
        "num_samples": num_samples,
        "num_shards": len(indices),
        "deep": deep,
        "checksums_verified": deep and with_sums == len(indices),
        "headers_verified": deep,
        "shards_with_checksums": with_sums if deep else None,
        "lengths_recorded": rule.describe() if rule is not None else None,
        "lengths_verified": deep and rule is not None,
        "checked": checked,
        "not_checked": not_checked,
        "lengths": _lengths_line(cache_dir, rule, deep),
    }


def verify_shards(
    storage: Storage,
    manifest: Mapping[str, Any],
    indices: Sequence[int],
    rule: LengthRule | None = None,
) -> tuple[dict[int, str], int]:
    """Verify the shards ``indices`` of ``manifest``'s cache completely (:func:`verify_shard_file`
    against the manifest's records; with a length ``rule``, also the lengths it records):
    ``({index: what is wrong}, how many of the sound ones carry checksums)``."""
    num_samples, shard_size = int(manifest["num_samples"]), int(manifest["shard_size"])
    records = shard_records(manifest)
    schema = cache_schema(storage, manifest)  # None: shard 0 itself is reported
    bad: dict[int, str] = {}
    with_sums = 0
    for i in indices:
        # every byte is read: an object is fetched into a local copy
        path = storage.whole(shard_name(i))
        try:
            check = verify_shard_file(
                path,
                schema,
                shard_rows(i, num_samples, shard_size),
                records[i] if records is not None else None,
                requires_shard_sums(manifest),
                i * shard_size,
            )
            if rule is not None and records is not None:
                _check_lengths(path, rule, records[i]["lengths"], i * shard_size)
            with_sums += check.header.sums is not None
        except CacheIntegrityError as exc:
            bad[i] = shard_problem(exc, path)
    return bad, with_sums


def shard_problem(exc: CacheIntegrityError, path: str) -> str:
    """What is wrong with the shard at ``path``, without its name or the repair hint."""
    text = str(exc).removeprefix(f"shard {path}").lstrip(": ")
    return text.split(" Restore it from a copy.")[0].split(" Repair: ")[0]


def _raise_problems(
    problems: list[tuple[str, str]], cache_dir: str, cache_name: str, producer: str | None
) -> None:
    """One :class:`CacheIntegrityError` naming every bad shard (``[(path, what)]``), or nothing."""
    if not problems:
        return
    listed = "\n".join(f"  {p}: {what}" for p, what in problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise CacheIntegrityError(
        f"{cache_name} cache at {cache_dir}: {len(problems)} bad shard(s):\n{listed}{more}\n"
        f"Restore these files from a copy. {repair_hint(cache_dir, producer)}",
        path=problems[0][0],
    )


def _check_lengths(path: str, rule: LengthRule, recorded: list[int], first_sample: int) -> None:
    """Recompute one shard's lengths from its data and compare them with the manifest's record
    (``first_sample``: the global index of the shard's row 0)."""
    got = read_shard_lengths(path, rule)
    bad = np.flatnonzero(got != np.asarray(recorded, dtype=np.int64))
    if bad.size:
        r = int(bad[0])
        raise CacheIntegrityError(
            f"shard {path}: {name_row(r, first_sample)}: the manifest records length "
            f"{recorded[r]}, the data gives {int(got[r])} "
            f"({rule.describe()}){f' and {bad.size - 1} more rows' if bad.size > 1 else ''}: "
            "the manifest's "
            "lengths do not describe this shard",
            path=path,
            sample=first_sample + r,
            key=rule.key,
            expected=str(recorded[r]),
            actual=str(int(got[r])),
        )


def _lengths_line(cache_dir: str, rule: LengthRule | None, deep: bool) -> str:
    """Whether the cache records per-sample lengths and whether they were checked."""
    if rule is None:
        return (
            "not recorded (a balanced loader scans them once and keeps them beside the cache "
            "in lengths.<key>.json)"
        )
    if deep:
        return f"recorded ({rule.describe()}), checked against the data"
    return (
        f"recorded ({rule.describe()}), covered by the manifest checksum; a full verify "
        "checks them "
        f"against the data: {cache_command('verify', cache_dir)}"
    )


def cache_info(cache_dir: str | Storage) -> dict[str, Any]:
    """Summary of a cache from its manifest (no shard reads unless the manifest lacks a schema).

    Keys: ``cache_dir``, ``format_version``, ``layout_version`` (``None`` for a
    reference-format manifest), ``num_samples``, ``shard_size``, ``num_shards``,
    ``bytes`` (total shard bytes), ``checksum`` (algorithm or ``None``),
    ``schema`` (``{key: {"dtype", "shape"}}``, per-sample shape), ``storage``
    (``{key: how it is stored}``: ``"rows"``, or ragged and its codec), ``fidelity``
    (``{codec key: {"max_rel_l2", "mean_rel_l2"}}`` over all shards: what the codec lost),
    ``options`` (every other manifest field: the producer options).
    """
    store = as_storage(cache_dir)  # a path, a URL or the cache's opened storage
    cache_dir, manifest = store.name, load_manifest(store)
    n = num_shards(int(manifest["num_samples"]), int(manifest["shard_size"]))
    records = shard_records(manifest)
    if records is not None:
        total = sum(int(r["bytes"]) for r in records)
    else:
        sizes = store.list()
        total = sum(sizes.get(shard_name(i), 0) for i in range(n))
    schema = cache_schema(store, manifest)
    layout = layout_of(manifest)
    storage = {
        k: describe_stored(layout, schema, k) if layout is not None and k in layout.keys else "rows"
        for k in (schema or {})
    }
    fidelity: dict[str, dict[str, float]] = {}
    rows_of = [
        shard_rows(i, int(manifest["num_samples"]), int(manifest["shard_size"])) for i in range(n)
    ]
    for rec, rows in zip(records or [], rows_of, strict=False):
        for k, f in (rec.get("fidelity") or {}).items():
            agg = fidelity.setdefault(k, {"max_rel_l2": 0.0, "mean_rel_l2": 0.0, "_w": 0})
            agg["max_rel_l2"] = max(agg["max_rel_l2"], float(f["max_rel_l2"]))
            # weighted by samples, near enough per token
            agg["mean_rel_l2"] += float(f["mean_rel_l2"]) * rows
            agg["_w"] += rows
    for agg in fidelity.values():
        w = agg.pop("_w")
        agg["mean_rel_l2"] = agg["mean_rel_l2"] / w if w else 0.0
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
        "storage": storage,
        "fidelity": fidelity,
        "options": {k: v for k, v in manifest.items() if k not in RESERVED_MANIFEST_KEYS},
    }
