"""Helpers of the example tests: import path of ``examples/`` and real gloo workers."""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any
) -> None:
    import torch
    import torch.distributed as dist

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)  # bytes: no shared-memory handles to outlive us
        queue.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def run_gloo(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` real gloo processes; results by rank.

    ``fn`` must be a module-level function (spawn pickles it by name).
    """
    import torch

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                r, payload = results.get(timeout=0.5)
                out[r] = torch.load(io.BytesIO(payload), weights_only=False)
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(
                        f"gloo workers failed or timed out; exit codes {codes}"
                    ) from None
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def small_cache_argv(out: str, num_samples: int) -> list[str]:
    """``precompute_cache.py`` arguments for the tests' small CP=2 cache (rows of 128)."""
    return [
        "--out", out,
        "--num-samples", str(num_samples),
        "--min-len", "5", "--max-len", "40",
        "--shard-size", "8", "--batch-size", "8",
        "--cp", "2", "--pack-seq-len", "128",
    ]  # fmt: skip


def one_error(res: subprocess.CompletedProcess, script: str = "train_ep_cp.py") -> str:
    """The job failed with exactly one ``error:`` line (not one per rank) and no traceback of ``script``;
    that line without its ``error: `` prefix."""
    text = res.stdout + res.stderr
    assert res.returncode != 0, text
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, text
    assert f'{script}", line' not in text, text  # no rank printed a traceback
    return errors[0].removeprefix("error: ")
