# Just over ~500 lines: the collator's public signature, its argument checks and the planned-rows
# path read best in one place.
"""Packing collator: variable-length samples -> packed BSHD rows for ``process_input_for_thd``.

The first arrow of the batch path::

    sample dicts -> packing -> thd_utils -> cp -> attention -> model

Samples (dicts of 1-D tensors, one per document) are bin-packed into rows of exactly
``seq_len`` (S) token slots with first-fit-decreasing (FFD). Every document occupies a
span padded to a multiple of ``pad_to_multiple_of`` (``2*cp`` for context parallelism,
times ``tp`` under sequence parallelism -- :func:`pad_to_multiple_for`); the row's
unused tail is given to the row's last document (its padded length grows, its real
length does not), so the padded lengths of a non-empty row always sum to S and every
row's physical offsets are exact. Output is the input format of
:func:`te_thd.thd_utils.process_input_for_thd`.

Label convention (decided here, documented in docs/packing.md): a sample's labels are in
the Hugging Face convention, **aligned with ``input_ids`` and not shifted**
(``labels[t]`` is the label *of* token ``t``; -100 = ignore, e.g. a masked prompt; no
label key = the input ids themselves). The collator emits **shifted** labels, the
Megatron/TE convention the seed example uses: ``labels[t]`` is the target predicted
*at* position ``t`` = the sample's ``labels[t+1]``. The shift happens inside each
document, so the last token of every document gets -100 and no target ever crosses a
document boundary; padding slots get -100 as well. A truncated document keeps its real
next-token target at its last kept position (the shift happens before truncation).
Samples whose labels are already shifted pass ``labels_shifted=True``: they are taken
as they are (only truncated and padded).

Position ids restart at 0 for every document and count on through its padding slots
(``0 .. padded_len-1``), so they depend only on the layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from te_thd._cp_strategy import DUAL_CHUNK_SWAP, normalize_strategy
from te_thd._flattened import seq_lens_from_position_ids, unflatten_from_position_ids
from te_thd.args import check_int, is_int
from te_thd.balance import plan_global_batch as plan_global_batch  # the planner, re-exported
from te_thd.boundaries import check_cp_args

__all__ = [
    "PackingCollator",
    "assign_bins",
    "pad_to_multiple_for",
    "seq_lens_from_position_ids",
    "unflatten_from_position_ids",
]

IGNORE_INDEX = -100


def pad_to_multiple_for(
    cp_size: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    strategy: Any = DUAL_CHUNK_SWAP,
) -> int:
    """Per-document padding multiple that context / sequence parallelism require.

    ``2 * cp_size`` when ``cp_size > 1`` (TE's THD CP splits every sequence into
    ``2*cp`` equal chunks), else 1; multiplied by ``tp_size`` when sequence parallelism
    is on with ``tp_size > 1`` (each CP rank's share is split again across TP ranks).
    The same rule as Megatron-Bridge's packed-sequence padding. Under
    ``strategy="no_load_balance"`` a rank holds a contiguous share of the whole stream, so no
    document is padded for CP (1, times ``tp_size`` with sequence parallelism); the stream,
    ``seq_len``, must then be a multiple of ``cp_size``.

    Returns:
        int >= 1 to pass as ``PackingCollator(pad_to_multiple_of=...)``.
    """
    check_cp_args(cp_size)
    check_int("tp_size", tp_size, 1)
    balanced = normalize_strategy(strategy) == DUAL_CHUNK_SWAP
    multiple = 2 * cp_size if cp_size > 1 and balanced else 1
    if sequence_parallel and tp_size > 1:
        multiple *= tp_size
    return multiple


# --------------------------------------------------------------------------- bin packing


def assign_bins(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    capacity: int,
    *,
    decreasing: bool = True,
) -> np.ndarray:
    """First-fit bin packing; first-fit-decreasing (FFD) by default. Pure function.

    Items are visited in decreasing length (ties in arrival order) when ``decreasing``,
    else in arrival order (plain first fit, the baseline ``perf/bench_packing.py``
    compares against). Each item goes into the lowest-numbered bin with room. A max
    segment tree over bin residual capacities finds that bin in O(log n), so the whole
    packing is O(n log n); unopened bins sit in the tree with full capacity, so the
    leftmost fitting leaf is also how a new bin is opened.

    Args:
        lengths: ``[n]`` non-negative item sizes, each ``<= capacity``.
        capacity: bin size (the row length S).

    Returns:
        int64 ``[n]``: the bin of each item; bins are numbered ``0 .. n_bins-1`` in
        opening order, with no gaps.
    """
    check_int("capacity", capacity, 1)
    sizes = np.asarray(
        lengths.detach().cpu() if isinstance(lengths, torch.Tensor) else lengths, dtype=np.int64
    ).reshape(-1)
    n = sizes.shape[0]
    out = np.zeros(n, dtype=np.int64)
    if n == 0:
        return out
    if sizes.min() < 0:
        i = int(np.argmin(sizes))
        raise ValueError(f"lengths must be >= 0: item {i} has length {int(sizes[i])}")
    if sizes.max() > capacity:
        i = int(np.argmax(sizes))
        raise ValueError(
            f"item {i} has length {int(sizes[i])} > capacity={capacity}; it cannot fit any bin"
        )
    order = np.argsort(-sizes, kind="stable") if decreasing else np.arange(n)
    leaves = 1 << max(0, (n - 1).bit_length())
    tree = [capacity] * (2 * leaves)  # tree[k] = max residual capacity under node k
    size_list = sizes.tolist()
    bin_of = [0] * n
    for item in order.tolist():
        need = size_list[item]
        node = 1
        while node < leaves:  # descend to the leftmost leaf with room
            node <<= 1
            if tree[node] < need:
                node += 1
        bin_of[item] = node - leaves
        tree[node] -= need
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left >= right else right
            node >>= 1
    out[:] = bin_of  # leftmost-first opening numbers the bins 0..n_bins-1 without gaps
    return out


# --------------------------------------------------------------------------- collator


@functools.lru_cache(maxsize=4)
def _arange(n: int) -> np.ndarray:
    """Read-only int64 ``arange(n)``, cached: B*S repeats batch after batch."""
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out


def _concat(parts: list[torch.Tensor], filler_len: int, fill: float) -> torch.Tensor:
    """``cat(parts)`` followed by ``filler_len`` copies of ``fill`` (one allocation).

    CPU tensors of numpy-representable dtypes go through numpy (views, no copies until
    the one concatenation), which is several times faster than torch's CPU cat and
    index_select for these many small pieces; anything else stays in torch.
    """
    first = parts[0]
    if first.device.type == "cpu" and first.dtype not in _NO_NUMPY:
        arrays = [p.numpy() for p in parts]
        arrays.append(np.full(filler_len, fill, dtype=arrays[0].dtype))
        return torch.from_numpy(np.concatenate(arrays))
    total = sum(p.shape[0] for p in parts)
    out = torch.empty(total + filler_len, dtype=first.dtype, device=first.device)
    torch.cat(parts, out=out[:total])
    out[total:] = fill
    return out


def _take(source: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """``source[index]`` for a 1-D source (numpy's take on the CPU: ~4x torch's index_select)."""
    if source.device.type == "cpu" and source.dtype not in _NO_NUMPY:
        return torch.from_numpy(np.take(source.numpy(), index))
    return source.index_select(0, torch.from_numpy(index).to(source.device))


def _shift_within_samples(labels: torch.Tensor, total: int, ends: np.ndarray) -> None:
    """In place: ``labels[t] = labels[t+1]`` for ``t < total-1``, then -100 at each sample's end."""
    if labels.device.type == "cpu" and labels.dtype not in _NO_NUMPY:
        arr = labels.numpy()
        arr[: total - 1] = arr[1:total]  # numpy handles the overlap (buffered copy)
        arr[ends] = IGNORE_INDEX
        return
    labels[: total - 1] = labels[1:total].clone()
    labels[torch.from_numpy(ends).to(labels.device)] = IGNORE_INDEX


_NO_NUMPY = (torch.bfloat16, torch.complex32) + tuple(
    d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2")) if d is not None
)


class _Rows(NamedTuple):
    """Where each document goes (arrays ``[n]`` in output order: by row, then arrival)."""

    n_rows: int  # B, rows in the batch
    n_filled: int  # rows holding documents (the first ones; the rest are empty)
    order: np.ndarray  # sample index of each output document
    row: np.ndarray  # its row
    slot: np.ndarray  # its index within the row
    counts: np.ndarray  # [B] documents per row
    real: np.ndarray  # kept tokens of each document
    span: np.ndarray  # slots of each document, padding and the row's tail included


def _planned_bins(
    planned: Sequence[int], padded: np.ndarray, seq_len: int, rows: int | None
) -> tuple[np.ndarray, int]:
    """Bins of documents given row by row (``planned[k]`` documents in row ``k``) and B.

    Empty rows move behind the non-empty ones (row order inside a batch carries no
    meaning; the layout puts empty rows last). Raises when a row overflows.
    """
    counts = np.asarray(planned, dtype=np.int64).reshape(-1)
    if counts.size == 0 or int(counts.min()) < 0 or int(counts.sum()) != padded.shape[0]:
        raise ValueError(
            f"rows={list(planned)} must be >= 0 sample counts, one per row, summing to the "
            f"{padded.shape[0]} samples given (samples in row order)"
        )
    K = counts.shape[0]
    B = K if rows is None else rows
    if K > B:
        raise ValueError(f"the plan has {K} rows but the collator was built with rows={B}")
    nonempty = counts > 0
    new_id = np.concatenate([np.flatnonzero(nonempty), np.flatnonzero(~nonempty)])
    bins = np.repeat(np.argsort(new_id), counts)  # row k's documents -> its new position
    fill = np.bincount(bins, weights=padded, minlength=K)
    if fill.max() > seq_len:
        k = int(new_id[int(np.argmax(fill))])
        raise ValueError(
            f"planned row {k} holds {int(fill.max())} padded tokens > seq_len={seq_len}; "
            "plan with the collator's seq_len and pad_to_multiple_of (and the same lengths)"
        )
    return bins, B


def _row_layout(
    full: np.ndarray,
    seq_len: int,
    multiple: int,
    rows: int | None,
    decreasing: bool,
    planned: Sequence[int] | None = None,
) -> _Rows:
    """Bin-pack documents of ``full`` ``[n]`` tokens into rows of ``seq_len`` slots
    (or take the rows of ``planned``, see :func:`_planned_bins`)."""
    n = full.shape[0]
    real = np.minimum(full, seq_len)  # [n] kept tokens
    padded = (real + (multiple - 1)) // multiple * multiple  # [n] span before the row tail
    if planned is not None:
        bins, B = _planned_bins(planned, padded, seq_len, rows)
        n_bins = int(bins.max()) + 1
    else:
        bins = assign_bins(padded, seq_len, decreasing=decreasing)
        n_bins = int(bins.max()) + 1
        B = n_bins if rows is None else rows
    if n_bins > B:
        raise ValueError(
            f"the {n} samples need {n_bins} rows of seq_len={seq_len} but rows={B}; "
            "pass fewer samples per batch, a larger rows, or rows=None"
        )
    # Documents in output order: by row, arrival order within a row. Rows
    # 0..n_bins-1 are non-empty (first fit opens bins leftmost), the rest empty.
    order = np.argsort(bins, kind="stable")
    row = bins[order]
    counts = np.bincount(row, minlength=B)  # [B] documents per row
    row_first = np.cumsum(counts) - counts  # [B] first document of each row
    slot = np.arange(n) - row_first[row]  # [n] index within the row
    span = padded[order].copy()  # [n] slots of each document incl. its padding
    row_fill = np.zeros(B, dtype=np.int64)
    np.add.at(row_fill, row, span)
    last = row_first[:n_bins] + counts[:n_bins] - 1
    span[last] += seq_len - row_fill[:n_bins]  # the row's unused tail joins its last document
    return _Rows(B, n_bins, order, row, slot, counts, real[order], span)


def document_spans(
    lengths: Sequence[int] | np.ndarray, seq_len: int, multiple: int, *, decreasing: bool = True
) -> np.ndarray:
    """Slots of each of a batch's documents in the rows :class:`PackingCollator` packs them into:
    int64 ``[n]`` in arrival order, each document's length padded to ``multiple`` plus, for the
    last document of a row, the row's unused tail -- its span in ``cu_seqlens_padded``, which
    context parallelism splits into ``2*cp`` chunks. ``lengths``: ``[n]`` real token counts."""
    full = np.asarray(lengths, dtype=np.int64).reshape(-1)
    rows = _row_layout(full, seq_len, multiple, None, decreasing)
    out = np.empty(full.shape[0], dtype=np.int64)
    out[rows.order] = rows.span
    return out


def document_starts(
    lengths: Sequence[int] | np.ndarray, seq_len: int, multiple: int, *, decreasing: bool = True
) -> np.ndarray:
    """Each of a batch's documents' first slot in the packed stream (all rows, ``B*S`` slots):
    int64 ``[n]`` in arrival order. With :func:`document_spans` it gives the slots
    ``[start, start + span)`` a document owns, where a contiguous CP partition cuts it."""
    full = np.asarray(lengths, dtype=np.int64).reshape(-1)
    rows = _row_layout(full, seq_len, multiple, None, decreasing)
    out = np.empty(full.shape[0], dtype=np.int64)
    out[rows.order] = np.cumsum(rows.span) - rows.span
    return out


def _gather_index(full: np.ndarray, rows: _Rows, seq_len: int) -> np.ndarray:
    """int64 ``[B*S]``: for every output slot, its position in a key's source.

    The source of a key is its samples concatenated in arrival order followed by a
    filler block of S slots; output runs alternate (document tokens, its padding) in
    output order, and run k of length len_k starting at output offset o_k reads
    source[first_k + j]. So index = repeat(first_k - o_k, len_k) + arange(B*S): one
    repeat, one add.
    """
    n = full.shape[0]
    n_empty = rows.n_rows - rows.n_filled
    src_start = (np.cumsum(full) - full)[rows.order]
    runs = np.empty(2 * n + n_empty, dtype=np.int64)
    runs[0 : 2 * n : 2] = rows.real
    runs[1 : 2 * n : 2] = rows.span - rows.real
    runs[2 * n :] = seq_len
    first = np.full(runs.shape[0], int(full.sum()), dtype=np.int64)  # padding -> filler
    first[0 : 2 * n : 2] = src_start
    index = np.repeat(first - (np.cumsum(runs) - runs), runs)
    index += _arange(rows.n_rows * seq_len)
    return index


class PackingCollator:
    """Collate variable-length samples into packed BSHD rows (``process_input_for_thd``'s input).

    Args:
        seq_len: S, slots per row. Must be a multiple of ``pad_to_multiple_of``.
        pad_to_multiple_of: every document's span is padded to this multiple (see
            :func:`pad_to_multiple_for`).
        overlong: a document longer than S is cut to S (``"truncate"``) or rejected
            (``"raise"``, the default: no silent data loss).
        label_key: key of a sample's labels (unshifted, aligned with ``input_ids``);
            when a sample lacks it, or it is ``None``, the labels are ``input_ids``.
        input_key: key of a sample's token ids (output key is always ``input_ids``).
        pad_token_id: filler id for ``input_ids`` padding slots.
        seq_lens_padding_value: sentinel for unused pack slots of ``seq_lens`` /
            ``seq_lens_padded`` (must be negative).
        rows: fixed B (e.g. for fixed shapes); ``None`` derives B = bins needed. A fixed
            B with fewer documents leaves the last rows empty: all their pack slots are
            the sentinel, their tokens padding (``process_input_for_thd`` folds such a
            row into the preceding document's padding, keeping every offset exact).
        labels_shifted: samples carry labels that are already shifted (see the module
            docstring); they are then not shifted again.
        pad_values: filler for other packed keys (default 0).
        bin_packing: ``"ffd"`` (first-fit-decreasing, the default) or ``"first_fit"``
            (arrival order: rows keep the data order, at some cost in padding).

    Call with a list of samples (``{key: 1-D tensor}``, all with the same keys and, per
    sample, the same length) or with a flattened batch (a mapping whose
    ``position_ids`` restart at 0 per document, see :func:`unflatten_from_position_ids`).
    A sample's own ``position_ids`` are ignored: they are recomputed from the layout.

    Returns a dict:
        ``input_ids`` ``[B, S]`` (samples' dtype), ``labels`` ``[B, S]`` (shifted, -100 on
        padding and each document's last token), ``position_ids`` int64 ``[B, S]``,
        ``seq_lens`` / ``seq_lens_padded`` int64 ``[B, P]`` (P = most documents in a row,
        sentinel-filled), every other sample key packed to ``[B, S]``, and
        ``packing_efficiency`` (float: real tokens / (B*S)).
    """

    def __init__(
        self,
        seq_len: int,
        *,
        pad_to_multiple_of: int = 1,
        overlong: Literal["truncate", "raise"] = "raise",
        label_key: str | None = "labels",
        input_key: str = "input_ids",
        pad_token_id: int = 0,
        seq_lens_padding_value: int = -1000,
        rows: int | None = None,
        labels_shifted: bool = False,
        pad_values: Mapping[str, int | float] | None = None,
        bin_packing: Literal["ffd", "first_fit"] = "ffd",
    ) -> None:
        self.seq_len = check_int("seq_len", seq_len, 1)
        self.pad_to_multiple_of = check_int("pad_to_multiple_of", pad_to_multiple_of, 1)
        if seq_len % pad_to_multiple_of:
            raise ValueError(
                f"seq_len={seq_len} must be a multiple of pad_to_multiple_of={pad_to_multiple_of} "
                f"so every row splits into whole padded documents; use seq_len="
                f"{math.ceil(seq_len / pad_to_multiple_of) * pad_to_multiple_of}"
            )
        if overlong not in ("truncate", "raise"):
            raise ValueError(f"overlong must be 'truncate' or 'raise', got {overlong!r}")
        self.overlong = overlong
        if not is_int(seq_lens_padding_value, below=0):
            raise ValueError(
                f"seq_lens_padding_value must be a negative int (a length can never equal it), "
                f"got {seq_lens_padding_value!r}"
            )
        self.seq_lens_padding_value = seq_lens_padding_value
        if rows is not None:
            check_int("rows", rows, 1)
        self.rows = rows
        self.label_key = label_key
        self.input_key = input_key
        self.pad_token_id = pad_token_id
        self.labels_shifted = labels_shifted
        self.pad_values = dict(pad_values or {})
        if bin_packing not in ("ffd", "first_fit"):
            raise ValueError(f"bin_packing must be 'ffd' or 'first_fit', got {bin_packing!r}")
        self.bin_packing = bin_packing

    # -- validation ---------------------------------------------------------------------

    def _lengths(self, samples: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[str]]:
        if len(samples) == 0:
            raise ValueError("samples is empty; a packed batch needs at least one sample")
        first = samples[0]
        if not isinstance(first, Mapping) or self.input_key not in first:
            raise ValueError(
                f"sample 0 must be a dict holding {self.input_key!r}, got "
                f"{sorted(first) if isinstance(first, Mapping) else type(first).__name__}"
            )
        keys = [k for k in first if k != "position_ids"]
        key_set = set(first)
        # A passed-through key must not share a name with an output the collator
        # writes itself: it would silently replace the tokens, or be replaced.
        written = {"seq_lens", "seq_lens_padded", "packing_efficiency"}
        if self.input_key != "input_ids":
            written.add("input_ids")
        if self.label_key != "labels":
            written.add("labels")
        clash = sorted(written & key_set)
        if clash:
            raise ValueError(
                f"sample key {clash[0]!r} collides with the collator's output {clash[0]!r} "
                f"(input_key={self.input_key!r}, label_key={self.label_key!r}); rename or drop "
                "it, or name it as input_key / label_key"
            )
        lengths: list[int] = []
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping) or set(sample) != key_set:
                got = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
                raise ValueError(
                    f"sample {i} has keys {got}, sample 0 has {sorted(key_set)}; every sample "
                    "must carry the same keys"
                )
            ids = sample[self.input_key]
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
                shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise ValueError(
                    f"sample {i}[{self.input_key!r}] must be a 1-D tensor, got {shape}"
                )
            n = ids.shape[0]
            if n == 0:
                raise ValueError(
                    f"sample {i} is empty (0 tokens); drop empty documents before packing"
                )
            for k in keys:
                v = sample[k]
                if not isinstance(v, torch.Tensor) or v.shape != (n,):
                    shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise ValueError(
                        f"sample {i}[{k!r}] must be a 1-D tensor of the sample's length {n}, got "
                        f"{shape}; drop per-sample keys that are not per-token before packing"
                    )
            if n > self.seq_len and self.overlong == "raise":
                raise ValueError(
                    f"sample {i} has {n} tokens > seq_len={self.seq_len}; pass "
                    "overlong='truncate' to cut it, or raise seq_len"
                )
            lengths.append(n)
        return lengths, keys

    # -- packing ------------------------------------------------------------------------

    def __call__(
        self,
        samples: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, Any],
        rows: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Pack ``samples``; with ``rows`` (a plan: ``rows[k]`` samples, given in row
        order, form row ``k``, as ``te_thd.balance.plan_global_batch`` plans them) the
        rows are taken as planned instead of bin-packed."""
        if isinstance(samples, Mapping):
            samples = unflatten_from_position_ids(samples)
        full_lens, keys = self._lengths(samples)
        S = self.seq_len
        full = np.asarray(full_lens, dtype=np.int64)  # [n] sample lengths
        layout = _row_layout(
            full, S, self.pad_to_multiple_of, self.rows, self.bin_packing == "ffd", rows
        )
        index = _gather_index(full, layout, S)
        B, n_bins = layout.n_rows, layout.n_filled
        n_empty = B - n_bins
        total_full = int(full.sum())
        span, r_ord = layout.span, layout.real

        P = int(layout.counts.max())
        seq_lens = np.full((B, P), self.seq_lens_padding_value, dtype=np.int64)
        seq_lens_padded = seq_lens.copy()
        seq_lens[layout.row, layout.slot] = r_ord
        seq_lens_padded[layout.row, layout.slot] = span

        out: dict[str, Any] = {}
        for k in keys:
            if k == self.label_key:
                continue
            name = "input_ids" if k == self.input_key else k
            fill = self.pad_token_id if k == self.input_key else self.pad_values.get(k, 0)
            source = _concat([smp[k] for smp in samples], S, fill)
            out[name] = _take(source, index).view(B, S)

        lab_key = self.label_key if self.label_key in keys else self.input_key
        labels_src = _concat([smp[lab_key] for smp in samples], S, IGNORE_INDEX)
        if not self.labels_shifted:
            # shift inside each sample: position t predicts the sample's label t+1; the
            # last token of every sample keeps -100 (no target from the next document)
            _shift_within_samples(labels_src, total_full, np.cumsum(full) - 1)
        out["labels"] = _take(labels_src, index).view(B, S)

        # Position ids count 0..span-1 over every document span (and each empty row).
        spans = np.concatenate([span, np.full(n_empty, S, dtype=np.int64)])
        position_ids = _arange(B * S) - np.repeat(np.cumsum(spans) - spans, spans)
        out["position_ids"] = torch.from_numpy(position_ids).view(B, S)
        out["seq_lens"] = torch.from_numpy(seq_lens)
        out["seq_lens_padded"] = torch.from_numpy(seq_lens_padded)
        out["packing_efficiency"] = float(r_ord.sum()) / float(B * S)
        return out
