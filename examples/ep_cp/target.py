"""The frozen "target" transformer whose per-token outputs the cache stores.

A tiny dense causal transformer, initialised deterministically from
``TargetConfig.seed`` (no checkpoint to download). For a right-padded batch
``[B, L]`` it produces the final hidden states and the top-k of its next-token
distribution -- the supervision the student is distilled on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ep_cp.config import TargetConfig
from ep_cp.rope import apply_rotary
from ep_cp.supervision import cache_rows


class _Block(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_heads
        self.norm1 = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.norm2 = nn.RMSNorm(h)
        self.up = nn.Linear(h, cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, h, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads).unbind(2)
        q, k = apply_rotary(q, pos), apply_rotary(k, pos)
        # Right padding + a causal mask: no real token ever attends to a pad slot.
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TargetTransformer(nn.Module):
    """Frozen dense causal LM. Parameters never require grad."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if (
                    name.endswith("norm1.weight")
                    or name.endswith("norm2.weight")
                    or name == "norm.weight"
                ):
                    p.fill_(1.0)
                else:
                    std = 1.0 if name == "embed.weight" else p.shape[-1] ** -0.5
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        self.requires_grad_(False)
        self.eval()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target on a right-padded batch.

        Args:
            input_ids: int64 ``[B, L]``.

        Returns:
            ``(hidden, logits)``: float32 ``[B, L, hidden_size]`` (after the final norm)
            and float32 ``[B, L, vocab_size]``.
        """
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x, pos)
        hidden = self.norm(x)
        return hidden, self.lm_head(hidden) * self.cfg.logit_scale

    @torch.no_grad()
    def supervision(
        self, input_ids: torch.Tensor, seq_len: torch.Tensor, topk: int, mask_prompt: bool
    ) -> dict[str, torch.Tensor]:
        """Per-token supervision of a right-padded batch, as the cache stores it.

        Args:
            input_ids: int64 ``[B, L]``, right-padded.
            seq_len: int64 ``[B]``, real lengths.
            topk: how many next-token candidates to keep per position.
            mask_prompt: when True the first quarter of every sequence (its "prompt")
                gets ``loss_mask == 0``, so only the "response" is supervised.

        Returns:
            :func:`ep_cp.supervision.cache_rows`: ``input_ids``, ``seq_len``,
            ``loss_mask``, ``topk_logprobs``, ``topk_indices``, ``hidden`` on CPU in
            their stored dtypes, zeros on padding.
        """
        hidden, logits = self(input_ids)
        ar = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        sup = ar >= seq_len[:, None] // 4 if mask_prompt else torch.ones_like(ar, dtype=torch.bool)
        return cache_rows(input_ids, seq_len, sup.expand_as(input_ids), logits, hidden, topk)
