"""Exception types of the offline cache.

Every one is a ``ValueError`` (bad input: a wrong directory, a wrong manifest, a
wrong tensor), so callers written against the reference module, which raised
plain ``ValueError``, keep catching them. Messages name the file or argument,
what is wrong, and what to run to fix it.
"""

from __future__ import annotations

import os
import shlex

#: What a Python user re-runs when the caller named no producer command.
PRODUCE_CACHE_HINT = (
    "the `te_thd.offline_cache.produce_cache(...)` call that built it (resume=True, the default, "
    "computes only the missing shards)"
)


def producer_hint(producer: str | None) -> str:
    """``producer`` (a command the caller gave, e.g. its script line) or :data:`PRODUCE_CACHE_HINT`."""
    return producer or PRODUCE_CACHE_HINT


def cache_command(verb: str, cache_dir: str, *flags: str) -> str:
    """The ``te-thd cache`` command ``verb`` of ``cache_dir`` (quoted for a shell), in backticks as
    messages print it: the one place every hint that names such a command builds it."""
    return f"`{' '.join(('te-thd cache', verb, shlex.quote(cache_dir), *flags))}`"


def repair_hint(cache_dir: str, producer: str | None = None) -> str:
    """The repair instruction of a cache with damaged shards; every command in it runs as printed."""
    return (
        f"Repair: {cache_command('repair', cache_dir)} (sets the damaged shards aside and "
        f"reopens the cache for a resume), then re-run {producer_hint(producer)}."
    )


def lost_manifest(path: str, cache_dir: str, cache_name: str, shards: int, producer: str | None) -> ManifestNotFoundError:
    """The error of a cache with no manifest at ``path``: with ``shards`` shard files in ``cache_dir``,
    the command that rebuilds it from them; else what builds the cache."""
    if shards:
        return ManifestNotFoundError(
            f"{cache_name} cache manifest not found at {path}, but {cache_dir} holds {shards} shard(s): the manifest "
            "was lost, or the cache was never finished. Rebuild it from the shards: "
            f"{cache_command('repair', cache_dir)} (it verifies every shard; when one is missing it prints the producer command "
            "that computes it)."
        )
    build = producer or "its producer (e.g. `te_thd.offline_cache.produce_cache(...)`)"
    return ManifestNotFoundError(
        f"{cache_name} cache manifest not found at {path}, and {cache_dir} holds no shards: the cache was never "
        f"finished there. Build it with {build}, or point cache_dir at a finished cache."
    )


def rebuild_manifest_hint(path: str) -> str:
    """What to do about the damaged manifest at ``path``: restore it, or rebuild it from the shards."""
    cache_dir = os.path.dirname(path) or "."
    return (
        f"Restore {os.path.basename(path)} from a copy, or rebuild it from the shards: "
        f"{cache_command('repair', cache_dir)} (it verifies every shard and keeps the damaged file)."
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


def unreadable_shard(path: str, why: BaseException, repair: str, by: str = "") -> CacheIntegrityError:
    """The error of a shard that could not be read (``by``: e.g. " by safetensors"), naming it, why, and the repair."""
    return CacheIntegrityError(f"shard {path} cannot be read{by} ({why}). {repair}", path=path)


class SchemaError(CacheError):
    """Tensors handed to the writer do not match the cache's key/dtype/shape schema."""


class CacheLockError(CacheError):
    """Another producer holds the output directory."""


class UnverifiedCacheWarning(UserWarning):
    """A cache is read without checksums: its shards predate self-verifying shards (or verification is off)."""
