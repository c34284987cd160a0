"""Producer writes hidden behind compute: ``produce_cache`` vs the same loop without writing.

A producer's ``compute_batch`` (a frozen model's forward) is simulated by a
sleep of tunable length, as a GPU forward looks to the host thread: the CPU is
free while it runs, and a background writer may use it. Per case, interleaved:

- ``ours``: ``produce_cache`` over the whole dataset (fresh directory per call):
  write-behind shard writes (serialise, checksum, write, fsync, rename on the
  commit thread while the next shard is computed), manifest last;
- ``no_write``: the same DataLoader and ``compute_batch``, results dropped: the
  throughput a producer would have if writing cost nothing (goal: ours >= 0.95x
  of it when compute time == write time);
- ``inline_write``: ``write_cache_shards`` with a ``DurableShardWriter`` whose
  writes run on the caller's thread (only fsync + rename overlap): the producer
  before write-behind, for the curve.

Shards: 16 samples of ``hidden`` [512, 768] bf16 + ``input_ids`` [512] int64
(12.7 MB), batch 4, 16 shards (``--quick``: 8). ``W`` = the median time of one
durable shard write, measured first in the same run; a case
``compute_<r>x_write`` sets the compute time per shard to ``r * W``. Full runs
report the curve r = 0.25, 0.5, 1, 2, 4; ``--quick`` r = 1 (the gated point).

Throughput is the producer's steady state, what a cache of thousands of shards
sees: samples per second between the end of the first shard's last
``compute_batch`` and the end of the last one (every candidate timed over the
same window of batches). What happens once per run -- the directory setup and
lock, the first shard, and after the loop the write of the last shard (nothing
can hide it) and the manifest -- is left out there and reported in
``extra["whole_run"]`` (samples/s of the full call per candidate).
``extra["hidden_fraction"]`` = the share of the write time that the steady state
did not pay: ``1 - (t_ours - t_no_write) / (shards_in_window * W)``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from harness import Record, print_records

BENCH = "produce_overlap"
SHARD, BATCH = 16, 4
KEYS = ("hidden", "input_ids")


class _Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Compute:
    """``compute_batch``: sleep ``seconds`` (a GPU forward, as the host sees it), return rows.

    ``ends`` collects the clock at the end of every call (the steady-state window).
    """

    def __init__(self, table: dict[str, torch.Tensor], seconds: float) -> None:
        self.table, self.seconds = table, seconds
        self.ends: list[float] = []

    def __call__(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(self.seconds)
        idx = batch % self.table["hidden"].shape[0]
        out = {k: v.index_select(0, idx) for k, v in self.table.items()}
        self.ends.append(time.perf_counter())
        return out


def _table() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(64, 512, 768, generator=g).to(torch.bfloat16),
        "input_ids": torch.randint(0, 32000, (64, 512), generator=g),
    }


def _write_time(tmp: str, table: dict[str, torch.Tensor]) -> float:
    """Median seconds of one durable shard write (serialise, write, fsync, rename)."""
    from te_thd.offline_cache.writer import DurableShardWriter

    d = os.path.join(tmp, "calibrate")
    shard = {k: v[:SHARD].clone() for k, v in table.items()}
    times = []
    with DurableShardWriter(KEYS, "bench", pipelined=False) as w:
        for i in range(7):
            t0 = time.perf_counter()
            w(d, i, shard)
            times.append(time.perf_counter() - t0)
    shutil.rmtree(d)
    return statistics.median(times)


def _candidates(tmp: str, n: int, compute: _Compute) -> dict[str, Any]:
    import logging

    from te_thd.offline_cache import DurableShardWriter, produce_cache, write_cache_shards

    loader = torch.utils.data.DataLoader(_Samples(n), batch_size=BATCH)
    counter = iter(range(10**9))

    def fresh_dir() -> str:
        d = os.path.join(tmp, f"run{next(counter)}")
        shutil.rmtree(d, ignore_errors=True)
        return d

    def ours() -> None:
        d = fresh_dir()
        produce_cache(loader, d, SHARD, compute, KEYS, cache_name="bench", progress=False)
        shutil.rmtree(d)

    def no_write() -> None:
        for batch in loader:
            compute(batch)

    def inline_write() -> None:
        d = fresh_dir()
        with DurableShardWriter(KEYS, "bench", pipelined=True, write_behind=False) as w:
            write_cache_shards(loader, d, SHARD, 0, compute, w, logging.getLogger("bench"))
        shutil.rmtree(d)

    return {"ours": ours, "no_write": no_write, "inline_write": inline_write}


def _steady(compute: _Compute, n_batches: int) -> float:
    """Seconds per batch between the end of the first shard and the end of the last batch."""
    ends = compute.ends
    if len(ends) != n_batches:
        raise RuntimeError(f"compute_batch ran {len(ends)} times, expected {n_batches}")
    first = SHARD // BATCH - 1
    return (ends[-1] - ends[first]) / (n_batches - 1 - first)


def run(quick: bool) -> list[Record]:
    shards = 8 if quick else 16
    factors = (1.0,) if quick else (0.25, 0.5, 1.0, 2.0, 4.0)
    trials = 3 if quick else 5
    n = shards * SHARD
    n_batches = n // BATCH
    table = _table()
    records = []
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_produce_") as tmp:
        w = _write_time(tmp, table)
        for r in factors:
            compute = _Compute(table, r * w * BATCH / SHARD)
            candidates = _candidates(tmp, n, compute)
            steady: dict[str, list[float]] = {k: [] for k in candidates}
            whole: dict[str, list[float]] = {k: [] for k in candidates}
            for trial in range(trials + 1):  # trial 0 warms up
                for name, fn in candidates.items():
                    compute.ends = []
                    t0 = time.perf_counter()
                    fn()
                    if trial:
                        whole[name].append(time.perf_counter() - t0)
                        steady[name].append(_steady(compute, n_batches))
            per_batch = {k: statistics.median(v) for k, v in steady.items()}
            window_shards = (n_batches - SHARD // BATCH) * BATCH / SHARD
            hidden = 1.0 - (per_batch["ours"] - per_batch["no_write"]) * (n_batches - SHARD // BATCH) / (window_shards * w)
            rate = {k: BATCH / v for k, v in per_batch.items()}
            records.append(
                Record(
                    bench=BENCH,
                    case=f"compute_{r:g}x_write",
                    metric="throughput",
                    unit="samples/s",
                    ours=rate.pop("ours"),
                    baselines=rate,
                    extra={
                        "write_s_per_shard": w,
                        "compute_s_per_shard": r * w,
                        "shards": shards,
                        "shard_mb": sum(v[0].numel() * v.element_size() for v in table.values()) * SHARD / 1e6,
                        "hidden_fraction": hidden,
                        "whole_run": {k: n / statistics.median(v) for k, v in whole.items()},
                    },
                )
            )
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_records(run("--quick" in sys.argv))
