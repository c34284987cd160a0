"""Per-rank, crash-safe training checkpoints for ``--resume``.

Layout::

    <dir>/iter_0000040/rank_00000.pt ... rank_<world-1>.pt
    <dir>/latest.json        {"step": 40, "world_size": 4, "cp": 2, "ep": 2, ...}

Every rank writes its own file (its expert shard, its optimizer state, its RNG) via
``te_thd``'s atomic write (temp file -> fsync -> rename -> fsync dir). After a
barrier -- every rank's file is durable -- rank 0 publishes ``latest.json`` the same
way. A job killed at any moment therefore resumes from the last *complete*
checkpoint: a half-written iteration is never pointed at, and is removed by the
next save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import torch
import torch.distributed as dist

from te_thd.offline_cache import atomic_write

LATEST = "latest.json"


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def _rank_file(root: str, step: int, rank: int) -> str:
    return os.path.join(_iter_dir(root, step), f"rank_{rank:05d}.pt")


def rng_state() -> dict[str, Any]:
    """Every RNG the training step may touch."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str,
    step: int,
    state: dict[str, Any],
    layout: dict[str, Any],
    info: dict[str, Any] | None = None,
) -> None:
    """Write this rank's ``state`` for ``step``; rank 0 publishes it once all ranks have.

    Collective over the default group. ``layout`` (world size, cp, ep, ...) is recorded
    in ``latest.json`` and checked by :func:`load_checkpoint`; ``info`` is recorded there
    too, unchecked.
    """
    rank = dist.get_rank()
    path = _rank_file(root, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    dist.barrier()
    if rank == 0:
        meta = {"step": step, **layout, **(info or {})}

        def write_meta(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)

        atomic_write(os.path.join(root, LATEST), write_meta)
        # Older iterations (and any torn one a killed job left) are no longer needed.
        keep = os.path.basename(_iter_dir(root, step))
        for name in os.listdir(root):
            if name.startswith("iter_") and name != keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()


def latest_step(root: str) -> dict[str, Any] | None:
    """``latest.json`` of ``root``, or None when no checkpoint was published."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); delete it to start afresh") from None


def load_checkpoint(root: str, layout: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """``(step, this rank's state)`` of the latest checkpoint, or None when there is none.

    Raises ``ValueError`` when the checkpoint was written with another layout (the
    expert shards and sampler position would not fit).
    """
    meta = latest_step(root)
    if meta is None:
        return None
    diff = {k: (meta.get(k), v) for k, v in layout.items() if meta.get(k) != v}
    if diff:
        what = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"checkpoint {os.path.join(root, LATEST)} was written with another layout ({what}); "
            "resume with the same flags and process count, or use a new --ckpt-dir"
        )
    step = int(meta["step"])
    path = _rank_file(root, step, dist.get_rank())
    state = torch.load(path, map_location="cpu", weights_only=True)
    return step, state
