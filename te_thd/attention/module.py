"""``ThdAttention``: one call site for TE's fused THD attention and the CPU reference.

``ThdAttention(...)(q, k, v, thd)`` (``thd`` a ``ThdLayout`` or the batch dict) runs TE
``DotProductAttention(qkv_format="thd")`` (with the CP group, if any) when ``transformer_engine``
imports, CUDA is available and the tensors are on CUDA; otherwise the plain-torch reference
(:func:`thd_attention_reference`, or :func:`thd_attention_cp_reference` with a CP
group of size > 1). Both return TE's THD output shape ``[T, H * D_v]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from te_thd._cp_strategy import normalize_strategy, te_cp_group_kwargs
from te_thd.attention.adapters import te_attention_kwargs
from te_thd.attention.contract import normalize_attn_mask_type
from te_thd.attention.cp_comm import (
    CP_COMM_TYPES,
    check_cp_comm_type,
    installed_te_version,
    resolve_cp_groups,
)
from te_thd.attention.cp_reference import thd_attention_cp_reference
from te_thd.attention.reference import thd_attention_reference
from te_thd.layout import ThdLayout

__all__ = ["ThdAttention", "te_available"]

Backend = Literal["te", "reference"]


@functools.lru_cache(maxsize=1)
def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports and CUDA is available."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # an ImportError, or a broken CUDA/cuDNN install raising OSError etc.
        return False
    return True


class ThdAttention(nn.Module):
    """Core attention for packed (THD) sequences with a TE backend and a reference fallback.

    Args:
        num_attention_heads: query heads ``H``.
        kv_channels: head dim ``D`` (TE's name).
        num_gqa_groups: key/value heads ``H_kv`` (default ``H``).
        attn_mask_type: ``"padding_causal"`` (default) or ``"padding"``.
        softmax_scale: default ``1 / sqrt(kv_channels)``.
        cp_group: context-parallel process group (``None``: no CP). q/k/v are then this
            rank's dual-chunk shards and the THD batch's boundaries stay global. For
            ``cp_comm_type="a2a+p2p"`` the list ``[a2a_group, p2p_group]``.
        cp_comm_type: how TE moves data between CP ranks: ``"p2p"`` (default),
            ``"all_gather"``, ``"a2a"`` or ``"a2a+p2p"``
            (:mod:`te_thd.attention.cp_comm`). A combination TE would reject (group
            structure, heads not divisible for all-to-all, a TE release without THD
            support for the type) raises here; the CPU reference runs every type.
        backend: ``"auto"`` (TE when :func:`te_available` and the input is on CUDA),
            ``"te"`` (require TE) or ``"reference"``.
        strategy: the CP partition the shards were cut by (:func:`te_thd.cp.partition_indices`):
            ``"dual_chunk_swap"`` (default) or ``"no_load_balance"`` (TE: ``all_gather`` and a
            causal mask only), passed to TE's ``set_context_parallel_group``
            (:func:`te_thd.attention.te_cp_group_kwargs`: a TE without it raises here).

    Attributes:
        preferred_backend: ``"te"`` or ``"reference"``, what CUDA input will use.
        last_backend: the backend the latest ``forward`` used (``None`` before any call).
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: int | None = None,
        *,
        attn_mask_type: str = "padding_causal",
        softmax_scale: float | None = None,
        cp_group: Any = None,
        cp_comm_type: str = "p2p",
        backend: Literal["auto", "te", "reference"] = "auto",
        strategy: Any = "dual_chunk_swap",
    ) -> None:
        super().__init__()
        if backend not in ("auto", "te", "reference"):
            raise ValueError(f"backend must be 'auto', 'te' or 'reference', got {backend!r}")
        heads_kv = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if num_attention_heads < 1 or heads_kv < 1 or num_attention_heads % heads_kv:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} must be a positive multiple of "
                f"num_gqa_groups={heads_kv}"
            )
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = heads_kv
        self.kv_channels = kv_channels
        self.attn_mask_type = normalize_attn_mask_type(attn_mask_type)
        self.softmax_scale = (
            1.0 / math.sqrt(kv_channels) if softmax_scale is None else float(softmax_scale)
        )
        self.cp_group = cp_group
        self.cp_comm_type = cp_comm_type
        self._cp = None if cp_group is None else resolve_cp_groups(cp_group, cp_comm_type)
        if cp_group is None and cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={cp_comm_type!r} is not one of TE's {CP_COMM_TYPES}")
        self.cp_size = 1 if self._cp is None else self._cp.size
        self.strategy = normalize_strategy(strategy)
        self.last_backend: Backend | None = None

        use_te = backend == "te" or (backend == "auto" and te_available())
        if use_te and not te_available():
            raise ValueError(
                "backend='te' needs transformer_engine and CUDA (torch.cuda.is_available() is "
                f"{torch.cuda.is_available()}); install it on a CUDA machine with "
                "pip install -e '.[te]', or use backend='auto' to fall back to the reference"
            )
        if self._cp is not None:
            check_cp_comm_type(
                self._cp,
                num_attention_heads=num_attention_heads,
                num_gqa_groups=heads_kv,
                attn_mask_type=self.attn_mask_type,
                te_version=installed_te_version() if use_te else None,
            )
        self._te: nn.Module | None = self._build_te() if use_te else None
        self.preferred_backend: Backend = "te" if self._te is not None else "reference"

    def _build_te(self) -> nn.Module:
        import transformer_engine.pytorch as te

        cp_kwargs: dict[str, Any] = {}
        if self._cp is not None and self._cp.size > 1:
            cp_kwargs = {
                "cp_group": self._cp.cp_group,
                "cp_global_ranks": list(self._cp.global_ranks),
                "cp_stream": torch.cuda.Stream(),
                "cp_comm_type": self._cp.comm_type,
            }
        dpa = te.DotProductAttention(
            self.num_attention_heads,
            self.kv_channels,
            num_gqa_groups=self.num_gqa_groups,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type=self.attn_mask_type,
            softmax_scale=self.softmax_scale,
            **cp_kwargs,
        )
        strategy_kwargs = te_cp_group_kwargs(self.strategy)  # {} for TE's default
        if cp_kwargs and strategy_kwargs:
            dpa.set_context_parallel_group(
                cp_kwargs["cp_group"],
                cp_kwargs["cp_global_ranks"],
                cp_kwargs["cp_stream"],
                cp_kwargs["cp_comm_type"],
                **strategy_kwargs,
            )
        return dpa

    def _kwargs(self, thd: ThdLayout | Mapping[str, Any], device: torch.device) -> dict:
        if isinstance(thd, Mapping) and "cu_seqlens_q" in thd:  # te_attention_kwargs output
            kw = dict(thd)
            kw.setdefault("attn_mask_type", self.attn_mask_type)
            return kw
        if isinstance(thd, ThdLayout) or (isinstance(thd, Mapping) and "cu_seqlens" in thd):
            strategy = self.strategy if self.cp_size > 1 else None
            kwargs = te_attention_kwargs(
                thd, self.attn_mask_type, cp_size=self.cp_size, device=device, strategy=strategy
            )
            return dict(kwargs)
        if not isinstance(thd, Mapping):
            raise ValueError(
                "thd must be a THD batch (process_input_for_thd output), its ThdLayout or "
                f"te_attention_kwargs(...) output, got {type(thd).__name__}"
            )
        raise ValueError(
            "thd has neither 'cu_seqlens' (a THD batch) nor 'cu_seqlens_q' "
            f"(TE kwargs); keys: {sorted(thd)}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        thd: ThdLayout | Mapping[str, Any],
    ) -> torch.Tensor:
        """Attention over packed sequences.

        Args:
            query: ``[T, H, D]`` (``T / cp`` local tokens under CP).
            key, value: ``[T, H_kv, D]`` / ``[T, H_kv, D_v]``.
            thd: the batch's :class:`~te_thd.layout.ThdLayout`, the THD batch dict
                (converted, CP-sharded if needed), or :func:`te_attention_kwargs` output.

        Returns:
            ``[T, H * D_v]`` (TE's THD output layout), zeros at padding slots.
        """
        kw = self._kwargs(thd, query.device)
        if self._te is not None and query.is_cuda:
            self.last_backend = "te"
            return self._te(query, key, value, **kw)
        self.last_backend = "reference"
        if self.cp_size > 1:
            out = thd_attention_cp_reference(
                query,
                key,
                value,
                cp_group=self._cp,  # resolved once, here (no collective per call)
                cp_comm_type=self.cp_comm_type,
                softmax_scale=self.softmax_scale,
                strategy=self.strategy,
                **kw,
            )
        else:
            out = thd_attention_reference(query, key, value, softmax_scale=self.softmax_scale, **kw)
        return out.reshape(out.shape[0], -1)
