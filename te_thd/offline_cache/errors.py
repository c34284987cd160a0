"""Exception types of the offline cache.

Every one is a ``ValueError`` (bad input: a wrong directory, a wrong manifest, a
wrong tensor), so callers written against the reference module, which raised
plain ``ValueError``, keep catching them. Messages name the file or argument,
what is wrong, and what to run to fix it.
"""

from __future__ import annotations


class CacheError(ValueError):
    """Base class of every offline-cache error."""


class ManifestError(CacheError):
    """``manifest.json`` is missing, unreadable, or does not match what the caller expects."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """No ``manifest.json``: the cache was never finished (or the path is wrong).

    Also a ``FileNotFoundError``, which is what the reference module raised.
    """


class CacheIntegrityError(CacheError):
    """A shard is missing, extra, truncated, or its bytes/schema differ from the manifest.

    ``path`` is the offending file (or the cache directory when the problem is the
    set of shards as a whole).
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class SchemaError(CacheError):
    """Tensors handed to the writer do not match the cache's key/dtype/shape schema."""


class CacheLockError(CacheError):
    """Another producer holds the output directory."""
