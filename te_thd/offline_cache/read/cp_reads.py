"""Which tokens of a cache each CP rank reads in an epoch: the spans CP splits (as
``CachedThdCollator`` packs a sequential epoch) and the tokens, in whole checksum blocks, that a
rank fetches of them under each CP strategy. Pure functions of the samples' lengths; the cache
plan prices them (:func:`~te_thd.offline_cache.tools.plan.plan_cache`).
"""

from __future__ import annotations

import numpy as np
import torch

from te_thd._cp_strategy import DUAL_CHUNK_SWAP
from te_thd.args import check_int
from te_thd.cp import partition_indices
from te_thd.offline_cache.format.ragged import block_table, plan_token_reads, row_offsets
from te_thd.packing import document_spans, document_starts, pad_to_multiple_for

#: positions planned per call of the CP share planner: bounds its memory on long documents
_CHUNK_TOKENS = 1 << 22


def cp_spans(
    lengths: np.ndarray,
    cp: int,
    pack_seq_len: int | None,
    batch_size: int,
    strategy: str = DUAL_CHUNK_SWAP,
) -> np.ndarray:
    """Each sample's span in ``cu_seqlens_padded`` (int64 ``[n]``): what CP splits. Packed as
    ``CachedThdCollator`` packs a sequential epoch's batches of ``batch_size`` into rows of
    ``pack_seq_len`` (:func:`~te_thd.packing.document_spans`), or each alone (``None``).
    ``"no_load_balance"`` pads no packed document, and a document alone to a multiple of ``cp``."""
    if strategy == DUAL_CHUNK_SWAP:
        multiple = row_multiple = pad_to_multiple_for(cp)
        what = f"2*cp={row_multiple}"
    else:
        multiple, row_multiple = (cp if pack_seq_len is None else 1), cp
        what = f"cp={cp} (strategy={strategy!r})"
    padded = -(-lengths // multiple) * multiple
    if pack_seq_len is None:
        return padded
    check_int("batch_size", batch_size, 1, meaning=" (samples per training batch)")
    if pack_seq_len % row_multiple or (padded.size and int(padded.max()) > pack_seq_len):
        raise ValueError(
            f"pack_seq_len={pack_seq_len} must be a multiple of {what} and hold the longest "
            f"sample padded to it ({int(padded.max())}); pass a multiple of {row_multiple} of at "
            f"least {int(padded.max())}"
        )
    out = np.empty_like(lengths)
    for a in range(0, lengths.size, batch_size):
        out[a : a + batch_size] = document_spans(
            lengths[a : a + batch_size], pack_seq_len, multiple
        )
    return out


def cp_tokens_read(
    lengths: np.ndarray,
    spans: np.ndarray,
    groups: np.ndarray,
    cp: int,
    rank: int,
    block_tokens: int,
    gap_tokens: int,
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
) -> int:
    """Tokens the reader fetches for CP rank ``rank`` of one stored tensor (blocks of
    ``block_tokens``, gaps up to ``gap_tokens`` read through) of samples ``lengths`` (int64 ``[n]``;
    ``spans``: their
    :func:`cp_spans`). ``groups`` (int64 ``[n]``, non-decreasing): the samples read together, one
    batch's samples of one shard, whose blocks the reader plans in one go. ``ranges``: each
    sample's slots the rank holds under ``"no_load_balance"`` (:func:`contiguous_ranges`); None:
    dual chunk swap, each document split by itself."""
    total = 0
    start = 0
    while start < lengths.size:
        stop = start + 1
        budget = int(lengths[start])
        while stop < lengths.size and (
            groups[stop] == groups[stop - 1] or budget + int(lengths[stop]) <= _CHUNK_TOKENS
        ):
            budget += int(lengths[stop])
            stop += 1
        lens = lengths[start:stop]
        cu = row_offsets(spans[start:stop])
        if ranges is None:
            pos = partition_indices(
                torch.from_numpy(cu), int(cu[-1]), cp, rank, check=False
            ).numpy()
        else:  # each sample's held slots, in the chunk's coordinates
            a, b = ranges[0][start:stop], ranges[1][start:stop]
            runs = b - a
            pos = np.repeat(cu[:-1] + a - (np.cumsum(runs) - runs), runs)
            pos += np.arange(pos.size, dtype=np.int64)
        doc = np.searchsorted(cu, pos, side="right") - 1
        pos = pos - cu[doc]
        real = pos < lens[doc]
        doc, pos = doc[real], pos[real]
        # between two groups a spacer longer than the gap: no read joins them, as separate reads do
        # not
        spacer = np.diff(groups[start:stop], prepend=groups[start]) != 0
        rows = np.arange(lens.size) + np.cumsum(spacer)
        spaced = np.full(int(rows[-1]) + 1, gap_tokens + 1, dtype=np.int64)
        spaced[rows] = lens
        offsets = row_offsets(spaced)
        total += plan_token_reads(
            block_table(offsets, block_tokens), offsets, rows[doc], pos, gap_tokens
        ).tokens
        start = stop
    return total


def contiguous_ranges(
    spans: np.ndarray,
    cp: int,
    rank: int,
    pack_seq_len: int | None,
    batch_size: int,
    lengths: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` int64 ``[n]``: the slots ``[a_i, b_i)`` of sample ``i``'s span that CP rank
    ``rank`` holds under ``"no_load_balance"``: the rank's contiguous piece of each stream (one
    batch's rows, or a document alone) cut with the document where the packer placed it."""
    if pack_seq_len is None:
        starts, totals = np.zeros_like(spans), spans
    else:
        starts, totals = np.empty_like(spans), np.empty_like(spans)
        for a in range(0, spans.size, batch_size):
            stop = min(a + batch_size, spans.size)
            starts[a:stop] = document_starts(lengths[a:stop], pack_seq_len, 1)
            totals[a:stop] = spans[a:stop].sum()
    piece = totals // cp
    lo = rank * piece - starts
    return np.clip(lo, 0, spans), np.clip(lo + piece, 0, spans)


__all__ = ["contiguous_ranges", "cp_spans", "cp_tokens_read"]
