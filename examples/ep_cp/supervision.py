"""A target's outputs -> the cache rows: top-k next-token log-probs, padding zeroed.

Both targets (the synthetic transformer of :mod:`ep_cp.target` and a Hugging Face
model, :mod:`ep_cp.hf_target`) end in :func:`cache_rows`, so the two caches hold the
same keys with the same dtypes and the same padding rule (see :mod:`ep_cp.cache_format`).
"""

from __future__ import annotations

import torch

from ep_cp.cache_format import DTYPES


def topk_logprobs(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the next-token log-softmax at every position.

    One sample at a time: the float32 ``[L, V]`` log-softmax of a real vocabulary
    (128k+ entries) is the largest buffer of the producer, so it is never built for
    the whole batch at once.

    Args:
        logits: ``[B, L, V]`` any float dtype.
        topk: candidates kept per position (``<= V``).

    Returns:
        ``(values, indices)``: float32 ``[B, L, topk]`` log-probabilities, int64
        ``[B, L, topk]`` vocabulary ids, best first.
    """
    values, indices = [], []
    for row in logits:
        v, i = torch.log_softmax(row.float(), dim=-1).topk(topk, dim=-1)
        values.append(v)
        indices.append(i)
    return torch.stack(values), torch.stack(indices)


def cache_rows(
    input_ids: torch.Tensor,
    seq_len: torch.Tensor,
    loss_mask: torch.Tensor,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    topk: int,
    layer_hidden: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The cache's tensors for a right-padded batch, in their stored dtypes, on CPU.

    Args:
        input_ids: int64 ``[B, L]``, right-padded.
        seq_len: int64 ``[B]``, real lengths.
        loss_mask: ``[B, L]`` (bool or 0/1), 1 = supervised; cleared on padding here.
        logits: ``[B, L, V]`` next-token logits.
        hidden: ``[B, L, H]`` final hidden states.
        topk: next-token candidates kept per position.
        layer_hidden: optional ``[B, L, n, H]`` hidden states of chosen layers.

    Returns:
        ``input_ids`` int64 ``[B, L]`` (0 on padding), ``seq_len`` int64 ``[B]``,
        ``loss_mask`` bool ``[B, L]``, ``topk_logprobs`` float32 ``[B, L, topk]``,
        ``topk_indices`` int32 ``[B, L, topk]``, ``hidden`` bf16 ``[B, L, H]`` and,
        with ``layer_hidden``, ``layer_hidden`` bf16 ``[B, L, n, H]``. Padding slots
        hold zeros, whatever the model computed there.
    """
    top_v, top_i = topk_logprobs(logits, topk)
    real = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] < seq_len[:, None]
    keep = real[..., None]
    rows = {
        "input_ids": input_ids.masked_fill(~real, 0),
        "seq_len": seq_len,
        "loss_mask": loss_mask.bool() & real,
        "topk_logprobs": top_v.masked_fill(~keep, 0.0),
        "topk_indices": top_i.masked_fill(~keep, 0),
        "hidden": hidden.masked_fill(~keep, 0.0),
    }
    if layer_hidden is not None:
        rows["layer_hidden"] = layer_hidden.masked_fill(~keep[..., None], 0.0)
    return {k: v.to(DTYPES[k]).cpu() for k, v in rows.items()}
