"""Context-parallel reference attention over a real ``torch.distributed`` group.

Each CP rank holds its dual-chunk shard of q/k/v (TE's THD CP layout, see
:mod:`te_thd.cp`). The reference all-gathers K/V in the CP group, restores sequence
order with :func:`te_thd.cp.cp_rank_to_sequence_order`, and attends the local
queries at their true global slots (:func:`te_thd.cp.partition_indices`), so causal
positions are exact for the dual-chunk layout. The all-gather's backward sums every
rank's K/V gradient and hands each rank its own shard, so gradients equal the
single-device ones. Works on gloo (CPU) and NCCL.

Communication lives here; the layout math it uses lives in :mod:`te_thd.cp` and
:mod:`te_thd.attention._layout`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from te_thd.attention.contract import check_te_thd_args
from te_thd.attention.reference import attend_slots, thd_attention_reference

__all__ = ["thd_attention_cp_reference"]


class _AllGatherCP(torch.autograd.Function):
    """``[T_local, ...]`` -> ``[cp * T_local, ...]`` in rank order; backward = reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        grad = grad.contiguous()
        n = grad.shape[0] // world
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = torch.empty_like(grad[:n])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        # gloo has no reduce-scatter: sum everywhere, keep this rank's slice.
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad[rank * n : (rank + 1) * n].contiguous(), None


def all_gather_cp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable all-gather along dim 0 in rank order.

    Args:
        x: ``[T_local, ...]``, the same shape on every rank.
        group: the CP process group.

    Returns:
        ``[cp * T_local, ...]``; its gradient is summed across ranks and each rank
        receives the slice of its own input.
    """
    return _AllGatherCP.apply(x, group)


def thd_attention_cp_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: Any,
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
    """THD attention with context parallelism, called like TE with a ``cp_group``.

    ``thd_attention_cp_reference(q, k, v, cp_group=g, **te_attention_kwargs(thd_rank))``
    where ``q/k/v`` are this rank's shards (``shard_thd_batch_for_cp`` order) and the
    boundaries are the global ones.

    Args:
        query: ``[T / cp, H, D]`` local queries (chunks ``r`` and ``2cp-1-r`` of every
            sequence).
        key, value: ``[T / cp, H_kv, D]`` / ``[T / cp, H_kv, D_v]`` local shards.
        cp_group: the CP process group (size 1 falls back to the plain reference).
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded: global
            int32 ``[N+1]`` boundaries; every padded length a multiple of ``2 * cp``.
        max_seqlen_q, max_seqlen_kv, attn_mask_type, qkv_format, pad_between_seqs,
            softmax_scale, query_chunk_size: as in :func:`thd_attention_reference`.

    Returns:
        ``[T / cp, H, D_v]``: this rank's output rows, in the same local order as
        ``query``; zeros at padding slots.
    """
    from te_thd.cp import cp_rank_to_sequence_order, partition_indices

    kwargs: dict[str, Any] = {
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_kv": cu_seqlens_kv,
        "cu_seqlens_q_padded": cu_seqlens_q_padded,
        "cu_seqlens_kv_padded": cu_seqlens_kv_padded,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_kv": max_seqlen_kv,
        "attn_mask_type": attn_mask_type,
        "qkv_format": qkv_format,
        "pad_between_seqs": pad_between_seqs,
    }
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp_size == 1:
        return thd_attention_reference(
            query,
            key,
            value,
            softmax_scale=softmax_scale,
            query_chunk_size=query_chunk_size,
            **kwargs,
        )
    mask = check_te_thd_args(query, key, value, cp_size=cp_size, **kwargs)
    assert cu_seqlens_q_padded is not None and cu_seqlens_kv_padded is not None  # checked
    rank = dist.get_rank(cp_group)

    k_all = cp_rank_to_sequence_order(all_gather_cp(key, cp_group), cu_seqlens_kv_padded, cp_size)
    v_all = cp_rank_to_sequence_order(all_gather_cp(value, cp_group), cu_seqlens_kv_padded, cp_size)
    q_slots = partition_indices(cu_seqlens_q_padded, query.shape[0] * cp_size, cp_size, rank)
    return attend_slots(
        query,
        k_all,
        v_all,
        q_slots,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv=cu_seqlens_kv,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        causal="causal" in mask,
        bottom_right="bottom_right" in mask,
        softmax_scale=softmax_scale,
        query_chunk_size=query_chunk_size,
    )
