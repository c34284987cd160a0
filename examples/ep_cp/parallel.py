"""torch.distributed + Megatron-Core parallel groups, and the gradient reductions.

Layout (Megatron's default order ``tp-cp-ep-dp-pp`` with TP = PP = 1), e.g. 4 ranks,
CP = 2, EP = 2::

    CP groups            [0, 1] [2, 3]    ranks that split the same sequences
    DP groups            [0, 2] [1, 3]    replicas (different samples)
    DP x CP group        [0, 1, 2, 3]     dense gradients are reduced here
    EP groups            [0, 1] [2, 3]    all-to-all token dispatch
    expert-DP groups     [0, 2] [1, 3]    expert gradients are reduced here

Dense parameters are replicated on every rank, so their gradients are summed over
DP x CP; an expert lives on one rank of every EP group, so its gradient (which
already holds every token routed to it from the whole EP group, via the all-to-all
backward) is summed over the expert-data-parallel group only.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

#: What megatron-core warns, once per module, when it imports without TE and Apex (4 lines
#: per rank: its optimizer, clip-grads and FSDP modules). This example uses none of the
#: fused kernels it falls back from, so that warning -- and only it -- is silenced.
MEGATRON_NO_TE_WARNING = "Transformer Engine and Apex are not installed"


def megatron_parallel_state() -> ModuleType:
    """``megatron.core.parallel_state``, imported without megatron's no-TE/Apex warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MEGATRON_NO_TE_WARNING, category=UserWarning)
        from megatron.core import parallel_state

    return parallel_state


@dataclass
class ParallelContext:
    """This process's place in the parallel layout (groups are Megatron's)."""

    device: torch.device
    rank: int
    world_size: int
    cp_size: int
    cp_rank: int
    ep_size: int
    ep_rank: int
    dp_size: int
    dp_rank: int
    cp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup


def check_layout(world_size: int, cp: int, ep: int, num_experts: int) -> None:
    """Raise ``ValueError`` naming the flag when the sizes cannot form a layout."""
    for name, v in (("--cp", cp), ("--ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    if world_size % cp:
        raise ValueError(
            f"--cp={cp} must divide the number of processes ({world_size}); "
            f"launch with --nproc-per-node a multiple of {cp} or change --cp"
        )
    if world_size % ep:
        raise ValueError(
            f"--ep={ep} must divide the number of processes ({world_size}); "
            f"launch with --nproc-per-node a multiple of {ep} or change --ep"
        )
    if num_experts % ep:
        raise ValueError(
            f"--ep={ep} must divide the number of experts ({num_experts}); "
            f"choose --ep among the divisors of {num_experts}"
        )


def check_device(device: str) -> None:
    """``--device`` is ``cpu``, or ``cuda`` on a machine where CUDA works: one line otherwise."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device={device!r} must be 'cpu' or 'cuda'")


def init_parallel(cp: int, ep: int, device: str, num_experts: int) -> ParallelContext:
    """Initialise ``torch.distributed`` (from torchrun's environment) and Megatron's groups.

    ``device="cpu"`` uses gloo, ``"cuda"`` NCCL with ``LOCAL_RANK``'s GPU.
    """
    ps = megatron_parallel_state()
    check_device(device)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    world = dist.get_world_size()
    check_layout(world, cp, ep, num_experts)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        create_gloo_process_groups=False,
    )
    return ParallelContext(
        device=dev,
        rank=dist.get_rank(),
        world_size=world,
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        expert_dp_group=ps.get_expert_data_parallel_group(),
    )


def shutdown_parallel() -> None:
    """Tear down Megatron's groups and the default process group."""
    ps = megatron_parallel_state()

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _sum_flat(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """SUM-all-reduce ``grads`` in place with one collective over a flat buffer."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:  # an unused parameter still takes part in the collective
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]  # type: ignore[misc]


def reduce_gradients(
    dense: list[nn.Parameter], expert: list[nn.Parameter], ctx: ParallelContext
) -> None:
    """Sum dense gradients over DP x CP and expert gradients over expert-DP."""
    _sum_flat(_grads(dense), ctx.dp_cp_group)
    _sum_flat(_grads(expert), ctx.expert_dp_group)


def clip_grad_norm(
    dense: list[nn.Parameter], expert: list[nn.Parameter], max_norm: float, ctx: ParallelContext
) -> torch.Tensor:
    """Clip by the global L2 norm of the whole (EP-sharded) model; returns the norm.

    After :func:`reduce_gradients` the dense gradients are identical on every rank,
    while each rank holds a different expert shard: the squared norm is the dense part
    plus the expert parts summed over the EP group. (``torch.nn.utils.clip_grad_norm_``
    on each rank would see only its own experts and clip the ranks differently.)
    No host sync: the scale is applied as a tensor.
    """
    dense_sq = torch.stack([p.grad.float().pow(2).sum() for p in dense]).sum()  # type: ignore[union-attr]
    if expert:
        expert_sq = torch.stack([p.grad.float().pow(2).sum() for p in expert]).sum()  # type: ignore[union-attr]
    else:
        expert_sq = torch.zeros_like(dense_sq)
    if ctx.ep_size > 1:
        dist.all_reduce(expert_sq, group=ctx.ep_group)
    norm = (dense_sq + expert_sq).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in (*dense, *expert):
        p.grad.mul_(scale.to(p.grad.dtype))  # type: ignore[union-attr]
    return norm
