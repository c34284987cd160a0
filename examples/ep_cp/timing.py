"""Per-rank compute time of each step, gathered once at the end of the run.

A data-parallel step lasts as long as its slowest rank; the others wait for it in the
gradient all-reduce (and, with EP / CP, inside the all-to-all and the attention's
exchange). Wall time of the forward / backward is therefore much the same on every
rank; what differs is the work each rank does. On the CPU that is the process's CPU
time (a rank blocked in a gloo collective does not spend CPU); on CUDA, the time
between two events around the forward / backward, read after the loop so that the
step itself never waits for the device.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class ComputeTimer:
    """Times ``with timer:`` blocks, one per step; :meth:`gather` returns every rank's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.times: list[float] = []  # CPU seconds per step (CPU ranks)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> ComputeTimer:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, torch.cuda.Event(enable_timing=True)))
        else:
            self._t0 = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.times.append(time.process_time() - self._t0)

    def seconds(self) -> list[float]:
        """This rank's compute seconds per step (synchronises the device once, on CUDA)."""
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in self.events]
        return list(self.times)

    def gather(self) -> list[list[float]]:
        """Every rank's :meth:`seconds` (one collective, after the run), indexed by rank."""
        mine = self.seconds()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [mine]
        out: list[list[float]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(out, mine)
        return out


def spread(per_rank: list[list[float]], skip_first: bool = True) -> dict[str, float]:
    """Mean over steps of the fastest and the slowest rank's compute time, and their ratio.

    The first step is left out by default (it includes start-up work).
    """
    steps = min(len(t) for t in per_rank)
    first = 1 if skip_first and steps > 1 else 0
    lo = [min(t[s] for t in per_rank) for s in range(first, steps)]
    hi = [max(t[s] for t in per_rank) for s in range(first, steps)]
    if not lo:
        return {"compute_min_s": 0.0, "compute_max_s": 0.0, "compute_max_over_min": 1.0}
    mean_lo, mean_hi = sum(lo) / len(lo), sum(hi) / len(hi)
    return {
        "compute_min_s": round(mean_lo, 6),
        "compute_max_s": round(mean_hi, 6),
        "compute_max_over_min": round(mean_hi / mean_lo, 4) if mean_lo > 0 else 1.0,
    }
