"""``te-thd cache repair DIR``: set damaged shards aside, rebuild a lost manifest, reopen the cache
for its producer.

A damaged shard cannot be fixed in place (its bytes are the producer's output): it is
computed again. :func:`repair_cache` turns that into a plain resume of the producer that
built the cache: under the producer lock every shard is verified
(:func:`~te_thd.offline_cache.tools.verify.verify_shards`), the producer's run record is written
from the manifest, damaged and extra shards go to ``DIR/.te_thd-damaged/`` and
``manifest.json`` is removed. A lost or damaged manifest is rebuilt from the run record
every ``produce_cache`` shard carries (:func:`rebuild_manifest`) and written last; shards
that predate the record need the fields they cannot tell passed back, and the error names
each one. Everything goes through the cache's :class:`~te_thd.offline_cache.storage.base.Storage`,
so a directory and an s3:// prefix are repaired by the same code (docs/integrity.md).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from te_thd.args import is_int
from te_thd.offline_cache.format.integrity import ShardHeader, read_shard_header, schema_of_header
from te_thd.offline_cache.format.lengths import LengthRule, producer_rule
from te_thd.offline_cache.format.schema import (
    FOLLOW_NAME,
    MANIFEST_NAME,
    SHARD_RE,
    CacheIntegrityError,
    CacheLockError,
    CacheSchema,
    ManifestError,
    cache_command,
    canonical_json,
    format_indices,
    num_shards,
    producer_hint,
    shard_name,
    shard_rows,
)
from te_thd.offline_cache.record.manifest import (
    listed_shards,
    load_manifest,
    producer_command,
    resume_command,
    write_manifest,
)
from te_thd.offline_cache.record.run import (
    ShardRecord,
    build_manifest,
    describe_diff,
    record_bytes,
    run_params,
    split_record,
)
from te_thd.offline_cache.storage.base import LocalDirectory, Storage
from te_thd.offline_cache.storage.schemes import as_storage, open_storage
from te_thd.offline_cache.tools.verify import shard_problem, verify_shards
from te_thd.offline_cache.write.resume import (
    DAMAGED_DIR,
    PROGRESS_NAME,
    check_options,
    existing_record,
    reopen_for_resume,
)

#: What a caller passes back when the shards cannot tell it: repair_cache's keyword -> its CLI flag.
REBUILD_ARGS = {
    "format_version": "--format-version",
    "options": "--options",
    "shard_size": "--shard-size",
    "num_samples": "--num-samples",
    "length_key": "--length-key",
}


@dataclass
class Rebuild:
    """What :func:`rebuild_manifest` found in a directory of shards."""

    params: dict[str, Any]  # the producer's run parameters (``run_params``): its record
    # the manifest to write (for write_manifest); None while a shard is missing
    manifest: dict[str, Any] | None
    bad: dict[int, str] = field(default_factory=dict)  # {index: problem}: set aside, recomputed
    missing: list[int] = field(default_factory=list)
    extra: list[int] = field(default_factory=list)
    from_arguments: list[str] = field(default_factory=list)  # the fields the caller passed back
    notes: list[str] = field(default_factory=list)  # what was assumed (shards without a run record)


def _check_given(given: Mapping[str, Any]) -> dict[str, Any]:
    """The rebuild arguments that were passed, each checked (one ``ValueError`` naming it)."""
    out = {k: v for k, v in given.items() if v is not None}
    for key in ("format_version", "shard_size", "num_samples"):
        if key in out and not is_int(out[key], 0 if key == "num_samples" else 1):
            raise ValueError(
                f"{key}={out[key]!r} must be an int >= {0 if key == 'num_samples' else 1}"
            )
    if "options" in out:
        if not isinstance(out["options"], Mapping):
            raise ValueError(
                f"options={out['options']!r} must be a dict: the manifest's producer options"
            )
        out["options"] = json.loads(json.dumps(check_options(out["options"])))
    if "length_key" in out and not isinstance(out["length_key"], str):
        raise ValueError(f"length_key={out['length_key']!r} must be the name of a stored key")
    return out


def _group_runs(headers: Mapping[int, ShardHeader], storage: Storage) -> dict[str, Any] | None:
    """The one run record the shards carry (``None``: none carries one); refuses two."""
    cache_dir = storage.name
    groups: dict[bytes, list[int]] = {}
    for i, h in headers.items():
        if h.sums is not None and h.sums.run is not None:
            groups.setdefault(canonical_json(h.sums.run), []).append(i)
    if len(groups) > 1:
        (a, ia), (b, ib) = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:2]
        raise CacheIntegrityError(
            f"{cache_dir}: shards {format_indices(ia)} and shards {format_indices(ib)} "
            "record different producer "
            f"runs ({describe_diff(json.loads(a), json.loads(b))}), so they are not one "
            "cache. Move the shards that "
            f"do not belong away, then run {cache_command('repair', cache_dir)} again.",
            path=storage.display(shard_name(ib[0])),
        )
    return json.loads(next(iter(groups))) if groups else None


def _from_record(
    record: dict[str, Any], given: dict[str, Any], cache_dir: str
) -> tuple[dict[str, Any], LengthRule | None, dict[str, Any]]:
    """``(params, length rule, manifest options)`` of shards that record their run; an argument that
    contradicts the record is refused, ``options`` the record lacks are added (caller metadata)."""
    params, rule = split_record(record)
    recorded = {
        "format_version": params["format_version"],
        "shard_size": params["shard_size"],
        "num_samples": params["num_samples"],
        "length_key": rule.key if rule is not None else None,
    }
    for key, value in given.items():
        if key == "options":
            clash = {
                k: v
                for k, v in value.items()
                if k in params["options"] and params["options"][k] != v
            }
            if clash:
                theirs = {k: params["options"][k] for k in clash}
                raise ValueError(
                    f"options={clash!r} contradicts the producer options the shards of "
                    f"{cache_dir} record "
                    f"({theirs!r}); pass only fields the shards do not record"
                )
        elif recorded[key] != value:
            raise ValueError(
                f"{key}={value!r} contradicts the shards of {cache_dir}, which record "
                f"{key}={recorded[key]!r}; "
                f"leave {REBUILD_ARGS[key]} out (the shards say it)"
            )
    return params, rule, {**params["options"], **given.get("options", {})}


def _from_arguments(
    headers: Mapping[int, ShardHeader], given: dict[str, Any], cache_dir: str, damaged: str | None
) -> tuple[dict[str, Any], LengthRule | None, dict[str, Any], list[str]]:
    """``(params, length rule, options, notes on what was assumed)`` of shards that predate the run
    record: what they tell (keys, token layout and its length rule, shard size and sample count when
    they fix them), the rest from ``given``; a :class:`ManifestError` names every field still
    missing and the argument for it."""
    headers = {i: h for i, h in headers.items() if h.sums is not None}
    if not headers:
        raise ManifestError(
            f"cannot rebuild the manifest of {cache_dir}: its shards carry no te_thd "
            "checksums (plain safetensors "
            "files, e.g. the reference implementation's), so they cannot be verified. "
            "Restore the manifest from a "
            "copy, or write one: te_thd.offline_cache.write_manifest(cache_dir, "
            "{'num_samples': ..., "
            "'shard_size': ...}, format_version)."
        )
    first = headers[min(headers)]
    schema = schema_of_header(first)
    tokens = first.tokens
    layout = tokens.layout if tokens is not None else None
    top = max(headers)
    shard_size = given.get("shard_size")
    if shard_size is None and top > min(headers):
        shard_size = first.sums.rows  # type: ignore[union-attr]  # a shard before the last: a full one
    num_samples = given.get("num_samples")
    notes = []
    if num_samples is None and shard_size is not None:
        num_samples = top * shard_size + headers[top].sums.rows  # type: ignore[union-attr]  # the last present ends it
        notes.append(
            f"num_samples={num_samples}: shard {top} is taken for the last (pass "
            f"{REBUILD_ARGS['num_samples']} "
            "if shards after it were lost too)"
        )
    needs = {
        "format_version": ("format_version" not in given, "the int its readers pass"),
        "options": ("options" not in given, "the producer options, a JSON object: {} for none"),
        "shard_size": (shard_size is None, "samples per shard: one shard does not tell"),
    }
    missing = [k for k, (lacking, _) in needs.items() if lacking]
    if missing:
        kwargs = ", ".join(f"{k}=..." for k in missing)
        where = (
            f" The damaged manifest is still in place ({damaged}): its fields may tell them."
            if damaged
            else ""
        )
        raise ManifestError(
            f"cannot rebuild the manifest of {cache_dir}: its shards were written before "
            "shards recorded their "
            "producer run, so they do not tell "
            f"{'; '.join(f'{k} ({needs[k][1]})' for k in missing)}. Pass "
            f"{'them' if len(missing) > 1 else 'it'} back: "
            f"{cache_command('repair', cache_dir, *(f'{REBUILD_ARGS[k]} <{k}>' for k in missing))}"
            ", "
            f"or repair_cache(cache_dir, {kwargs}).{where}"
        )
    if layout is not None:
        rule: LengthRule | None = LengthRule.from_json(tokens.length_rule)  # type: ignore[union-attr]
        if "length_key" in given and given["length_key"] != rule.key:
            raise ValueError(
                f"length_key={given['length_key']!r} contradicts the shards, which store "
                f"tokens by {rule.key!r}"
            )
    else:
        rule = producer_rule(given.get("length_key"), list(schema))
        if "length_key" not in given:
            notes.append(
                "lengths by "
                f"{rule.describe() if rule else 'no key (no input_ids stored)'}, the "
                "producer's "
                f"default (pass {REBUILD_ARGS['length_key']} if it was given another length_key)"
            )
    params = run_params(
        given["format_version"], num_samples, shard_size, list(schema), given["options"], layout
    )
    return params, rule, dict(given["options"]), notes


def rebuild_manifest(
    storage: Storage, cache_name: str = "offline", damaged: str | None = None, **given: Any
) -> Rebuild:
    """Rebuild the manifest of the directory of shards ``storage`` (changes nothing).

    Every shard's header is read; the producer run they record (or, for shards that record
    none, the ``given`` fields: ``format_version``, ``options``, ``shard_size``,
    ``num_samples``, ``length_key``) gives the parameters; every shard is verified
    completely and its manifest record taken from it (:func:`existing_record`).
    Shards that fail, or belong to no run of this cache, are ``bad``; indices the cache
    lacks are ``missing``. ``manifest`` is what the producer would have written, or
    ``None`` while a shard is bad or missing. ``damaged``: the damaged manifest's path
    (named in messages). Raises :class:`ManifestError` when the shards leave a field open
    (naming the argument that passes it) and :class:`CacheIntegrityError` when they record
    two runs.
    """
    given, cache_dir = _check_given(given), storage.name
    present = sorted(listed_shards(storage.list()))
    if not present:
        raise ManifestError(
            f"cannot rebuild the manifest of {cache_dir}: it holds no shards "
            "(shard-NNNNNN.safetensors). Point "
            f"at the directory the cache was built in, or build it: run {producer_hint(None)}."
        )
    headers: dict[int, ShardHeader] = {}
    bad: dict[int, str] = {}
    for i in present:
        path = storage.header(shard_name(i))
        try:
            headers[i] = read_shard_header(path)
        except CacheIntegrityError as exc:
            bad[i] = shard_problem(exc, path)
    if not headers:
        raise CacheIntegrityError(
            f"cannot rebuild the manifest of {cache_dir}: no shard header is readable "
            f"({'; '.join(f'shard {i}: {why}' for i, why in list(bad.items())[:3])})",
            path=storage.display(shard_name(present[0])),
        )
    record = _group_runs(headers, storage)
    notes: list[str] = []
    if record is not None:
        params, rule, options = _from_record(record, given, cache_dir)
        used: list[str] = sorted(set(given.get("options", {})) - set(params["options"]))
    else:
        params, rule, options, notes = _from_arguments(headers, given, cache_dir, damaged)
        used = sorted(given)
    count = num_shards(params["num_samples"], params["shard_size"])
    extra = [i for i in present if i >= count]
    schema: CacheSchema | None = None
    records: dict[int, ShardRecord] = {}
    for i in (i for i in present if i < count and i in headers):
        sums = headers[i].sums
        if record is not None and (sums is None or sums.run != record):
            bad[i] = (
                "records no producer run or another one than the other shards: it does "
                "not belong to this cache"
            )
            continue
        theirs = schema_of_header(headers[i])
        if schema is None and set(theirs) == set(params["keys"]):
            schema = theirs
        if schema is None:
            bad[i] = f"holds keys {sorted(theirs)}, the cache stores {params['keys']}"
            continue
        # every byte is read: an object is fetched into a local copy
        path = storage.whole(shard_name(i))
        try:
            records[i] = existing_record(
                path,
                schema,
                shard_rows(i, params["num_samples"], params["shard_size"]),
                rule,
                first_sample=i * params["shard_size"],
            )
        except CacheIntegrityError as exc:
            bad[i] = shard_problem(exc, path)
    missing = sorted(set(range(count)) - set(records) - set(bad))
    result = Rebuild(
        params,
        None,
        {i: bad[i] for i in sorted(bad) if i < count},
        missing,
        sorted({*extra, *(i for i in bad if i >= count)}),
        used,
        notes,
    )
    if not (result.bad or missing) and schema is not None or count == 0:
        result.manifest = build_manifest(params, options, rule, schema, records)
    return result


def repair_cache(
    cache_dir: str | Storage,
    cache_name: str = "offline",
    *,
    format_version: int | None = None,
    options: Mapping[str, Any] | None = None,
    shard_size: int | None = None,
    num_samples: int | None = None,
    length_key: str | None = None,
) -> dict[str, Any]:
    """Verify every shard; set the damaged ones aside and reopen the cache for a resume, or rebuild
    a lost or damaged manifest from the shards.

    Returns ``{"cache_dir", "damaged": {file: problem}, "missing": [file],
    "extra": [file], "set_aside_in": dir or None, "reopened": bool, "producer": str,
    "rebuilt": bool, "from_arguments": [field], "notes": [what a rebuild assumed], "removed":
    [temp file a killed writer left, removed], "kept_aside": what earlier repairs set aside (a sound
    cache: ``{"dir", "files", "bytes", "remove"}``, else None)}``. ``reopened``: the cache waits for
    its producer (re-run ``producer``: it computes the missing and damaged shards); False when
    every shard is sound (nothing is changed then, unless ``rebuilt``: the manifest was
    written again from the shards). ``format_version``, ``options``, ``shard_size``,
    ``num_samples``, ``length_key``: only for a rebuild from shards that do not record
    their producer run (the error says which are needed); ``options`` may also add manifest
    fields the shards do not record. Raises :class:`CacheLockError` while a producer holds
    the directory.
    """
    given = {
        "format_version": format_version,
        "options": options,
        "shard_size": shard_size,
        "num_samples": num_samples,
        "length_key": length_key,
    }
    storage = as_storage(cache_dir)  # a path, a URL or the cache's opened storage
    cache_dir = storage.name
    storage.must_exist(MANIFEST_NAME)  # before the lock, which would create a missing directory
    lock = storage.lock()
    try:
        lock.acquire()
    except CacheLockError:
        raise _held(storage) from None
    try:
        # under the lock no writer is live: a temp file is one a killed writer left
        removed = storage.clean()
        try:
            manifest = load_manifest(storage, cache_name)
        except ManifestError:
            listing = storage.list()
            damaged = MANIFEST_NAME in listing
            if not damaged and not listed_shards(listing):
                # no manifest and no shards: nothing to rebuild from, and the error says what the
                # path is
                raise
            rebuilt = rebuild_manifest(
                storage, cache_name, storage.display(MANIFEST_NAME) if damaged else None, **given
            )
            return {**_apply_rebuild(storage, rebuilt, damaged), "removed": removed}
        passed = [k for k, v in given.items() if v is not None]
        if passed:
            raise ValueError(
                f"{', '.join(passed)}: only a rebuild of a lost or damaged manifest takes "
                "them, and the manifest of "
                f"{cache_dir} is sound; run {cache_command('repair', cache_dir)} without them"
            )
        count = num_shards(int(manifest["num_samples"]), int(manifest["shard_size"]))
        present = listed_shards(storage.list())
        bad, _ = verify_shards(storage, manifest, sorted(i for i in present if i < count))
        missing = sorted(set(range(count)) - present)
        extra = sorted(i for i in present if i >= count)
        result = _result(cache_dir, bad, missing, extra, producer_command(cache_dir, manifest))
        result["removed"] = removed
        if not (bad or missing or extra):
            result["kept_aside"] = _kept_aside(storage)
            return result
        result["set_aside_in"] = reopen_for_resume(storage, manifest, [*bad, *extra])
        result["reopened"] = True
        return result
    finally:
        lock.release()


def _held(storage: Storage) -> CacheLockError:
    """Repair's refusal while a producer holds the cache: who, and when to run repair."""
    holder = storage.lock_holder() or {}
    who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
    # another host's lock may be a killed producer's: that host's unlock removes it
    if holder.get("alive") is None and "host" in holder:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
        return CacheLockError(
            f"a producer holds the lock of {storage.name} ({who}, since {since}), so "
            "repair changes "
            "nothing: run it again once that producer has finished or stopped; if it was killed on "
            f"that host, first run {cache_command('unlock', storage.name)}"
        )
    return CacheLockError(
        f"a producer is writing {storage.name} ({who}); repair would change the files it "
        "writes, so "
        "it changed nothing. Let the producer finish (it writes the manifest last), or stop it and "
        f"run {cache_command('repair', storage.name)} again"
    )


def _kept_aside(storage: Storage) -> dict[str, Any] | None:
    """What earlier repairs set aside in the cache's :data:`DAMAGED_DIR`: ``{"dir", "files",
    "bytes", "remove"}`` (``remove``: how to delete it), or ``None`` when nothing is there."""
    # the folder is a place of its own (readers never list it): its own storage lists it
    aside = open_storage(storage.display(DAMAGED_DIR)).list()
    if not aside:
        return None
    where = storage.display(DAMAGED_DIR)
    local = isinstance(storage, LocalDirectory)
    return {
        "dir": where,
        "files": len(aside),
        "bytes": sum(aside.values()),
        "remove": f"`rm -r {shlex.quote(where)}`"
        if local
        else f"delete the objects under {where}/",
    }


def shard_span(names: Sequence[str]) -> str:
    """``names`` of shards in one short phrase: the name of one, else the count with the first and
    the last (and the indices when they have gaps)."""
    if len(names) == 1:
        return names[0]
    indices = [int(m.group(1)) for n in names if (m := SHARD_RE.match(n))]
    gaps = len(indices) == len(names) and indices[-1] - indices[0] + 1 != len(indices)
    return f"{len(names)} shards, {names[0]} to {names[-1]}" + (
        f" (indices {format_indices(indices)})" if gaps else ""
    )


def _result(
    cache_dir: str, bad: Mapping[int, str], missing: list[int], extra: list[int], producer: str
) -> dict[str, Any]:
    """What :func:`repair_cache` returns, before anything is changed (``producer``:
    :func:`producer_command`)."""
    return {
        "cache_dir": cache_dir,
        "damaged": {shard_name(i): why for i, why in bad.items()},
        "missing": [shard_name(i) for i in missing],
        "extra": [shard_name(i) for i in extra],
        "set_aside_in": None,
        "reopened": False,
        "rebuilt": False,
        "from_arguments": [],
        "notes": [],
        "producer": producer,
        "removed": [],
        "kept_aside": None,
    }


def _apply_rebuild(storage: Storage, rebuilt: Rebuild, damaged: bool) -> dict[str, Any]:
    """Write what :func:`rebuild_manifest` found (the lock is held): the damaged manifest and bad
    shards set aside, then the manifest last -- or, with a shard missing, the producer's run
    record, so the producer command resumes and fills the gap."""
    cache_dir = storage.name
    result = _result(
        cache_dir,
        rebuilt.bad,
        rebuilt.missing,
        rebuilt.extra,
        # a killed producer's follow record names the command that resumes it
        resume_command(storage)
        if storage.get(FOLLOW_NAME)
        else producer_command(cache_dir, rebuilt.params["options"]),
    )
    result["from_arguments"], result["notes"] = rebuilt.from_arguments, rebuilt.notes
    result["rebuilt"] = rebuilt.manifest is not None
    result["reopened"] = rebuilt.manifest is None
    aside = [shard_name(i) for i in [*rebuilt.bad, *rebuilt.extra]] + (
        [MANIFEST_NAME] if damaged else []
    )
    if rebuilt.manifest is None:
        storage.put(PROGRESS_NAME, record_bytes(rebuilt.params))
    result["set_aside_in"] = storage.set_aside(aside, DAMAGED_DIR)
    if rebuilt.manifest is not None:
        # last: the cache is finished
        write_manifest(storage, rebuilt.manifest, rebuilt.params["format_version"])
        storage.delete(PROGRESS_NAME)  # as the producer does once its manifest is written
    storage.flush()
    return result
