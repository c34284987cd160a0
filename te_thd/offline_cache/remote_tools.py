"""``verify_cache``, ``repair_cache`` and the lock of an s3:// cache: the local tools over a fetched copy.

Verification needs every byte, so the cache is fetched into a private
:class:`~te_thd.offline_cache.mirror.ObjectMirror` (only the shards' sizes for a quick
check) and the local checks run on it; their messages name the objects by URL.
Repair sets damaged objects aside under ``<prefix>/.te_thd-damaged/`` (which readers
never list: they read only the objects directly under the prefix), and reopens the
cache for its producer: the producer record goes up, the manifest is deleted.
"""

from __future__ import annotations

from typing import Any

from te_thd.offline_cache import objectstore
from te_thd.offline_cache.durable import LOCK_NAME
from te_thd.offline_cache.errors import CacheError, CacheIntegrityError
from te_thd.offline_cache.format import MANIFEST_NAME, canonical_json
from te_thd.offline_cache.location import ObjectLocation
from te_thd.offline_cache.mirror import ObjectMirror
from te_thd.offline_cache.object_lock import read_holder


def fetched(loc: ObjectLocation, whole: bool) -> ObjectMirror:
    """A private local copy of the cache at ``loc``: its manifest and sparse shards, every byte when ``whole``."""
    mirror = ObjectMirror(loc)
    mirror.sync()
    if whole:
        for name, size in mirror.sizes.items():
            mirror.ensure(name, [(0, size)])
    return mirror


def named_by_url(exc: CacheError, mirror: ObjectMirror) -> CacheError:
    """``exc`` with the local copy's paths replaced by the objects' URLs."""
    root, url = mirror.root, mirror.loc.url
    text = str(exc).replace(root, url)
    if isinstance(exc, CacheIntegrityError):
        path = exc.path.replace(root, url) if exc.path else exc.path
        return CacheIntegrityError(text, path=path, sample=exc.sample, key=exc.key, expected=exc.expected, actual=exc.actual)
    return type(exc)(text)


def in_urls(obj: Any, root: str, url: str) -> Any:
    if isinstance(obj, str):
        return obj.replace(root, url)
    if isinstance(obj, list):
        return [in_urls(v, root, url) for v in obj]
    if isinstance(obj, dict):
        return {k: in_urls(v, root, url) for k, v in obj.items()}
    return obj


def unlock_remote(loc: ObjectLocation) -> dict[str, Any] | None:
    """Delete the producer lock object of the cache at ``loc``; the holder it recorded (None: no lock)."""
    holder = read_holder(loc)
    if holder is not None:
        objectstore.delete(loc, LOCK_NAME)
    return holder



def set_aside_and_reopen(
    loc: ObjectLocation, names: list[str], damaged_dir: str, progress_name: str, params: dict[str, Any]
) -> None:
    """Move objects ``names`` under ``damaged_dir/`` and reopen the cache for its producer: the producer
    record (``params``) goes up first and the manifest is deleted last, so a reader never finds the
    cache finished and unsound."""
    for name in names:
        objectstore.copy(loc, name, f"{damaged_dir}/{name}")
        objectstore.delete(loc, name)
    objectstore.put_bytes(loc, progress_name, canonical_json(params))
    objectstore.delete(loc, MANIFEST_NAME)
