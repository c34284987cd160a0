"""Which :class:`~te_thd.offline_cache.storage.base.Storage` a path or URL opens: a local
directory, or by :data:`SCHEMES` the object store its URL's scheme names (``s3://``, ``msc://``),
imported only when a URL asks for it.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

from te_thd.args import check_path
from te_thd.offline_cache.storage.base import LocalDirectory, Storage

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
#: per URL scheme te_thd reads and writes: its implementation (``module:class``, imported when a
#: cache of that scheme is opened), the URL's form, the rule its part after ``//`` must meet, and
#: what that part is
SCHEMES: dict[str, tuple[str, str, re.Pattern[str], str]] = {
    "s3": (
        "te_thd.offline_cache.storage.s3:S3Prefix",
        "s3://<bucket>/<prefix>",
        re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$"),
        "an S3 bucket name (3-63 lowercase letters, digits, dots and hyphens)",
    ),
    "msc": (
        "te_thd.offline_cache.storage.msc:MSCPrefix",
        "msc://<profile>/<path>",
        re.compile(r"^[\w.\-]+$"),
        "an MSC profile name (letters, digits, '_', '-' and '.')",
    ),
}


def as_storage(cache: str | os.PathLike[str] | Storage, name: str = "cache_dir") -> Storage:
    """``cache`` itself when it is an opened :class:`Storage`, else :func:`open_storage` of it."""
    return cache if isinstance(cache, Storage) else open_storage(cache, name)


def open_storage(path: str | os.PathLike[str], name: str = "cache_dir", **options: Any) -> Storage:
    """The :class:`Storage` of the cache at ``path``: a local directory, or by :data:`SCHEMES` its
    URL's.

    ``options`` go to a URL's implementation (an object store reader's ``read_cache_dir`` and
    ``read_cache_bytes``). ``ValueError`` naming the argument ``name`` for a scheme te_thd
    does not support, a malformed URL, or a bucket (profile) name the scheme refuses;
    ``TypeError`` naming it for a ``path`` that is neither a ``str`` nor ``os.PathLike``.
    """
    path = check_path(
        name, path, "a local directory (str or os.PathLike), an s3:// or an msc:// URL"
    )
    m = _SCHEME.match(path)
    if m is None or len(m.group(1)) == 1:  # a Windows drive letter is no scheme
        return LocalDirectory(path)
    scheme = m.group(1).lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"{name}={path!r}: URL scheme {scheme!r} is not supported; te_thd caches live in "
            "a local directory, at s3://bucket/prefix (any S3-compatible store) or at "
            "msc://profile/path (multi-storage-client). Pass a local path, an s3:// or an "
            "msc:// URL"
        )
    implementation, form, rule, what = SCHEMES[scheme]
    rest = path[len(m.group(0)) :]
    if not rest.startswith("//"):
        raise ValueError(
            f"{name}={path!r} is not a URL of the form {form}; write {scheme}://{rest.lstrip('/')}"
        )
    bucket, _, prefix = rest[2:].partition("/")
    if not rule.match(bucket):
        raise ValueError(f"{name}={path!r}: {bucket!r} is not {what}; write {form}")
    module, _, cls = implementation.partition(":")
    return getattr(importlib.import_module(module), cls)(
        scheme, bucket, prefix.strip("/"), **options
    )
