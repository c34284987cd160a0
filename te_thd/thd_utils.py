"""Packed BSHD batch -> THD tensors plus the boundaries Transformer Engine needs.

Drop-in for ``nemo_automodel.components.distributed.thd_utils`` (same public
names, parameters and keyword names), with these contracts:

* Row ``b`` of a ``[B, S]`` batch starts at stream offset ``b*S``; its sequences
  sit back to back, sequence ``i`` occupying ``seq_lens_padded[b, i]`` slots of
  which the first ``seq_lens[b, i]`` are real. Slots a row leaves unused (and rows
  without sequences) are padding of the preceding sequence, so
  ``cu_seqlens_padded`` always ends at ``B*S`` and points into the right row.
* All layout math runs on the host (numpy over the ``[B, P]`` length tables) in
  a handful of vectorised operations: when the length tensors are on the CPU --
  the normal case, the collate runs in DataLoader workers -- nothing here touches
  a GPU. Lengths on a GPU are copied to the host once (a sync; the number of
  sequences is data-dependent, so it cannot be avoided there).
* Trailing-pad absorption is on by default (the reference behaviour, correct for
  causal masks); pass ``absorb_trailing_pad=False`` for bidirectional attention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch

from te_thd._thd_inputs import (
    host_ints,
    length_tables,
    read_token_tensors,
    token_padding_mask_rows,
)
from te_thd._thd_layout import (
    PackLayout,
    StreamLayout,
    check_stream_fits_int32,
    flat_padding_mask,
    pack_layout,
    stream_layout,
)
from te_thd.args import check_int, check_names

__all__ = [
    "ThdBatch",
    "ThdChunkedBatch",
    "process_input_for_thd",
    "split_batch_into_thd_chunks",
    "thd_padding_mask_from_token_ids",
]
# ``_thd_padding_mask`` is the reference's private helper: importable from here (drop-in),
# not part of the public list.

# Consumed by the conversion, not passed through (as the reference does).
_CONSUMED_KEYS = frozenset({"seq_lens", "seq_lens_padded"})


class ThdBatch(TypedDict):
    """What :func:`process_input_for_thd` returns (plus every pass-through key).

    ``T = B*S`` tokens, ``N`` sequences.

    Attributes:
        input_ids: ``[T]`` token ids or ``[T, H]`` embeddings; a view of the input.
        labels: ``[T]`` (view); only present when the input batch had ``labels``.
        position_ids: ``[T]``, or ``[n_rope, 1, T]`` for 3-D mRoPE input (None when given as None).
        cu_seqlens: int32 ``[N+1]`` cumulative real lengths (after absorption);
            TE's ``cu_seqlens_q/kv``.
        cu_seqlens_padded: int32 ``[N+1]`` physical start offsets, last entry
            ``T``; TE's ``cu_seqlens_q/kv_padded``. Always present when lengths
            are known (equal to ``cu_seqlens`` when nothing is padded).
        pad_between_seqs: Python bool; the two complete boundary arrays differ.
            Pass it to TE explicitly (its auto-detection has had bugs,
            NVIDIA/TransformerEngine#3331).
        max_seqlen: int32 0-d tensor, ``max(diff(cu_seqlens))``.
        max_seqlen_int: the same as a Python int, for TE's ``max_seqlen_q/kv``.
        num_seqs: ``N`` as a Python int.
        padding_mask: bool ``[T]``, True = padding, from the pack layout.
    """

    input_ids: torch.Tensor
    labels: NotRequired[torch.Tensor]
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    pad_between_seqs: bool
    max_seqlen: torch.Tensor
    max_seqlen_int: int
    num_seqs: int
    padding_mask: torch.Tensor


class ThdChunkedBatch(TypedDict):
    """What :func:`split_batch_into_thd_chunks` returns for ``num_chunks = C > 1``.

    ``T_c = (B/C)*S`` tokens per chunk, ``maxN`` the most sequences in a chunk.

    Attributes:
        input_ids: ``[C, T_c]`` or ``[C, T_c, H]`` (view).
        labels: ``[C, T_c]`` (view); only when the input had ``labels``.
        position_ids: ``[C, T_c]``, or ``[C, n_rope, 1, T_c]`` for mRoPE (view).
        cu_seqlens: int32 ``[C, maxN+1]``; row ``c`` is chunk ``c``'s
            ``cu_seqlens`` right-padded with ``seq_lens_padding_value``.
        cu_seqlens_padded: int32 ``[C, maxN+1]``, same padding; offsets are
            relative to the chunk start.
        num_seqs: ``list[int]`` of length ``C``; row ``c`` has ``num_seqs[c]+1``
            valid entries. Host-side, so trimming sentinels needs no device
            ``argmin``.
        pad_between_seqs: Python bool, True if any chunk needs it.
        max_seqlen: int32 ``[C]``.
        max_seqlen_int: ``list[int]`` of length ``C``.
        padding_mask: bool ``[C, T_c]``.
    """

    input_ids: torch.Tensor
    labels: NotRequired[torch.Tensor]
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    pad_between_seqs: bool
    max_seqlen: torch.Tensor
    max_seqlen_int: list[int]
    num_seqs: list[int]
    padding_mask: torch.Tensor


# --------------------------------------------------------------------------- masks


def thd_padding_mask_from_token_ids(input_ids: torch.Tensor, padding_token_id: int) -> torch.Tensor:
    """Mark padding by token value, rejecting a pad id that is also content.

    Only for callers with no pack metadata. A value comparison is correct just
    when the pad id fills a right-padded tail and appears nowhere else, so that
    is validated: a colliding id (e.g. a model whose pad id is also its EOS id)
    fails loudly instead of silently masking content out.

    Args:
        input_ids: integer token ids ``[total_tokens]``.
        padding_token_id: token id used as filler.

    Returns:
        bool ``[total_tokens]`` on ``input_ids.device``; True marks padding.

    Raises:
        ValueError: if ``input_ids`` is not 1-D, or ``padding_token_id`` also
            occurs before the padded tail. The check reads one bool to the host
            (a sync when ``input_ids`` is on a GPU; use pack metadata to avoid it).
    """
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids must be 1-D [total_tokens], got shape {tuple(input_ids.shape)}; "
            "flatten it first (input_ids.reshape(-1))."
        )
    return token_padding_mask_rows(input_ids.unsqueeze(0), padding_token_id, "input_ids")[0]


def _thd_padding_mask(
    total_tokens: int,
    valid_seq_lens: torch.Tensor,
    valid_seq_lens_padded: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Mark padding slots in a packed THD stream from the pack layout.

    Sequences sit back to back from offset 0: sequence ``i`` occupies
    ``[start_i, start_i + padded_i)`` and only its first ``real_i`` slots hold
    tokens; everything else, including slots past the last sequence, is padding,
    whatever token id fills it. (For row-structured batches use
    :func:`process_input_for_thd`, which also honours row starts at ``b*S``.)

    Args:
        total_tokens: length of the packed stream.
        valid_seq_lens: integer ``[N]`` real lengths (sentinels already dropped).
        valid_seq_lens_padded: integer ``[N]`` slots per sequence, or None when
            sequences carry no individual padding.
        device: device of the returned mask.

    Returns:
        bool ``[total_tokens]`` on ``device``; True marks padding.

    Raises:
        ValueError: if the lengths are not 1-D integers of equal shape, real
            exceeds padded, or the sequences need more than ``total_tokens`` slots.
    """
    real = host_ints(valid_seq_lens, "valid_seq_lens")
    if real.ndim != 1:
        raise ValueError(
            f"valid_seq_lens must be 1-D [N], got shape {real.shape}; drop sentinels and "
            "flatten first."
        )
    padded = None
    if valid_seq_lens_padded is not None:
        padded = host_ints(valid_seq_lens_padded, "valid_seq_lens_padded")
        if padded.shape != real.shape:
            raise ValueError(
                f"valid_seq_lens_padded shape {padded.shape} != valid_seq_lens shape "
                f"{real.shape}; pass one padded length per sequence."
            )
        if (real > padded).any():
            i = int(np.argmax(real > padded))
            raise ValueError(
                f"valid_seq_lens[{i}]={int(real[i])} exceeds valid_seq_lens_padded[{i}]="
                f"{int(padded[i])}; padded lengths must be >= real lengths."
            )
    if (real < 0).any():
        i = int(np.argmax(real < 0))
        raise ValueError(
            f"valid_seq_lens[{i}]={int(real[i])} is negative; drop sentinel entries first."
        )
    needed = int((real if padded is None else padded).sum(dtype=np.int64))
    if needed > total_tokens:
        raise ValueError(
            f"the sequences occupy {needed} slots but total_tokens={total_tokens}; pass the "
            "stream length (>= the sum of the padded lengths)."
        )
    mask = flat_padding_mask(real, padded, int(total_tokens))
    return torch.from_numpy(mask).to(device, non_blocking=True)


# ---------------------------------------------------------------- conversion


def process_input_for_thd(
    batch: dict[str, torch.Tensor],
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
    *,
    absorb_trailing_pad: bool = True,
    token_keys: Sequence[str] = (),
) -> ThdBatch:
    """Convert a packed BSHD batch to THD tensors plus TE's boundary arguments.

    Args:
        batch: mapping with
            ``input_ids`` ``[B, S]`` token ids or ``[B, S, H]`` embeddings (required);
            ``position_ids`` ``[B, S]`` or ``[n_rope, B, S]`` for mRoPE (required;
            ``None`` is returned as ``None``, as the reference does);
            ``seq_lens`` integer ``[B, P]`` real lengths, ``seq_lens_padding_value``
            in unused slots (required; an explicit ``None`` falls back to the
            token-id padding mask with one sequence per row, see below);
            ``seq_lens_padded`` integer ``[B, P]`` slots per sequence, same
            sentinel slots (optional; absent or None means no per-sequence pad);
            ``labels`` ``[B, S]`` (optional, e.g. an inference collate);
            any other key is passed through untouched.
        seq_lens_padding_value: sentinel marking unused pack slots.
        padding_token_id: only used when ``seq_lens`` is None: then every row is
            one sequence and padding is inferred from token values via
            :func:`thd_padding_mask_from_token_ids` (validated; reads to host).
        absorb_trailing_pad: keyword-only. True (default, the reference
            behaviour): if the boundary arrays agree everywhere but the last
            entry, the last sequence is grown to the end of the stream, so TE can
            use ``pad_between_seqs=False``. Correct only for causal masks; pass
            False for bidirectional attention (real tokens would attend to pad).
        token_keys: keyword-only; other per-token keys of ``batch`` (``[B, S, ...]``,
            e.g. ``loss_mask``) flattened to ``[T, ...]`` exactly like ``input_ids``.
            Default: none, so every other key passes through untouched (the reference's
            behaviour).

    Returns:
        :class:`ThdBatch`: ``input_ids``/``labels``/``position_ids`` (and ``token_keys``) flattened
        to ``T = B*S`` tokens (views), ``cu_seqlens`` and ``cu_seqlens_padded`` int32
        ``[N+1]`` on the device of ``seq_lens``, ``pad_between_seqs`` (bool),
        ``max_seqlen`` (int32 0-d) and ``max_seqlen_int`` (int), ``num_seqs``
        (int), ``padding_mask`` bool ``[T]`` on the device of ``input_ids``, and
        every other input key except ``seq_lens``/``seq_lens_padded``.

    Raises:
        ValueError: for missing keys, mismatched shapes, non-integer lengths,
            lengths <= 0 that are not the sentinel, ``seq_lens > seq_lens_padded``,
            a row whose padded lengths exceed ``S``, a first row without any
            sequence, or (fallback) a pad id that is also content.

    Example (the reference page's, B=2, S=6)::

        seq_lens [[3, 2], [6, -1000]], seq_lens_padded [[4, 2], [6, -1000]]
        -> cu_seqlens [0, 3, 5, 11], cu_seqlens_padded [0, 4, 6, 12],
           pad_between_seqs True, max_seqlen 6
    """
    out, layout, device, mask = _convert(
        batch, 1, seq_lens_padding_value, padding_token_id, absorb_trailing_pad, token_keys
    )
    max_seqlen = np.array(layout.max_seqlen, dtype=np.int32)
    if device is None:  # lengths on the CPU, the normal case: zero-copy views
        out["cu_seqlens"] = torch.from_numpy(layout.cu_seqlens)
        out["cu_seqlens_padded"] = torch.from_numpy(layout.cu_seqlens_padded)
        out["max_seqlen"] = torch.from_numpy(max_seqlen)  # 0-d int32
    else:
        out["cu_seqlens"] = _to_device(layout.cu_seqlens, device)
        out["cu_seqlens_padded"] = _to_device(layout.cu_seqlens_padded, device)
        out["max_seqlen"] = _to_device(max_seqlen, device)
    out["pad_between_seqs"] = layout.pad_between_seqs
    out["max_seqlen_int"] = layout.max_seqlen
    out["num_seqs"] = layout.num_seqs
    out["padding_mask"] = mask
    _pass_through(out, batch)
    return out  # type: ignore[return-value]


def split_batch_into_thd_chunks(
    batch: dict[str, torch.Tensor],
    num_chunks: int,
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
    *,
    absorb_trailing_pad: bool = True,
    token_keys: Sequence[str] = (),
) -> ThdChunkedBatch | ThdBatch:
    """Split along the batch into ``num_chunks`` equal chunks and convert each.

    Equal to calling :func:`process_input_for_thd` on each chunk of
    ``B/num_chunks`` rows and stacking, but computed in one vectorised pass.

    Args:
        batch: as for :func:`process_input_for_thd`.
        num_chunks: ``C``; must divide ``B``. ``0`` or ``1`` returns
            ``process_input_for_thd(batch, ...)`` unchanged (no chunk axis); a negative
            count is refused (the reference returned the batch unsplit).
        seq_lens_padding_value: sentinel of the length tables, and the value
            that right-pads the boundary rows to ``[C, maxN+1]``.
        padding_token_id: as for :func:`process_input_for_thd` (the fallback
            validates each chunk's stream separately).
        absorb_trailing_pad: keyword-only; applied to each chunk's own stream.
        token_keys: keyword-only; per-token keys (``[B, S, ...]``) split per chunk and
            flattened to ``[C, T_c, ...]`` exactly like ``input_ids`` (default: none).

    Returns:
        :class:`ThdChunkedBatch` (see its attribute docs) plus every other input
        key except ``seq_lens``/``seq_lens_padded``, passed through untouched
        (not split: only the caller knows which axis of such a tensor is B).

    Raises:
        ValueError: ``num_chunks`` not an int >= 0 dividing ``B``, or any error of
            :func:`process_input_for_thd`.
    """
    check_int(
        "num_chunks",
        num_chunks,
        0,
        numpy_ints=True,
        meaning=(
            "; pass the number of chunks (e.g. the pipeline's micro-batch count; 0 or 1: no split)"
        ),
    )
    if num_chunks <= 1:
        return process_input_for_thd(
            batch,
            seq_lens_padding_value,
            padding_token_id,
            absorb_trailing_pad=absorb_trailing_pad,
            token_keys=token_keys,
        )
    out, layout, device, mask = _convert(
        batch,
        int(num_chunks),
        seq_lens_padding_value,
        padding_token_id,
        absorb_trailing_pad,
        token_keys,
    )
    out["cu_seqlens"] = _to_device(layout.cu_seqlens, device)
    out["cu_seqlens_padded"] = _to_device(layout.cu_seqlens_padded, device)
    out["max_seqlen"] = _to_device(layout.max_seqlen, device)
    out["pad_between_seqs"] = bool(layout.pad_between_seqs.any())
    out["max_seqlen_int"] = layout.max_seqlen.tolist()
    out["num_seqs"] = layout.num_seqs.tolist()
    out["padding_mask"] = mask
    _pass_through(out, batch)
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------- internals


def _convert(
    batch: Mapping[str, Any],
    num_chunks: int,
    sentinel: int,
    padding_token_id: int,
    absorb: bool,
    token_keys: Sequence[str] = (),
) -> tuple[dict[str, Any], Any, torch.device | None, torch.Tensor]:
    """Shared body: validate, compute the layout, build the token part of the output.

    Returns the output dict holding the tokens (``[C, T_c, ...]`` for ``C > 1``,
    ``[T, ...]`` for ``C == 1``), the host layout (a ``StreamLayout`` for
    ``C == 1``, else a ``PackLayout``), the device the boundary tensors belong
    on (that of ``seq_lens``; None for the CPU), and the padding mask on the token
    device. Callers add the boundary keys in their own shapes, the mask, then
    the pass-through keys.
    """
    input_ids, position_ids, seq_lens, labels, shape, plain = read_token_tensors(batch)
    bsz = shape[0]
    seq_len = shape[1]
    if num_chunks > 1 and bsz % num_chunks:
        raise ValueError(
            f"num_chunks={num_chunks} does not divide the batch size B={bsz} "
            f"(input_ids.shape[0]); pick a divisor of {bsz} or change the batch size."
        )
    tok = bsz // num_chunks * seq_len
    check_stream_fits_int32(tok)
    sl, sp, meta_device = length_tables(
        batch, seq_lens, input_ids, num_chunks, padding_token_id, sentinel
    )
    layout: PackLayout | StreamLayout = (
        stream_layout(sl, sp, seq_len, sentinel, absorb)
        if num_chunks == 1
        else pack_layout(sl, sp, seq_len, sentinel, num_chunks, absorb)
    )
    out = _flat_tokens(input_ids, position_ids, labels, plain, num_chunks, tok)
    for key in _token_keys(token_keys, batch, bsz, seq_len):
        t = batch[key]
        out[key] = _flatten(
            t, (num_chunks, tok, *t.shape[2:]) if num_chunks > 1 else (tok, *t.shape[2:])
        )
    mask = _to_device(layout.padding_mask, None if input_ids.is_cpu else input_ids.device)
    return out, layout, meta_device, mask.view(num_chunks, tok) if num_chunks > 1 else mask


def _token_keys(
    token_keys: Sequence[str], batch: Mapping[str, Any], bsz: int, seq_len: int
) -> tuple[str, ...]:
    """``token_keys``, checked: each names a tensor of ``batch`` shaped ``[B, S, ...]`` like the
    ids."""
    keys = check_names("token_keys", token_keys) if token_keys else ()
    for key in keys:
        if key in ("input_ids", "labels", "position_ids") or key in _CONSUMED_KEYS:
            raise ValueError(
                f"token_keys names {key!r}, which the conversion handles itself; drop it "
                "from token_keys"
            )
        if key not in batch:
            raise ValueError(
                f"token_keys names {key!r}, which the batch does not hold (it has {sorted(batch)})"
            )
        t = batch[key]
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != (bsz, seq_len):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"token key {key!r} is {got}, not [B, S, ...]=[{bsz}, {seq_len}, ...] "
                "like input_ids; "
                "pass only per-token tensors in token_keys"
            )
    return keys


def _flat_tokens(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    plain: bool,
    num_chunks: int,
    tok: int,
) -> dict[str, Any]:
    """The token part of the output: ``[T, ...]`` (``[C, T_c, ...]`` when chunked) views."""
    if plain and num_chunks == 1:  # the collate's [B, S] tensors: flat views
        out: dict[str, Any] = {"input_ids": input_ids.ravel()}
        if labels is not None:
            out["labels"] = labels.ravel()
        out["position_ids"] = None if position_ids is None else position_ids.ravel()
        return out
    lead = (num_chunks, tok) if num_chunks > 1 else (tok,)
    out = {"input_ids": _flatten(input_ids, lead if input_ids.dim() == 2 else (*lead, -1))}
    if labels is not None:
        out["labels"] = _flatten(labels, lead if labels.dim() == 2 else (*lead, *labels.shape[2:]))
    if position_ids is None:
        out["position_ids"] = None
    elif position_ids.dim() == 3:
        n_rope = position_ids.shape[0]
        pos = position_ids.reshape(n_rope, num_chunks, 1, tok)
        out["position_ids"] = pos.transpose(0, 1) if num_chunks > 1 else pos[:, 0]
    else:
        out["position_ids"] = _flatten(position_ids, lead)
    return out


def _flatten(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` in ``shape``: a view when the strides allow it, else a ``reshape`` (copy).

    ``ravel()`` for the common 1-D target: a view whenever the strides allow
    one (else a copy, like ``reshape``), and per call about half the cost of a
    ``reshape`` with a shape tuple, which matters at ~25 us per conversion.
    """
    if len(shape) == 1:
        return t.ravel()
    try:
        return t.view(shape)
    except RuntimeError:  # strides that no view can express
        return t.reshape(shape)


def _pass_through(out: dict[str, Any], batch: Mapping[str, Any]) -> None:
    """Copy every input key the conversion neither produced nor consumed."""
    for key, value in batch.items():
        if key not in out and key not in _CONSUMED_KEYS:
            out[key] = value


def _to_device(arr: np.ndarray, device: torch.device | None) -> torch.Tensor:
    """Host array -> tensor on ``device`` (None: the CPU, zero-copy).

    Other devices get an asynchronous copy. For CUDA the source is pinned first:
    a copy from pageable memory may synchronise with the stream, one from
    pinned memory never does (the caching host allocator keeps the buffer alive
    until the copy has run).
    """
    t = torch.from_numpy(arr)
    if device is None:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
