"""One training step's forward + backward, shared by the script and the tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ep_cp.objective import batch_loss_sums
from ep_cp.parallel import ParallelContext
from ep_cp.student import StudentMoE

#: order of the entries of the stats vector :func:`forward_backward` returns
STATS = ("loss_sum", "kl_sum", "mse_sum", "supervised", "aux", "real_tokens")


def forward_backward(
    model: StudentMoE,
    batch: Mapping[str, Any],
    attn_kwargs: Mapping[str, Any],
    ctx: ParallelContext,
    hidden_weight: float,
    aux_weight: float,
) -> torch.Tensor:
    """Forward and backward of this rank's THD shard; gradients are NOT reduced yet.

    The objective whose gradient the ranks' gradients sum to (over DP x CP for dense
    parameters, over expert-DP for experts; see :mod:`ep_cp.parallel`) is::

        sum_ranks loss_sum_r / N_supervised  +  aux_weight * sum_ranks aux_r / dp

    i.e. the token mean of the distillation loss over the whole global batch plus the
    mean over data-parallel replicas of the load-balancing loss (each CP rank holds
    an additive share of its replica's). It does not depend on how the batch is
    split over CP ranks.

    Args:
        batch: the collate's THD batch (this CP rank's tokens) on ``ctx.device``.
        attn_kwargs: ``te_attention_kwargs`` of the batch.

    Returns:
        float32 ``[6]`` detached local stats, see :data:`STATS`.
    """
    logits, hidden_pred, aux = model(
        batch["input_ids"], batch["position_ids"], batch["padding_mask"], attn_kwargs
    )
    parts = batch_loss_sums(logits, hidden_pred, batch, hidden_weight)
    n_global = parts.weight.detach().clone()
    if dist.get_world_size(ctx.dp_cp_group) > 1:
        dist.all_reduce(n_global, group=ctx.dp_cp_group)
    loss = parts.total / n_global.clamp(min=1.0) + aux * (aux_weight / ctx.dp_size)
    loss.backward()
    real = (~batch["padding_mask"]).sum().to(torch.float32)
    return torch.stack(
        [
            parts.total.detach(),
            parts.kl.detach(),
            parts.mse.detach(),
            parts.weight,
            aux.detach(),
            real,
        ]
    )


def global_stats(
    local: torch.Tensor, grad_norm: torch.Tensor, ctx: ParallelContext
) -> dict[str, float]:
    """Sum the local stats over DP x CP and turn them into the logged means.

    ``grad_norm`` (already global) rides along, so the whole log costs one small
    all-reduce and one device-to-host copy per step.
    """
    s = local.clone()
    if dist.get_world_size(ctx.dp_cp_group) > 1:
        dist.all_reduce(s, group=ctx.dp_cp_group)
    host = torch.cat([s, grad_norm.detach().float().reshape(1).to(s.device)]).tolist()
    v = dict(zip(STATS, host[: len(STATS)], strict=True))
    n = max(v["supervised"], 1.0)
    return {
        "loss": v["loss_sum"] / n,
        "kl": v["kl_sum"] / n,
        "mse": v["mse_sum"] / n,
        "aux": v["aux"] / ctx.dp_size,
        "supervised_tokens": v["supervised"],
        "tokens": v["real_tokens"],
        "grad_norm": host[-1],
    }
