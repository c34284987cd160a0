"""Self-verifying shards: per-row checksums in the shard header, the header read back, and the
checks.

Every shard te_thd writes carries one ``"te_thd"`` entry in its safetensors ``__metadata__``
(its fields: docs/integrity.md, "What a shard carries"): per-row xxh3_64 sums seeded with the
row index, so a row read from the wrong place fails too (:func:`verify_rows` hashes exactly
the bytes a read copied, right after the copy, while still in cache), and a digest of the
header (:func:`header_digest`), so a flipped dtype, shape, offset or stored sum is caught on
open. One metadata key, not one per field, keeps the file byte-identical to
``save_file(tensors, metadata={"te_thd": ...})``: safetensors writes metadata keys in hash-map
order.

:func:`read_shard_header` parses a shard's header and these fields and checks that the offsets
tile the file; :func:`check_shard_header` is the one check of a header against its cache,
which readers, ``verify_cache`` and the producer's resume all call.
"""

from __future__ import annotations

import array
import base64
import ctypes
import functools
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from te_thd.args import is_int
from te_thd.offline_cache.format.ragged import TokenFields
from te_thd.offline_cache.format.schema import (
    ST_TO_DTYPE,
    CacheIntegrityError,
    TensorSpec,
    advise,
    canonical_json,
    dtype_name,
    tensor_nbytes,
)

#: Version of the self-verifying shard fields (the manifest's ``layout_version`` from this on).
SHARD_LAYOUT = 3
HASH_NAME = "xxh3_64"
META_KEY = "te_thd"

#: ``hash64(data, seed=0) -> int``: the one hash (:data:`HASH_NAME`) of every te_thd checksum
hash64 = xxhash.xxh3_64_intdigest


def byte_view(t: torch.Tensor, *, hold: bool = True) -> memoryview:
    """Writable flat byte view (``[numel * itemsize]`` uint8) of the contiguous CPU tensor ``t``'s
    memory, zero-copy: what a shard is written from, read into and hashed over.

    ``hold``: the view keeps ``t`` alive. False: only pointer and length, which ``t`` must
    outlive; a cache of views by address needs that, or it would keep pooled batches in use.

    Built from the data pointer: ``t.view(torch.uint8).numpy()`` goes through torch's
    dispatcher twice, which costs more than hashing a small batch.
    """
    if not t.is_contiguous():
        raise ValueError(
            f"tensor of shape {list(t.shape)} is not contiguous; read into a contiguous tensor"
        )
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    if hold:
        raw._tensor = t  # type: ignore[attr-defined]  # the view keeps ``raw``, which keeps ``t``
    return memoryview(raw).cast("B")


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU and contiguous, as a shard's rows are written and hashed from:
    ``t`` itself when it already is one (a GPU producer's batch is copied once, here)."""
    if t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad:
        return t
    return t.detach().to("cpu").contiguous()


def byte_row_sums(view: memoryview, rows: int, first_row: int = 0) -> list[int]:
    """``xxh3_64`` of each of ``rows`` equal rows laid out back to back in the bytes of ``view``,
    row ``i`` seeded with ``first_row + i`` (the shard row index of the view's first row)."""
    return [hash64(row, first_row + i) for i, row in enumerate(cut_rows(view, rows))]


def cut_rows(view: memoryview, n: int) -> list[memoryview]:
    """``view`` cut into ``n`` equal rows (sliced through ``map``: no bytecode per row)."""
    rb = view.nbytes // n if n else 0
    if not rb:  # zero-size rows
        return [view[:0]] * n
    return list(map(view.__getitem__, map(slice, range(0, n * rb, rb), range(rb, n * rb + rb, rb))))


def encode_sums(sums: Sequence[int]) -> str:
    return base64.b64encode(np.asarray(sums, dtype="<u8").tobytes()).decode("ascii")


def decode_sums(text: str, rows: int) -> array.array:
    """Inverse of :func:`encode_sums`: ``array('Q')`` of ``rows`` sums (``ValueError`` otherwise).
    Not an ndarray: a reader picks a batch's sums by Python index, where numpy's fancy indexing
    pays a fixed cost per call larger than a small batch's lookups."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) != 8 * rows:
        raise ValueError(f"holds {len(raw) // 8} row checksums, the shard has {rows} rows")
    out = array.array("Q")
    out.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - stored little-endian
        out.byteswap()
    return out


def header_digest(tensor_entries: Mapping[str, Any], fields: Mapping[str, Any]) -> str:
    """Digest of a shard header: the safetensors tensor entries and the te_thd fields but
    ``header``."""
    body = {"tensors": tensor_entries, META_KEY: {k: v for k, v in fields.items() if k != "header"}}
    return f"{hash64(canonical_json(body)):016x}"


def shard_metadata(
    tensor_entries: Mapping[str, Any],
    sums: Mapping[str, Sequence[int]],
    rows: int,
    tokens: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
) -> tuple[dict[str, str], str]:
    """The ``__metadata__`` of a new shard (``{"te_thd": <JSON of the fields>}``) and its header
    digest.

    ``tensor_entries`` is the safetensors header without metadata
    (``{key: {"dtype", "shape", "data_offsets"}}``), ``sums`` the per-row sums of
    every key (:func:`byte_row_sums`), ``rows`` the sample count. ``tokens``: the
    ragged tensors' fields of a token-layout shard (:mod:`~te_thd.offline_cache.write.shardfile`),
    covered by the digest like the rest. ``run``: the producer's run record (JSON
    values; see the module docstring), covered too. The digest is what the manifest
    records for the shard (:func:`shard_checksum`).
    """
    fields: dict[str, Any] = {
        "layout": SHARD_LAYOUT,
        "rows": rows,
        "hash": HASH_NAME,
        "sums": {k: encode_sums(v) for k, v in sums.items()},
    }
    if tokens is not None:
        fields["tokens"] = dict(tokens)
    if run is not None:
        fields["run"] = dict(run)
    fields["header"] = digest = header_digest(tensor_entries, fields)
    return {META_KEY: json.dumps(fields, sort_keys=True, separators=(",", ":"))}, digest


def shard_checksum(digest: str) -> str:
    """The manifest's record of a shard: ``"xxh3_64:<header digest>"``. The digest covers every
    entry and row checksum, which cover every data byte: a shard swapped for another valid one no
    longer matches its record, and checking that costs one header read, not a pass over the file."""
    return f"{HASH_NAME}:{digest}"


@dataclass(frozen=True)
class ShardSums:
    """The verified te_thd fields of one shard: ``rows``, ``sums[key]`` (uint64 ``[rows]``) and the
    header ``digest``."""

    rows: int
    sums: dict[str, array.array]
    digest: str
    #: the ragged tensors' fields of a token-layout shard, else None
    tokens: TokenFields | None = None
    #: the producer's run record (``produce_cache`` shards), else None
    run: dict[str, Any] | None = None


def damaged_fields(path: str, fields: str, what: str) -> CacheIntegrityError:
    """The error of shard ``path`` whose te_thd ``fields`` (e.g. ``"token fields"``) ``what`` (e.g.
    ``"are not JSON"``): its header was damaged after it was written."""
    return CacheIntegrityError(
        f"shard {path}: its {fields} {what}: the header is damaged", path=path
    )


def parse_shard_metadata(
    path: str, metadata: Mapping[str, Any] | None, tensor_entries: Mapping[str, Any]
) -> ShardSums | None:
    """Check and decode the te_thd fields of a parsed header; ``None`` when the shard has none.

    ``metadata`` is the header's ``__metadata__`` (or ``None``) and
    ``tensor_entries`` the raw tensor entries as parsed. Raises
    :class:`CacheIntegrityError` naming ``path`` when the fields are malformed,
    when the header digest does not match (a flipped byte in the header), or
    when a key has no sums.
    """
    if not metadata or META_KEY not in metadata:
        return None
    bad = functools.partial(damaged_fields, path, "te_thd checksum fields")
    try:
        fields = json.loads(metadata[META_KEY])
    except (TypeError, ValueError):
        raise bad("are not JSON") from None
    if (
        not isinstance(fields, dict)
        or fields.get("hash") != HASH_NAME
        or not isinstance(fields.get("sums"), dict)
    ):
        raise bad(f"are malformed or name another hash than {HASH_NAME!r}")
    rows = fields.get("rows")
    if not is_int(rows, 0):
        raise bad(f"record rows={rows!r}")
    recorded = fields.get("header")
    actual = header_digest(tensor_entries, fields)
    if recorded != actual:
        raise CacheIntegrityError(
            f"shard {path}: header checksum mismatch (expected {HASH_NAME}:{recorded}, the header "
            f"hashes to {HASH_NAME}:{actual}): the header was damaged after it was written",
            path=path,
            expected=f"{HASH_NAME}:{recorded}",
            actual=f"{HASH_NAME}:{actual}",
        )
    tokens = fields.get("tokens")
    if tokens is not None and not (
        isinstance(tokens, dict) and isinstance(tokens.get("stored"), dict)
    ):
        raise bad("hold a malformed 'tokens' entry")
    tokens = TokenFields(tokens, rows) if tokens is not None else None
    run = fields.get("run")
    if run is not None and not isinstance(run, dict):
        raise bad("hold a malformed 'run' entry")
    # ragged tensors are covered by block sums (``tokens``), not row sums
    ragged = tokens.ragged if tokens is not None else set()
    missing = sorted(set(tensor_entries) - set(fields["sums"]) - ragged)
    if missing:
        raise bad(f"have no row checksums for keys {missing}")
    try:
        sums = {k: decode_sums(v, rows) for k, v in fields["sums"].items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise bad(f"hold unreadable row checksums ({exc})") from None
    return ShardSums(rows, sums, recorded, tokens, run)


def verify_rows(
    data: torch.Tensor,
    rows: Sequence[int] | np.ndarray,
    expected: Sequence[int],
    *,
    path: str,
    key: str,
    first_sample: int,
    repair: str,
) -> None:
    """Check rows a reader copied against their recorded sums; raise on the first mismatch.

    ``data`` is ``[len(rows), ...]`` (contiguous CPU, the copy a batch holds), ``rows`` the
    shard-local row indices it came from (a list, ``range`` or int array), ``expected`` the shard's
    ``sums[key]`` (``[shard rows]`` ints), ``first_sample`` the global index of the shard's row 0
    and ``repair`` how to fix the cache; the error names file, sample, key and both checksums.
    Thread-safe."""
    if isinstance(rows, np.ndarray):
        rows = rows.tolist()
    if len(rows):
        verify_row_views(
            row_views(data, len(rows)),
            rows,
            expected,
            path=path,
            key=key,
            first_sample=first_sample,
            repair=repair,
        )


#: ``(address, bytes, rows) -> one byte view per row``: batches land in a few recycled
#: buffers, and cutting 32 row views costs as much as hashing 32 rows of 2 KiB.
_ROW_VIEWS: dict[tuple[int, int, int], list[memoryview]] = {}
_ROW_VIEWS_MAX = 256


def row_views(data: torch.Tensor, n: int) -> list[memoryview]:
    """``n`` byte views, one per row, of the contiguous CPU tensor ``data`` (``[n, ...]``).

    Cached by address and size: a view is only pointer and length (``hold=False``), so
    the cached views of an address are the right views of whatever tensor of that size
    sits there when they are used, and they are used only while it does.
    """
    if not data.is_contiguous():
        return cut_rows(byte_view(data.contiguous()), n)  # a fresh copy: not worth caching
    cache_key = (data.data_ptr(), data.numel() * data.element_size(), n)
    views = _ROW_VIEWS.get(cache_key)
    if views is None:
        if len(_ROW_VIEWS) >= _ROW_VIEWS_MAX:
            _ROW_VIEWS.clear()
        views = _ROW_VIEWS[cache_key] = cut_rows(byte_view(data, hold=False), n)
    return views


def name_row(row: int, first_sample: int | None) -> str:
    """How a message names row ``row`` of a shard whose row 0 is sample ``first_sample``: by its
    global sample index, the one a user's dataset and the trainer use (``None``: not known)."""
    return (
        f"row {row} of the shard"
        if first_sample is None
        else f"sample {first_sample + row} (row {row} of the shard)"
    )


def checksum_mismatch(
    path: str,
    row: int,
    first_sample: int | None,
    key: str,
    want: int,
    got: int,
    *,
    tokens: tuple[int, int, str] | None = None,
    read: bool = True,
    more: int = 0,
    repair: str = "",
) -> CacheIntegrityError:
    """The error of bytes of shard ``path`` that hash to ``got`` where the header records ``want``.

    They are row ``row`` of ``key`` (:func:`name_row`), or, with ``tokens=(lo, hi, stored
    name)``, tokens ``lo..hi`` of that row in one block of a ragged tensor. ``read``: the bytes
    a read just copied (else a check of the file's own bytes); ``more``: further bad rows found;
    ``repair`` (non-empty: a read's batch was refused) says how to fix the cache.
    """
    exp, act = f"{HASH_NAME}:{want:016x}", f"{HASH_NAME}:{got:016x}"
    span = "" if tokens is None else f" in its tokens {tokens[0]}..{tokens[1]}"
    stored = "" if tokens is None else f"{tokens[2]}; "
    rest = f" and {more} more rows" if more else ""
    returned = f"; the batch was not returned. {repair}" if repair else ""
    return CacheIntegrityError(
        f"shard {path}: {name_row(row, first_sample)}, key {key!r}: checksum mismatch{span} "
        f"({stored}expected {exp}, the bytes {'read ' if read else ''}hash to {act}){rest}: "
        f"the file is damaged{returned}",
        path=path,
        sample=None if first_sample is None else first_sample + row,
        key=key,
        expected=exp,
        actual=act,
    )


def verify_row_views(
    views: Sequence[memoryview],
    rows: Sequence[int],
    expected: Sequence[int],
    *,
    path: str,
    key: str,
    first_sample: int,
    repair: str,
) -> None:
    """:func:`verify_rows` of rows already cut into byte views (:func:`row_views`): ``views[j]``
    (the bytes of one row) must hash, seeded with ``rows[j]``, to ``expected[rows[j]]``.

    The form a batched read calls after each piece: the batch tensor's row views are cut
    once per batch (cached by address), so checking a piece slices a list, not a tensor
    (a tensor slice goes through torch's dispatcher).
    """
    # map() over prebuilt row views: no Python bytecode per row, unlike an indexed loop
    got = list(map(hash64, views, rows))
    want = list(map(expected.__getitem__, rows))
    if got == want:
        return
    j = next(j for j, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
    raise checksum_mismatch(path, rows[j], first_sample, key, want[j], got[j], repair=repair)


# -- the header read back and checked --

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on header size


@dataclass(frozen=True)
class HeaderEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class ShardHeader:
    """A parsed shard header: ``entries`` (``{key: HeaderEntry}``) and its te_thd ``sums`` (or
    ``None``)."""

    entries: dict[str, HeaderEntry]
    sums: ShardSums | None

    @property
    def tokens(self) -> TokenFields | None:
        """The ragged fields of a token-layout shard (None: a padded or unchecked shard)."""
        return self.sums.tokens if self.sums is not None else None


#: the fields of a safetensors tensor entry, sorted
_ENTRY_KEYS = ["data_offsets", "dtype", "shape"]


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ``...`` marking the cut (a value quoted in a
    message)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_shard_header(path: str, name: str | None = None) -> ShardHeader:
    """Parse and sanity-check a safetensors header, with its te_thd checksum fields when present.

    Raises :class:`CacheIntegrityError` naming the shard ``name`` (default ``path``, the file read)
    if the header is unreadable, the offsets do not tile the data region exactly, the file size
    disagrees with the last offset, or the te_thd fields do not match the header
    (:func:`parse_shard_metadata`).
    """
    name = name or path

    def bad(what: str) -> CacheIntegrityError:
        return CacheIntegrityError(
            f"shard {name} is not a valid safetensors file: {what}", path=name
        )

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
            # a damaged "__metadata__" name turns the metadata into an entry: never print it whole
            fields = sorted(info) if isinstance(info, dict) else None
            held = f"keys {fields}" if fields not in (None, _ENTRY_KEYS) else repr(info)
            raise bad(
                f"entry {clip(repr(key), 40)} is no tensor (it holds {clip(held, 60)})"
            ) from None
        nbytes = tensor_nbytes(dtype, shape)
        if end - start != nbytes:
            raise bad(
                f"entry {key!r} spans {end - start} bytes but {dtype}{list(shape)} needs {nbytes}"
            )
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
    return ShardHeader(entries, parse_shard_metadata(name, metadata, header))


def check_shard_header(
    path: str,
    schema: Mapping[str, TensorSpec] | None,
    rows: int,
    keys: Sequence[str] | None = None,
    require_sums: bool = False,
    checksum: str | None = None,
    name: str | None = None,
) -> ShardHeader:
    """Read shard ``path``'s header and check it against its cache: the one header check.

    ``schema``: ``{key: TensorSpec}`` every shard must follow (``None``: no dtype/shape check).
    ``rows``: the samples the cache puts in this shard, which the shard's own record must agree
    with. ``keys``: the keys a reader needs (others may exist); ``None``: exactly ``schema``'s.
    ``require_sums``: the shard must carry te_thd checksums (a manifest of layout >= 3
    promises them). ``checksum``: the manifest's record; when it is a header digest
    (:func:`shard_checksum`) the shard's own must match, which catches a shard swapped for
    another valid one. Raises :class:`CacheIntegrityError` naming the shard ``name`` (default
    ``path``) and every problem.
    """
    name = name or path
    try:
        header = read_shard_header(path, name)
    except FileNotFoundError:
        raise CacheIntegrityError(f"shard {name} is missing", path=name) from None
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
            problems.append(
                f"key {key!r} is {dtype_name(e.dtype)}{list(e.shape)}, the schema says "
                f"{spec.describe()}"
            )
        elif e.shape[0] != rows:
            problems.append(
                f"key {key!r} holds {e.shape[0]} samples, the manifest puts {rows} in this shard"
            )
    if header.sums is not None and header.sums.rows != rows:
        problems.append(f"records {header.sums.rows} rows, the manifest puts {rows} in this shard")
    if require_sums and header.sums is None:
        problems.append(
            "carries no te_thd checksums although the manifest's layout records them for every "
            "shard (the file was replaced by another writer's)"
        )
    if checksum is not None and checksum.startswith(f"{HASH_NAME}:"):
        actual = (
            shard_checksum(header.sums.digest) if header.sums is not None else "no te_thd checksums"
        )
        if actual != checksum:
            problems.append(
                f"its header digest is {actual}, the manifest records {checksum}: the shard was "
                "swapped for another or replaced after the manifest was written"
            )
    if problems:
        raise CacheIntegrityError(f"shard {name}: {'; '.join(problems)}", path=name)
    return header


def logical_entries(header: ShardHeader) -> dict[str, HeaderEntry]:
    """The header's entries as the cache's keys: a token-layout shard's ragged tensors
    (``key@tokens``, ``key@scale``, the block sums) become their logical key ``[rows, L, ...]``
    (its ``start``/``end`` then span nothing: read it through ``read.tokens``)."""
    tokens = header.tokens
    if tokens is None:
        return header.entries
    try:
        logical = tokens.logical
    except ValueError as exc:
        raise CacheIntegrityError(f"shard header's token fields are malformed ({exc})") from None
    out = {k: e for k, e in header.entries.items() if k not in tokens.ragged}
    for k, spec in logical.items():
        out[k] = HeaderEntry(spec.dtype, (tokens.rows, *spec.shape), 0, 0)
    return out


def schema_of_header(header: ShardHeader) -> dict[str, TensorSpec]:
    """``{key: TensorSpec(dtype, trailing shape)}`` of a header's non-scalar entries (logical
    keys)."""
    return {
        k: TensorSpec(e.dtype, e.shape[1:]) for k, e in logical_entries(header).items() if e.shape
    }
