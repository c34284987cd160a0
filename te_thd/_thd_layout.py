"""Pure pack-layout math behind :mod:`te_thd.thd_utils` (numpy, host side).

Everything here works on small host arrays (``[B, P]`` length tables) and is a
pure function: no torch, no devices, no hidden state. The torch-facing module
turns tensors into these arrays, calls :func:`stream_layout` (one stream, the
hot path) or :func:`pack_layout` (chunked), and wraps the result. At these sizes
a numpy call costs about a microsecond and the data almost nothing, so the code
counts calls: that is why some steps use ``count_nonzero``, ``argmax`` or a
bytes comparison instead of the obvious reduction.

Layout rules implemented here:

* Row ``b`` of a ``[B, S]`` batch starts at stream offset ``b*S``. Its valid
  (non-sentinel) pack slots hold sequences back to back; sequence ``i`` occupies
  ``seq_lens_padded[b, i]`` slots of which the first ``seq_lens[b, i]`` are real.
* **Physical boundaries** (``cu_seqlens_padded``) are the true start offsets of
  the sequences, plus the stream end. Slots a row's padded lengths leave unused
  (the row tail), and whole rows without sequences, are padding owned by the
  nearest preceding sequence: its physical segment runs up to the next
  sequence's start. So ``cu_seqlens_padded`` is monotone, starts at 0, ends at
  the stream length, and accounts for every token, as TE's THD kernels and CP
  partitioning require. The reference implementation instead cumsums padded
  lengths across rows, which points into the wrong row when a row is not filled.
* **Attention boundaries** (``cu_seqlens``) are the cumulative real lengths.
* **Trailing-pad absorption** (causal masks only): when both arrays agree on
  every entry but the last, the last sequence is grown to the stream end.

Chunking (``num_chunks`` equal groups of rows) is the general case; the
unchunked conversion is ``num_chunks == 1``. Each chunk is its own stream of
``rows_per_chunk * S`` tokens with its own boundaries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Boundaries are int32 for TE; the stream length must fit.
# A Python int: comparing an int with a numpy scalar is several times slower.
_INT32_MAX = int(np.iinfo(np.int32).max)
# Comparing with a 0-d int64 array skips the ~0.25 us Python-int conversion.
_ONE = np.array(1, dtype=np.int64)


class PackLayout(NamedTuple):
    """Boundaries and padding of a (possibly chunked) packed stream.

    Attributes:
        cu_seqlens: int32 ``[C, maxN+1]``; row ``c`` holds ``num_seqs[c]+1``
            cumulative real lengths (after absorption) then the sentinel.
        cu_seqlens_padded: int32 ``[C, maxN+1]``; physical start offsets of the
            chunk's sequences relative to the chunk start, then the chunk length
            ``rows_per_chunk*S``, then the sentinel.
        num_seqs: int64 ``[C]``; sequences per chunk (valid entries are the first
            ``num_seqs[c] + 1`` of each boundary row).
        max_seqlen: int32 ``[C]``; ``max(diff(cu_seqlens[c, :num_seqs[c]+1]))``.
        pad_between_seqs: bool ``[C]``; the complete boundary arrays differ.
        padding_mask: bool ``[B*S]``; True where a slot holds no real token.
    """

    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    num_seqs: np.ndarray
    max_seqlen: np.ndarray
    pad_between_seqs: np.ndarray
    padding_mask: np.ndarray


class StreamLayout(NamedTuple):
    """Boundaries and padding of ONE packed stream (the unchunked conversion).

    Attributes:
        cu_seqlens: int32 ``[N+1]`` cumulative real lengths (after absorption).
        cu_seqlens_padded: int32 ``[N+1]`` physical starts, then the stream length.
        num_seqs: ``N``.
        max_seqlen: ``max(diff(cu_seqlens))``.
        pad_between_seqs: the two complete arrays differ.
        padding_mask: bool ``[B*S]``, True where a slot holds no real token.
    """

    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    num_seqs: int
    max_seqlen: int
    pad_between_seqs: bool
    padding_mask: np.ndarray


def _first_index(bad: np.ndarray) -> tuple[int, ...]:
    """Index of the first True entry of ``bad`` (error path only)."""
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _fmt(index: tuple[int, ...]) -> str:
    return ", ".join(str(i) for i in index)


def validate_pack_lengths(
    seq_lens: np.ndarray,
    seq_lens_padded: np.ndarray,
    seq_len: int,
    sentinel: int,
    rows_per_chunk: int,
) -> np.ndarray:
    """Check a ``[B, P]`` pair of length tables; return the valid-slot mask.

    Args:
        seq_lens: integer ``[B, P]`` real lengths, ``sentinel`` in unused slots.
        seq_lens_padded: integer ``[B, P]`` slot counts, same sentinel layout.
        seq_len: ``S``, the row length of the token batch.
        sentinel: ``seq_lens_padding_value``.
        rows_per_chunk: rows per chunk (``B`` when unchunked); the first row of
            every chunk must hold a sequence.

    Returns:
        bool ``[B, P]``, True for slots that hold a sequence.

    Raises:
        ValueError: naming the argument, the offending value and the fix.
    """
    valid = seq_lens != sentinel
    valid_padded = seq_lens_padded != sentinel
    if not np.array_equal(valid, valid_padded):
        i = _first_index(valid != valid_padded)
        raise ValueError(
            f"seq_lens and seq_lens_padded disagree on unused pack slots: at [{_fmt(i)}] "
            f"seq_lens={int(seq_lens[i])} but seq_lens_padded={int(seq_lens_padded[i])} "
            f"(sentinel seq_lens_padding_value={sentinel}). Put the sentinel in the same "
            "slots of both tables."
        )
    bad = valid & (seq_lens <= 0)
    if bad.any():
        i = _first_index(bad)
        raise ValueError(
            f"seq_lens[{_fmt(i)}]={int(seq_lens[i])} is not a positive length and not the "
            f"sentinel seq_lens_padding_value={sentinel}. Use a length >= 1 for a packed "
            f"sequence or {sentinel} for an unused pack slot."
        )
    bad = valid & (seq_lens > seq_lens_padded)
    if bad.any():
        i = _first_index(bad)
        raise ValueError(
            f"seq_lens[{_fmt(i)}]={int(seq_lens[i])} exceeds seq_lens_padded[{_fmt(i)}]="
            f"{int(seq_lens_padded[i])}: a sequence cannot hold more real tokens than the "
            "slots it occupies. seq_lens_padded must be >= seq_lens (real + its padding)."
        )
    bad = valid & (seq_lens_padded > seq_len)
    if bad.any():
        i = _first_index(bad)
        raise ValueError(
            f"seq_lens_padded[{_fmt(i)}]={int(seq_lens_padded[i])} exceeds the row length "
            f"S={seq_len} (input_ids.shape[1]): a sequence must fit in its row. Repack, or "
            "use longer rows."
        )
    # Every slot is now in [1, S], so these int64 row sums cannot wrap.
    row_slots = np.where(valid, seq_lens_padded, 0).sum(axis=1, dtype=np.int64)
    bad_rows = row_slots > seq_len
    if bad_rows.any():
        b = int(np.argmax(bad_rows))
        raise ValueError(
            f"seq_lens_padded row {b} occupies {int(row_slots[b])} slots but the batch rows "
            f"hold S={seq_len} tokens (input_ids.shape[1]). Each row's padded lengths must "
            "sum to at most S; repack so every sequence fits in its row."
        )
    first_rows = valid[::rows_per_chunk]
    empty = ~first_rows.any(axis=1)
    if empty.any():
        c = int(np.argmax(empty))
        where = (
            f"chunk {c} (batch row {c * rows_per_chunk})"
            if rows_per_chunk < len(valid)
            else "row 0"
        )
        raise ValueError(
            f"seq_lens {where} holds no sequence (every slot is the sentinel {sentinel}), so "
            "the stream would start with tokens that belong to no sequence. Put rows without "
            "sequences after rows with sequences (their slots then count as padding of the "
            "preceding sequence), or drop them from the batch."
        )
    return valid


def pack_layout(
    seq_lens: np.ndarray,
    seq_lens_padded: np.ndarray,
    seq_len: int,
    sentinel: int,
    num_chunks: int = 1,
    absorb_trailing_pad: bool = True,
    *,
    validate: bool = True,
) -> PackLayout:
    """Boundaries, per-chunk metadata and padding mask of a packed batch.

    Args:
        seq_lens: integer ``[B, P]`` real lengths (``sentinel`` = unused slot).
        seq_lens_padded: integer ``[B, P]`` slot counts (same sentinel slots).
        seq_len: ``S``, tokens per batch row.
        sentinel: ``seq_lens_padding_value``; also right-pads boundary rows.
        num_chunks: ``C``, must divide ``B``; each chunk is converted on its own.
        absorb_trailing_pad: grow the last sequence over trailing pad when the
            boundary arrays agree everywhere else (causal attention only).
        validate: run :func:`validate_pack_lengths` first.

    Returns:
        A :class:`PackLayout`; see its attribute docs for shapes and dtypes.
    """
    batch, slots = seq_lens.shape
    rows = batch // num_chunks
    chunk_tokens = rows * seq_len
    valid, start, _ = _slot_starts(seq_lens, seq_lens_padded, seq_len, sentinel, rows, validate)
    real = seq_lens * valid  # unused slots: 0

    if num_chunks == 1:
        one = _single_stream(start[valid], seq_lens[valid], chunk_tokens, absorb_trailing_pad)
        return PackLayout(
            one.cu_seqlens[None],
            one.cu_seqlens_padded[None],
            np.array([one.num_seqs]),
            np.array([one.max_seqlen], dtype=np.int32),
            np.array([one.pad_between_seqs]),
            one.padding_mask,
        )

    padding_mask = _mask_from_starts(start.ravel(), real.ravel(), batch * seq_len)

    # Per chunk: move valid slots to the front (stable keeps stream order).
    start = start.reshape(num_chunks, rows * slots)
    start -= (np.arange(num_chunks, dtype=np.int64) * chunk_tokens)[:, None]
    real = real.reshape(num_chunks, rows * slots)
    valid = valid.reshape(num_chunks, rows * slots)
    num_seqs = valid.sum(axis=1)
    max_n = int(num_seqs.max())
    if not valid[:, :max_n].all():
        order = np.argsort(~valid, axis=1, kind="stable")[:, :max_n]
        start = np.take_along_axis(start, order, axis=1)
        real = np.take_along_axis(real, order, axis=1)  # slots past num_seqs hold 0
    else:
        start = start[:, :max_n]
        real = real[:, :max_n]

    col = np.arange(max_n + 1)
    last = num_seqs[:, None]
    beyond = col > last  # sentinel columns
    at_end = col == last

    cu_padded = np.empty((num_chunks, max_n + 1), dtype=np.int64)
    cu_padded[:, :max_n] = start
    cu_padded[:, max_n] = 0
    cu_padded[at_end] = chunk_tokens

    cu = np.zeros((num_chunks, max_n + 1), dtype=np.int64)
    np.cumsum(real, axis=1, out=cu[:, 1:])

    if absorb_trailing_pad:
        # See _single_stream for why absorbing is right (causal masks only).
        inner_equal = ((cu == cu_padded) | (col >= last)).all(axis=1)
        cu[inner_equal[:, None] & at_end] = chunk_tokens
    pad_between = ((cu != cu_padded) & ~beyond).any(axis=1)

    seg = np.diff(cu, axis=1)
    seg[beyond[:, 1:]] = 0
    max_seqlen = seg.max(axis=1) if max_n else np.zeros(num_chunks, dtype=np.int64)

    cu[beyond] = sentinel
    cu_padded[beyond] = sentinel
    return PackLayout(
        cu_seqlens=cu.astype(np.int32),
        cu_seqlens_padded=cu_padded.astype(np.int32),
        num_seqs=num_seqs,
        max_seqlen=max_seqlen.astype(np.int32),
        pad_between_seqs=pad_between,
        padding_mask=padding_mask,
    )


def stream_layout(
    seq_lens: np.ndarray,
    seq_lens_padded: np.ndarray,
    seq_len: int,
    sentinel: int,
    absorb_trailing_pad: bool = True,
    *,
    validate: bool = True,
) -> StreamLayout:
    """:func:`pack_layout` for ``num_chunks == 1`` with scalars as Python values.

    The hot path of ``process_input_for_thd``: same arguments and rules as
    :func:`pack_layout`, 1-D boundary arrays, no per-chunk bookkeeping.
    """
    valid, start, all_valid = _slot_starts(
        seq_lens, seq_lens_padded, seq_len, sentinel, seq_lens.shape[0], validate
    )
    if all_valid:  # no sentinel: every slot is a sequence, nothing to compact
        start = start.ravel()
        real = seq_lens.ravel()
    else:
        start = start[valid]  # stream order (row-major), unused slots dropped
        real = seq_lens[valid]
    return _single_stream(start, real, seq_lens.shape[0] * seq_len, absorb_trailing_pad)


def _slot_starts(
    seq_lens: np.ndarray,
    seq_lens_padded: np.ndarray,
    seq_len: int,
    sentinel: int,
    rows: int,
    validate: bool,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Validate; return ``valid`` (bool) and each slot's stream ``start`` (int64),
    both ``[B, P]``, and whether every slot is used (no sentinel at all).

    Unused slots get the start right after the preceding sequence's slots.
    """
    # Callers pass int64 tables (thd_utils widens narrower dtypes).
    valid = seq_lens != sentinel
    n_valid = np.count_nonzero(valid)
    all_valid = n_valid == valid.size
    occupied = seq_lens_padded if all_valid else seq_lens_padded * valid
    # End of every slot inside its row. ufunc.accumulate is np.cumsum without
    # its wrapper overhead, which is most of the cost at these sizes. Trusted
    # only after validation (every slot <= S, so the sums cannot wrap).
    end = np.add.accumulate(occupied, axis=1) if seq_lens.shape[1] else occupied
    if validate and not _layout_ok(
        seq_lens, seq_lens_padded, valid, valid.size - n_valid, end, seq_len, sentinel, rows
    ):
        validate_pack_lengths(seq_lens, seq_lens_padded, seq_len, sentinel, rows)
        raise AssertionError("unreachable: validate_pack_lengths accepted a rejected layout")
    # Start of every slot: row offset b*S plus the exclusive prefix sum in the row.
    start = end - occupied
    if seq_lens.shape[0] > 1:  # row 0 starts at 0
        start += _row_offsets(seq_lens.shape[0], seq_len)
    return valid, start, all_valid


_ROW_OFFSETS: dict[tuple[int, int], np.ndarray] = {}


def _row_offsets(batch: int, seq_len: int) -> np.ndarray:
    """int64 ``[B, 1]`` row starts ``b*S`` (cached: shapes repeat every step)."""
    key = (batch, seq_len)
    off = _ROW_OFFSETS.get(key)
    if off is None:
        off = (np.arange(batch, dtype=np.int64) * seq_len)[:, None]
        off.flags.writeable = False
        if len(_ROW_OFFSETS) < 64:
            _ROW_OFFSETS[key] = off
    return off


def _layout_ok(
    seq_lens: np.ndarray,
    seq_lens_padded: np.ndarray,
    valid: np.ndarray,
    n_unused: int,
    end: np.ndarray,
    seq_len: int,
    sentinel: int,
    rows: int,
) -> bool:
    """Fast combined form of every check in :func:`validate_pack_lengths`.

    Elementwise comparisons counted by ``count_nonzero`` (a ufunc reduction
    costs about a microsecond at these sizes, the data almost nothing); the
    per-check diagnosis with its messages only runs when this says something
    is wrong. ``n_unused`` is the number of sentinel slots in ``seq_lens``;
    ``end`` the row-wise cumsum of ``seq_lens_padded`` with unused slots zeroed
    (last column: the row sums).
    """
    if seq_lens.shape[1] == 0:
        return False
    # The sentinel must mark the same slots in both tables (bytes compare: no
    # reduction call). Without unused slots, and a sentinel outside [1, S], the
    # checks below already imply it: they force 1 <= seq_lens_padded <= S on
    # every slot, so no slot of seq_lens_padded can hold the sentinel.
    if (n_unused or 1 <= sentinel <= seq_len) and (
        (seq_lens_padded != sentinel).tobytes() != valid.tobytes()
    ):
        return False
    # Per used slot 1 <= seq_lens <= seq_lens_padded <= S, by comparisons only
    # (a subtraction could wrap for adversarial int64 values). The ``n_unused``
    # sentinel slots hold the sentinel in both tables, so each comparison is
    # either true on all of them or on none: counting (count_nonzero, no
    # reduction call) and comparing with that number checks the used slots.
    if np.count_nonzero(seq_lens < _ONE) != (n_unused if sentinel < 1 else 0):
        return False
    if np.count_nonzero(seq_lens_padded > seq_len) != (n_unused if sentinel > seq_len else 0):
        return False
    if np.count_nonzero(seq_lens > seq_lens_padded):
        return False
    # Row sums cannot wrap now. [B] ints: max/min in Python beat two reductions.
    row_slots = end[:, -1].tolist()
    return max(row_slots) <= seq_len and min(row_slots[::rows]) > 0


def _single_stream(start: np.ndarray, real: np.ndarray, total: int, absorb: bool) -> StreamLayout:
    """One stream's layout from its sequences in stream order.

    Args:
        start: int64 ``[N]`` physical start of each sequence (first one at 0).
        real: int64 ``[N]`` real length of each sequence.
        total: stream length ``B*S``.
        absorb: trailing-pad absorption switch.
    """
    n = start.shape[0]
    # Row 0 is cu_seqlens, row 1 cu_seqlens_padded: one buffer, one int32 cast.
    both = np.empty((2, n + 1), dtype=np.int64)
    cu = both[0]
    cu_padded = both[1]
    cu[0] = 0
    np.add.accumulate(real, out=cu[1:])
    cu_padded[:n] = start
    cu_padded[n] = total
    # Padding mask as one run-length decode of the sorted run boundaries
    # 0, start_0, end_0, start_1, ..., end_{n-1}, total (end = start + real):
    # pad before the first sequence, then per sequence its real run and the
    # pad up to the next sequence's start. Filled in place: fewest numpy calls.
    bounds = np.empty(2 * n + 2, dtype=np.int64)
    bounds[0] = 0
    bounds[1::2] = cu_padded
    np.add(start, real, out=bounds[2::2])
    # The ndarray method: np.repeat's wrapper costs ~3x the work at this size.
    mask = _pattern(n).repeat(bounds[1:] - bounds[:-1])
    # Python ints via .item(): numpy scalar arithmetic costs ~0.1 us per step.
    last = cu.item(n)
    # Equality of small int64 arrays via bytes: ~10x cheaper than (a == b).all().
    if absorb and last != total and cu[:n].tobytes() == cu_padded[:n].tobytes():
        # Only the tail is padding: the last sequence can own it because a
        # causal mask never lets a real token attend forward into it; TE then
        # takes its faster pad_between_seqs=False path.
        cu[n] = last = total
    pad_between = cu.tobytes() != cu_padded.tobytes()
    # Segments of cu_seqlens are the real lengths, the last one possibly grown
    # by absorption. argmax + item: a direct C call, ~3x cheaper than a ufunc
    # max reduction at these sizes.
    max_seqlen = max(real.item(real.argmax()), last - cu.item(n - 1)) if n else 0
    both = both.astype(np.int32)
    return StreamLayout(both[0], both[1], n, max_seqlen, pad_between, mask)


def _mask_from_starts(start: np.ndarray, real: np.ndarray, total: int) -> np.ndarray:
    """bool ``[total]`` padding mask from slot starts and real lengths.

    ``start`` and ``real`` are int ``[K]`` in stream order with
    ``start[k] + real[k] <= start[k+1]``; slot ``k`` makes
    ``[start[k], start[k] + real[k])`` real, everything else is padding. Built as
    one run-length decode (pad gap, real run, pad gap, ...) so the cost is a
    single pass over the stream with no per-sequence Python work.
    """
    k = start.shape[0]
    runs = np.empty(2 * k + 1, dtype=np.int64)
    ends = start + real
    runs[0] = start[0] if k else total
    if k:
        runs[2:-1:2] = start[1:] - ends[:-1]
        runs[1:-1:2] = real
        runs[-1] = total - ends[-1]
    return _pattern(k).repeat(runs)


_PATTERNS: dict[int, np.ndarray] = {}


def _pattern(k: int) -> np.ndarray:
    """``[True, False, True, ..., True]`` of length ``2k+1`` (cached per k)."""
    pat = _PATTERNS.get(k)
    if pat is None:
        pat = np.ones(2 * k + 1, dtype=bool)
        pat[1::2] = False
        if len(_PATTERNS) < 256:
            _PATTERNS[k] = pat
    return pat


def flat_padding_mask(
    valid_seq_lens: np.ndarray, valid_seq_lens_padded: np.ndarray | None, total: int
) -> np.ndarray:
    """bool ``[total]`` mask for sequences packed back to back from offset 0.

    Args:
        valid_seq_lens: int ``[N]`` real lengths (sentinels already dropped).
        valid_seq_lens_padded: int ``[N]`` slots per sequence, or None (= real).
        total: stream length; slots past the last sequence are padding.
    """
    real = valid_seq_lens.astype(np.int64, copy=False)
    occupied = real if valid_seq_lens_padded is None else valid_seq_lens_padded.astype(np.int64)
    start = np.cumsum(occupied) - occupied
    return _mask_from_starts(start, real, total)


def check_stream_fits_int32(total_tokens: int) -> None:
    """Raise if a stream of ``total_tokens`` cannot be indexed by int32 boundaries."""
    if total_tokens > _INT32_MAX:
        raise ValueError(
            f"input_ids holds {total_tokens} tokens per converted stream (B*S, or B/num_chunks*S "
            f"when chunked), more than int32 boundaries (cu_seqlens) can address "
            f"({_INT32_MAX}). Use smaller batches or more chunks."
        )
