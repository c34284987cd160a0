"""One shard file: the safetensors bytes te_thd writes, row piece by row piece, in either layout.

The bytes are exactly those of ``safetensors.torch.save_file(tensors, path, metadata=...)``
with the ``"te_thd"`` metadata entry of :mod:`~te_thd.offline_cache.format.integrity`: an 8-byte
little-endian header length, a compact JSON header padded with spaces to a multiple of 8,
then every tensor's raw bytes, ordered by dtype (safetensors' enum order, descending, which
keeps wider types aligned) and then by name. The tests assert byte equality with ``save_file``.

:class:`ShardStream` is the one serialiser of both layouts. A shard's row count is known
before its first row, so is its header's length (fixed-width checksums): each piece of rows
goes straight from its own memory to its final offset (``pwrite``), is hashed while still in
cache, and the header is written at offset 0 last. A token-layout shard
(:mod:`~te_thd.offline_cache.format.ragged`) holds the per-sample keys as rows, then the ragged
tensors ``[T, ...]`` (the most bytes per token first), then the uint64 block sums. Its token
count is known only after its last row, so its header reserves room for ``rows * L`` tokens,
padded with spaces (valid JSON); the first ragged tensor goes to its final offset, the others
to sibling temp files appended on finish. Not atomic by itself: writers stream into a temp
file and rename it (:mod:`~te_thd.offline_cache.storage.base`).
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from te_thd.args import check_int
from te_thd.offline_cache.format.integrity import (
    byte_row_sums,
    byte_view,
    hash64,
    name_row,
    on_cpu,
    shard_checksum,
    shard_metadata,
)
from te_thd.offline_cache.format.lengths import LengthRule
from te_thd.offline_cache.format.ragged import (
    BLOCK_SUMS,
    StoredTensor,
    TokenLayout,
    block_table,
    check_token_schema,
    encode_offsets,
    row_offsets,
)
from te_thd.offline_cache.format.schema import DTYPE_RANK, DTYPE_TO_ST, TensorSpec, tensor_nbytes
from te_thd.offline_cache.record.run import ShardRecord
from te_thd.offline_cache.storage.base import temp_path_for, unlink_quietly

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian on disk
    raise ImportError(
        "te_thd.offline_cache writes raw tensor memory and needs a little-endian host"
    )

#: widest fidelity figure the header holds (the reservation's placeholder)
_WIDEST_FLOAT = "9.9999e-100"


def tensor_entries(tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> dict[str, Any]:
    """The safetensors header entries (``{name: {dtype, shape, data_offsets}}``) of ``(name, dtype,
    shape)`` tensors in file order."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        n = tensor_nbytes(dtype, shape)
        entries[name] = {
            "dtype": DTYPE_TO_ST[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
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


def copy_range(src: int, dst: int, count: int, dst_offset: int) -> None:
    """Copy bytes ``[0, count)`` of ``src`` to ``dst`` at ``dst_offset`` (in the kernel where it
    can)."""
    src_off = 0
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, count, src_off, dst_offset)
        # no copy_file_range here (or across these files): read and write
        except (AttributeError, OSError):
            n = 0
        if n <= 0:
            chunk = os.pread(src, min(count, 8 << 20), src_off)
            if not chunk:
                raise OSError(f"temp file ended {count} bytes early while finishing a shard")
            n = os.pwrite(dst, chunk, dst_offset)  # a short write: the rest is read again
        src_off += n
        dst_offset += n
        count -= n


@functools.lru_cache(maxsize=16)
def _reserved_len(
    specs: tuple[tuple[str, TensorSpec], ...],
    rows: int,
    run: str | None,
    tokens: TokenLayout | None,
    rule: LengthRule | None,
) -> int:
    """:func:`shard_header_len` (``run``: the run record's JSON); the same for every full shard of a
    cache, so it is computed once."""
    stream = ShardStream(
        None, dict(specs), rows, json.loads(run) if run is not None else None, tokens, rule
    )
    return len(stream.header(final=False))


def shard_header_len(
    specs: Mapping[str, TensorSpec],
    rows: int,
    run: Mapping[str, Any] | None = None,
    tokens: TokenLayout | None = None,
    rule: LengthRule | None = None,
) -> int:
    """Bytes (length prefix included) of the header :class:`ShardStream` reserves for a ``rows``-row
    shard of ``specs`` with the run record ``run``: a padded shard's header, or the most a token
    shard's rows can need (padded with spaces once the real one is written)."""
    return _reserved_len(
        tuple(specs.items()),
        rows,
        json.dumps(dict(run), sort_keys=True) if run is not None else None,
        tokens,
        rule,
    )


class ShardStream:
    """Write one self-verifying shard of ``rows`` rows to a NEW file ``path``, piece by piece.

    ``specs``: ``{key: TensorSpec(dtype, trailing shape)}`` (a token key's logical ``[L, ...]``).
    :meth:`write` writes the next rows of every key (``[n, *trailing]``, one ``n``) before it
    returns; :meth:`finish` writes the header and returns the :class:`ShardRecord`; :meth:`abort`
    removes the files. ``run``: the producer's run record, kept in the header. ``rule`` (a
    ``LengthRule``): each row's length, recorded; with ``tokens`` (a ``TokenLayout``) the token
    keys are stored ragged. ``first_sample``: the global index of row 0, for messages. Pieces are
    checked by the writer, once
    (:meth:`~te_thd.offline_cache.write.writer.DurableShardWriter.validate`).
    ``path=None`` opens nothing: the stream only lays the shard out.
    """

    def __init__(
        self,
        path: str | None,
        specs: Mapping[str, TensorSpec],
        rows: int,
        run: Mapping[str, Any] | None = None,
        tokens: TokenLayout | None = None,
        rule: LengthRule | None = None,
        first_sample: int | None = None,
    ) -> None:
        check_int("rows", rows, 0, meaning=" (the samples the shard holds)")
        self.path, self.rows, self.tokens, self.rule = path, rows, tokens, rule
        self._first = first_sample
        self._run = dict(run) if run is not None else None
        self.specs = dict(specs)
        self.width = check_token_schema(tokens, self.specs) if tokens is not None else 0
        self.stored: list[StoredTensor] = tokens.stored(self.specs) if tokens is not None else []
        fixed = [(k, s) for k, s in self.specs.items() if tokens is None or k not in tokens.keys]
        self._fixed = sorted(fixed, key=lambda kv: (-DTYPE_RANK[kv[1].dtype], kv[0]))
        self._row_bytes = {k: tensor_nbytes(s.dtype, s.shape) for k, s in self._fixed}
        self._sums: dict[str, list[int]] = {k: [] for k, _ in self._fixed}
        self._block_sums: dict[str, list[int]] = {s.name: [] for s in self.stored}
        self._lengths: list[int] = []
        self._tokens = self._cursor = 0
        self._err = (
            {k: [0.0, 0.0, 0] for k in tokens.lossy_keys} if tokens is not None else {}
        )  # max, sum, count
        self._side: dict[str, tuple[str, int]] = {}
        self._fd: int | None = None
        if path is None:  # the layout only (:func:`shard_header_len`): no file
            return
        self._header_len = shard_header_len(self.specs, rows, self._run, tokens, rule)
        self._start: dict[str, int] = {}
        pos = self._header_len
        for k, _ in self._fixed:
            self._start[k] = pos
            pos += self._row_bytes[k] * rows
        self._ragged_start = pos  # the first ragged tensor's file offset
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for s in self.stored[1:]:
                side = temp_path_for(path + "." + s.name.replace("@", "."))
                self._side[s.name] = (
                    side,
                    os.open(side, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644),
                )
        except BaseException:
            self.abort()
            raise

    def header(self, final: bool, blocks_digest: str = "0" * 16) -> bytes:
        """The header: the real one (``final``: every row written), else the reservation's, whose
        checksums, offsets and figures are placeholders of their widest size."""
        tokens = self._tokens if final else self.rows * self.width
        if final:
            blocks = sum(len(v) for v in self._block_sums.values())
        else:  # every row at full width
            blocks = sum(self.rows * -(-self.width // s.block_tokens) for s in self.stored)
        entries = self._entries(tokens, blocks)
        fields = None
        if self.tokens is not None:
            assert self.rule is not None  # the writer requires one with a token layout
            offsets = row_offsets(
                np.asarray(self._lengths if final else [0] * self.rows, dtype=np.int64)
            )
            fidelity = {
                k: _fidelity(e)
                if final
                else dict.fromkeys(("max_rel_l2", "mean_rel_l2"), _WIDEST_FLOAT)
                for k, e in self._err.items()
            }
            fields = {
                "layout": self.tokens.to_json(),
                "logical": {k: self.specs[k].to_json() for k in self.tokens.keys},
                "length_rule": self.rule.to_json(),
                "offsets": encode_offsets(offsets),
                "stored": {
                    s.name: {"key": s.key, "role": s.role, "block_tokens": s.block_tokens}
                    for s in self.stored
                },
                "block_sums": BLOCK_SUMS,
                "block_sums_digest": blocks_digest,
                "fidelity": fidelity,
            }
        sums = {k: v if final else [0] * self.rows for k, v in self._sums.items()}
        metadata, self._digest = shard_metadata(entries, sums, self.rows, fields, self._run)
        return build_header(entries, metadata)

    def _entries(self, tokens: int, blocks: int) -> dict[str, Any]:
        """The header entries, in file order, of this shard holding ``tokens`` tokens in each ragged
        tensor and ``blocks`` block sums."""
        return tensor_entries(
            [(k, s.dtype, [self.rows, *s.shape]) for k, s in self._fixed]
            + [(s.name, s.dtype, [tokens, *s.shape]) for s in self.stored]
            + ([(BLOCK_SUMS, torch.uint64, [blocks])] if self.tokens is not None else [])
        )

    def file_bytes(self, lengths: np.ndarray) -> int:
        """Bytes of this shard's file when its rows hold ``lengths`` real tokens (int64 ``[rows]``;
        unused without a token layout): the reserved header and every tensor, as :meth:`finish`
        lays them out. A layout-only stream (``path=None``) prices a shard without writing it."""
        offsets = row_offsets(lengths)
        blocks = sum(block_table(offsets, s.block_tokens).blocks for s in self.stored)
        data = self._entries(int(offsets[-1]), blocks).values()
        header = shard_header_len(self.specs, self.rows, self._run, self.tokens, self.rule)
        return header + max((e["data_offsets"][1] for e in data), default=0)

    def write(self, piece: Mapping[str, torch.Tensor]) -> None:
        """Write the next rows: every key of ``specs``, ``[n, *trailing]`` with one ``n``."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed; start a new one")
        n = next((piece[k].shape[0] for k in self.specs), 0)
        piece = {k: on_cpu(piece[k]) for k in self.specs}
        lengths = self.rule.lengths(piece[self.rule.key]) if self.rule is not None else None
        if self.tokens is not None:
            bad = np.flatnonzero((lengths < 0) | (lengths > self.width))
            if bad.size:
                which = name_row(self._cursor + int(bad[0]), self._first)
                raise ValueError(
                    f"{which} has length {int(lengths[bad[0]])} by "
                    f"{self.rule.describe()}, outside [0, L={self.width}]: "
                    "compute_batch's length key must give each sample's real token "
                    "count; nothing of this shard was kept"
                )
        # little Python between the GIL-free calls (pwrite, hashes): a producer's compute thread
        # waits for the GIL whenever it wakes while this thread holds it
        for k, _ in self._fixed:
            view = byte_view(piece[k])
            pwrite_all(self._fd, view, self._start[k] + self._cursor * self._row_bytes[k])
            self._sums[k] += byte_row_sums(view, n, self._cursor)
        if self.tokens is not None:
            self._write_ragged(piece, lengths, n)
        if lengths is not None:
            self._lengths += lengths.tolist()
        self._cursor += n

    def _write_ragged(self, piece: Mapping[str, torch.Tensor], lengths: np.ndarray, n: int) -> None:
        """Each row's first ``lengths`` tokens of every token key (encoded where a codec says), and
        the block sums of each ragged tensor."""
        assert self.tokens is not None and self._fd is not None
        real_slots = torch.arange(self.width).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)
        flat = torch.nonzero(real_slots.view(-1))
        local = row_offsets(lengths)
        data: dict[str, torch.Tensor] = {}
        for key in self.tokens.keys:
            v = piece[key]
            real = v.reshape(n * self.width, *v.shape[2:]).index_select(0, flat.view(-1))
            codec = self.tokens.codec(key)
            if codec is None:
                data[key + "@tokens"] = real.contiguous()
                continue
            bad = codec.out_of_range(real)
            if bad is not None:
                row = int(np.searchsorted(local, bad[0], side="right")) - 1
                which = name_row(self._cursor + row, self._first)
                raise ValueError(
                    f"{which}: {codec.range_problem(key, bad[1])}; nothing of this shard was kept"
                )
            parts, err = codec.encode(real)
            data.update({f"{key}@{role}": t.contiguous() for role, t in parts.items()})
            if err is not None and err.numel():
                e = self._err[key]
                e[0] = max(e[0], float(err.max()))
                e[1] += float(err.double().sum())
                e[2] += int(err.numel())
        for s in self.stored:
            view, tb = byte_view(data[s.name]), s.token_bytes
            if s is self.stored[0]:
                pwrite_all(self._fd, view, self._ragged_start + self._tokens * tb)
            else:
                pwrite_all(self._side[s.name][1], view, self._tokens * tb)
            first = len(self._block_sums[s.name])
            starts = block_table(local, s.block_tokens).start.tolist()
            self._block_sums[s.name] += [
                hash64(view[a * tb : b * tb], first + g)
                for g, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True))
            ]
        self._tokens += int(local[-1])

    def finish(self) -> ShardRecord:
        """Append the other ragged tensors and the block sums, write the header (all ``rows`` must
        have arrived), close the files; the shard's record."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed")
        if self._cursor != self.rows:
            raise ValueError(
                f"shard stream {self.path} got {self._cursor} of its {self.rows} rows; "
                "write the rest first"
            )
        fd = self._fd
        try:
            pos = self._ragged_start + (
                self._tokens * self.stored[0].token_bytes if self.stored else 0
            )
            for s in self.stored[1:]:
                n = self._tokens * s.token_bytes
                copy_range(self._side[s.name][1], fd, n, pos)
                pos += n
            digest = "0" * 16
            if self.tokens is not None:
                sums = np.asarray(
                    [v for s in self.stored for v in self._block_sums[s.name]], dtype="<u8"
                )
                pwrite_all(fd, memoryview(sums.tobytes()), pos)
                pos += sums.nbytes
                digest = f"{hash64(sums.tobytes()):016x}"
            header = self.header(final=True, blocks_digest=digest)
            # the reservation is the most any rows can need, and exactly a padded shard's: else a
            # bug, never data
            if len(header) > self._header_len or (
                self.tokens is None and len(header) != self._header_len
            ):
                raise AssertionError(
                    f"shard header is {len(header)} bytes, {self._header_len} were reserved"
                )
            # spaces up to the reserved length
            body = header[8:] + b" " * (self._header_len - len(header))
            pwrite_all(fd, memoryview(len(body).to_bytes(8, "little") + body), 0)
        except BaseException:
            self.abort()
            raise
        self._fd = None
        os.close(fd)
        self._close_side()
        fidelity = {
            k: {name: float(v) for name, v in _fidelity(e).items()} for k, e in self._err.items()
        }
        lengths = tuple(self._lengths) if self.rule is not None else None
        return ShardRecord(
            bytes=pos,
            checksum=shard_checksum(self._digest),
            lengths=lengths,
            fidelity=fidelity or None,
        )

    def _close_side(self) -> None:
        side, self._side = self._side, {}
        for path, fd in side.values():
            os.close(fd)
            unlink_quietly(path)

    def abort(self) -> None:
        """Close and remove the files (an unfinished shard is never kept)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._close_side()
        if self.path is not None:
            unlink_quietly(self.path)


def _fidelity(err: list[float]) -> dict[str, str]:
    """What a codec lost over a shard, as its header records it: from ``[max, sum, count]``."""
    return {
        "max_rel_l2": f"{err[0]:.4e}",
        "mean_rel_l2": f"{err[1] / err[2] if err[2] else 0.0:.4e}",
    }
