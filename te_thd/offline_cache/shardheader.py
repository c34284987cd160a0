"""A shard file's header read back and checked against its cache (:mod:`~te_thd.offline_cache.shardfile` writes it).

:func:`read_shard_header` parses the safetensors header and the te_thd fields
(:mod:`~te_thd.offline_cache.integrity`) and checks that the offsets tile the file;
:func:`check_shard_header` is the one check of a header against its cache, which readers,
``verify_cache`` and the producer's resume all call. :func:`logical_entries` shows a
token-layout shard's ragged tensors as the cache's keys.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from te_thd.offline_cache.format import (
    ST_TO_DTYPE,
    CacheIntegrityError,
    TensorSpec,
    dtype_name,
    tensor_nbytes,
)
from te_thd.offline_cache.integrity import (
    HASH_NAME,
    ShardSums,
    parse_shard_metadata,
    shard_checksum,
)
from te_thd.offline_cache.ragged import logical_specs
from te_thd.offline_cache.readexec import advise

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on header size


@dataclass(frozen=True)
class HeaderEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class ShardHeader:
    """A parsed shard header: ``entries`` (``{key: HeaderEntry}``) and its te_thd ``sums`` (or ``None``)."""

    entries: dict[str, HeaderEntry]
    sums: ShardSums | None


def read_shard_header(path: str) -> ShardHeader:
    """Parse and sanity-check a safetensors header, with its te_thd checksum fields when present.

    Raises :class:`CacheIntegrityError` naming ``path`` if the header is unreadable, the offsets
    do not tile the data region exactly, the file size disagrees with the last offset, or the
    te_thd fields do not match the header (:func:`parse_shard_metadata`).
    """

    def bad(what: str) -> CacheIntegrityError:
        return CacheIntegrityError(f"shard {path} is not a valid safetensors file: {what}", path=path)

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        # read exactly the header: kernel read-ahead here would prefetch the tensors after it
        # (and mark pages whose later reads prefetch more), which a reader may read only a share of
        advise(fd, "random")
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise bad(f"only {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise bad(f"header length {n} does not fit in a {size}-byte file")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    base = 8 + n
    entries: dict[str, HeaderEntry] = {}
    spans = []
    for key, info in header.items():
        try:
            dtype = ST_TO_DTYPE[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {key!r} is malformed: {info!r}") from None
        nbytes = tensor_nbytes(dtype, shape)
        if end - start != nbytes:
            raise bad(f"entry {key!r} spans {end - start} bytes but {dtype}{list(shape)} needs {nbytes}")
        entries[key] = HeaderEntry(dtype, shape, base + start, base + end)
        spans.append((start, end))
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise bad(f"data offsets leave a gap or overlap at byte {pos}")
        pos = end
    if base + pos != size:
        raise bad(f"the header describes {base + pos} bytes but the file has {size}")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("__metadata__ is not a JSON object")
    return ShardHeader(entries, parse_shard_metadata(path, metadata, header))


def header_problems(
    header: ShardHeader,
    schema: Mapping[str, TensorSpec] | None,
    rows: int,
    keys: Sequence[str] | None = None,
) -> list[str]:
    """What is wrong with a shard's header for its cache (an empty list: sound).

    ``schema``: ``{key: TensorSpec}`` every shard must follow (``None``: no dtype/shape check).
    ``rows``: the samples the cache puts in this shard, which the shard's own record must agree
    with. ``keys``: the keys a reader needs (others may exist); ``None``: exactly ``schema``'s.
    """
    entries = logical_entries(header)
    problems = []
    required = list(keys) if keys is not None else list(schema or entries)
    missing = [k for k in required if k not in entries]
    if missing:
        problems.append(f"lacks keys {missing} (it holds {sorted(entries)})")
    if keys is None and schema is not None:
        extra = [k for k in entries if k not in schema]
        if extra:
            problems.append(f"has keys {extra} the schema does not list")
    for key in required:
        e = entries.get(key)
        if e is None:
            continue
        spec = schema.get(key) if schema is not None else None
        if not e.shape:
            problems.append(f"key {key!r} is a scalar, not [samples, ...]")
        elif spec is not None and TensorSpec(e.dtype, e.shape[1:]) != spec:
            problems.append(f"key {key!r} is {dtype_name(e.dtype)}{list(e.shape)}, the schema says {spec.describe()}")
        elif e.shape[0] != rows:
            problems.append(f"key {key!r} holds {e.shape[0]} samples, the manifest puts {rows} in this shard")
    if header.sums is not None and header.sums.rows != rows:
        problems.append(f"records {header.sums.rows} rows, the manifest puts {rows} in this shard")
    return problems


def check_shard_header(
    path: str,
    schema: Mapping[str, TensorSpec] | None,
    rows: int,
    keys: Sequence[str] | None = None,
    require_sums: bool = False,
    checksum: str | None = None,
) -> ShardHeader:
    """Read shard ``path``'s header and check it (:func:`header_problems`): the one header check.

    ``require_sums``: the shard must carry te_thd checksums (a manifest of layout >= 3
    promises them). ``checksum``: the manifest's record; when it is a header digest
    (:func:`~te_thd.offline_cache.integrity.shard_checksum`) the shard's own must match, which
    catches a shard swapped for another valid one. Raises :class:`CacheIntegrityError` naming
    ``path`` and every problem.
    """
    try:
        header = read_shard_header(path)
    except FileNotFoundError:
        raise CacheIntegrityError(f"shard {path} is missing", path=path) from None
    problems = header_problems(header, schema, rows, keys)
    if require_sums and header.sums is None:
        problems.append(
            "carries no te_thd checksums although the manifest's layout records them for every "
            "shard (the file was replaced by another writer's)"
        )
    if checksum is not None and checksum.startswith(f"{HASH_NAME}:"):
        actual = shard_checksum(header.sums.digest) if header.sums is not None else "no te_thd checksums"
        if actual != checksum:
            problems.append(
                f"its header digest is {actual}, the manifest records {checksum}: the shard was swapped for "
                "another or replaced after the manifest was written"
            )
    if problems:
        raise CacheIntegrityError(f"shard {path}: {'; '.join(problems)}", path=path)
    return header


def logical_entries(header: ShardHeader) -> dict[str, HeaderEntry]:
    """The header's entries as the cache's keys: a token-layout shard's ragged tensors
    (``key@tokens``, ``key@scale``, the block sums) become their logical key ``[rows, L, ...]``
    (its ``start``/``end`` then span nothing: read it through ``token_read``)."""
    tokens = header.sums.tokens if header.sums is not None else None
    if tokens is None:
        return header.entries
    try:
        logical = logical_specs(tokens)
    except ValueError as exc:
        raise CacheIntegrityError(f"shard header's token fields are malformed ({exc})") from None
    ragged = set(tokens["stored"]) | {tokens.get("block_sums")}
    out = {k: e for k, e in header.entries.items() if k not in ragged}
    for k, spec in logical.items():
        out[k] = HeaderEntry(spec.dtype, (header.sums.rows, *spec.shape), 0, 0)
    return out


def schema_of_header(header: ShardHeader) -> dict[str, TensorSpec]:
    """``{key: TensorSpec(dtype, trailing shape)}`` of a header's non-scalar entries (logical keys)."""
    return {k: TensorSpec(e.dtype, e.shape[1:]) for k, e in logical_entries(header).items() if e.shape}
