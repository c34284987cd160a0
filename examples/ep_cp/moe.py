"""Top-k routed mixture of experts with expert parallelism (EP) over all-to-all.

The experts of a layer are split evenly over the ranks of the expert-parallel
group: EP rank ``r`` owns global experts ``[r * E_local, (r + 1) * E_local)``.
A forward step

1. routes every local token to its ``k`` best experts (softmax router, gates
   renormalised over the chosen ``k``); padding tokens are routed nowhere;
2. sorts the (token, expert) assignments by expert, so each destination rank's
   assignments form one contiguous block;
3. **exchanges the counts explicitly** -- ``all_to_all_single`` of the per-expert
   counts ``[E]`` gives every rank the ``[ep, E_local]`` matrix of what it will
   receive -- and turns them into the split sizes of the token all-to-all;
4. dispatches the token activations (:class:`AllToAll`), regroups them by local
   expert, runs the experts, undoes the regrouping, and returns the results with
   the transposed all-to-all;
5. combines the ``k`` expert outputs of every token weighted by its gates.

:class:`AllToAll` is an autograd function whose backward is the all-to-all with
the split sizes swapped, so gradients flow back to the token's rank (for the
activations) and to the expert's rank (for the expert weights) -- in both
directions through the same collective. All other steps are ordinary
differentiable torch ops (``index_select``, ``index_add``).

Host synchronisation: the split sizes of ``all_to_all_single`` are Python ints,
so step 3 reads the counts on the host once per layer. Megatron's all-to-all
dispatcher does the same; it is the only sync of the MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` with explicit split sizes.

    ``x`` is ``[sum(input_splits), ...]``; the result is ``[sum(output_splits), ...]``
    holding, in source-rank order, the blocks other ranks sent to this rank.
    Backward sends the gradient of each received block back to its source: the
    same collective with ``input_splits`` and ``output_splits`` swapped.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
            group=group,
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad_in = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            grad_in,
            grad.contiguous(),
            output_split_sizes=ctx.input_splits,
            input_split_sizes=ctx.output_splits,
            group=ctx.group,
        )
        return grad_in, None, None, None


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all of per-expert token counts.

    Args:
        send_counts: int64 ``[E]``, how many assignments this rank sends to each
            global expert (experts of EP rank ``r`` at ``[r*E_local, (r+1)*E_local)``).
        group: the expert-parallel group (``None`` or size 1: no communication).

    Returns:
        int64 ``[ep, E_local]``: row ``s`` is what EP rank ``s`` sends to each of this
        rank's local experts.
    """
    ep = 1 if group is None else dist.get_world_size(group)
    if ep == 1:
        return send_counts.view(1, -1)
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.view(ep, -1)


@dataclass
class RouterStats:
    """What one MoE layer reports for the load-balancing loss and the log.

    ``aux_loss`` is this rank's additive share of the layer's Switch load-balancing
    loss ``E * sum_e f_e * P_e`` over all tokens of the CP group (summing the shares
    over the CP ranks gives the loss of the whole sequences); ``tokens_per_expert``
    int64 ``[E]`` counts the CP group's routed assignments.
    """

    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


class MoELayer(nn.Module):
    """Top-k routed MLP experts, ``E_local = num_experts / ep`` of them on this rank.

    Dense parameters (``router``) are replicated on every rank; the expert weights
    ``w_in`` ``[E_local, H, F]`` and ``w_out`` ``[E_local, F, H]`` are this rank's
    shard and carry ``param.is_expert = True`` (reduced over the expert-data-parallel
    group, not the data-parallel one). Expert ``e`` is initialised from
    ``(seed, layer, e)`` alone, so any EP layout starts from the same weights.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        topk: int,
        layer_index: int,
        seed: int,
        ep_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.ep_group, self.cp_group = ep_group, cp_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel size "
                f"ep={self.ep}; choose --ep among the divisors of num_experts"
            )
        self.num_experts, self.topk = num_experts, topk
        self.num_local = num_experts // self.ep
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        w_in, w_out = [], []
        for e in range(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local):
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer_index * 1_009 + e)
            w_in.append(torch.randn(hidden_size, ffn_size, generator=g) * hidden_size**-0.5)
            w_out.append(torch.randn(ffn_size, hidden_size, generator=g) * ffn_size**-0.5)
        self.w_in = nn.Parameter(torch.stack(w_in))
        self.w_out = nn.Parameter(torch.stack(w_out))
        self.w_in.is_expert = True  # type: ignore[attr-defined]
        self.w_out.is_expert = True  # type: ignore[attr-defined]

    def _experts(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Run local expert ``j`` on the ``per_expert[j]`` rows of its block of ``x``."""
        outs = [
            F.gelu(xj @ self.w_in[j]) @ self.w_out[j]
            for j, xj in enumerate(torch.split(x, per_expert))
        ]
        return torch.cat(outs) if outs else x

    def forward(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RouterStats]:
        """Route, dispatch, compute, return, combine.

        Args:
            x: ``[T, H]`` this rank's tokens (its CP shard of its data-parallel batch).
            padding_mask: bool ``[T]``, True = padding (routed to no expert).

        Returns:
            ``([T, H], RouterStats)``; padding rows of the output are zero.
        """
        k, num_e = self.topk, self.num_experts
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        top_p, top_e = probs.topk(k, dim=-1)  # [T, k]
        gates = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)

        flat_e = top_e.reshape(-1)  # [T*k], assignment a = token * k + slot
        if padding_mask is not None:
            # Padding goes to the virtual expert E, which sorts last and is never sent.
            flat_e = flat_e.masked_fill(padding_mask.repeat_interleave(k), num_e)
        order = torch.argsort(flat_e, stable=True)
        send_counts = torch.bincount(flat_e, minlength=num_e + 1)[:num_e]  # [E]

        stats = self._router_stats(probs, send_counts, padding_mask)

        # The one host sync of the layer: all_to_all_single takes Python split sizes.
        recv_counts = exchange_counts(send_counts, self.ep_group)  # [ep, E_local]
        counts_host = torch.cat([send_counts, recv_counts.reshape(-1)]).tolist()
        send_host, recv_host = counts_host[:num_e], counts_host[num_e:]
        n_send = sum(send_host)

        assign = order[:n_send]  # assignments sorted by global expert
        token_idx = torch.div(assign, k, rounding_mode="floor")
        x_send = x.index_select(0, token_idx)  # [n_send, H]

        if self.ep == 1:
            y_send = self._experts(x_send, send_host)
        else:
            nl = self.num_local
            in_splits = [sum(send_host[r * nl : (r + 1) * nl]) for r in range(self.ep)]
            out_splits = [sum(recv_host[s * nl : (s + 1) * nl]) for s in range(self.ep)]
            x_recv = AllToAll.apply(x_send, out_splits, in_splits, self.ep_group)
            # Received rows are grouped by source rank, then local expert; regroup by expert.
            local_e = torch.arange(nl, device=x.device).repeat(self.ep)
            row_expert = local_e.repeat_interleave(
                recv_counts.reshape(-1), output_size=sum(recv_host)
            )
            perm = torch.argsort(row_expert, stable=True)
            per_expert = [sum(recv_host[s * nl + j] for s in range(self.ep)) for j in range(nl)]
            y_grouped = self._experts(x_recv.index_select(0, perm), per_expert)
            y_recv = y_grouped.index_select(0, torch.argsort(perm))
            y_send = AllToAll.apply(y_recv, in_splits, out_splits, self.ep_group)

        w = gates.reshape(-1).index_select(0, assign)  # [n_send]
        # (under autocast the experts' output may be bf16 while x is float32)
        out = torch.zeros_like(x).index_add(0, token_idx, (y_send * w[:, None]).to(x.dtype))
        return out, stats

    def _router_stats(
        self, probs: torch.Tensor, send_counts: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> RouterStats:
        """Switch load-balancing loss over the CP group's (real) tokens.

        ``f_e = n_e / (N k)`` uses the CP group's counts (an all-reduce of integer
        counts: no gradient needed); ``P_e = sum_t p_te / N`` is a sum over tokens,
        so this rank contributes ``E / (N^2 k) * sum_e n_e * sum_{t local} p_te`` and
        the CP ranks' contributions add up to the loss of the full sequences.
        """
        counts = send_counts.clone()
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            dist.all_reduce(counts, group=self.cp_group)
        k, num_e = self.topk, self.num_experts
        n_tokens = (counts.sum() / k).clamp(min=1).to(probs.dtype)
        if padding_mask is not None:
            probs = probs.masked_fill(padding_mask[:, None], 0.0)
        aux = (counts.to(probs.dtype) * probs.sum(0)).sum() * (num_e / (k * n_tokens * n_tokens))
        return RouterStats(aux_loss=aux, tokens_per_expert=counts)
