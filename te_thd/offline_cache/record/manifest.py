"""The cache manifest: ``manifest.json`` written last, read and validated by every reader.

Its fields, its own checksum and the layout versions are specified in docs/integrity.md
("The manifest"). It is written as sorted-key JSON with no timestamps or host names, so two
runs that produced the same shards write byte-identical manifests; ``manifest_checksum`` is
the CRC-32 of its canonical JSON without that field (:func:`manifest_checksum`), a function
of the content, not of the formatting, so a reader re-serialises what it parsed to check it.
Every te_thd load checks it; a manifest declaring ``layout_version >= 2`` must carry it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Callable, Mapping
from typing import Any

from te_thd._checkout import checkout_file
from te_thd.args import check_int, is_int
from te_thd.offline_cache.format.integrity import read_shard_header, schema_of_header
from te_thd.offline_cache.format.lengths import LENGTH_RULE_KEY, LengthRule, check_lengths_record
from te_thd.offline_cache.format.ragged import (
    TOKEN_LAYOUT_KEY,
    TokenLayout,
)
from te_thd.offline_cache.format.schema import (
    CHECKSUM_ALGORITHM,
    FOLLOW_NAME,
    MANIFEST_NAME,
    MAX_SHARDS,
    PROGRESS_NAME,
    SHARD_RE,
    CacheIntegrityError,
    CacheSchema,
    ManifestError,
    ManifestNotFoundError,
    cache_command,
    json_crc32,
    lost_manifest,
    manifest_path,
    num_shards,
    producer_hint,
    rebuild_manifest_hint,
    recorded_command,
    schema_from_json,
    shard_name,
    shard_rows,
)
from te_thd.offline_cache.storage.base import LOCK_NAME, TEMP_RE, Storage, json_object
from te_thd.offline_cache.storage.schemes import as_storage

#: The manifest field holding the checksum of the rest of the manifest.
MANIFEST_CHECKSUM_KEY = "manifest_checksum"
#: Manifest keys te_thd writes itself; producer options may not use them.
RESERVED_MANIFEST_KEYS = frozenset(
    {
        "format_version",
        "num_samples",
        "shard_size",
        "layout_version",
        "schema",
        "shards",
        LENGTH_RULE_KEY,
        TOKEN_LAYOUT_KEY,
        MANIFEST_CHECKSUM_KEY,
    }
)


#: the tag on a ragged cache's recorded ``format_version``: ``"1+tokens"``
FORMAT_TAG = "+tokens"
_TAGGED = re.compile(rf"^(\d+){re.escape(FORMAT_TAG)}$")


def existing_shard_indices(cache_dir: str | Storage) -> set[int]:
    """Return the shard indices present in ``cache_dir`` (a path, a URL or its opened storage).

    Only names matching :data:`SHARD_RE` count; temp files, the lock and any
    foreign file are ignored.
    """
    return listed_shards(as_storage(cache_dir).list())


def listed_shards(listing: Mapping[str, int]) -> set[int]:
    """The shard indices in one listing of a cache (``Storage.list``)."""
    return {int(m.group(1)) for name in listing if (m := SHARD_RE.match(name))}


def check_format_version_arg(value: Any) -> None:
    """Refuse a reader's ``format_version`` argument that is not an int, saying what to pass: a
    digit string or the manifest's tagged spelling (``"1+tokens"``) never equals the recorded
    int."""
    version, tagged = parse_format_version(value)
    if tagged:
        raise ValueError(
            f"format_version={value!r} is how manifest.json records version {version} of a cache "
            f"with ragged token keys: pass format_version={version}"
        )
    if isinstance(value, str) and value.strip().isdigit():
        raise ValueError(
            f"format_version={value!r} is a str, but the version is an int (the types differ, so "
            f"it never matches): pass format_version={int(value)}"
        )
    check_int(
        "format_version",
        value,
        numpy_ints=True,
        meaning=": the version of what the cached tensors mean, e.g. 1",
    )


def parse_format_version(value: Any) -> tuple[Any, bool]:
    """``(version, tagged)`` of a manifest's recorded ``format_version``."""
    if isinstance(value, str):
        m = _TAGGED.match(value)
        if m:
            return int(m.group(1)), True
    return value, False


def _damaged(path: str, what: str) -> ManifestError:
    """The error of the manifest at ``path`` whose content is damaged: ``manifest <path>`` and
    ``what``, then the fix."""
    return ManifestError(
        f"manifest {path}{what}. The manifest is damaged. {rebuild_manifest_hint(path)}"
    )


def _parsed(manifest: Mapping[str, Any], key: str, parse: Callable[[Any], Any], path: str) -> Any:
    """``parse(manifest[key])``, its ``ValueError`` a :class:`ManifestError` naming the field."""
    try:
        return parse(manifest[key])
    except ValueError as exc:
        raise ManifestError(f"manifest {path} has an invalid {key!r}: {exc}") from None


def validate_manifest(manifest: Mapping[str, Any], path: str, producer: str | None = None) -> None:
    """Check the fields every reader relies on; ``path`` is only used in messages.

    Required: ``num_samples`` (int >= 0), ``shard_size`` (int >= 1). When the
    te_thd integrity fields are present they must be well formed: ``schema``
    parses, ``shards`` has one ``{file, bytes, checksum}`` entry per shard, in order.
    ``producer`` is the command that rebuilds the cache (named in messages).
    """
    for key, minimum in (("num_samples", 0), ("shard_size", 1)):
        if key not in manifest:
            raise ManifestError(
                f"manifest {path} has no {key!r} field, so the cache layout is unknown. "
                "The manifest is damaged or was not written by an offline-cache producer. "
                + rebuild_manifest_hint(path)
            )
        if not is_int(manifest[key], minimum):
            raise _damaged(path, f" has {key}={manifest[key]!r}; it must be an int >= {minimum}")
    num_samples, shard_size = manifest["num_samples"], manifest["shard_size"]
    n = num_shards(num_samples, shard_size)
    if n > MAX_SHARDS:
        raise ManifestError(
            f"manifest {path} declares {n} shards; at most {MAX_SHARDS} are addressable"
        )
    if "schema" in manifest and not (manifest["schema"] == {} and num_samples == 0):
        _parsed(manifest, "schema", schema_from_json, path)
    if "shards" in manifest:
        shards = manifest["shards"]
        if not isinstance(shards, list) or len(shards) != n:
            got = len(shards) if isinstance(shards, list) else type(shards).__name__
            raise _damaged(
                path,
                f" lists {got} shard records but num_samples={num_samples} / shard_size="
                f"{shard_size} means {n}",
            )
        for i, rec in enumerate(shards):
            name = shard_name(i)
            ok = (
                isinstance(rec, dict)
                and rec.get("file") == name
                and is_int(rec.get("bytes"), 0)
                and isinstance(rec.get("checksum"), str)
                and ":" in rec["checksum"]
            )
            if not ok:
                raise _damaged(
                    path,
                    f": shard record {i} is {rec!r}, expected {{'file': {name!r}, 'bytes': int, "
                    "'checksum': '<algorithm>:<hex>'}",
                )
            bad = check_lengths_record(rec, shard_rows(i, num_samples, shard_size))
            if bad is not None:
                raise _damaged(path, f": shard record {i}: {bad}")
    if LENGTH_RULE_KEY in manifest:
        _parsed(manifest, LENGTH_RULE_KEY, LengthRule.from_json, path)
    if TOKEN_LAYOUT_KEY in manifest:
        layout = _parsed(manifest, TOKEN_LAYOUT_KEY, TokenLayout.from_json, path)
        schema = manifest.get("schema") or {}
        if LENGTH_RULE_KEY not in manifest or not set(layout.keys) <= set(schema):
            raise _damaged(
                path,
                f": {TOKEN_LAYOUT_KEY!r} needs a 'length_rule' and its keys {list(layout.keys)} "
                "in the 'schema'",
            )


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"crc32:<8 hex>"`` of ``manifest``'s canonical JSON, without ``manifest_checksum``.

    Canonical: sorted keys, no whitespace, ASCII escapes -- a function of the
    parsed content only, so the writer's indentation, or whitespace a byte flip
    leaves valid, does not matter. ``manifest`` must hold JSON values (what
    ``json.loads`` returns); NaN/inf are rendered (a manifest holding them never
    matches a checksum :func:`write_manifest` recorded, as it refuses them).
    """
    return json_crc32({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM_KEY})


def write_manifest(cache_dir: str | Storage, manifest: dict[str, Any], format_version: int) -> str:
    """Persist an offline-cache manifest atomically.

    Written as ``{"format_version": format_version, **manifest}`` plus its
    ``manifest_checksum`` (recomputed here; a value in ``manifest``, e.g. from
    a manifest read and edited, is replaced), with sorted keys and no volatile
    fields, through :func:`~te_thd.offline_cache.storage.base.atomic_write` (temp file, fsync,
    rename, fsync of the directory). A producer writes it after every shard is on disk: its presence
    is what marks a cache finished.
    """
    storage = as_storage(cache_dir)
    return storage.put(MANIFEST_NAME, manifest_bytes(storage.name, manifest, format_version))


def manifest_bytes(cache_dir: str, manifest: dict[str, Any], format_version: int) -> bytes:
    """The bytes :func:`write_manifest` writes for ``manifest`` (``cache_dir``: named in errors)."""
    path = manifest_path(cache_dir)
    if "format_version" in manifest and manifest["format_version"] != format_version:
        raise ManifestError(
            f"write_manifest: manifest['format_version']={manifest['format_version']!r} "
            f"contradicts format_version={format_version!r}; pass one value."
        )
    full = {"format_version": format_version, **manifest}
    full.pop(MANIFEST_CHECKSUM_KEY, None)
    validate_manifest(full, path)
    # a ragged cache records "<version>+tokens": readers that do not know the layout refuse it
    if TOKEN_LAYOUT_KEY in full:
        full["format_version"] = f"{format_version}{FORMAT_TAG}"
    try:
        # The checksum is taken over what a reader will parse (tuples become
        # lists, int dict keys strings), so write the JSON round trip.
        parsed = json.loads(json.dumps(full, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ManifestError(
            f"write_manifest: the manifest for {cache_dir} is not JSON-serialisable ({exc}). "
            "Producer options must be JSON values (bool, int, float, str, list, dict)."
        ) from None
    parsed[MANIFEST_CHECKSUM_KEY] = manifest_checksum(parsed)
    return (json.dumps(parsed, indent=2, sort_keys=True) + "\n").encode("utf-8")


def fetch_manifest(storage: Storage) -> bytes | None:
    """The bytes of the cache's ``manifest.json`` (one request of an object store); None: none."""
    storage.must_exist(MANIFEST_NAME)
    return storage.get(MANIFEST_NAME)


def check_manifest(
    storage: Storage,
    raw: bytes | None,
    cache_name: str,
    version: int | None,
    producer: str | None = None,
) -> dict[str, Any]:
    """:func:`read_manifest` of ``raw``, what :func:`fetch_manifest` read from ``storage``
    (``version`` None: any ``format_version``, as :func:`load_manifest`).

    Parsed, then checked against its own checksum, then its ``format_version`` (the more useful
    message when a cache is merely old), then its layout (:func:`validate_manifest`). A directory
    with nothing a producer writes is not a cache.
    """
    path = manifest_path(storage.name)
    if raw is None:
        names = storage.list()
        if not any(
            SHARD_RE.match(n) or TEMP_RE.match(n) or (n.startswith(".te_thd-") and n != LOCK_NAME)
            for n in names
        ):
            raise ManifestNotFoundError(
                f"{cache_name} cache manifest not found: cache_dir={storage.name!r} holds no "
                "manifest.json and no shards: it is not a te_thd cache; check the path"
            )
        raise lost_manifest(
            path,
            storage.name,
            cache_name,
            sum(1 for n in names if SHARD_RE.match(n)),
            producer,
            producer_status(storage, producer),
        )
    if not raw.strip():  # json's "Expecting value: line 1 column 1" says nothing of the cause
        raise ManifestError(
            f"{cache_name} cache manifest {path} is empty ({len(raw)} bytes): it was cut off "
            "after it was written (a full disk, a copy that stopped). "
            + rebuild_manifest_hint(path)
        )
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(
            f"{cache_name} cache manifest {path} is not valid JSON ({exc}). It was not written by "
            f"an offline-cache producer or was damaged. {rebuild_manifest_hint(path)}"
        ) from None
    if not isinstance(manifest, dict):
        raise ManifestError(
            f"{cache_name} cache manifest {path} holds a JSON {type(manifest).__name__}, not an "
            f"object. {rebuild_manifest_hint(path)}"
        )
    _check_manifest_checksum(manifest, path, cache_name)
    manifest.pop(MANIFEST_CHECKSUM_KEY, None)
    if "format_version" not in manifest:
        raise ManifestError(
            f"{cache_name} cache manifest {path} has no 'format_version' field: it is damaged, "
            "or it is not an offline-cache manifest (te_thd and the reference producer both "
            "write one). " + rebuild_manifest_hint(path)
        )
    recorded, tagged = parse_format_version(manifest["format_version"])
    if tagged != (TOKEN_LAYOUT_KEY in manifest):
        raise ManifestError(
            f"{cache_name} cache manifest {path} has format_version={manifest['format_version']!r} "
            f"{'without' if tagged else 'with'} a {TOKEN_LAYOUT_KEY!r} field; a ragged cache "
            f"records both. The manifest is damaged. {rebuild_manifest_hint(path)}"
        )
    manifest["format_version"] = recorded  # the caller's version; the layout is in token_layout
    # Checked before the layout: a wrong version is the more useful message when both are wrong.
    if version is not None and (isinstance(recorded, bool) or recorded != version):
        raise ManifestError(
            f"{cache_name} cache manifest {path} has format_version={recorded!r}, expected "
            f"{version}: its tensors mean something else. Point cache_dir at a cache built "
            f"for format_version {version}, or build one into a new directory with "
            f"{producer or f'produce_cache(..., format_version={version})'}."
        )
    validate_manifest(manifest, path, producer)
    return manifest


def _check_manifest_checksum(manifest: Mapping[str, Any], path: str, cache_name: str) -> None:
    recorded, layout = manifest.get(MANIFEST_CHECKSUM_KEY), manifest.get("layout_version")
    if MANIFEST_CHECKSUM_KEY not in manifest:
        if not is_int(layout, 2):
            return  # a reference-format (or layout 1) manifest: nothing to check
        problem = (
            f"declares layout_version={layout} but has no {MANIFEST_CHECKSUM_KEY!r} field, which "
            "that layout always records: the file was damaged"
        )
    elif not isinstance(recorded, str) or recorded.split(":", 1)[0] != CHECKSUM_ALGORITHM:
        problem = (
            f"has {MANIFEST_CHECKSUM_KEY}={recorded!r}, not '{CHECKSUM_ALGORITHM}:<8 hex digits>': "
            "the file was damaged"
        )
    elif (actual := manifest_checksum(manifest)) != recorded:
        problem = (
            f"does not match its own checksum (it records {recorded}, its content hashes to "
            f"{actual}): the file was damaged or edited"
        )
    else:
        return
    raise ManifestError(
        f"{cache_name} cache manifest {path} {problem} after it was written, so none of its fields "
        f"can be trusted. {rebuild_manifest_hint(path)} (After a deliberate edit, rewrite it with "
        "`te_thd.offline_cache.write_manifest(cache_dir, manifest, format_version)`, which records "
        "a new checksum.)"
    )


def load_manifest(
    cache_dir: str | Storage, cache_name: str = "offline", producer_name: str | None = None
) -> dict[str, Any]:
    """Read and validate ``manifest.json`` without checking ``format_version``'s value.

    For tools that inspect any cache (``te-thd cache info``, ``verify_cache``);
    readers use :func:`read_manifest`, which also pins the version. Checks the
    manifest's own checksum when it records one (see the module docstring) and
    returns the manifest without that field.
    """
    storage = as_storage(cache_dir)
    return check_manifest(storage, fetch_manifest(storage), cache_name, None, producer_name)


def read_manifest(
    cache_dir: str,
    cache_name: str,
    format_version: int,
    producer_name: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load and validate an offline-cache manifest (``cache_dir``: also its opened ``Storage``).

    ``defaults`` holds fields added after the format was first released, with
    the value a producer that predates them effectively used; a manifest that
    lacks such a field is read as if it recorded that default, so older caches
    keep comparing and training under the configuration they were built with.

    Raises ``ValueError`` when ``format_version`` is not an int, :class:`ManifestNotFoundError`
    (also a ``FileNotFoundError``) when the manifest is absent, and :class:`ManifestError` naming
    ``manifest.json`` when it is not JSON, not an object, fails its own ``manifest_checksum``
    (damaged), has no or another ``format_version``, or lacks ``num_samples``/``shard_size``. The
    returned dict does not contain ``manifest_checksum`` (it describes the file, not the cache;
    :func:`write_manifest` recomputes it).
    """
    check_format_version_arg(format_version)  # before any request: the caller's mistake first
    storage = as_storage(cache_dir)
    manifest = check_manifest(
        storage, fetch_manifest(storage), cache_name, format_version, producer_name
    )
    return {**(defaults or {}), **manifest}


def _same_option(recorded: Any, expected: Any) -> bool:
    # The reference compared bool(); that makes cp_size=2 and cp_size=4 "equal".
    # Bools keep the reference's truthiness comparison, anything else compares by value.
    if isinstance(expected, bool):
        return bool(recorded) == expected
    return type(recorded) is not bool and recorded == expected


def ensure_supervision_options_match(
    manifest: dict[str, Any],
    expected: dict[str, bool],
    cache_name: str,
    cache_dir: str,
    producer_name: str,
) -> None:
    """Reject a cache whose stored supervision was shaped by different options than the run's.

    The cached trainers stream the precomputed ``loss_mask``/``position_mask`` as
    stored, so dataset options such as ``mask_generation_prompt`` only take effect
    through the producer. ``expected`` maps each such option to the recipe's value.
    A manifest that does not record an option (a cache older than the option, or
    than its manifest field) cannot be verified and is rejected too, unless
    ``read_manifest`` filled the field in from its defaults.

    Boolean options compare by truthiness (as the reference did); other values
    (e.g. ``cp_size`` a packed cache was padded for) compare by equality.
    """
    missing = [k for k in expected if k not in manifest]
    if missing:
        raise ManifestError(
            f"{cache_name} cache at {cache_dir} does not record {', '.join(missing)}, so the "
            "options its supervision was built with cannot be verified. Rebuild the cache with "
            f"the current {producer_name}, or pass defaults={{{missing[0]!r}: <value the old "
            "producer used>}} to read_manifest if you know it."
        )
    mismatched = [k for k, v in expected.items() if not _same_option(manifest[k], v)]
    if mismatched:
        recorded = ", ".join(f"{k}={manifest[k]!r}" for k in mismatched)
        configured = ", ".join(f"{k}={expected[k]!r}" for k in mismatched)
        raise ManifestError(
            f"{cache_name} cache at {cache_dir} was built with {recorded}, but the run sets "
            f"{configured}. The cached tensors are used as stored, so rebuild the cache with "
            f"{producer_name} under the run's settings or match them in the run."
        )


#: Producer options that say how to run the producer again: ``producer`` (a script path) and
#: ``producer_args`` (its arguments, :data:`CACHE_DIR_ARG` standing for the output directory).
PRODUCER_KEY, PRODUCER_ARGS_KEY, CACHE_DIR_ARG = "producer", "producer_args", "{cache_dir}"


def producer_command(
    cache_dir: str, manifest: Mapping[str, Any], producer: str | None = None
) -> str:
    """What re-runs the producer of ``manifest``'s cache into ``cache_dir``, as every hint names it:
    ``producer`` (the caller's); else the command the cache records in its ``producer`` and
    ``producer_args`` options (the example's does), in backticks, run by this interpreter
    (``sys.executable``: the one with torch and te_thd), or ``"<producer> with the arguments that
    built it"`` when only the script is recorded; else the ``produce_cache`` call
    (``producer_hint``). The script is named by its absolute path when found
    (:func:`checkout_file`), so the command runs from any directory."""
    recorded, args = manifest.get(PRODUCER_KEY), manifest.get(PRODUCER_ARGS_KEY)
    if producer or not isinstance(recorded, str):
        return producer_hint(producer)
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        return f"{recorded} (the producer this cache records) with the arguments that built it"
    args = [cache_dir if a == CACHE_DIR_ARG else a for a in args]
    return f"`{shlex.join([sys.executable, checkout_file(recorded), *args])}`"


def resume_command(storage: Storage, producer: str | None = None) -> str:
    """What resumes the unfinished producer run of the cache in ``storage``, as hints print it:
    ``producer`` (the caller's), else the command the follow record stores, else the one the run's
    options record (:func:`producer_command`), else the ``produce_cache`` call."""
    if producer:
        return producer
    command = recorded_command(json_object(storage.get(FOLLOW_NAME)).get("producer_command"))
    if command is not None:
        return command
    options = json_object(storage.get(PROGRESS_NAME)).get("options")
    return producer_command(storage.name, options if isinstance(options, dict) else {})


def producer_status(storage: Storage, producer: str | None = None) -> str | None:
    """What the producer files of a cache without a manifest say, or ``None`` (no producer left
    any): a producer writing it (host, pid), or one that stopped and the command that resumes it."""
    holder = storage.lock_holder()
    if holder is None and not storage.get(FOLLOW_NAME) and not storage.get(PROGRESS_NAME):
        return None
    who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}" if holder else ""
    if holder is not None and holder["alive"]:
        return (
            f"a producer is writing it ({who}) and writes the manifest last. Wait for it to "
            "finish, or read the cache as it is written (follow=True)."
        )
    resume = resume_command(storage, producer)
    if holder is None:  # released: the producer raised, or repair reopened the cache
        return (
            "its producer run is unfinished (stopped by an error, or reopened by te-thd cache "
            f"repair); resume with: {resume}"
        )
    if holder["alive"] is None:  # another host's object-store lock
        return (
            f"a producer on {who} holds its lock: it is writing the cache, or was killed there "
            f"(then run {cache_command('unlock', storage.name)}). Resume a stopped producer "
            f"with: {resume}"
        )
    return (
        f"its producer stopped before it finished ({who} no longer holds its lock); resume "
        f"with: {resume}"
    )


def shard_records(manifest: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The per-shard ``{file, bytes, checksum}`` records, or ``None`` for a manifest without
    them."""
    recs = manifest.get("shards")
    return list(recs) if isinstance(recs, list) else None


def manifest_schema(manifest: Mapping[str, Any]) -> CacheSchema | None:
    """The manifest's key schema (``{}`` for an empty cache), or ``None`` for a manifest without
    one."""
    if "schema" not in manifest:
        return None
    return {} if manifest["schema"] == {} else schema_from_json(manifest["schema"])


def cache_schema(
    storage: Storage, manifest: Mapping[str, Any], *, strict: bool = False
) -> CacheSchema | None:
    """The cache's key schema: the manifest's, else (a reference manifest records none) shard 0's.

    ``{}`` for an empty cache. Without a manifest schema and with shard 0 missing or its header
    damaged: ``None`` (the caller's own checks report that shard), or with ``strict`` the
    :class:`CacheIntegrityError` naming it.
    """
    schema = manifest_schema(manifest)
    if schema is not None:
        return schema
    if not int(manifest.get("num_samples", 0)):
        return {}
    try:
        return schema_of_header(read_shard_header(storage.header(shard_name(0))))
    except (CacheIntegrityError, FileNotFoundError, KeyError):  # KeyError: no such object
        if strict:
            raise
        return None
