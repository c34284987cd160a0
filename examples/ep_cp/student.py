"""The MoE student: embeddings, THD attention, expert-parallel MoE MLPs, two heads.

Every tensor is in THD layout: one packed stream of this rank's ``T`` tokens (its CP
shard of the data-parallel batch). Attention is pluggable -- ``make_attention()``
builds the module each layer calls as ``attn(q, k, v, te_attention_kwargs(thd))``
(``te_thd.attention.ThdAttention`` in the example: TE ``DotProductAttention`` with
the CP group on CUDA, the plain-torch reference CP attention on CPU). Only attention
needs the other CP ranks' tokens; every other layer is per token.

Dense parameters are replicated on every rank; the MoE expert weights are sharded
over the expert-parallel group (see :mod:`ep_cp.moe`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ep_cp.config import StudentConfig
from ep_cp.moe import MoELayer
from ep_cp.rope import apply_rotary


class _Block(nn.Module):
    def __init__(
        self,
        cfg: StudentConfig,
        layer: int,
        attention: nn.Module,
        ep_group: dist.ProcessGroup | None,
        cp_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.attn = attention
        self.proj = nn.Linear(h, h, bias=False)
        self.norm2 = nn.RMSNorm(h)
        self.moe = MoELayer(
            h,
            cfg.expert_ffn_size,
            cfg.num_experts,
            cfg.router_topk,
            layer_index=layer,
            seed=cfg.seed,
            ep_group=ep_group,
            cp_group=cp_group,
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        attn_kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q, k, v = (
            self.qkv(self.norm1(x)).view(t, 3, self.cfg.num_heads, self.cfg.head_dim).unbind(1)
        )
        q = apply_rotary(q, position_ids, self.cfg.rope_base)
        k = apply_rotary(k, position_ids, self.cfg.rope_base)
        a = self.attn(q, k, v, attn_kwargs)  # ThdAttention -> [T, H*D], TE's THD layout
        x = x + self.proj(a.reshape(t, -1))
        y, stats = self.moe(self.norm2(x), padding_mask)
        return x + y, stats.aux_loss


class StudentMoE(nn.Module):
    """MoE transformer distilled from the cached target outputs.

    Args:
        cfg: sizes.
        make_attention: builds one attention module per layer (called ``num_layers`` times).
        ep_group: expert-parallel group (``None``: all experts local).
        cp_group: context-parallel group (``None``: no CP); used by the router statistics.

    Dense parameters are initialised from ``cfg.seed`` in a fixed order that does not
    depend on the EP / CP layout, experts from ``(seed, layer, expert)``.
    """

    def __init__(
        self,
        cfg: StudentConfig,
        make_attention: Callable[[], nn.Module],
        ep_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.blocks = nn.ModuleList(
            _Block(cfg, i, make_attention(), ep_group, cp_group) for i in range(cfg.num_layers)
        )
        self.norm = nn.RMSNorm(h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.hidden_head = nn.Linear(h, cfg.target_hidden_size, bias=False)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if getattr(p, "is_expert", False):
                    continue  # initialised by MoELayer from (seed, layer, expert)
                if p.dim() == 1:  # norm weights
                    p.fill_(1.0)
                else:
                    std = 1.0 if name == "embed.weight" else p.shape[-1] ** -0.5
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        attn_kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the student on this rank's THD tokens.

        Args:
            input_ids: int64 ``[T]``.
            position_ids: int64 ``[T]`` (restart per sequence; this rank's CP shard).
            padding_mask: bool ``[T]``, True = padding slot (routed to no expert).
            attn_kwargs: ``te_attention_kwargs(thd)`` -- global boundaries, host ints.

        Returns:
            ``(logits, hidden_pred, aux_loss)``: float ``[T, vocab]``, float
            ``[T, target_hidden_size]``, and the summed per-layer load-balancing share
            (a scalar, see :class:`ep_cp.moe.RouterStats`).
        """
        x = self.embed(input_ids)
        aux = x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, a = blk(x, position_ids, padding_mask, attn_kwargs)
            aux = aux + a
        h = self.norm(x)
        return self.lm_head(h), self.hidden_head(h), aux

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's expert shard (reduced over the expert-data-parallel group)."""
        return [p for p in self.parameters() if getattr(p, "is_expert", False)]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Replicated parameters (reduced over the data-parallel x CP group)."""
        return [p for p in self.parameters() if not getattr(p, "is_expert", False)]
