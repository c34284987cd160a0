"""Offline-cache shard writes: te_thd's durable, checksummed writes vs plain ``save_file``.

A producer writes a STREAM of new shard files, so one timed call writes ``K``
shards with distinct names into an empty directory (created, and emptied again
after the call, outside the clock: unlinking also drops ``save_file``'s dirty
pages so they cannot slow the next candidate). Candidates, interleaved in the
same run on the same tensors:

- ``ours``: :class:`te_thd.offline_cache.write.writer.DurableShardWriter` as
  ``produce_cache`` uses it -- key/row/schema validation, safetensors bytes
  written zero-copy to a unique temp file with per-row xxh3_64 checksums, then
  fsync(file) + rename + fsync(dir) on the commit thread, overlapping the next
  shard; timed until ``flush()`` returns, i.e. until all K shards are durable;
- ``save_file``: ``safetensors.torch.save_file`` per shard -- no temp file, no
  fsync, no checksum (the goal: ours >= 0.8x its throughput);
- ``save_file_fsync``: ``save_file`` + fsync per shard (what durability alone costs);
- ``reference`` (when nemo-automodel 0.7.0 is installed): its ``write_tensor_shard``
  (``save_file`` to ``<path>.tmp`` + rename; no fsync, no checksum).

``extra["ours_unpipelined"]`` is the same with synchronous
``write_tensor_shard`` calls (each shard durable before the call returns).
Throughput = shard bytes / s (MB = 1e6 B); ratio = ours / baseline. Cases:

- ``large_shard``: K=8 shards of 64 samples x (``hidden`` [512, 768] bf16 +
  ``input_ids`` [512] int64 + ``loss_mask`` [512] bool) = 50.6 MB each
  (``--quick``: 16 samples, 12.7 MB);
- ``medium_shard``: K=16 shards of 256 samples x (``input_ids`` [1024] int64 +
  ``loss_mask`` [1024] bool + ``logits_topk`` [1024, 4] f16) = 4.7 MB each:
  fsync's fixed cost per file weighs more here.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from harness import Record, print_records, reference_offline_cache

BENCH = "cache_write"


def _tensors(kind: str, quick: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "large_shard":
        n = 16 if quick else 64
        return {
            "hidden": torch.randn(n, 512, 768, generator=g).to(torch.bfloat16),
            "input_ids": torch.randint(0, 32000, (n, 512), generator=g),
            "loss_mask": torch.rand(n, 512, generator=g) > 0.5,
        }
    n = 256
    return {
        "input_ids": torch.randint(0, 32000, (n, 1024), generator=g),
        "loss_mask": torch.rand(n, 1024, generator=g) > 0.5,
        "logits_topk": torch.randn(n, 1024, 4, generator=g).to(torch.float16),
    }


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _candidates(tensors: dict[str, torch.Tensor], k: int) -> dict[str, Callable[[str], object]]:
    """``{name: fn(empty_dir)}``, each writing ``k`` shards of ``tensors`` into ``empty_dir``."""
    from safetensors.torch import save_file

    from te_thd.offline_cache import write_tensor_shard
    from te_thd.offline_cache.format.schema import shard_path
    from te_thd.offline_cache.write.writer import DurableShardWriter

    keys = tuple(tensors)

    def ours(d: str) -> None:
        with DurableShardWriter(keys, "bench") as writer:
            for i in range(k):
                writer(d, i, tensors)
            writer.flush()

    def ours_unpipelined(d: str) -> None:
        for i in range(k):
            write_tensor_shard(d, i, tensors, keys, "bench")

    def plain(d: str) -> None:
        for i in range(k):
            save_file(tensors, shard_path(d, i))

    def plain_fsync(d: str) -> None:
        for i in range(k):
            p = shard_path(d, i)
            save_file(tensors, p)
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    cands: dict[str, Callable[[str], object]] = {
        "ours": ours,
        "ours_unpipelined": ours_unpipelined,
        "save_file": plain,
        "save_file_fsync": plain_fsync,
    }
    ref = reference_offline_cache()
    if ref is not None:
        cands["reference"] = lambda d: [
            ref.write_tensor_shard(d, i, tensors, keys, "bench") for i in range(k)
        ]
    return cands


def time_fresh_dirs(
    candidates: dict[str, Callable[[str], object]], root: str, trials: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call, round-robin like ``harness.time_interleaved``, each call
    into a fresh empty directory that is removed right after the call (outside the clock)."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for t in range(warmup + trials):
        for name, fn in candidates.items():
            d = os.path.join(root, f"{name}-{t}")
            os.makedirs(d)
            t0 = time.perf_counter()
            fn(d)
            dt = time.perf_counter() - t0
            shutil.rmtree(d)
            if t >= warmup:
                samples[name].append(dt)
    return {name: statistics.median(v) for name, v in samples.items()}


def run(quick: bool) -> list[Record]:
    trials = 5 if quick else 9
    records = []
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_cache_write_") as tmp:
        for case, k in (("large_shard", 8), ("medium_shard", 16)):
            tensors = _tensors(case, quick)
            nbytes = _nbytes(tensors) * k
            times = time_fresh_dirs(_candidates(tensors, k), tmp, trials)
            mbps = {name: nbytes / v / 1e6 for name, v in times.items()}
            ours = mbps.pop("ours")
            unpipelined = mbps.pop("ours_unpipelined")
            records.append(
                Record(
                    bench=BENCH,
                    case=case,
                    metric="throughput",
                    unit="MB/s",
                    ours=ours,
                    baselines=mbps,
                    extra={
                        "shards_per_call": k,
                        "shard_bytes": nbytes // k,
                        "trials": trials,
                        "ours_unpipelined": unpipelined,
                        "ours_unpipelined_vs_save_file": unpipelined / mbps["save_file"],
                        "durability": "temp file + per-row xxh3_64 + fsync(file) + rename + fsync(dir)",
                    },
                )
            )
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_records(run("--quick" in sys.argv))
