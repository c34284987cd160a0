"""On-disk format of the offline cache: paths, manifest, schema.

A cache directory holds::

    manifest.json                 written last; its presence means "finished"
    shard-000000.safetensors      samples [0, shard_size)
    shard-000001.safetensors      samples [shard_size, 2*shard_size)
    ...                           the last shard may be short

Every shard holds the same keys, each a tensor ``[n, *trailing]`` stacked on
dim 0 (``n == shard_size`` except for the last shard). Anything else in the
directory (dot-prefixed temp files of a killed writer, the producer lock,
notes a user dropped there) is ignored by readers.

Manifest (``json``, sorted keys, no timestamps or host names, so two runs that
produced the same shards write byte-identical manifests)::

    {
      "format_version": 3,              # the caller's version of what the tensors mean
      "num_samples": 1000,
      "shard_size": 256,
      "manifest_checksum": "crc32:0badf00d",  # of the manifest itself (below)
      "layout_version": 2,              # te_thd integrity fields below; absent in
      "schema": {                       #   manifests of the reference producer
        "hidden": {"dtype": "bfloat16", "shape": [512, 4096]}   # trailing shape
      },
      "shards": [
        {"file": "shard-000000.safetensors", "bytes": 1073741912,
         "checksum": "crc32:9a1b2c3d"},
        ...
      ],
      "mask_generation_prompt": true,   # producer options, top level (as in the
      ...                               #   reference, so ensure_supervision_options_match
    }                                   #   reads them unchanged)

Checksum: CRC-32 (``zlib.crc32``) of the whole shard file. Measured on the
2-core CI box over a 64 MiB buffer: crc32 3.8 GB/s, sha256 1.8 GB/s (SHA-NI),
adler32 1.9 GB/s, blake2b 0.85 GB/s, md5 0.74 GB/s. The checksum guards against
torn/bit-rotted/truncated files, not against an adversary, so the fastest
stdlib option with good burst-error detection wins; it needs no extra
dependency, and the writer computes it on a second thread while the same
bytes go to disk (see ``shardfile.py``). With the optional ``isal`` package
(ISA-L) installed the same CRC-32 values are computed ~3-4x faster (10 GB/s
measured). The value is stored as ``"crc32:<8 hex>"`` so the algorithm can
change without a format bump.

Manifest checksum: ``manifest_checksum`` is the CRC-32 of the manifest's
*canonical* JSON without that field (:func:`manifest_checksum`: sorted keys, no
whitespace, ASCII), so it is a function of the content, not of the formatting:
two runs with the same shards still write identical bytes, and a reader
re-serialises what it parsed to check it. Without it a flipped byte inside an
option value (``"cp_size": 2`` -> ``3``) or inside a shard's recorded checksum
leaves valid JSON that every reader trusts. :func:`write_manifest` always records
it (also for manifests written through the reference-compatible API); every
te_thd load (:func:`read_manifest`, :func:`load_manifest`, hence readers,
``verify_cache`` and ``te-thd cache``) checks it and reports a mismatch against
``manifest.json``. Manifests without the field still load unchecked -- the
reference producer writes none, nor did te_thd before ``layout_version`` 2 --
except that a manifest declaring ``layout_version >= 2`` (every ``produce_cache``
manifest) must carry it, so a flip that damages the field's own name is caught
too.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from te_thd.offline_cache.durable import atomic_write
from te_thd.offline_cache.errors import CacheIntegrityError, ManifestError, ManifestNotFoundError

MANIFEST_NAME = "manifest.json"
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")

#: Version of the te_thd integrity fields in a manifest. 1: ``schema`` and
#: ``shards``; 2: also ``manifest_checksum``, required from this version on.
LAYOUT_VERSION = 2
CHECKSUM_ALGORITHM = "crc32"
#: The manifest field holding the checksum of the rest of the manifest.
MANIFEST_CHECKSUM_KEY = "manifest_checksum"
#: ``shard-%06d`` names: SHARD_RE matches exactly six digits.
MAX_SHARDS = 1_000_000

#: Manifest keys te_thd writes itself; producer options may not use them.
RESERVED_MANIFEST_KEYS = frozenset(
    {"format_version", "num_samples", "shard_size", "layout_version", "schema", "shards", MANIFEST_CHECKSUM_KEY}
)

# torch dtype <-> safetensors dtype code, in the ascending order of the
# safetensors ``Dtype`` enum (its writer sorts tensors by that order, descending,
# then by name; ``shardfile`` mirrors it to produce byte-identical files).
_DTYPE_TABLE: tuple[tuple[torch.dtype, str], ...] = (
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.int16, "I16"),
    (torch.uint16, "U16"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int32, "I32"),
    (torch.uint32, "U32"),
    (torch.float32, "F32"),
    (torch.complex64, "C64"),
    (torch.float64, "F64"),
    (torch.int64, "I64"),
    (torch.uint64, "U64"),
)
DTYPE_TO_ST: dict[torch.dtype, str] = {d: code for d, code in _DTYPE_TABLE}
ST_TO_DTYPE: dict[str, torch.dtype] = {code: d for d, code in _DTYPE_TABLE}
DTYPE_RANK: dict[torch.dtype, int] = {d: i for i, (d, _) in enumerate(_DTYPE_TABLE)}
_NAME_TO_DTYPE: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d, _ in _DTYPE_TABLE}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ``ValueError`` for a dtype a cache cannot hold."""
    try:
        return _NAME_TO_DTYPE[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not a cache dtype; supported: {sorted(_NAME_TO_DTYPE)}"
        ) from None


@dataclass(frozen=True)
class TensorSpec:
    """dtype and per-sample (trailing) shape of one cache key: ``[n, *shape]`` on disk."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: Any) -> TensorSpec:
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("dtype"), str)
            or not isinstance(obj.get("shape"), list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in obj["shape"])
        ):
            raise ValueError(f"schema entry {obj!r} is not {{'dtype': str, 'shape': [int, ...]}}")
        return cls(dtype_from_name(obj["dtype"]), tuple(obj["shape"]))

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)}[n, {', '.join(map(str, self.shape))}]" if self.shape else f"{dtype_name(self.dtype)}[n]"


#: key -> TensorSpec, in the caller's key order.
CacheSchema = dict[str, TensorSpec]


def schema_to_json(schema: Mapping[str, TensorSpec]) -> dict[str, Any]:
    return {k: spec.to_json() for k, spec in schema.items()}


def schema_from_json(obj: Any) -> CacheSchema:
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"schema must be a non-empty object of key -> {{dtype, shape}}, got {obj!r}")
    return {k: TensorSpec.from_json(v) for k, v in obj.items()}


def load_safetensors(cache_name: str):
    """Return ``(save_file, safe_open)`` or raise a clear dependency error."""
    try:
        from safetensors import safe_open
        from safetensors.torch import save_file
    except ImportError as exc:  # pragma: no cover - safetensors is a hard dependency
        raise ImportError(
            f"The {cache_name} offline cache requires the 'safetensors' package "
            f"({exc}). Install it with `pip install 'safetensors>=0.4'` and re-run."
        ) from exc
    return save_file, safe_open


def shard_path(cache_dir: str, shard_index: int) -> str:
    """Return the path of shard ``shard_index`` inside ``cache_dir``."""
    if not 0 <= shard_index < MAX_SHARDS:
        raise ValueError(
            f"shard_index={shard_index} is outside [0, {MAX_SHARDS}): shard names have six "
            "digits. Use a larger shard_size so the cache needs fewer shards."
        )
    return os.path.join(cache_dir, f"shard-{shard_index:06d}.safetensors")


def manifest_path(cache_dir: str) -> str:
    """Return the manifest path inside ``cache_dir``."""
    return os.path.join(cache_dir, MANIFEST_NAME)


def num_shards(num_samples: int, shard_size: int) -> int:
    """``ceil(num_samples / shard_size)``: shards a cache of that size has."""
    check_shard_size(shard_size)
    return -(-num_samples // shard_size)


def shard_num_samples(shard_index: int, num_samples: int, shard_size: int) -> int:
    """Samples held by shard ``shard_index`` (``shard_size``, or fewer for the last one)."""
    return max(0, min(shard_size, num_samples - shard_index * shard_size))


def check_shard_size(shard_size: Any, name: str = "shard_size") -> int:
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size <= 0:
        raise ValueError(
            f"{name} must be a positive int (samples per shard), got {shard_size!r}. "
            "Pass e.g. shard_size=256."
        )
    return shard_size


def format_indices(indices: Iterable[int], limit: int = 8) -> str:
    """``[0, 1, 2, 5, 9, 10]`` -> ``"0-2, 5, 9-10"`` (at most ``limit`` runs, then ``...``)."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    if len(runs) > limit:
        text.append(f"... ({len(runs) - limit} more runs)")
    return ", ".join(text) if text else "none"


def existing_shard_indices(cache_dir: str) -> set[int]:
    """Return the shard indices already present in ``cache_dir``.

    Only names matching :data:`SHARD_RE` count; temp files, the lock and any
    foreign file are ignored.
    """
    if not os.path.isdir(cache_dir):
        return set()
    return {int(m.group(1)) for name in os.listdir(cache_dir) if (m := SHARD_RE.match(name))}


def validate_contiguous_shards(
    cache_dir: str, cache_name: str, num_samples: int, shard_size: int
) -> list[int]:
    """Return shard indices, requiring exactly ``0..N-1`` for the manifest size.

    Raises :class:`CacheIntegrityError` naming the missing files (gaps) and the
    extra ones (indices ``>= N``, e.g. left over from a larger earlier run).
    """
    expected = num_shards(num_samples, shard_size)
    present = existing_shard_indices(cache_dir)
    missing = sorted(set(range(expected)) - present)
    extra = sorted(i for i in present if i >= expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"missing shard indices {format_indices(missing)} "
                f"(e.g. {os.path.basename(shard_path(cache_dir, missing[0]))})"
            )
        if extra:
            parts.append(
                f"extra shard indices {format_indices(extra)} beyond the declared {expected} "
                f"(e.g. {os.path.basename(shard_path(cache_dir, extra[0]))})"
            )
        first = missing[0] if missing else extra[0]
        raise CacheIntegrityError(
            f"{cache_name} cache at {cache_dir} declares {num_samples} samples in {expected} "
            f"shards of {shard_size}, but has {'; '.join(parts)}. Re-run the producer with "
            "resume=True to fill gaps, and delete shards that do not belong to this cache.",
            path=shard_path(cache_dir, first),
        )
    return list(range(expected))


def _check_count(manifest: Mapping[str, Any], key: str, path: str, minimum: int) -> None:
    if key not in manifest:
        raise ManifestError(
            f"manifest {path} has no {key!r} field, so the cache layout is unknown. "
            "The manifest is damaged or was not written by an offline-cache producer; "
            "rebuild the cache."
        )
    value = manifest[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestError(
            f"manifest {path} has {key}={value!r}; it must be an int >= {minimum}. "
            "The manifest is damaged; rebuild the cache."
        )


def validate_manifest(manifest: Mapping[str, Any], path: str) -> None:
    """Check the fields every reader relies on; ``path`` is only used in messages.

    Required: ``num_samples`` (int >= 0), ``shard_size`` (int >= 1). When the
    te_thd integrity fields are present they must be well formed: ``schema``
    parses, ``shards`` has one ``{file, bytes, checksum}`` entry per shard, in order.
    """
    _check_count(manifest, "num_samples", path, 0)
    _check_count(manifest, "shard_size", path, 1)
    n = num_shards(manifest["num_samples"], manifest["shard_size"])
    if n > MAX_SHARDS:
        raise ManifestError(f"manifest {path} declares {n} shards; at most {MAX_SHARDS} are addressable")
    if "schema" in manifest and not (manifest["schema"] == {} and manifest["num_samples"] == 0):
        try:
            schema_from_json(manifest["schema"])
        except ValueError as exc:
            raise ManifestError(f"manifest {path} has an invalid 'schema': {exc}") from None
    if "shards" in manifest:
        shards = manifest["shards"]
        if not isinstance(shards, list) or len(shards) != n:
            got = len(shards) if isinstance(shards, list) else type(shards).__name__
            raise ManifestError(
                f"manifest {path} lists {got} shard records but num_samples="
                f"{manifest['num_samples']} / shard_size={manifest['shard_size']} means {n}. "
                "The manifest is damaged; rebuild the cache."
            )
        for i, rec in enumerate(shards):
            name = f"shard-{i:06d}.safetensors"
            ok = (
                isinstance(rec, dict)
                and rec.get("file") == name
                and isinstance(rec.get("bytes"), int)
                and not isinstance(rec.get("bytes"), bool)
                and isinstance(rec.get("checksum"), str)
                and ":" in rec["checksum"]
            )
            if not ok:
                raise ManifestError(
                    f"manifest {path}: shard record {i} is {rec!r}, expected "
                    f"{{'file': {name!r}, 'bytes': int, 'checksum': 'crc32:<hex>'}}. "
                    "The manifest is damaged; rebuild the cache."
                )


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"crc32:<8 hex>"`` of ``manifest``'s canonical JSON, without ``manifest_checksum``.

    Canonical: sorted keys, no whitespace, ASCII escapes -- a function of the
    parsed content only, so the writer's indentation, or whitespace a byte flip
    leaves valid, does not matter. ``manifest`` must hold JSON values (what
    ``json.loads`` returns); NaN/inf are rendered (a manifest holding them never
    matches a checksum :func:`write_manifest` recorded, as it refuses them).
    """
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{CHECKSUM_ALGORITHM}:{zlib.crc32(text.encode('ascii')) & 0xFFFFFFFF:08x}"


def write_manifest(cache_dir: str, manifest: dict[str, Any], format_version: int) -> str:
    """Persist an offline-cache manifest atomically.

    Written as ``{"format_version": format_version, **manifest}`` plus its
    ``manifest_checksum`` (recomputed here; a value in ``manifest``, e.g. from
    a manifest read and edited, is replaced), with sorted keys and no volatile
    fields, through :func:`atomic_write` (temp file, fsync, rename, fsync of the
    directory). A producer writes it after every shard is on disk: its presence
    is what marks a cache finished.
    """
    path = manifest_path(cache_dir)
    if "format_version" in manifest and manifest["format_version"] != format_version:
        raise ManifestError(
            f"write_manifest: manifest['format_version']={manifest['format_version']!r} "
            f"contradicts format_version={format_version!r}; pass one value."
        )
    full = {"format_version": format_version, **manifest}
    full.pop(MANIFEST_CHECKSUM_KEY, None)
    validate_manifest(full, path)
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
    data = (json.dumps(parsed, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def _write(tmp_path: str) -> None:
        with open(tmp_path, "wb") as f:
            f.write(data)

    return atomic_write(path, _write)


def _producer(cache_name: str, producer_name: str | None) -> str:
    return producer_name or f"precompute_{cache_name.lower().replace('-', '')}"


def _read_checked_manifest(cache_dir: str, cache_name: str, producer: str) -> dict[str, Any]:
    """Parse ``manifest.json`` and check its own checksum; returns it without that field.

    Nothing else is validated: the caller checks ``format_version`` first (the
    more useful message when a cache is merely old), then the layout.
    """
    path = manifest_path(cache_dir)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        where = "" if os.path.isdir(cache_dir) else f" (the directory {cache_dir} does not exist)"
        raise ManifestNotFoundError(
            f"{cache_name} cache manifest not found at {path}{where}. A producer writes it last, "
            f"so the cache was never finished: re-run {producer} with resume=True, or point "
            "cache_dir at a finished cache."
        ) from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(
            f"{cache_name} cache manifest {path} is not valid JSON ({exc}). It was not written by "
            f"an offline-cache producer or was damaged; rebuild the cache with {producer}."
        ) from None
    if not isinstance(manifest, dict):
        raise ManifestError(
            f"{cache_name} cache manifest {path} holds a JSON {type(manifest).__name__}, not an "
            f"object; rebuild the cache with {producer}."
        )
    _check_manifest_checksum(manifest, path, cache_name, producer)
    manifest.pop(MANIFEST_CHECKSUM_KEY, None)
    if "format_version" not in manifest:
        raise ManifestError(
            f"{cache_name} cache manifest {path} has no 'format_version' field: it is damaged, or it "
            "is not an offline-cache manifest (te_thd and the reference producer both write one). "
            f"Restore it from a copy, or rebuild the cache with {producer}."
        )
    return manifest


def _check_manifest_checksum(manifest: Mapping[str, Any], path: str, cache_name: str, producer: str) -> None:
    damaged = (
        "so none of its fields can be trusted. Restore manifest.json from a copy, or delete the "
        f"cache and rebuild it with {producer}. (After a deliberate edit, rewrite it with "
        "te_thd.offline_cache.write_manifest, which records a new checksum.)"
    )
    if MANIFEST_CHECKSUM_KEY not in manifest:
        layout = manifest.get("layout_version")
        if isinstance(layout, int) and not isinstance(layout, bool) and layout >= 2:
            raise ManifestError(
                f"{cache_name} cache manifest {path} declares layout_version={layout} but has no "
                f"{MANIFEST_CHECKSUM_KEY!r} field, which that layout always records: the file was "
                f"damaged after it was written, {damaged}"
            )
        return  # a reference-format (or layout 1) manifest: nothing to check
    recorded = manifest[MANIFEST_CHECKSUM_KEY]
    if not isinstance(recorded, str) or recorded.split(":", 1)[0] != CHECKSUM_ALGORITHM:
        raise ManifestError(
            f"{cache_name} cache manifest {path} has {MANIFEST_CHECKSUM_KEY}={recorded!r}, not "
            f"'{CHECKSUM_ALGORITHM}:<8 hex digits>': the file was damaged after it was written, {damaged}"
        )
    actual = manifest_checksum(manifest)
    if actual != recorded:
        raise ManifestError(
            f"{cache_name} cache manifest {path} does not match its own checksum (it records "
            f"{recorded}, its content hashes to {actual}): the file was damaged or edited after "
            f"it was written, {damaged}"
        )


def load_manifest(
    cache_dir: str, cache_name: str = "offline", producer_name: str | None = None
) -> dict[str, Any]:
    """Read and validate ``manifest.json`` without checking ``format_version``'s value.

    For tools that inspect any cache (``te-thd cache info``, ``verify_cache``);
    readers use :func:`read_manifest`, which also pins the version. Checks the
    manifest's own checksum when it records one (see the module docstring) and
    returns the manifest without that field.
    """
    manifest = _read_checked_manifest(cache_dir, cache_name, _producer(cache_name, producer_name))
    validate_manifest(manifest, manifest_path(cache_dir))
    return manifest


def read_manifest(
    cache_dir: str,
    cache_name: str,
    format_version: int,
    producer_name: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load and validate an offline-cache manifest.

    ``defaults`` holds fields added after the format was first released, with
    the value a producer that predates them effectively used; a manifest that
    lacks such a field is read as if it recorded that default, so older caches
    keep comparing and training under the configuration they were built with.

    Raises :class:`ManifestNotFoundError` (also a ``FileNotFoundError``) when the
    manifest is absent, and :class:`ManifestError` naming ``manifest.json`` when
    it is not JSON, not an object, fails its own ``manifest_checksum`` (damaged),
    has no or another ``format_version``, or lacks ``num_samples``/``shard_size``.
    The returned dict does not contain ``manifest_checksum`` (it describes the
    file, not the cache; :func:`write_manifest` recomputes it).
    """
    path = manifest_path(cache_dir)
    producer = _producer(cache_name, producer_name)
    manifest = _read_checked_manifest(cache_dir, cache_name, producer)
    version = manifest["format_version"]
    # Checked before the layout: a wrong version is the more useful message when both are wrong.
    if isinstance(version, bool) or version != format_version:
        raise ManifestError(
            f"{cache_name} cache manifest {path} has format_version={version!r}, expected "
            f"{format_version}. Regenerate the cache with the current {producer}."
        )
    validate_manifest(manifest, path)
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


def shard_records(manifest: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The per-shard ``{file, bytes, checksum}`` records, or ``None`` for a manifest without them."""
    recs = manifest.get("shards")
    return list(recs) if isinstance(recs, list) else None


def manifest_schema(manifest: Mapping[str, Any]) -> CacheSchema | None:
    """The manifest's key schema, or ``None`` for a manifest without one."""
    return schema_from_json(manifest["schema"]) if "schema" in manifest else None


def check_integrity_entry(path: str, expected_bytes: int) -> None:
    """Raise :class:`CacheIntegrityError` unless ``path`` exists with ``expected_bytes`` bytes."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CacheIntegrityError(
            f"shard {path} is missing (the manifest lists it). Restore it, or rebuild the cache.",
            path=path,
        ) from None
    if size != expected_bytes:
        raise CacheIntegrityError(
            f"shard {path} has {size} bytes, the manifest records {expected_bytes}: the file was "
            "truncated or replaced. Restore it, or rebuild the cache.",
            path=path,
        )
