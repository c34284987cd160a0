"""What a producer finds in its output directory, and what it makes of it.

- the run record ``.te_thd-producer.json`` (:data:`PROGRESS_NAME`): the
  parameters of an unfinished run (:func:`~te_thd.offline_cache.record.run.run_params`), so a
  resume with other parameters is refused instead of mixing shards; ``te-thd cache repair``
  writes one from a manifest (:func:`~te_thd.offline_cache.record.run.params_of_manifest`) to
  reopen a finished cache;
- :func:`prepare_directory`: rank 0's decision under the lock -- reuse a
  finished identical cache, resume, or refuse, naming the difference;
- :func:`verify_existing`: shards a previous run left are verified completely
  before they are kept;
- :func:`assemble_manifest`: rank 0 turns every rank's shard records into the
  manifest, refusing a missing shard or two schemas.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from te_thd.offline_cache.format.integrity import read_shard_header, schema_of_header
from te_thd.offline_cache.format.lengths import (
    LengthRule,
    for_tensor_spec,
    read_shard_lengths,
)
from te_thd.offline_cache.format.schema import (
    FOLLOW_NAME,
    MANIFEST_NAME,
    PROGRESS_NAME,
    SHARD_RE,
    CacheError,
    CacheIntegrityError,
    CacheSchema,
    SchemaError,
    cache_command,
    format_indices,
    num_shards,
    schema_from_json,
    shard_name,
    shard_path,
    shard_rows,
)
from te_thd.offline_cache.format.shard_check import verify_shard_file
from te_thd.offline_cache.record.files import check_listed_files, shard_size_errors
from te_thd.offline_cache.record.manifest import (
    RESERVED_MANIFEST_KEYS,
    listed_shards,
    read_manifest,
)
from te_thd.offline_cache.record.run import (
    ShardRecord,
    build_manifest,
    describe_diff,
    params_of_manifest,
    record_bytes,
)
from te_thd.offline_cache.storage.base import LOCK_NAME, TEMP_RE, Storage

_log = logging.getLogger(__name__)


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The producer options as a dict, refused (``ValueError``) when a key is one te_thd writes
    itself or a value is not JSON (they are recorded top-level in the manifest)."""
    options = dict(options or {})
    clash = sorted(set(options) & RESERVED_MANIFEST_KEYS)
    if clash:
        raise ValueError(
            f"options {clash} clash with manifest fields te_thd writes itself "
            f"({sorted(RESERVED_MANIFEST_KEYS)}); rename them"
        )
    try:
        json.dumps(options, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"options must be JSON values (recorded in manifest.json): {exc}"
        ) from None
    return options


#: Where damaged or foreign shards are moved when a cache is reopened (readers never look there).
DAMAGED_DIR = ".te_thd-damaged"


def reopen_for_resume(
    storage: Storage, manifest: Mapping[str, Any], set_aside: Sequence[int]
) -> str | None:
    """Turn a finished cache into an unfinished run its producer resumes; the caller holds the lock.

    The producer's run record is written from ``manifest``, the shards ``set_aside`` are
    moved to :data:`DAMAGED_DIR` (kept for inspection), and ``manifest.json`` is removed
    last. Returns the set-aside directory (``None`` when nothing was moved).
    """
    storage.put(PROGRESS_NAME, record_bytes(params_of_manifest(manifest)))
    aside = storage.set_aside([shard_name(i) for i in set_aside], DAMAGED_DIR)
    storage.delete(MANIFEST_NAME)
    return aside


def _wrong_sized(
    storage: Storage, listing: Mapping[str, int], manifest: Mapping[str, Any]
) -> list[int]:
    """Shards of ``manifest``'s cache that are present with another size than recorded, or beyond
    its count (by ``listing``: one listing of the cache)."""
    count = num_shards(int(manifest["num_samples"]), int(manifest["shard_size"]))
    present = sorted(listed_shards(listing))
    wrong_size = shard_size_errors(storage, listing, manifest, [i for i in present if i < count])
    return [*wrong_size, *(i for i in present if i >= count)]


#: what a producer (or its lock) leaves in its output directory besides shards and the manifest
_OWN = frozenset({PROGRESS_NAME, FOLLOW_NAME, LOCK_NAME})


def prepare_directory(
    storage: Storage, params: dict[str, Any], resume: bool, cache_name: str, producer_name: str
) -> dict[str, Any] | None:
    """Rank 0, under the lock: decide. Returns the finished manifest, or ``None`` (= produce).
    ``storage``: the output directory the producer opened."""
    output_dir, listing = storage.name, storage.list()
    shards = listed_shards(listing)
    if MANIFEST_NAME in listing:
        if not resume:
            raise CacheError(
                f"output_dir {output_dir} already holds a finished cache (manifest.json). Pass "
                "resume=True to reuse it, or choose an empty output_dir."
            )
        manifest = read_manifest(storage, cache_name, params["format_version"], producer_name)
        recorded = params_of_manifest(manifest, params["keys"])
        if recorded != params:
            raise CacheError(
                f"output_dir {output_dir} holds a finished cache built with other parameters "
                f"({describe_diff(recorded, params)}). Choose another output_dir, or "
                "delete this cache."
            )
        try:
            check_listed_files(storage, listing, manifest, cache_name, producer_name)
        except CacheIntegrityError:
            # a shard of a finished cache is missing, truncated or extra: this run has the same
            # parameters, so it fills the gap itself (what `te-thd cache repair` then a resume do)
            wrong = _wrong_sized(storage, listing, manifest)
            reopen_for_resume(storage, manifest, wrong)
            _log.warning(
                "%s: a finished cache with shards missing or of the wrong size (set aside: %s); "
                "recomputing them",
                output_dir,
                format_indices(wrong),
            )
            storage.clean()
            return None
        # killed after the manifest, before this cleanup
        for leftover in (PROGRESS_NAME, FOLLOW_NAME):
            if leftover in listing:
                storage.delete(leftover)
        return manifest
    foreign = [
        n for n in sorted(listing) if not (n in _OWN or TEMP_RE.match(n) or SHARD_RE.match(n))
    ]
    if foreign and not resume:
        # resume=False asks for a directory of its own: files no producer wrote mean a wrong path
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise CacheError(
            f"output_dir {output_dir} is not empty: it holds "
            f"{', '.join(foreign[:3])}{more}, which no "
            "te_thd producer wrote, and resume=False builds a cache only in an empty "
            "directory. Choose "
            "an empty output_dir, or pass resume=True to write the cache beside these files."
        )
    raw = storage.get(PROGRESS_NAME)
    if raw is not None:
        try:
            recorded = json.loads(raw.decode())
        except ValueError as exc:
            raise CacheError(
                f"cannot read the producer record {storage.display(PROGRESS_NAME)} "
                f"({exc}); delete it, then rebuild the "
                f"record from the shards: {cache_command('repair', output_dir)}"
            ) from None
        if shards and not resume:
            raise CacheError(
                f"output_dir {output_dir} holds {len(shards)} shards of an unfinished "
                "run. Pass resume=True "
                "to continue it, or choose an empty output_dir."
            )
        if shards and recorded != params:
            raise CacheError(
                f"output_dir {output_dir} holds shards of an unfinished run with other parameters "
                f"({describe_diff(recorded, params)}). Resume with the same parameters, or choose "
                "another output_dir."
            )
    elif shards:
        raise CacheError(
            f"output_dir {output_dir} holds shards ({format_indices(shards)}) but no "
            "manifest and no "
            f"producer record ({PROGRESS_NAME}), so their parameters cannot be checked. "
            "Rebuild the manifest "
            f"from the shards: {cache_command('repair', output_dir)} (when a shard is "
            "missing it prints "
            "the producer command that computes it), or choose an empty output_dir."
        )
    removed = storage.clean()
    if removed:
        _log.info(
            "Removed %d temp file(s) of an interrupted writer in %s", len(removed), output_dir
        )
    storage.put(PROGRESS_NAME, record_bytes(params))
    return None


def verify_existing(
    storage: Storage,
    indices: Sequence[int],
    keys: Sequence[str],
    num_samples: int,
    shard_size: int,
    length_rule: LengthRule | None = None,
    run: Mapping[str, Any] | None = None,
) -> tuple[dict[int, ShardRecord], CacheSchema | None]:
    """Records of shards a previous run wrote, each verified completely (:func:`existing_record`).

    The first shard fixes the schema (its keys must be this run's). ``run``: this run's record
    (:func:`~te_thd.offline_cache.record.run.run_record`). Raises :class:`CacheIntegrityError`
    naming a damaged shard and what to do.
    """
    records: dict[int, ShardRecord] = {}
    schema: CacheSchema | None = None
    for i in sorted(indices):
        shown = storage.display(shard_name(i))
        # every byte is read: an object is fetched into a local copy
        path = storage.whole(shard_name(i))
        try:
            if schema is None:
                schema = schema_of_header(read_shard_header(path))
                if set(schema) != set(keys):
                    raise SchemaError(
                        f"existing shard {shown} holds keys {sorted(schema)}, this run "
                        f"stores {sorted(keys)}; "
                        "resume with the same keys, or choose another output_dir"
                    )
            records[i] = existing_record(
                path,
                schema,
                shard_rows(i, num_samples, shard_size),
                length_rule,
                run,
                first_sample=i * shard_size,
            )
        except CacheIntegrityError as exc:
            raise CacheIntegrityError(
                "existing shard "
                f"{shown}{str(exc).removeprefix(f'shard {path}').rstrip('. ')}. Delete it "
                "and run again: "
                "the producer recomputes missing shards.",
                path=shown,
            ) from None
    return records, schema


def existing_record(
    path: str,
    schema: CacheSchema,
    rows: int,
    length_rule: LengthRule | None,
    run: Mapping[str, Any] | None = None,
    first_sample: int | None = None,
) -> ShardRecord:
    """The manifest record of the shard at ``path`` (``rows`` rows of ``schema``), verified
    completely (:func:`verify_shard_file`, te_thd checksums required); with a ``length_rule`` its
    rows' lengths. ``run``: the run record the shard must carry when it carries one.
    ``first_sample``: the global index of its row 0, to name a damaged row by its sample. Raises
    :class:`CacheIntegrityError`."""
    check = verify_shard_file(path, schema, rows, require_sums=True, first_sample=first_sample)
    theirs = check.header.sums.run if check.header.sums is not None else None
    if run is not None and theirs is not None and theirs != run:
        raise CacheIntegrityError(
            f"shard {path} was written by a producer run with other arguments "
            f"({describe_diff(theirs, run)}), so "
            "it is not part of this run's cache: resume with the arguments that wrote it.",
            path=path,
        )
    lengths = None
    if length_rule is not None:
        rule = for_tensor_spec(length_rule, schema[length_rule.key])
        lengths = tuple(read_shard_lengths(path, rule).tolist())
    fidelity = check.header.tokens.fidelity if check.header.tokens is not None else None
    return ShardRecord(
        bytes=check.bytes, checksum=check.checksum, lengths=lengths, fidelity=fidelity
    )


def assemble_manifest(
    gathered: Sequence[tuple[str | None, dict[int, ShardRecord], dict[str, Any] | None]],
    params: Mapping[str, Any],
    options: Mapping[str, Any],
    output_dir: str,
    cache_name: str,
    length_rule: LengthRule | None = None,
) -> dict[str, Any]:
    """The manifest (:func:`~te_thd.offline_cache.record.run.build_manifest`) of a finished run from
    ``gathered``: per rank ``(error or None, {shard: record}, schema JSON or None)``. A rank's
    error, a shard no rank reported, or two schemas raise."""
    errors = [(r, e) for r, (e, _, _) in enumerate(gathered) if e is not None]
    if errors:
        raise SchemaError("; ".join(f"rank {r}: {e}" for r, e in errors))
    num_samples, shard_size = params["num_samples"], params["shard_size"]
    expected = num_shards(num_samples, shard_size)
    records: dict[int, ShardRecord] = {}
    for _, recs, _ in gathered:
        records.update(recs)
    missing = sorted(set(range(expected)) - set(records))
    if missing:
        raise CacheIntegrityError(
            f"{cache_name} cache at {output_dir}: no rank reported shards "
            f"{format_indices(missing)}; "
            "the dataloader yielded fewer samples than len(dataset). Fix the dataset, then resume.",
            path=shard_path(output_dir, missing[0]),
        )
    schemas = {
        json.dumps(s, sort_keys=True): (r, s)
        for r, (_, _, s) in enumerate(gathered)
        if s is not None
    }
    if len(schemas) > 1:
        desc = "; ".join(f"rank {r}: {schema_from_json(s)}" for r, s in schemas.values())
        raise SchemaError(
            f"ranks wrote shards with different schemas ({desc}); compute_batch must be "
            "deterministic in dtype/shape"
        )
    schema = schema_from_json(next(iter(schemas.values()))[1]) if schemas else {}
    shards = {i: records[i] for i in range(expected)}
    return build_manifest(params, options, length_rule, schema, shards)
