"""Where a cache lives: a local directory or an object-store URL (``s3://bucket/prefix``).

Every writer and reader of the cache passes its ``cache_dir`` / ``output_dir`` through
:func:`parse_location` once, where it is built: a string with a URL scheme is never
taken for a local path (``"s3://b/x"`` used to become the directory ``s3:/b/x``).
``s3://`` is the one scheme te_thd reads and writes (any S3-compatible store:
:mod:`~te_thd.offline_cache.objectstore`); any other scheme is refused with what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: URL schemes te_thd reads and writes
SUPPORTED_SCHEMES = ("s3",)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class ObjectLocation:
    """``s3://bucket/prefix``: ``prefix`` without leading or trailing slashes (``""``: the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def key(self, name: str) -> str:
        """The object key of file ``name`` of the cache."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return self.url


def parse_location(path: str, name: str = "cache_dir") -> str | ObjectLocation:
    """``path`` itself when it is a local path, else its :class:`ObjectLocation`.

    ``ValueError`` naming the argument for a scheme te_thd does not support, a malformed
    ``s3://`` URL, or a bucket name S3 refuses.
    """
    if not isinstance(path, str):
        path = str(path)
    m = _SCHEME.match(path)
    if m is None or len(m.group(1)) == 1:
        return path
    scheme = m.group(1).lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"{name}={path!r}: URL scheme {scheme!r} is not supported; te_thd caches live in a local "
            f"directory or at s3://bucket/prefix (any S3-compatible store). Pass a local path or an s3:// URL"
        )
    rest = path[len(m.group(0)) :]
    if not rest.startswith("//"):
        raise ValueError(f"{name}={path!r} is not a URL of the form {scheme}://bucket/prefix; write {scheme}://{rest.lstrip('/')}")
    bucket, _, prefix = rest[2:].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(
            f"{name}={path!r}: {bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, dots "
            "and hyphens); write s3://<bucket>/<prefix>"
        )
    return ObjectLocation(scheme, bucket, prefix.strip("/"))
