"""One shard file written batch by batch: the bytes of ``write_shard_pieces``, streamed.

A producer that knows a shard's row count before its first batch writes each
batch into the shard's temp file as soon as the batch is computed, instead of
holding the whole shard in memory until it is complete. The batch's memory is
free again right after its write, while it is still in cache, and the next
batches reuse it: on the 2-vCPU VM this module was measured on, holding
shards until they were written cost the compute thread page faults and cold
caches (docs/performance-io.md).

How the bytes stay identical to :func:`~te_thd.offline_cache.shardfile.write_shard_pieces`:

- the header's length depends on the shapes alone (the per-row checksums are
  fixed-width base64, the digest 16 hex digits), so it is measured up front
  from a header with placeholder sums; each key's rows go to their final
  offsets (``pwrite``), and the real header is written at offset 0 last;
- the file's CRC-32 is assembled in file order from each written run's CRC
  (:func:`~te_thd.offline_cache.crc.crc32_combine`), with no second pass.

Each written run's writeback starts at once (``sync_file_range``), so the
shard's closing fsync waits for less, and the kernel's work of submitting the
I/O runs in the writing thread rather than in one burst at the fsync (measured:
+1-2% producer throughput at compute time == write time).

Not atomic by itself: the durable writer streams into a temp file and renames
it when complete (``te_thd.offline_cache.writer``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from te_thd.offline_cache.crc import crc32, crc32_combine
from te_thd.offline_cache.durable import start_writeback, unlink_quietly
from te_thd.offline_cache.format import DTYPE_RANK, TensorSpec, dtype_name
from te_thd.offline_cache.integrity import byte_row_sums, byte_view, shard_metadata
from te_thd.offline_cache.shardfile import (
    ShardRecord,
    build_header,
    format_checksum,
    tensor_entries,
)


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    view = buf.cast("B") if buf.format != "B" else buf
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class _Layout(NamedTuple):
    specs: dict[str, TensorSpec]  # in file order
    joined: list[tuple[str, torch.Tensor]]  # shape-only (meta) tensors of the whole shard
    entries: dict[str, Any]  # the header's tensor entries
    header_len: int
    row_bytes: dict[str, int]
    start: dict[str, int]  # file offset of each key's first row


@functools.lru_cache(maxsize=16)
def _layout(specs: tuple[tuple[str, TensorSpec], ...], rows: int) -> _Layout:
    """Where everything of a ``rows``-row shard of ``specs`` goes; the same for every full shard of a
    cache, so it is computed once (~130 us of header building the writer thread would repeat)."""
    order = sorted(specs, key=lambda kv: (-DTYPE_RANK[kv[1].dtype], kv[0]))
    joined = [(k, torch.empty((rows, *s.shape), dtype=s.dtype, device="meta")) for k, s in order]
    entries = tensor_entries(joined)
    placeholder = shard_metadata(entries, {k: [0] * rows for k, _ in order}, rows)
    header_len = len(build_header(joined, placeholder))
    row_bytes = {k: t[0].numel() * t.element_size() for k, t in joined}
    start = {k: header_len + e["data_offsets"][0] for k, e in entries.items()}
    return _Layout(dict(order), joined, entries, header_len, row_bytes, start)


class ShardStream:
    """Write one self-verifying shard of ``rows`` rows to a NEW file ``path``, piece by piece.

    ``specs``: ``{key: TensorSpec(dtype, trailing shape)}``. :meth:`write` takes
    the next rows of every key (``{key: tensor [n, *trailing]}``, CPU, one ``n``);
    :meth:`finish` writes the header once all ``rows`` arrived and returns the
    shard's :class:`~te_thd.offline_cache.shardfile.ShardRecord`; :meth:`abort`
    closes and removes the file. Pieces are written when :meth:`write` returns:
    the caller may free them at once.
    """

    def __init__(self, path: str, specs: Mapping[str, TensorSpec], rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1 (a shard holds at least one sample)")
        self.path = path
        self.rows = rows
        layout = _layout(tuple(specs.items()), rows)
        self.specs = layout.specs
        self._joined, self._entries, self._header_len = layout.joined, layout.entries, layout.header_len
        self._row_bytes, self._start = layout.row_bytes, layout.start
        self._sums: dict[str, list[int]] = {k: [] for k in self.specs}
        self._runs: dict[str, list[tuple[int, int]]] = {k: [] for k in self.specs}  # (crc, bytes) per piece
        self._cursor = 0
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    @property
    def rows_written(self) -> int:
        return self._cursor

    def write(self, piece: Mapping[str, torch.Tensor]) -> None:
        """Write the next rows: every key of ``specs``, ``[n, *trailing]`` with one ``n``."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed; start a new one")
        counts = {k: piece[k].shape[0] if piece[k].dim() else None for k in self.specs}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise ValueError(
                f"piece of {self.path}: its keys hold different row counts {counts}; every key holds the same rows"
            )
        for k, spec in self.specs.items():
            t = piece[k]
            if t.dtype != spec.dtype or tuple(t.shape[1:]) != spec.shape:
                raise ValueError(
                    f"piece of {self.path}: key {k!r} is {dtype_name(t.dtype)}{list(t.shape)}, the shard holds "
                    f"{spec.describe()} rows"
                )
        n = next(iter(counts.values()))
        assert n is not None
        if self._cursor + n > self.rows:
            raise ValueError(
                f"piece of {self.path}: {n} rows after {self._cursor} overflow the shard's {self.rows} rows"
            )
        # Python between the GIL-free calls (pwrite, hashes) is kept short: the producer's compute
        # thread waits for the GIL whenever it wakes while this thread holds it
        for k in self.specs:
            t = piece[k]
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().to("cpu").contiguous()
            view = byte_view(t)  # t outlives the view: both end with this iteration
            offset = self._start[k] + self._cursor * self._row_bytes[k]
            _pwrite_all(self._fd, view, offset)
            start_writeback(self._fd, offset, view.nbytes)
            self._sums[k] += byte_row_sums(view, n, self._cursor)
            self._runs[k].append((crc32(view), view.nbytes))
        self._cursor += n

    def finish(self) -> ShardRecord:
        """Write the header (all ``rows`` must have arrived), close the file; the shard's record."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed")
        if self._cursor != self.rows:
            raise ValueError(f"shard stream {self.path} got {self._cursor} of its {self.rows} rows; write the rest first")
        header = build_header(self._joined, shard_metadata(self._entries, self._sums, self.rows))
        if len(header) != self._header_len:  # the format's fixed-width fields changed: a bug, never data
            raise AssertionError(f"shard header is {len(header)} bytes, {self._header_len} were reserved")
        fd, self._fd = self._fd, None
        try:
            _pwrite_all(fd, memoryview(header), 0)
        finally:
            os.close(fd)
        crc = crc32(header)
        total = len(header)
        for k in self.specs:  # file order: keys in order, each key's pieces in row order
            for run_crc, nbytes in self._runs[k]:
                crc = crc32_combine(crc, run_crc, nbytes)
                total += nbytes
        return ShardRecord(bytes=total, checksum=format_checksum(crc))

    def abort(self) -> None:
        """Close and remove the file (an unfinished shard is never kept)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        unlink_quietly(self.path)
