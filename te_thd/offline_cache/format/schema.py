"""On-disk format of the offline cache: paths, dtypes, schema, shard layout; the errors that name
them.

A cache directory holds::

    manifest.json                 written last; its presence means "finished"
    shard-000000.safetensors      samples [0, shard_size)
    shard-000001.safetensors      samples [shard_size, 2*shard_size)
    ...                           the last shard may be short

Every shard holds the same keys, each a tensor ``[n, *trailing]`` stacked on
dim 0 (``n == shard_size`` except for the last shard: :func:`shard_rows`). Every
shard te_thd writes also carries its own row count and per-row checksums in its
safetensors ``__metadata__`` (:mod:`~te_thd.offline_cache.format.integrity`). Anything
else in the directory (dot-prefixed temp files of a killed writer, the producer
lock, damaged shards set aside by ``te-thd cache repair``, notes a user dropped
there) is ignored by readers. The manifest is described in
:mod:`~te_thd.offline_cache.record.manifest`.

Shard checksum (recorded per shard in the manifest): ``"xxh3_64:<header digest>"``,
the digest each shard's header carries over its tensor entries and per-row
checksums (:func:`~te_thd.offline_cache.format.integrity.shard_checksum`); manifests of
older te_thd versions record ``"crc32:<8 hex>"`` of the whole file instead. The
prefix names the algorithm, so it can change without a format bump.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shlex
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from te_thd.args import check_int, is_int

MANIFEST_NAME = "manifest.json"
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
#: a producer's run record: the parameters of an unfinished run (``write.resume``)
PROGRESS_NAME = ".te_thd-producer.json"
#: what a reader following a running producer reads (``follow.py``): written before its first shard
FOLLOW_NAME = ".te_thd-follow.json"

#: Algorithm of a manifest's checksum of itself and of the lengths side files' (canonical JSON).
CHECKSUM_ALGORITHM = "crc32"
#: ``shard-%06d`` names: SHARD_RE matches exactly six digits.
MAX_SHARDS = 1_000_000


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


_fadvise = getattr(os, "posix_fadvise", None)  # not on macOS


def advise(fd: int, advice: str, offset: int = 0, length: int = 0) -> None:
    """Page-cache advice on ``fd``'s bytes ``[offset, offset + length)`` (``length`` 0: to the end),
    the one place the cache gives it; nothing where the platform has no ``posix_fadvise``.

    ``"willneed"``: start reading those pages now, so scattered reads queue up at the
    storage at once. ``"random"``: no kernel read-ahead, for a file read a few pieces
    here and there (a shard header; a ragged shard), where read-ahead reads what is not needed.
    """
    if _fadvise is not None:
        flag = os.POSIX_FADV_WILLNEED if advice == "willneed" else os.POSIX_FADV_RANDOM
        _fadvise(fd, offset, length, flag)


def canonical_json(obj: Any) -> bytes:
    """``obj`` as canonical JSON (sorted keys, no whitespace, ASCII escapes): a function of the
    parsed content only, so the digests of a manifest or a side file do not depend on formatting."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def json_crc32(obj: Any) -> str:
    """``"crc32:<8 hex>"`` of :func:`canonical_json` of ``obj`` (a manifest's or side file's own
    checksum)."""
    return f"{CHECKSUM_ALGORITHM}:{zlib.crc32(canonical_json(obj)) & 0xFFFFFFFF:08x}"


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


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a ``dtype`` tensor of ``shape``; given a sample's trailing shape, the bytes of one
    row.

    The one formula by which shards are laid out, written and read back (exact: Python ints)."""
    return math.prod(shape) * dtype.itemsize


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
            or not all(is_int(s, 0) for s in obj["shape"])
        ):
            raise ValueError(f"schema entry {obj!r} is not {{'dtype': str, 'shape': [int, ...]}}")
        return cls(dtype_from_name(obj["dtype"]), tuple(obj["shape"]))

    def describe(self) -> str:
        """``"bfloat16[n, 4096]"``: the dtype and the on-disk shape, ``n`` the samples."""
        return f"{dtype_name(self.dtype)}[{', '.join(('n', *map(str, self.shape)))}]"


#: key -> TensorSpec, in the caller's key order.
CacheSchema = dict[str, TensorSpec]


def schema_to_json(schema: Mapping[str, TensorSpec]) -> dict[str, Any]:
    return {k: spec.to_json() for k, spec in schema.items()}


def schema_from_json(obj: Any) -> CacheSchema:
    if not isinstance(obj, dict) or not obj:
        raise ValueError(
            f"schema must be a non-empty object of key -> {{dtype, shape}}, got {obj!r}"
        )
    return {k: TensorSpec.from_json(v) for k, v in obj.items()}


def safe_import_from(
    module: str,
    symbol: str,
    *,
    msg: str | None = None,
    alt: Any = None,
    fallback_module: str | None = None,
) -> tuple[bool, Any]:
    """``(True, module.symbol)``, or ``(False, alt)`` when it cannot be imported.

    ``fallback_module`` is tried when ``module`` fails; ``msg`` is accepted for
    signature compatibility with the reference helper (the caller words its own
    error). Tests of the reference module's consumers patch it on
    ``te_thd.offline_cache`` to simulate a missing dependency, so
    :func:`load_safetensors` looks it up there on every call.
    """
    del msg
    for name in filter(None, (module, fallback_module)):
        try:
            return True, getattr(importlib.import_module(name), symbol)
        except (ImportError, AttributeError):
            continue
    return False, alt


def load_safetensors(cache_name: str):
    """Return ``(save_file, safe_open)`` or raise a clear dependency error (``ImportError``)."""
    import te_thd.offline_cache as package  # the patch point: the package's attribute, per call

    has_save, save_file = package.safe_import_from("safetensors.torch", "save_file")
    has_open, safe_open = package.safe_import_from("safetensors", "safe_open")
    if not (has_save and has_open):
        raise ImportError(
            f"The {cache_name} offline cache requires the 'safetensors' package, which cannot be "
            "imported. Install it with `pip install 'safetensors>=0.4'` and re-run."
        )
    return save_file, safe_open


def shard_path(cache_dir: str, shard_index: int) -> str:
    """Return the path of shard ``shard_index`` inside ``cache_dir``."""
    return os.path.join(cache_dir, shard_name(shard_index))


def shard_name(shard_index: int) -> str:
    """The file (object) name of shard ``shard_index``."""
    if not 0 <= shard_index < MAX_SHARDS:
        raise ValueError(
            f"shard_index={shard_index} is outside [0, {MAX_SHARDS}): shard names have six "
            "digits. Use a larger shard_size so the cache needs fewer shards."
        )
    return f"shard-{shard_index:06d}.safetensors"


def manifest_path(cache_dir: str) -> str:
    """Return the manifest path inside ``cache_dir``."""
    return os.path.join(cache_dir, MANIFEST_NAME)


def shard_layout(num_samples: int, shard_size: int) -> tuple[int, int]:
    """``(number of shards, rows of the last shard)`` of a cache of ``num_samples``.

    The one place shard counts and rows per shard are derived: shard ``i`` holds
    samples ``[i * shard_size, i * shard_size + rows)``, ``rows == shard_size``
    except for the last shard. An empty cache has ``(0, 0)``.
    """
    check_shard_size(shard_size)
    count = -(-num_samples // shard_size)
    return count, num_samples - (count - 1) * shard_size if count else 0


def num_shards(num_samples: int, shard_size: int) -> int:
    """Shards a cache of ``num_samples`` has (:func:`shard_layout`)."""
    return shard_layout(num_samples, shard_size)[0]


def shard_rows(shard_index: int, num_samples: int, shard_size: int) -> int:
    """Samples held by shard ``shard_index`` (:func:`shard_layout`; 0 outside the cache)."""
    count, last = shard_layout(num_samples, shard_size)
    if not 0 <= shard_index < count:
        return 0
    return last if shard_index == count - 1 else shard_size


def check_shard_size(shard_size: Any, name: str = "shard_size") -> int:
    return check_int(name, shard_size, 1, meaning=" (samples per shard); pass e.g. shard_size=256")


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


# -- errors: every one a ValueError (the reference raised plain ValueError, so its callers keep
# catching them); messages name the file or argument, what is wrong, and what to run to fix it --


#: What a Python user re-runs when the caller named no producer command.
PRODUCE_CACHE_HINT = (
    "the `te_thd.offline_cache.produce_cache(...)` call that built it (resume=True, the default, "
    "computes only the missing shards)"
)


def producer_hint(producer: str | None) -> str:
    """``producer`` (a command the caller gave, e.g. its script line) or
    :data:`PRODUCE_CACHE_HINT`."""
    return producer or PRODUCE_CACHE_HINT


def command_record(producer: str | None) -> str | None:
    """How a record (the follow record) stores the command ``producer``, which hints spell in
    backticks: plain, as a shell takes it (anything else, e.g. prose quoting code, as given)."""
    quoted = producer and len(producer) > 2 and producer[0] == producer[-1] == "`"
    return producer[1:-1] if quoted and "`" not in producer[1:-1] else producer


def recorded_command(value: object) -> str | None:
    """The command a record stores, as hints print it: in backticks (``None``: none recorded). A
    value that holds a backtick already is a hint's own spelling (older records stored that)."""
    if not isinstance(value, str) or not value.strip():
        return None
    return value if "`" in value else f"`{value}`"


def cache_command(verb: str, cache_dir: str, *flags: str) -> str:
    """The ``te-thd cache`` command ``verb`` of ``cache_dir`` (quoted for a shell), in backticks as
    messages print it: the one place every hint that names such a command builds it."""
    return f"`{' '.join(('te-thd cache', verb, shlex.quote(cache_dir), *flags))}`"


def repair_hint(cache_dir: str, producer: str | None = None) -> str:
    """The repair instruction of a cache with damaged shards; every command in it runs as
    printed."""
    return f"Repair: {cache_command('repair', cache_dir)}, then re-run {producer_hint(producer)}."


def lost_manifest(
    path: str,
    cache_dir: str,
    cache_name: str,
    shards: int,
    producer: str | None,
    status: str | None = None,
) -> ManifestNotFoundError:
    """The error of a cache with no manifest at ``path``: with ``status`` (what its producer's files
    say: one is writing it, or it stopped and the command that resumes it), that; with ``shards``
    shard files in ``cache_dir``, the command that rebuilds it from them; else what builds the
    cache."""
    lost = f"{cache_name} cache manifest not found at {path}"
    if status:
        return ManifestNotFoundError(f"{lost} ({shards} shard(s) so far): {status}")
    if shards:
        return ManifestNotFoundError(
            f"{lost}, but {cache_dir} holds {shards} shard(s): the manifest was lost, or the "
            "cache was never finished. Rebuild it from the shards: "
            f"{cache_command('repair', cache_dir)} (it verifies every shard; when one is "
            "missing it prints the producer command that computes it)."
        )
    build = producer or "its producer (e.g. `te_thd.offline_cache.produce_cache(...)`)"
    return ManifestNotFoundError(
        f"{lost}, and {cache_dir} holds no shards: the cache was never finished there. "
        f"Build it with {build}, or point cache_dir at a finished cache."
    )


def rebuild_manifest_hint(path: str) -> str:
    """What to do about the damaged manifest at ``path``: restore it, or rebuild it from the
    shards."""
    cache_dir = os.path.dirname(path) or "."
    return (
        f"Restore {os.path.basename(path)} from a copy, or rebuild it from the shards: "
        f"{cache_command('repair', cache_dir)} (it verifies every shard and keeps the "
        "damaged file)."
    )


class CacheError(ValueError):
    """Base class of every offline-cache error."""


class ManifestError(CacheError):
    """``manifest.json`` is missing, unreadable, or does not match what the caller expects."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """No ``manifest.json``: the cache was never finished (or the path is wrong).

    Also a ``FileNotFoundError``, which is what the reference module raised.
    """


class CacheIntegrityError(CacheError):
    """A shard is missing, extra, truncated, or its bytes/schema differ from what was written.

    ``path`` is the offending file (or the cache directory when the problem is the
    set of shards as a whole). A failed row checksum also sets ``sample`` (the
    global sample index), ``key``, ``expected`` and ``actual`` (the checksums).
    """

    def __init__(
        self,
        message: str,
        path: str | None = None,
        *,
        sample: int | None = None,
        key: str | None = None,
        expected: str | None = None,
        actual: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.sample, self.key, self.expected, self.actual = sample, key, expected, actual


def unreadable_shard(
    path: str, why: BaseException, repair: str, by: str = ""
) -> CacheIntegrityError:
    """The error of a shard that could not be read (``by``: e.g. " by safetensors"), naming it, why,
    and the repair."""
    return CacheIntegrityError(f"shard {path} cannot be read{by} ({why}). {repair}", path=path)


class SchemaError(CacheError):
    """Tensors handed to the writer do not match the cache's key/dtype/shape schema."""


class CacheLockError(CacheError):
    """Another producer holds the output directory."""


class UnverifiedCacheWarning(UserWarning):
    """A cache is read without checksums: its shards predate self-verifying shards (or verification
    is off)."""
