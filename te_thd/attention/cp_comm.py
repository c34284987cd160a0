"""TE's context-parallel communication types for THD attention: the rules and the groups.

TE ``DotProductAttention(cp_comm_type=...)`` moves data between CP ranks four ways
(``context_parallel.py``, ``attn_forward_func_with_cp``):

- ``"p2p"``: K/V passed around a ring; one ``ProcessGroup``;
- ``"all_gather"``: K/V all-gathered; one ``ProcessGroup``;
- ``"a2a"`` (Ulysses): an all-to-all scatters heads and gathers the sequence; one
  ``ProcessGroup``; query and key/value head counts divisible by the CP size;
- ``"a2a+p2p"`` (hierarchical): all-to-all inside ``cp_group[0]``, then the ring across
  ``cp_group[1]``; ``cp_group`` is the list ``[a2a_group, p2p_group]``, the CP size the
  product of the two sizes, and head counts divisible by the a2a group's size.

Whatever the type, each rank holds the same dual-chunk share of every sequence: TE's
partition over the whole CP size, where a hierarchical rank's CP index is
``p2p_rank * a2a_size + a2a_rank``. :func:`resolve_cp_groups` works that out;
:func:`check_cp_comm_type` rejects what TE's asserts would, before TE runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CP_COMM_TYPES",
    "CpGroups",
    "check_cp_comm_type",
    "installed_te_version",
    "resolve_cp_groups",
]

CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather", "a2a", "a2a+p2p")

#: First TE release whose CP path accepts ``qkv_format="thd"`` with each type (read from
#: TE's source and its CP tests: a2a from 2.10, all_gather from 2.18, a2a+p2p after 2.18).
THD_SUPPORTED_SINCE: dict[str, tuple[int, int]] = {
    "p2p": (1, 0),
    "a2a": (2, 10),
    "all_gather": (2, 18),
    "a2a+p2p": (2, 19),
}


@dataclass(frozen=True)
class CpGroups:
    """The CP process groups of one attention layer, as TE reads them.

    Attributes:
        comm_type: one of :data:`CP_COMM_TYPES`.
        cp_group: what TE's ``cp_group`` takes: a ``ProcessGroup``, or for ``"a2a+p2p"``
            the list ``[a2a_group, p2p_group]``.
        a2a_group: the group heads are scattered over (``None``: no all-to-all).
        p2p_group: the group K/V travel around / are gathered over (``None``: none).
        a2a_size, p2p_size: their sizes (1 when absent).
        size: the CP size, ``a2a_size * p2p_size``.
        rank: this process's CP index, ``p2p_rank * a2a_size + a2a_rank`` (the shard
            of every sequence it holds).
        global_ranks: global ranks of the CP index order (TE's ``cp_global_ranks``).
    """

    comm_type: str
    cp_group: Any
    a2a_group: Any
    p2p_group: Any
    a2a_size: int
    p2p_size: int
    size: int
    rank: int
    global_ranks: tuple[int, ...]


def _is_group(g: Any) -> bool:
    return isinstance(g, dist.ProcessGroup)


def resolve_cp_groups(cp_group: Any, cp_comm_type: str = "p2p") -> CpGroups:
    """Check ``cp_group`` against ``cp_comm_type`` and work out the CP size and index.

    Args:
        cp_group: a ``ProcessGroup`` (``"p2p"``, ``"all_gather"``, ``"a2a"``), or the
            list / tuple ``[a2a_group, p2p_group]`` (``"a2a+p2p"``), or an already
            resolved :class:`CpGroups` of the same type (returned as it is: resolving
            hierarchical groups costs a collective).
        cp_comm_type: one of :data:`CP_COMM_TYPES`.

    Raises:
        ValueError: an unknown type, or a group structure TE would reject.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} is not one of TE's {CP_COMM_TYPES} "
            "(TE: 'Unsupported communication type')"
        )
    if isinstance(cp_group, CpGroups):
        if cp_group.comm_type != cp_comm_type:
            raise ValueError(
                f"cp_group was resolved for cp_comm_type={cp_group.comm_type!r}, not "
                f"{cp_comm_type!r}"
            )
        return cp_group
    if cp_comm_type == "a2a+p2p":
        if (
            not isinstance(cp_group, Sequence)
            or len(cp_group) != 2
            or not all(_is_group(g) for g in cp_group)
        ):
            raise ValueError(
                f"cp_comm_type='a2a+p2p' needs cp_group=[a2a_group, p2p_group] (two process "
                f"groups: heads are exchanged inside the first, K/V around the second), got "
                f"{type(cp_group).__name__}; TE: 'CP implementation a2a+p2p requires "
                "cp_group = [a2a_cp_group, p2p_cp_group]!' -- Megatron builds them with "
                "hierarchical_context_parallel_sizes"
            )
        a2a, p2p = cp_group
        a2a_size, p2p_size = dist.get_world_size(a2a), dist.get_world_size(p2p)
        # CP index p * A + a is rank a of the a2a group of the p2p ring's rank p
        rings: list[Any] = [None] * p2p_size
        dist.all_gather_object(rings, dist.get_process_group_ranks(a2a), group=p2p)
        every = tuple(int(g) for members in rings for g in members)
        if len(set(every)) != a2a_size * p2p_size:
            raise ValueError(
                f"cp_group=[a2a_group, p2p_group] do not tile a CP group: the a2a groups "
                f"along this p2p ring hold ranks {list(rings)}; every rank's a2a group must "
                "hold the ranks with the same p2p rank (Megatron: "
                "get_hierarchical_context_parallel_groups())"
            )
        return CpGroups(
            comm_type=cp_comm_type,
            cp_group=[a2a, p2p],
            a2a_group=a2a if a2a_size > 1 else None,
            p2p_group=p2p if p2p_size > 1 else None,
            a2a_size=a2a_size,
            p2p_size=p2p_size,
            size=a2a_size * p2p_size,
            rank=dist.get_rank(p2p) * a2a_size + dist.get_rank(a2a),
            global_ranks=every,
        )
    if not _is_group(cp_group):
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} needs one torch.distributed ProcessGroup as "
            f"cp_group, got {type(cp_group).__name__} (TE: 'cp_group must be ProcessGroup "
            "type'); a list [a2a_group, p2p_group] goes with cp_comm_type='a2a+p2p'"
        )
    size = dist.get_world_size(cp_group)
    a2a = cp_comm_type == "a2a"
    return CpGroups(
        comm_type=cp_comm_type,
        cp_group=cp_group,
        a2a_group=cp_group if a2a and size > 1 else None,
        p2p_group=None if a2a or size == 1 else cp_group,
        a2a_size=size if a2a else 1,
        p2p_size=1 if a2a else size,
        size=size,
        rank=dist.get_rank(cp_group),
        global_ranks=tuple(dist.get_process_group_ranks(cp_group)),
    )


def check_cp_comm_type(
    groups: CpGroups,
    *,
    num_attention_heads: int,
    num_gqa_groups: int,
    attn_mask_type: str,
    te_version: tuple[int, int] | None = None,
) -> None:
    """Reject a combination TE's THD context-parallel path would assert on.

    Args:
        groups: from :func:`resolve_cp_groups`.
        num_attention_heads, num_gqa_groups: query and key/value heads.
        attn_mask_type: normalised mask type.
        te_version: ``(major, minor)`` of the installed TE, or ``None`` (not installed:
            the version rule is skipped; the CPU reference runs every type).

    Raises:
        ValueError: naming the argument, its value, TE's rule and the fix.
    """
    t = groups.comm_type
    if groups.size > 1 and attn_mask_type not in ("padding", "padding_causal"):
        raise ValueError(
            f"attn_mask_type={attn_mask_type!r} with context parallelism: TE's THD CP "
            "supports only 'padding' and 'padding_causal'"
        )
    if groups.a2a_size > 1:
        for name, heads in (
            ("num_attention_heads", num_attention_heads),
            ("num_gqa_groups", num_gqa_groups),
        ):
            if heads % groups.a2a_size:
                where = "the CP size" if t == "a2a" else "the a2a group's size"
                raise ValueError(
                    f"cp_comm_type={t!r} scatters attention heads over {where} "
                    f"({groups.a2a_size}), but {name}={heads} is not divisible by it (TE: "
                    f"'cp_comm_type=a2a requires num_heads % cp_size == 0'); use "
                    "cp_comm_type='p2p' or a head count divisible by it"
                )
    if te_version is not None and groups.size > 1:
        need = THD_SUPPORTED_SINCE[t]
        if te_version < need:
            raise ValueError(
                f"cp_comm_type={t!r} with qkv_format='thd' needs Transformer Engine >= "
                f"{need[0]}.{need[1]}, installed: {te_version[0]}.{te_version[1]} (older "
                f"releases assert qkv_format != 'thd' on this path); upgrade TE or use "
                "cp_comm_type='p2p'"
            )


def installed_te_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Transformer Engine, or None (read from its
    package metadata: no import, no CUDA)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist_name in ("transformer-engine", "transformer-engine-torch"):
        try:
            parts = version(dist_name).split(".")
        except PackageNotFoundError:
            continue
        try:
            return int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            return None
    return None


class _UlyssesAllToAll(torch.autograd.Function):
    """``[T, H, D]`` <-> ``[A * T, H / A, D]``; its backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_sequence: bool) -> torch.Tensor:
        ctx.group, ctx.to_sequence = group, to_sequence
        return _all_to_all(x, group, to_sequence)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_to_all(grad, ctx.group, not ctx.to_sequence), None, None


def _all_to_all(x: torch.Tensor, group: Any, to_sequence: bool) -> torch.Tensor:
    """Heads -> sequence: head block ``j`` goes to rank ``j``, every rank's tokens come
    back in rank order; sequence -> heads: the inverse."""
    world = dist.get_world_size(group)
    split, join = (1, 0) if to_sequence else (0, 1)
    sends = [c.contiguous() for c in x.chunk(world, dim=split)]
    recvs = [torch.empty_like(sends[0]) for _ in range(world)]
    dist.all_to_all(recvs, sends, group=group)
    return torch.cat(recvs, dim=join)


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable Ulysses all-to-all: ``[T, H, D]`` -> ``[A * T, H / A, D]``.

    Rank ``a`` of the ``A``-rank group keeps head block ``a`` and receives every rank's
    tokens, concatenated in rank order. ``H`` must be divisible by ``A``.
    """
    return _UlyssesAllToAll.apply(x, group, True)


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Inverse of :func:`heads_to_sequence`: ``[A * T, H / A, D]`` -> ``[T, H, D]``."""
    return _UlyssesAllToAll.apply(x, group, False)
