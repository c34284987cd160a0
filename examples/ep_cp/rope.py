"""Rotary position embedding driven by explicit position ids.

THD packing restarts positions at 0 for every sequence and CP sharding hands each
rank a non-contiguous slice of them, so the angle comes from ``position_ids`` --
never from a token's offset in the packed stream.
"""

from __future__ import annotations

import torch


def apply_rotary(
    x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0
) -> torch.Tensor:
    """Rotate ``x`` by its positions (rotate-half convention).

    Args:
        x: ``[..., T, H, D]`` float, ``D`` even (``[T, H, D]`` in THD, ``[B, T, H, D]`` in BSHD).
        position_ids: integer ``[..., T]`` matching ``x``'s leading dims.
        base: rotary base.

    Returns:
        Tensor of ``x``'s shape and dtype.
    """
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = position_ids.to(torch.float32)[..., None] * inv_freq  # [..., T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :].to(x.dtype)  # [..., T, 1, D]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin
