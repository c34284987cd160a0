"""The shards a reading process holds open: header, descriptor, mapping and ``safe_open`` handle.

One :class:`OpenShards` per dataset and process (an LRU of ``max_open_shards``)
replaces a cache per kind of handle: each :class:`OpenShard` holds its checked
header and, made when a read first needs them, its descriptor
(:meth:`OpenShard.descriptor`), its memory mapping (:meth:`OpenShard.mapped`) and
the ``safe_open`` handle the per-item path uses.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .copyread import advise
from .errors import CacheIntegrityError
from .shardheader import HeaderEntry, ShardHeader
from .storage import Fetch
from .token_read import TokenIndex

__all__ = ["OpenShard", "OpenShards", "map_shard"]

def map_shard(path: str, entries: dict[str, HeaderEntry], keys: Sequence[str], repair: str) -> dict[str, torch.Tensor]:
    """Memory-map one safetensors file and return ``{key: [rows, ...] view}`` for ``keys``.

    ``entries`` is the file's parsed header (``shardheader.check_shard_header``). The file is mapped copy-on-write
    (``torch.from_file(shared=False)``: opened read-only, no descriptor kept) and
    never written, so every page stays file-backed; safetensors itself has no
    zero-copy view API, ``safe_open`` copies on every slice.
    """
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CacheIntegrityError(
            f"shard {path} is missing (removed after the cache was opened?). {repair}", path=path
        ) from None
    whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    views: dict[str, torch.Tensor] = {}
    for key in keys:
        e = entries[key]
        raw = whole[e.start : e.end]
        if e.start % raw.new_empty(0, dtype=e.dtype).element_size():
            raw = raw.clone()  # misaligned (safetensors aligns; a foreign writer may not): copy once
        views[key] = raw.view(e.dtype).view(e.shape)
    return views


class OpenShard:
    """One open shard: ``path``, its checked ``header``, a read-only descriptor ``fd``, and, once a
    read needs them, its memory mapping ``views`` (``{key: [rows, ...]}``) and ``safe_open`` ``handle``.

    The descriptor is closed when the last reference goes: the LRU drops its
    reference on eviction, and every ``preadv`` piece planned from it holds one
    (``Piece.owner``) until it is read. So a batch spanning more shards than
    ``max_open_shards``, or a read still in flight while the next batch opens
    other shards, never reads through a closed descriptor -- or through its
    number reused by the next open, which would read another file.
    """

    __slots__ = ("path", "header", "fd", "views", "handle", "tokens", "fetch", "_pid")

    def __init__(self, path: str, header: ShardHeader, tokens: TokenIndex | None = None, fetch: Fetch | None = None) -> None:
        self.path, self.header, self.fd = path, header, -1
        self.tokens = tokens  # a token-layout shard's ragged index
        self.fetch = fetch  # makes byte ranges present in the local file (``Storage.readable``; None: all are)
        self.views: dict[str, torch.Tensor] | None = None
        self.handle: Any = None
        self._pid = os.getpid()

    def descriptor(self, prefetch: Sequence[str], repair: str) -> int:
        """The read-only descriptor, opened on first use.

        Opening asks the kernel to start reading the byte ranges of the keys ``prefetch``
        (``POSIX_FADV_WILLNEED``; empty: no hint), and for a token shard, whose ragged
        reads fetch a few blocks here and there (one CP rank's tokens), to do no
        read-ahead of its own (``POSIX_FADV_RANDOM``).
        """
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise CacheIntegrityError(
                    f"shard {self.path} is missing (removed after the cache was opened?). {repair}", path=self.path
                ) from None
            if self.tokens is not None:
                advise(self.fd, "random")
            for key in prefetch:
                e = self.header.entries[key]
                advise(self.fd, "willneed", e.start, e.end - e.start)
        return self.fd

    def mapped(self, keys: Sequence[str], repair: str) -> dict[str, torch.Tensor]:
        """``{key: [rows, ...]}`` views of the mapped shard for ``keys`` (:func:`map_shard`), mapped on first use."""
        if self.views is None:
            self.views = map_shard(self.path, self.header.entries, keys, repair)
        return self.views

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            _close(fd)

    # os's functions bound at definition: at interpreter exit the module may be torn down first
    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        # a forked child's inherited copies are closed by OpenShards.close()
        if self._pid == _getpid():
            try:
                self.close()
            except OSError:
                pass


class OpenShards:
    """LRU of ``shard -> OpenShard``; an evicted shard's descriptor closes once nothing reads from it."""

    def __init__(self) -> None:
        self._lru: OrderedDict[int, OpenShard] = OrderedDict()

    def get(self, shard: int) -> OpenShard | None:
        f = self._lru.get(shard)
        if f is not None:
            self._lru.move_to_end(shard)
        return f

    def put(self, shard: int, f: OpenShard, limit: int) -> OpenShard:
        self._lru[shard] = f
        while len(self._lru) > limit:
            self._lru.popitem(last=False)
        return f

    def __len__(self) -> int:
        return len(self._lru)

    def items(self) -> list[tuple[int, OpenShard]]:
        """``[(shard index, open shard)]``, least recently used first."""
        return list(self._lru.items())

    def drop(self, shard: int) -> None:
        """Forget shard ``shard`` (it is opened, and its header read and checked, again on next use)."""
        self._lru.pop(shard, None)

    def close(self) -> None:
        """Close every descriptor now (a forked child closing its inherited copies: no reads in flight)."""
        while self._lru:
            self._lru.popitem()[1].close()
