"""One shard file: the safetensors bytes te_thd writes, row piece by row piece, and its header read back.

The bytes are exactly those of ``safetensors.torch.save_file(tensors, path,
metadata=...)`` with the single ``"te_thd"`` metadata entry of
:mod:`~te_thd.offline_cache.integrity` (per-row checksums, row count, header
digest): an 8-byte little-endian header length, a compact JSON header padded
with spaces to a multiple of 8, then every tensor's raw bytes, ordered by dtype
(safetensors' enum order, descending, which keeps wider types aligned) and then
by name. The tests assert byte equality with ``save_file`` so the format cannot
drift.

:class:`ShardStream` is the one serialiser, used by every writer: a shard's row
count is known before its first row, so the header's length is known too (the
per-row checksums are fixed-width base64, the digest 16 hex digits). Each piece
of rows goes straight from its own memory to its final offset (``pwrite``), the
rows are hashed right after, while still in cache, and the header is written at
offset 0 last. A shard buffered as a list of batches is therefore never copied
into a shard-sized tensor, and a producer's batch is free once it is written.
Not atomic by itself: writers stream into a temp file and rename it when complete
(:mod:`~te_thd.offline_cache.durable`).
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from te_thd.args import check_int
from te_thd.offline_cache.durable import unlink_quietly
from te_thd.offline_cache.errors import CacheIntegrityError
from te_thd.offline_cache.format import (
    DTYPE_RANK,
    DTYPE_TO_ST,
    ST_TO_DTYPE,
    TensorSpec,
    dtype_name,
    tensor_nbytes,
)
from te_thd.offline_cache.integrity import (
    HASH_NAME,
    ShardSums,
    byte_row_sums,
    byte_view,
    on_cpu,
    parse_shard_metadata,
    shard_checksum,
    shard_metadata,
)
from te_thd.offline_cache.readexec import advise
from te_thd.offline_cache.tokens import logical_specs

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian on disk
    raise ImportError("te_thd.offline_cache writes raw tensor memory and needs a little-endian host")

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on header size


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest records per shard: file size and checksum (``"xxh3_64:<header digest>"``)."""

    bytes: int
    checksum: str
    #: every row's real length (``te_thd.offline_cache.lengths``), when recorded
    lengths: tuple[int, ...] | None = None
    #: per codec key of a token-layout shard, what its codec lost: ``{key: {"max_rel_l2", "mean_rel_l2"}}``
    fidelity: dict[str, dict[str, float]] | None = None

    def to_json(self, file_name: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"file": file_name, "bytes": self.bytes, "checksum": self.checksum}
        if self.lengths is not None:
            rec["lengths"] = list(self.lengths)
        if self.fidelity is not None:
            rec["fidelity"] = self.fidelity
        return rec


def tensor_entries(specs: Sequence[tuple[str, TensorSpec]], rows: int) -> dict[str, Any]:
    """The safetensors header entries (``{name: {dtype, shape, data_offsets}}``) of a ``rows``-row
    shard of ``specs`` (already in file order)."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, spec in specs:
        shape = [rows, *spec.shape]
        n = tensor_nbytes(spec.dtype, shape)
        entries[name] = {"dtype": DTYPE_TO_ST[spec.dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return entries


def build_header(entries: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length prefix plus the padded JSON header of ``entries`` (in file order)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata), **entries}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` of ``fd`` (``os.pwrite`` may write less than asked)."""
    view = buf.cast("B") if buf.format != "B" else buf
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class _Layout(NamedTuple):
    specs: dict[str, TensorSpec]  # in file order
    entries: dict[str, Any]  # the header's tensor entries
    header_len: int
    row_bytes: dict[str, int]
    start: dict[str, int]  # file offset of each key's first row


@functools.lru_cache(maxsize=16)
def _layout(specs: tuple[tuple[str, TensorSpec], ...], rows: int, run: str | None) -> _Layout:
    """Where everything of a ``rows``-row shard of ``specs`` goes (``run``: the run record's JSON); the
    same for every full shard of a cache, so it is computed once."""
    order = sorted(specs, key=lambda kv: (-DTYPE_RANK[kv[1].dtype], kv[0]))
    entries = tensor_entries(order, rows)
    placeholder, _ = shard_metadata(entries, {k: [0] * rows for k, _ in order}, rows,
                                    run=json.loads(run) if run is not None else None)  # fmt: skip
    header_len = len(build_header(entries, placeholder))
    row_bytes = {k: tensor_nbytes(s.dtype, s.shape) for k, s in order}
    start = {k: header_len + e["data_offsets"][0] for k, e in entries.items()}
    return _Layout(dict(order), entries, header_len, row_bytes, start)


def shard_header_len(specs: Mapping[str, TensorSpec], rows: int, run: Mapping[str, Any] | None = None) -> int:
    """Bytes (length prefix included) of the header of a ``rows``-row shard of ``specs`` that
    :class:`ShardStream` writes with the run record ``run``."""
    return _layout(tuple(specs.items()), rows, json.dumps(dict(run), sort_keys=True) if run is not None else None).header_len


def piece_rows(specs: Mapping[str, TensorSpec], piece: Mapping[str, torch.Tensor]) -> int:
    """The row count of a piece the writer checked (every key ``[n, *trailing]`` with one ``n``)."""
    return next((piece[k].shape[0] for k in specs), 0)


class ShardStream:
    """Write one self-verifying shard of ``rows`` rows to a NEW file ``path``, piece by piece.

    ``specs``: ``{key: TensorSpec(dtype, trailing shape)}``. :meth:`write` takes
    the next rows of every key (``{key: tensor [n, *trailing]}``, one ``n``);
    :meth:`finish` writes the header once all ``rows`` arrived and returns the
    shard's :class:`ShardRecord`; :meth:`abort` closes and removes the file.
    Pieces are written when :meth:`write` returns: the caller may free them at once.
    ``run``: the producer's run record, kept in the header (:func:`shard_metadata`).
    Pieces are not checked here: the writer checks each batch once, at its boundary
    (:meth:`~te_thd.offline_cache.writer.DurableShardWriter.validate`).
    """

    def __init__(self, path: str, specs: Mapping[str, TensorSpec], rows: int, run: Mapping[str, Any] | None = None) -> None:
        check_int("rows", rows, 0, meaning=" (the samples the shard holds)")
        self.path = path
        self.rows = rows
        self._run = dict(run) if run is not None else None
        layout = _layout(tuple(specs.items()), rows, json.dumps(self._run, sort_keys=True) if run is not None else None)
        self.specs = layout.specs
        self._entries, self._header_len = layout.entries, layout.header_len
        self._row_bytes, self._start = layout.row_bytes, layout.start
        self._sums: dict[str, list[int]] = {k: [] for k in self.specs}
        self._cursor = 0
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, piece: Mapping[str, torch.Tensor]) -> None:
        """Write the next rows: every key of ``specs``, ``[n, *trailing]`` with one ``n``."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed; start a new one")
        n = piece_rows(self.specs, piece)
        # little Python between the GIL-free calls (pwrite, hashes): a producer's compute thread
        # waits for the GIL whenever it wakes while this thread holds it
        for k in self.specs:
            t = on_cpu(piece[k])
            view = byte_view(t)  # t outlives the view: both end with this iteration
            pwrite_all(self._fd, view, self._start[k] + self._cursor * self._row_bytes[k])
            self._sums[k] += byte_row_sums(view, n, self._cursor)
        self._cursor += n

    def finish(self) -> ShardRecord:
        """Write the header (all ``rows`` must have arrived), close the file; the shard's record."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed")
        if self._cursor != self.rows:
            raise ValueError(f"shard stream {self.path} got {self._cursor} of its {self.rows} rows; write the rest first")
        metadata, digest = shard_metadata(self._entries, self._sums, self.rows, run=self._run)
        header = build_header(self._entries, metadata)
        if len(header) != self._header_len:  # the format's fixed-width fields changed: a bug, never data
            raise AssertionError(f"shard header is {len(header)} bytes, {self._header_len} were reserved")
        fd, self._fd = self._fd, None
        try:
            pwrite_all(fd, memoryview(header), 0)
        finally:
            os.close(fd)
        total = self._header_len + sum(self._row_bytes[k] * self.rows for k in self.specs)
        return ShardRecord(bytes=total, checksum=shard_checksum(digest))

    def abort(self) -> None:
        """Close and remove the file (an unfinished shard is never kept)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        unlink_quietly(self.path)


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

    Raises :class:`CacheIntegrityError` naming ``path`` if the header is
    unreadable, the offsets do not tile the data region exactly, the file
    size disagrees with the last offset (a truncated or padded file), or the
    te_thd fields do not match the header (see :func:`parse_shard_metadata`).
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

    ``schema``: ``{key: TensorSpec}`` every shard must follow (``None``: no
    dtype/shape check). ``rows``: the samples the cache puts in this shard
    (:func:`~te_thd.offline_cache.format.shard_rows`). ``keys``: the keys a
    reader needs (other keys may exist); ``None`` means exactly ``schema``'s keys.
    The row count the shard records itself must agree too.
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
    """Read shard ``path``'s header and check it (:func:`header_problems`); return it.

    The one header check of the cache: readers, ``verify_cache`` and the
    producer's resume all call it. ``require_sums``: the shard must carry te_thd
    checksums (a manifest of layout >= 3 promises them). ``checksum``: the
    manifest's record of the shard; when it is a header digest
    (:func:`~te_thd.offline_cache.integrity.shard_checksum`) the shard's own
    digest must match it, which catches a shard swapped for another valid one.
    Raises :class:`CacheIntegrityError` naming ``path`` and every problem.
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
