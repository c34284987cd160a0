"""Context-parallel reference attention over real ``torch.distributed`` groups.

Each CP rank holds its dual-chunk shard of q/k/v (TE's THD CP layout, see
:mod:`te_thd.cp`). The reference moves data the way TE's ``cp_comm_type`` names
(:mod:`te_thd.attention.cp_comm`), then attends the queries it holds at their true
global slots (:func:`te_thd.cp.partition_indices`), so causal positions are exact:

- ``"p2p"`` / ``"all_gather"``: K/V all-gathered over the CP group (TE passes them
  around a ring for ``"p2p"``; what every rank ends up attending to is the same);
- ``"a2a"``: an all-to-all gives each rank ``H / cp`` heads of every rank's tokens,
  attention runs over the whole sequence for those heads, and the inverse all-to-all
  returns each rank its own tokens with all heads;
- ``"a2a+p2p"``: the all-to-all inside ``cp_group[0]``, K/V gathered over
  ``cp_group[1]``, the inverse all-to-all.

Every type gives the same numbers as the single-device reference. The collectives'
backward passes sum every rank's K/V gradient and hand each rank its own shard, so
gradients equal the single-device ones too. Works on gloo (CPU) and NCCL.

Communication lives here; the layout math it uses lives in :mod:`te_thd.cp` and
:mod:`te_thd.attention._layout`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from te_thd.attention.contract import ThdContractError, check_te_thd_args
from te_thd.attention.cp_comm import heads_to_sequence, resolve_cp_groups, sequence_to_heads
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
    cp_comm_type: str = "p2p",
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
    strategy: Any = "dual_chunk_swap",
) -> torch.Tensor:
    """THD attention with context parallelism, called like TE with a ``cp_group``.

    ``thd_attention_cp_reference(q, k, v, cp_group=g, **te_attention_kwargs(thd_rank))``
    where ``q/k/v`` are this rank's shards (``shard_thd_batch_for_cp`` order) and the
    boundaries are the global ones.

    Args:
        query: ``[T / cp, H, D]`` local queries (chunks ``r`` and ``2cp-1-r`` of every
            sequence).
        key, value: ``[T / cp, H_kv, D]`` / ``[T / cp, H_kv, D_v]`` local shards.
        cp_group: the CP process group (size 1 falls back to the plain reference); for
            ``cp_comm_type="a2a+p2p"`` the list ``[a2a_group, p2p_group]``; or their
            :class:`~te_thd.attention.cp_comm.CpGroups`.
        cp_comm_type: ``"p2p"`` (default), ``"all_gather"``, ``"a2a"`` or ``"a2a+p2p"``,
            as TE's (see the module docstring); the result does not depend on it.
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded: global
            int32 ``[N+1]`` boundaries; every padded length a multiple of ``2 * cp``.
        max_seqlen_q, max_seqlen_kv, attn_mask_type, qkv_format, pad_between_seqs,
            softmax_scale, query_chunk_size: as in :func:`thd_attention_reference`.
        strategy: the CP partition the shards were cut by (:func:`te_thd.cp.partition_indices`);
            ``"no_load_balance"``, as in TE, with ``cp_comm_type="all_gather"`` and a causal
            mask only (TE takes it in ``set_context_parallel_group``).

    Returns:
        ``[T / cp, H, D_v]``: this rank's output rows, in the same local order as
        ``query``; zeros at padding slots.
    """
    from te_thd._cp_strategy import NO_LOAD_BALANCE, normalize_strategy
    from te_thd.cp import cp_rank_to_sequence_order, partition_indices

    strategy = normalize_strategy(strategy)

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
    groups = None if cp_group is None else resolve_cp_groups(cp_group, cp_comm_type)
    if groups is None or groups.size == 1:
        return thd_attention_reference(
            query,
            key,
            value,
            softmax_scale=softmax_scale,
            query_chunk_size=query_chunk_size,
            **kwargs,
        )
    cp_size = groups.size
    mask = check_te_thd_args(query, key, value, cp_size=cp_size, strategy=strategy, **kwargs)
    if strategy == NO_LOAD_BALANCE and (cp_comm_type != "all_gather" or "causal" not in mask):
        raise ThdContractError(
            f"strategy='no_load_balance' with cp_comm_type={cp_comm_type!r} and "
            f"attn_mask_type={mask!r}: TE runs it with cp_comm_type='all_gather' and a causal "
            "mask only; use those, or strategy='dual_chunk_swap'"
        )
    assert cu_seqlens_q_padded is not None and cu_seqlens_kv_padded is not None  # checked
    for name, t in (("query", query), ("key", key)):
        if t.shape[1] % groups.a2a_size:
            raise ValueError(
                f"{name} has {t.shape[1]} heads, not divisible by the {groups.a2a_size} ranks "
                f"cp_comm_type={cp_comm_type!r} scatters heads over (TE: 'cp_comm_type=a2a "
                "requires num_heads % cp_size == 0'); use cp_comm_type='p2p'"
            )
    # CP indices whose tokens this rank attends for: its own, or after the all-to-all
    # every rank of its a2a group (a2a group rank a holds CP index p * A + a)
    first = groups.rank - groups.rank % groups.a2a_size
    owners = range(first, first + groups.a2a_size)
    if groups.a2a_group is not None:
        query, key, value = (heads_to_sequence(t, groups.a2a_group) for t in (query, key, value))
    if groups.p2p_group is not None:
        key, value = (all_gather_cp(t, groups.p2p_group) for t in (key, value))
    # key/value now hold every CP index's tokens, in CP-index order
    k_all = cp_rank_to_sequence_order(key, cu_seqlens_kv_padded, cp_size, strategy=strategy)
    v_all = cp_rank_to_sequence_order(value, cu_seqlens_kv_padded, cp_size, strategy=strategy)
    total_q = query.shape[0] // groups.a2a_size * cp_size
    q_slots = torch.cat(
        [
            partition_indices(cu_seqlens_q_padded, total_q, cp_size, r, strategy=strategy)
            for r in owners
        ]
    )
    out = attend_slots(
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
    if groups.a2a_group is not None:
        out = sequence_to_heads(out, groups.a2a_group)
    return out
