"""The few collectives the producer needs, over an optional ``torch.distributed`` group.

With one process every call is trivial, so the producer runs the same code with or
without a process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProducerComm", "resolve_ranks"]


class ProducerComm:
    """The few collectives the producer needs, trivial for a single process."""

    def __init__(self, rank: int, world_size: int, group: Any) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.distributed = world_size > 1
        if self.distributed:
            backend = dist.get_backend(group)
            self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            self.src = dist.get_global_rank(group, 0) if group is not None else 0

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def resolve_ranks(rank: int | None, world_size: int | None, group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of this process: the initialised ``group``'s (the arguments, if given,
    must agree), else ``(0, 1)``; any other value without a process group is a ``ValueError``."""
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        g_rank, g_size = dist.get_rank(group), dist.get_world_size(group)
        if (rank is not None and rank != g_rank) or (world_size is not None and world_size != g_size):
            raise ValueError(
                f"rank={rank!r}, world_size={world_size!r} contradict the process group "
                f"(rank {g_rank} of {g_size}); omit them to use the group's"
            )
        return g_rank, g_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size != 1 or rank != 0:
        raise ValueError(
            f"world_size={world_size!r}, rank={rank!r} need an initialised torch.distributed process "
            "group (call torch.distributed.init_process_group first, or use world_size=1)"
        )
    return 0, 1
