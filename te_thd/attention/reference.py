"""Plain-torch THD attention with TE's keyword arguments: the CPU stand-in for TE.

``thd_attention_reference(q, k, v, **te_attention_kwargs(thd))`` computes what TE
``DotProductAttention(qkv_format="thd")`` computes for the same kwargs: sequence ``i``
occupies slots ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` and only its first
``cu_seqlens[i+1] - cu_seqlens[i]`` slots take part in attention; every other slot's
output is zero (and receives zero gradient). Causal (``"padding_causal"``, top-left;
``"padding_causal_bottom_right"``) and bidirectional (``"padding"``) masks, GQA and a
softmax scale are supported; everything is differentiable.

Vectorised: segment ids and positions of every slot come from one ``searchsorted``
(:mod:`._layout`); queries are processed in chunks of rows against the key window
those rows can see, so memory is ``O(H * chunk * window)``, never ``O(T^2)``, and
there is no Python loop over sequences. The per-chunk window bounds are read on the
host once per call (a device sync when the boundaries live on a GPU: this is a
reference and test oracle, not a training kernel).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from te_thd.attention._layout import slot_segments
from te_thd.attention.contract import check_te_thd_args

__all__ = ["thd_attention_reference"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are accumulated in float32 (as fused kernels do); float64
    # stays float64 so tests can compare at tight tolerances.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_ranges(
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_kv_padded: torch.Tensor,
    seg_q: torch.Tensor,
    pos_q: torch.Tensor,
    real_q: torch.Tensor,
    len_q: torch.Tensor,
    causal: bool,
    bottom_right: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row ``[M]``: causal shift, whether it sees any key, and the key range
    ``[lo, hi)`` it can attend to, as global kv slots (int64)."""
    cukv = cu_seqlens_kv.to(torch.int64)
    kv_start = torch.cat((cu_seqlens_kv_padded.to(torch.int64)[:-1], cukv.new_zeros(1)))
    kv_len = torch.cat((cukv[1:] - cukv[:-1], cukv.new_zeros(1)))
    seg_q_kv = seg_q.clamp(max=kv_len.numel() - 1)
    lo = kv_start[seg_q_kv]
    span = kv_len[seg_q_kv]
    shift = torch.zeros_like(pos_q)
    if causal:
        if bottom_right:
            shift = span - len_q
        span = torch.minimum(span, (pos_q + shift + 1).clamp(min=0))
    return shift, real_q & (span > 0), lo, lo + span


def _chunk_windows(
    lo: torch.Tensor, hi: torch.Tensor, valid_row: torch.Tensor, chunk: int
) -> tuple[int, list[int], list[int]]:
    """``(n_chunks, win_lo, win_hi)``: the key window of each chunk of ``chunk`` query
    rows, read on the host once (rows with nothing to see ignored)."""
    m = lo.shape[0]
    n_chunks = max(1, -(-m // chunk))
    pad_rows = n_chunks * chunk - m
    big = torch.iinfo(torch.int64).max
    lo_c = torch.where(valid_row, lo, torch.full_like(lo, big))
    hi_c = torch.where(valid_row, hi, torch.full_like(hi, -1))
    lo_c = torch.cat((lo_c, lo_c.new_full((pad_rows,), big)))
    hi_c = torch.cat((hi_c, hi_c.new_full((pad_rows,), -1)))
    win_lo = lo_c.view(n_chunks, chunk).amin(1).tolist()
    win_hi = hi_c.view(n_chunks, chunk).amax(1).tolist()
    return n_chunks, win_lo, win_hi


def attend_slots(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_slots: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_kv_padded: torch.Tensor,
    causal: bool,
    bottom_right: bool = False,
    softmax_scale: float | None = None,
    query_chunk_size: int = 256,
) -> torch.Tensor:
    """Attention of query rows sitting at arbitrary global slots over a full K/V stream.

    The single-device reference passes ``q_slots = arange(T_q)``; the CP reference passes
    a rank's partition indices (its dual-chunk shard), so causal positions are the true
    global ones.

    Args:
        query: ``[M, H, D]``; row ``m`` sits at global query slot ``q_slots[m]``.
        key, value: ``[T_kv, H_kv, D]`` / ``[T_kv, H_kv, D_v]``, the whole stream in
            sequence order; ``H % H_kv == 0`` (query head ``h`` uses kv head
            ``h // (H / H_kv)``).
        q_slots: int64 ``[M]``.
        cu_seqlens_q, cu_seqlens_q_padded, cu_seqlens_kv, cu_seqlens_kv_padded: int
            ``[N+1]`` boundaries (real and physical).
        causal: mask keys after the query's position.
        bottom_right: align the causal diagonal to the bottom-right corner of each
            sequence's ``[len_q, len_kv]`` block (TE ``*_bottom_right``); top-left otherwise.
        softmax_scale: default ``1 / sqrt(D)``.
        query_chunk_size: rows per chunk (bounds the score buffer).

    Returns:
        ``[M, H, D_v]`` in ``query.dtype``; zero rows for padding slots.
    """
    if query_chunk_size < 1:
        raise ValueError(f"query_chunk_size must be >= 1, got {query_chunk_size}")
    m, hq, d = query.shape
    t_kv, hkv, dv = value.shape
    groups = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    acc = _acc_dtype(query.dtype)
    dev = query.device

    seg_q, pos_q, real_q, len_q = slot_segments(cu_seqlens_q, cu_seqlens_q_padded, q_slots)
    kv_slots = torch.arange(t_kv, device=cu_seqlens_kv_padded.device, dtype=torch.int64)
    seg_k, pos_k, real_k, _ = slot_segments(cu_seqlens_kv, cu_seqlens_kv_padded, kv_slots)

    shift, valid_row, lo, hi = _key_ranges(
        cu_seqlens_kv, cu_seqlens_kv_padded, seg_q, pos_q, real_q, len_q, causal, bottom_right
    )
    n_chunks, win_lo, win_hi = _chunk_windows(lo, hi, valid_row, query_chunk_size)

    seg_q, pos_q, real_q, shift = (x.to(dev) for x in (seg_q, pos_q, real_q, shift))
    seg_k, pos_k, real_k = (x.to(dev) for x in (seg_k, pos_k, real_k))

    outs: list[torch.Tensor] = []
    for c in range(n_chunks):
        a, b = c * query_chunk_size, min(m, (c + 1) * query_chunk_size)
        wl, wh = win_lo[c], win_hi[c]
        if wh <= wl:
            # No real query row with a visible key: an empty key window yields zero rows
            # that stay connected to the autograd graph (zero gradient, like TE's output).
            wl = wh = 0
        allowed = (seg_q[a:b, None] == seg_k[None, wl:wh]) & real_q[a:b, None] & real_k[None, wl:wh]
        if causal:
            allowed &= pos_k[None, wl:wh] <= (pos_q[a:b] + shift[a:b])[:, None]
        row_ok = allowed.any(dim=1)  # [C]
        qc = query[a:b].to(acc).transpose(0, 1)  # [H, C, D]
        kc = key[wl:wh].to(acc).transpose(0, 1)  # [H_kv, W, D]
        vc = value[wl:wh].to(acc).transpose(0, 1)
        if wh > wl:
            # A row with no visible key (padding) would softmax to NaN and poison the
            # backward pass: let it see the window's first key, then zero its output
            # (torch.where also zeroes the gradient flowing to that key).
            allowed[:, 0] |= ~row_ok
            out = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=allowed, scale=scale, enable_gqa=groups > 1
            )
            out = torch.where(row_ok[None, :, None], out, out.new_zeros(()))
        else:
            # Empty window: zero rows still connected to the autograd graph.
            out = torch.einsum("hcd,hwd->hcw", qc[:hkv], kc) @ vc
            out = out.repeat_interleave(groups, dim=0)
        outs.append(out.transpose(0, 1).to(query.dtype))
    return torch.cat(outs, dim=0)


def thd_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    attn_mask_type: str = "padding_causal",
    qkv_format: str = "thd",
    pad_between_seqs: bool | None = None,
    softmax_scale: float | None = None,
    query_chunk_size: int = 256,
) -> torch.Tensor:
    """THD attention in plain torch, called exactly like TE ``DotProductAttention.forward``.

    ``thd_attention_reference(q, k, v, **te_attention_kwargs(thd))``. The arguments are
    validated with :func:`check_te_thd_args` first, so a CPU run rejects what TE would.

    Args:
        query: ``[T_q, H, D]``.
        key, value: ``[T_kv, H_kv, D]`` / ``[T_kv, H_kv, D_v]``, ``H % H_kv == 0`` (GQA).
        cu_seqlens_q, cu_seqlens_kv: int32 ``[N+1]`` real boundaries.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: int32 ``[N+1]`` physical offsets
            (``None``: no padding between sequences).
        max_seqlen_q, max_seqlen_kv, pad_between_seqs: validated, otherwise unused.
        attn_mask_type: ``"padding_causal"`` (default), ``"padding_causal_bottom_right"``
            or ``"padding"`` (bidirectional); TE spellings such as ``"padding,causal"``.
        qkv_format: must be ``"thd"``.
        softmax_scale: default ``1 / sqrt(D)`` (TE's default for ``kv_channels = D``).
        query_chunk_size: query rows per chunk (memory bound).

    Returns:
        ``[T_q, H, D_v]`` in ``query.dtype`` (TE returns the same values as
        ``[T_q, H * D_v]``); zeros at padding slots.
    """
    mask = check_te_thd_args(
        query,
        key,
        value,
        qkv_format=qkv_format,
        attn_mask_type=attn_mask_type,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        pad_between_seqs=pad_between_seqs,
    )
    q_slots = torch.arange(query.shape[0], device=cu_seqlens_q.device, dtype=torch.int64)
    return attend_slots(
        query,
        key,
        value,
        q_slots,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_q_padded=cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_kv=cu_seqlens_kv,
        cu_seqlens_kv_padded=(
            cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
        ),
        causal="causal" in mask,
        bottom_right="bottom_right" in mask,
        softmax_scale=softmax_scale,
        query_chunk_size=query_chunk_size,
    )
