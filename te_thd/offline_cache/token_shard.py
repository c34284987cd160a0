"""Write one token-layout shard: per-sample keys as rows, token keys ragged (:mod:`~te_thd.offline_cache.tokens`).

The file is valid safetensors::

    [8-byte length][header, padded with spaces to the length reserved up front]
    [per-sample keys, [rows, ...] each, ordered as ShardStream orders them]
    [ragged tensors, [T, ...] each, the one with the most bytes per token first]
    [block sums, uint64 [blocks of every ragged tensor]]

A shard's row count is known before its first row, its token count only after its
last. So the header's space is reserved for the most tokens the rows can hold
(``rows * L``) and padded with spaces (valid JSON, which safetensors accepts), the
per-sample keys and the first ragged tensor -- whose start is known -- are written
straight to their final offsets as pieces arrive, and the other ragged tensors
(fewer bytes: scales, ids, log-probs) go to sibling temp files appended to the shard
(``copy_file_range``) when it is finished. Nothing is held in memory beyond a piece.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from te_thd.args import check_int
from te_thd.offline_cache.codecs import encode, is_lossy, out_of_range, range_problem
from te_thd.offline_cache.durable import temp_path_for, unlink_quietly
from te_thd.offline_cache.format import DTYPE_RANK, DTYPE_TO_ST, TensorSpec, tensor_nbytes
from te_thd.offline_cache.integrity import (
    byte_row_sums,
    byte_view,
    on_cpu,
    shard_checksum,
    shard_metadata,
)
from te_thd.offline_cache.lengths import LengthRule
from te_thd.offline_cache.shardfile import (
    ShardRecord,
    build_header,
    piece_rows,
    pwrite_all,
)
from te_thd.offline_cache.tokens import (
    BLOCK_SUMS,
    StoredTensor,
    TokenLayout,
    block_table,
    check_token_schema,
    encode_offsets,
    row_offsets,
)

_hash = xxhash.xxh3_64_intdigest
#: widest fidelity figure the header holds (the reservation's placeholder)
_WIDEST_FLOAT = "9.9999e-100"


def _fmt(v: float) -> str:
    return f"{v:.4e}"


class TokenShardStream:
    """Write one token-layout shard of ``rows`` rows to a NEW file ``path``, piece by piece.

    ``specs``: the logical ``{key: TensorSpec}`` of every stored key (token keys
    ``[L, ...]`` per sample); ``layout``: which keys are ragged and their codecs;
    ``rule``: how each sample's length is read from its piece (the tokens kept).
    Same interface as :class:`~te_thd.offline_cache.shardfile.ShardStream`:
    :meth:`write` the next rows (logical, padded ``[n, L, ...]`` for token keys),
    :meth:`finish` returns the :class:`ShardRecord`, :meth:`abort` removes the files.
    ``run``: the producer's run record, kept in the header. ``path=None`` opens nothing: the
    stream only lays the shard out (:func:`reserved_header_len`).
    """

    def __init__(
        self, path: str | None, specs: Mapping[str, TensorSpec], rows: int, layout: TokenLayout, rule: LengthRule,
        run: Mapping[str, Any] | None = None, first_sample: int | None = None,
    ) -> None:  # fmt: skip
        check_int("rows", rows, 0, meaning=" (the samples the shard holds)")
        self._run = dict(run) if run is not None else None
        self._first = first_sample  # the global index of row 0, when the writer knows it (for messages)
        self.path, self.rows, self.layout, self.rule = path, rows, layout, rule
        self.specs = dict(specs)
        self.width = check_token_schema(layout, self.specs)
        fixed = [(k, s) for k, s in self.specs.items() if k not in layout.keys]
        self._fixed = sorted(fixed, key=lambda kv: (-DTYPE_RANK[kv[1].dtype], kv[0]))
        self._row_bytes = {k: tensor_nbytes(s.dtype, s.shape) for k, s in self._fixed}
        self.stored: list[StoredTensor] = layout.stored(self.specs)
        self._sums: dict[str, list[int]] = {k: [] for k, _ in self._fixed}
        self._block_sums: dict[str, list[int]] = {s.name: [] for s in self.stored}
        self._lengths: list[int] = []
        self._tokens = 0
        self._cursor = 0
        self._err: dict[str, list[float]] = {k: [0.0, 0.0, 0] for k, c in layout.codecs if is_lossy(c)}  # max, sum, count
        self._header_len = len(self._header(rows * self.width, None))
        self._fixed_start: dict[str, int] = {}
        pos = self._header_len
        for k, _ in self._fixed:
            self._fixed_start[k] = pos
            pos += self._row_bytes[k] * rows
        self._ragged_start = pos  # the first ragged tensor's file offset
        self._side: dict[str, tuple[str, int]] = {}
        self._fd: int | None = None
        if path is None:  # the layout only (:func:`reserved_header_len`): no file
            return
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for s in self.stored[1:]:
                side = temp_path_for(path + "." + s.name.replace("@", "."))
                self._side[s.name] = (side, os.open(side, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
        except BaseException:
            self.abort()
            raise

    # -- the header -----------------------------------------------------------------

    def _entries(self, tokens: int) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        offset = 0

        def add(name: str, dtype: torch.dtype, shape: list[int]) -> None:
            nonlocal offset
            n = tensor_nbytes(dtype, shape)
            entries[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n

        for k, spec in self._fixed:
            add(k, spec.dtype, [self.rows, *spec.shape])
        for s in self.stored:
            add(s.name, s.dtype, [tokens, *s.shape])
        blocks = self._blocks_total(tokens)
        add(BLOCK_SUMS, torch.uint64, [blocks])
        return entries

    def _blocks_total(self, tokens: int) -> int:
        if self._cursor == self.rows and tokens == self._tokens and self.rows:  # finished: the real count
            return sum(len(v) for v in self._block_sums.values())
        # the reservation: every row at full width
        return sum(self.rows * -(-self.width // s.block_tokens) for s in self.stored)

    def _header(self, tokens: int, blocks_digest: str | None) -> bytes:
        entries = self._entries(tokens)
        real = blocks_digest is not None
        offsets = row_offsets(np.asarray(self._lengths if real else [0] * self.rows, dtype=np.int64))
        fidelity = {
            k: {
                "max_rel_l2": _fmt(e[0]) if real else _WIDEST_FLOAT,
                "mean_rel_l2": _fmt(e[1] / e[2] if e[2] else 0.0) if real else _WIDEST_FLOAT,
            }
            for k, e in self._err.items()
        }
        tokens_fields = {
            "layout": self.layout.to_json(),
            "logical": {k: self.specs[k].to_json() for k in self.layout.keys},
            "length_rule": self.rule.to_json(),
            "offsets": encode_offsets(offsets),
            "stored": {s.name: {"key": s.key, "role": s.role, "block_tokens": s.block_tokens} for s in self.stored},
            "block_sums": BLOCK_SUMS,
            "block_sums_digest": blocks_digest if real else "0" * 16,
            "fidelity": fidelity,
        }
        sums = {k: v if real else [0] * self.rows for k, v in self._sums.items()}
        metadata, self._digest = shard_metadata(entries, sums, self.rows, tokens_fields, self._run)
        return build_header(entries, metadata)

    # -- rows ----------------------------------------------------------------------------

    def write(self, piece: Mapping[str, torch.Tensor]) -> None:
        """Write the next rows: every key of ``specs`` (token keys padded ``[n, L, ...]``), one ``n``."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed; start a new one")
        n = piece_rows(self.specs, piece)
        piece = {k: on_cpu(t) for k, t in piece.items() if k in self.specs}
        lengths = self.rule.lengths(piece[self.rule.key])
        bad = np.flatnonzero((lengths < 0) | (lengths > self.width))
        if bad.size:
            raise ValueError(
                f"{self._which(int(bad[0]))} has length {int(lengths[bad[0]])} by {self.rule.describe()}, outside [0, L={self.width}]: "
                "compute_batch's length key must give each sample's real token count; nothing of this shard was kept"
            )
        for k, _ in self._fixed:
            view = byte_view(piece[k])
            pwrite_all(self._fd, view, self._fixed_start[k] + self._cursor * self._row_bytes[k])
            self._sums[k] += byte_row_sums(view, n, self._cursor)
        valid = torch.arange(self.width).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)
        flat = torch.nonzero(valid.view(-1)).view(-1)
        local = row_offsets(lengths)
        tokens = int(local[-1])
        data = self._ragged_data(piece, flat, n, local)
        for s in self.stored:
            t = data[s.name]
            view = byte_view(t)
            if s is self.stored[0]:
                pwrite_all(self._fd, view, self._ragged_start + self._tokens * s.token_bytes)
            else:
                pwrite_all(self._side[s.name][1], view, self._tokens * s.token_bytes)
            table = block_table(local, s.block_tokens)
            first = len(self._block_sums[s.name])
            tb = s.token_bytes
            starts = table.start.tolist()
            self._block_sums[s.name] += [
                _hash(view[a * tb : b * tb], first + g) for g, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True))
            ]
        self._lengths += lengths.tolist()
        self._tokens += tokens
        self._cursor += n

    def _which(self, row: int) -> str:
        """Row ``row`` of this piece in messages: its global sample where the writer knows it."""
        row += self._cursor
        return f"row {row} of the shard" if self._first is None else f"sample {self._first + row} (row {row} of the shard)"

    def _ragged_data(
        self, piece: Mapping[str, torch.Tensor], flat: torch.Tensor, n: int, local: np.ndarray
    ) -> dict[str, torch.Tensor]:
        """Each ragged tensor's bytes of this piece: ``{name: [tokens, ...]}`` (encoded where a codec says);
        ``local``: the piece's row offsets (:func:`~te_thd.offline_cache.tokens.row_offsets`)."""
        out: dict[str, torch.Tensor] = {}
        for key in self.layout.keys:
            v = piece[key]
            real = v.reshape(n * self.width, *v.shape[2:]).index_select(0, flat)
            codec = self.layout.codec(key)
            if codec is None:
                out[key + "@tokens"] = real.contiguous()
                continue
            bad = out_of_range(real, codec)
            if bad is not None:
                row = int(np.searchsorted(local, bad[0], side="right")) - 1
                raise ValueError(f"{self._which(row)}: {range_problem(key, codec, bad[1])}; nothing of this shard was kept")
            parts, err = encode(codec, real)
            out.update({f"{key}@{role}": t.contiguous() for role, t in parts.items()})
            if err is None:
                continue
            e = self._err[key]
            if err.numel():
                e[0] = max(e[0], float(err.max()))
                e[1] += float(err.double().sum())
                e[2] += int(err.numel())
        return out

    def finish(self) -> ShardRecord:
        """Append the other ragged tensors and the block sums, write the header, close; the record."""
        if self._fd is None:
            raise ValueError(f"shard stream {self.path} is closed")
        if self._cursor != self.rows:
            raise ValueError(f"shard stream {self.path} got {self._cursor} of its {self.rows} rows; write the rest first")
        fd = self._fd
        try:
            pos = self._ragged_start + self._tokens * self.stored[0].token_bytes if self.stored else self._ragged_start
            for s in self.stored[1:]:
                n = self._tokens * s.token_bytes
                _copy_range(self._side[s.name][1], fd, n, pos)
                pos += n
            sums = np.asarray([v for s in self.stored for v in self._block_sums[s.name]], dtype="<u8")
            pwrite_all(fd, memoryview(sums.tobytes()), pos)
            pos += sums.nbytes
            header = self._header(self._tokens, f"{_hash(sums.tobytes()):016x}")
            if len(header) > self._header_len:  # the reservation is the most any rows can need: a bug
                raise AssertionError(f"token shard header is {len(header)} bytes, {self._header_len} were reserved")
            # pad the JSON with spaces to the reserved length (and the length prefix to match)
            body = header[8:] + b" " * (self._header_len - len(header))
            pwrite_all(fd, memoryview(len(body).to_bytes(8, "little") + body), 0)
        except BaseException:
            self.abort()
            raise
        self._fd = None
        os.close(fd)
        self._close_side()
        fidelity = {k: {"max_rel_l2": float(_fmt(e[0])), "mean_rel_l2": float(_fmt(e[1] / e[2] if e[2] else 0.0))}
                    for k, e in self._err.items()}  # fmt: skip
        return ShardRecord(bytes=pos, checksum=shard_checksum(self._digest), fidelity=fidelity or None)

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
        unlink_quietly(self.path)


def reserved_header_len(
    specs: Mapping[str, TensorSpec], rows: int, layout: TokenLayout, rule: LengthRule, run: Mapping[str, Any] | None = None
) -> int:
    """Bytes (length prefix included) of the header a token shard of ``rows`` rows reserves: the most
    its rows can need, padded with spaces once the real one is written, so the file's size."""
    return TokenShardStream(None, specs, rows, layout, rule, run)._header_len


def _copy_range(src: int, dst: int, count: int, dst_offset: int) -> None:
    """Copy bytes ``[0, count)`` of ``src`` to ``dst`` at ``dst_offset`` (in the kernel where it can)."""
    src_off = 0
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, count, src_off, dst_offset)
        except (AttributeError, OSError):  # no copy_file_range here (or across these files): read and write
            n = 0
        if n <= 0:
            chunk = os.pread(src, min(count, 8 << 20), src_off)
            if not chunk:
                raise OSError(f"temp file ended {count} bytes early while finishing a shard")
            pwrite_all(dst, memoryview(chunk), dst_offset)
            n = len(chunk)
        src_off += n
        dst_offset += n
        count -= n
