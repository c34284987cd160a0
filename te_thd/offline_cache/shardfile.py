"""One shard file: deterministic safetensors bytes, written zero-copy with an overlapped CRC-32.

The bytes are exactly those of ``safetensors.torch.save_file(tensors, path,
metadata=...)`` with the single ``"te_thd"`` metadata entry of
:mod:`~te_thd.offline_cache.integrity` (per-row checksums, row count, header
digest): an 8-byte little-endian header length, a compact JSON header padded
with spaces to a multiple of 8, then every tensor's raw bytes, ordered by dtype
(safetensors' enum order, descending, which keeps wider types aligned) and then
by name. Writing the format here instead of calling ``save_file``
lets the writer know the exact file bytes before they reach the disk, so the
CRC-32 the manifest records runs on a second thread over the same in-memory
buffers while the main thread writes them (``zlib.crc32`` and file writes both
release the GIL): checksumming costs ~nothing instead of a second pass. The
tests assert byte equality with ``save_file`` so the format cannot drift.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd.offline_cache.crc import crc32 as _crc32
from te_thd.offline_cache.errors import CacheIntegrityError
from te_thd.offline_cache.format import (
    CHECKSUM_ALGORITHM,
    DTYPE_RANK,
    DTYPE_TO_ST,
    ST_TO_DTYPE,
    TensorSpec,
    dtype_name,
)
from te_thd.offline_cache.integrity import ShardSums, parse_shard_metadata, row_sums, shard_metadata

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian on disk
    raise ImportError("te_thd.offline_cache writes raw tensor memory and needs a little-endian host")

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on header size
_READ_CHUNK = 8 << 20
_crc_pool: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _crc_pool
    if _crc_pool is None:
        _crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="te_thd-crc")
    return _crc_pool


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest records per shard: file size and checksum of the whole file."""

    bytes: int
    checksum: str
    #: every row's real length (``te_thd.offline_cache.lengths``), when recorded
    lengths: tuple[int, ...] | None = None

    def to_json(self, file_name: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"file": file_name, "bytes": self.bytes, "checksum": self.checksum}
        if self.lengths is not None:
            rec["lengths"] = list(self.lengths)
        return rec


def format_checksum(crc: int) -> str:
    return f"{CHECKSUM_ALGORITHM}:{crc & 0xFFFFFFFF:08x}"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy ``uint8`` view of a contiguous CPU tensor's memory (``[numel * itemsize]``)."""
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()) if flat.numel() else memoryview(b"")


def prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """CPU, contiguous, in file order (dtype rank descending, then name)."""
    return [(name, parts[0]) for name, parts in prepare_pieces({k: [t] for k, t in tensors.items()})]


def prepare_pieces(pieces: Mapping[str, Sequence[torch.Tensor]]) -> list[tuple[str, list[torch.Tensor]]]:
    """Each key's pieces (``[n_i, *trailing]``, one dtype and trailing shape per key) CPU and
    contiguous, keys in file order (dtype rank descending, then name).

    A key stored from several pieces holds them concatenated on dim 0; a single
    piece may have any shape (0-d included).
    """
    items = []
    for name, parts in pieces.items():
        parts = [p.detach().to("cpu").contiguous() for p in parts]
        if not parts:
            raise ValueError(f"tensor {name!r} has no pieces; pass at least one tensor per key")
        dtype = parts[0].dtype
        if dtype not in DTYPE_TO_ST:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
                f"cast it to one of {sorted(dtype_name(d) for d in DTYPE_TO_ST)}"
            )
        if len(parts) > 1 and any(p.dim() == 0 or (p.dtype, p.shape[1:]) != (dtype, parts[0].shape[1:]) for p in parts):
            raise ValueError(
                f"the pieces of tensor {name!r} cannot be concatenated on dim 0: "
                f"{[(dtype_name(p.dtype), list(p.shape)) for p in parts]}; give every piece one dtype and trailing shape"
            )
        items.append((name, parts))
    items.sort(key=lambda kv: (-DTYPE_RANK[kv[1][0].dtype], kv[0]))
    return items


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` itself if one, else a shape-only (meta) tensor of their dim-0 concatenation."""
    if len(parts) == 1:
        return parts[0]
    rows = sum(p.shape[0] for p in parts)
    return torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")


def tensor_entries(items: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The safetensors header entries (``{name: {dtype, shape, data_offsets}}``) of ``items``, in file order."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    return entries


def self_verifying_metadata(items: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> dict[str, str]:
    """The te_thd ``__metadata__`` of ``items`` (:func:`prepare_pieces`; every key ``[n, ...]`` with one
    ``n``): row sums, rows, digest."""
    joined = [(k, _joined(parts)) for k, parts in items]
    counts = {t.shape[0] if t.dim() else None for _, t in joined}
    if len(counts) != 1 or None in counts:
        raise ValueError(
            f"a self-verifying shard needs every tensor [n, ...] with one n; got shapes "
            f"{ {k: list(t.shape) for k, t in joined} }"
        )
    return shard_metadata(tensor_entries(joined), {k: _pieces_row_sums(parts) for k, parts in items}, counts.pop())


def _pieces_row_sums(parts: Sequence[torch.Tensor]) -> list[int]:
    """:func:`row_sums` of the dim-0 concatenation of ``parts``, without concatenating them."""
    sums: list[int] = []
    for p in parts:
        sums += row_sums(p, first_row=len(sums))
    return sums


def build_header(items: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for ``items`` (already in file order)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    header.update(tensor_entries(items))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _crc(buffers: Sequence[memoryview]) -> int:
    crc = 0
    for b in buffers:
        crc = _crc32(b, crc)
    return crc


def _write_all(fd: int, buf: memoryview) -> None:
    view = buf.cast("B") if buf.format != "B" else buf
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_shard_file(path: str, tensors: Mapping[str, torch.Tensor], self_verifying: bool = True) -> ShardRecord:
    """Write ``tensors`` to a NEW file ``path`` in safetensors format; return its record.

    ``self_verifying``: record per-row checksums, the row count and a header
    digest in ``__metadata__`` (every tensor must then be ``[n, ...]`` with one
    ``n``); ``False`` writes plain ``save_file`` bytes. Not atomic by itself: the
    writer calls it on a temp path inside :func:`~te_thd.offline_cache.durable.atomic_write`.
    """
    return write_shard_pieces(path, {k: [t] for k, t in tensors.items()}, self_verifying)


def write_shard_pieces(
    path: str, pieces: Mapping[str, Sequence[torch.Tensor]], self_verifying: bool = True
) -> ShardRecord:
    """:func:`write_shard_file` of ``{key: torch.cat(pieces[key])}``, written from the pieces.

    Each key's data is its pieces' bytes back to back (dim 0), the same file as
    concatenating first; the pieces go to the file (and the checksums) straight
    from their own memory, so a shard buffered
    as a list of batches is never copied into a fresh shard-sized tensor: that
    copy, page faults included, would cost about as much as the file write itself.
    """
    items = prepare_pieces(pieces)
    metadata = self_verifying_metadata(items) if self_verifying else None
    header = build_header([(k, _joined(parts)) for k, parts in items], metadata)
    buffers = [memoryview(header)] + [tensor_bytes(p) for _, parts in items for p in parts]
    total = sum(b.nbytes for b in buffers)
    crc_future = _pool().submit(_crc, buffers)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for b in buffers:
            _write_all(fd, b)
    finally:
        os.close(fd)
        crc = crc_future.result()  # always join: the buffers must outlive the CRC thread
    return ShardRecord(bytes=total, checksum=format_checksum(crc))


def file_checksum(path: str) -> str:
    """CRC-32 of the whole file at ``path`` (streamed; never holds the file in memory)."""
    crc = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = _crc32(view[:n], crc)
    return format_checksum(crc)


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


def read_header(path: str) -> dict[str, HeaderEntry]:
    """:func:`read_shard_header`'s ``entries``."""
    return read_shard_header(path).entries


def read_shard_header(path: str) -> ShardHeader:
    """Parse and sanity-check a safetensors header, with its te_thd checksum fields when present.

    Raises :class:`CacheIntegrityError` naming ``path`` if the header is
    unreadable, the offsets do not tile the data region exactly, the file
    size disagrees with the last offset (a truncated or padded file), or the
    te_thd fields do not match the header (see :func:`parse_shard_metadata`).
    """

    def bad(what: str) -> CacheIntegrityError:
        return CacheIntegrityError(f"shard {path} is not a valid safetensors file: {what}", path=path)

    size = os.stat(path).st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise bad(f"only {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise bad(f"header length {n} does not fit in a {size}-byte file")
        raw = f.read(n)
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
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
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
    entries = header.entries
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
) -> ShardHeader:
    """Read shard ``path``'s header and check it (:func:`header_problems`); return it.

    The one header check of the cache: readers, ``verify_cache`` and the
    producer's resume all call it. ``require_sums``: the shard must carry te_thd
    checksums (a manifest of layout >= 3 promises them). Raises
    :class:`CacheIntegrityError` naming ``path`` and every problem.
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
    if problems:
        raise CacheIntegrityError(f"shard {path}: {'; '.join(problems)}", path=path)
    return header


def schema_of_header(header: ShardHeader) -> dict[str, TensorSpec]:
    """``{key: TensorSpec(dtype, trailing shape)}`` of a header's non-scalar entries."""
    return {k: TensorSpec(e.dtype, e.shape[1:]) for k, e in header.entries.items() if e.shape}
