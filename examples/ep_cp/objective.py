"""Distillation objective on the cached supervision, masked per token.

Per supervised token ``t`` (``loss_mask == 1`` and not padding):

* ``kl_t = sum_j p_tj (log p_tj - log q_t[idx_tj])`` -- KL from the target's top-k
  next-token distribution (renormalised over its ``k`` entries) to the student's;
* ``mse_t = mean((h_student_t - h_target_t)^2)`` -- hidden-state regression.

The loss of a step is ``sum_t (kl_t + hidden_weight * mse_t) / N`` where ``N`` counts
the supervised tokens of the whole data-parallel x CP group (an all-reduce of an
integer count), so every rank's backward contributes its exact share of the global
token mean and a plain SUM of the gradients over the group is the gradient of it --
whatever the CP / DP split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LossParts:
    """Local (this rank's) sums over supervised tokens; ``weight`` is their count."""

    total: torch.Tensor
    kl: torch.Tensor
    mse: torch.Tensor
    weight: torch.Tensor


def distill_loss_sums(
    logits: torch.Tensor,
    hidden_pred: torch.Tensor,
    topk_logprobs: torch.Tensor,
    topk_indices: torch.Tensor,
    target_hidden: torch.Tensor,
    supervised: torch.Tensor,
    hidden_weight: float,
) -> LossParts:
    """Masked sums of the per-token distillation loss.

    Args:
        logits: float ``[T, V]`` student logits.
        hidden_pred: float ``[T, Hd]`` student's regression head.
        topk_logprobs: float ``[T, K]`` target log-probabilities of its top-k tokens.
        topk_indices: int ``[T, K]`` their vocabulary ids.
        target_hidden: ``[T, Hd]`` target final hidden states (any float dtype).
        supervised: bool ``[T]``, loss mask AND not padding.
        hidden_weight: weight of the regression term.

    Returns:
        :class:`LossParts` of float32 scalars.
    """
    w = supervised.to(torch.float32)
    logq = torch.log_softmax(logits.float(), dim=-1)
    logp = torch.log_softmax(topk_logprobs.float(), dim=-1)  # renormalise the top-k
    kl = (logp.exp() * (logp - logq.gather(-1, topk_indices.long()))).sum(-1)  # [T]
    mse = (hidden_pred.float() - target_hidden.float()).pow(2).mean(-1)  # [T]
    kl_sum, mse_sum = (kl * w).sum(), (mse * w).sum()
    return LossParts(total=kl_sum + hidden_weight * mse_sum, kl=kl_sum, mse=mse_sum, weight=w.sum())


def batch_loss_sums(
    logits: torch.Tensor,
    hidden_pred: torch.Tensor,
    batch: Mapping[str, Any],
    hidden_weight: float,
) -> LossParts:
    """:func:`distill_loss_sums` fed from a cached THD batch.

    ``batch`` holds this rank's ``[T, ...]`` tensors ``loss_mask``, ``padding_mask``,
    ``topk_logprobs``, ``topk_indices`` and ``hidden``; a token is supervised when its
    loss mask is set and it is not padding.
    """
    supervised = batch["loss_mask"].bool() & ~batch["padding_mask"]
    return distill_loss_sums(
        logits,
        hidden_pred,
        batch["topk_logprobs"],
        batch["topk_indices"],
        batch["hidden"],
        supervised,
        hidden_weight,
    )
