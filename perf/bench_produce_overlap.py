"""Producer writes hidden behind compute: ``produce_cache`` vs the same loop without writing.

A producer's ``compute_batch`` (a frozen model's forward) is simulated by a
sleep of tunable length, as a GPU forward looks to the host thread: the CPU is
free while it runs, and a background writer may use it. Per case, interleaved:

- ``ours``: ``produce_cache`` over the whole dataset (fresh directory per call):
  each batch written into its shard's temp file on the write-behind thread as
  soon as it is computed (checksums as it goes), each shard's header, fsync and
  rename once its last batch is written, all while the next batches are
  computed; manifest last;
- ``no_write``: the same DataLoader and ``compute_batch``, results dropped: the
  throughput a producer would have if writing cost nothing (goal: ours >= 0.95x
  of it when compute time == write time);
- full runs only: ``inline_write``, ``write_cache_shards`` with a
  ``DurableShardWriter`` whose writes run on the caller's thread (only fsync +
  rename overlap), the producer before write-behind, for the curve; and
  ``no_write_cpu_busy``, ``no_write`` while a thread burns the CPU seconds one
  durable write takes (GIL released) after every shard: what a perfectly hidden
  write would still cost a machine without a spare core.

Shards: 16 samples of ``hidden`` [512, 768] bf16 + ``input_ids`` [512] int64
(12.7 MB), batch 4, 16 shards (``--quick``: 8). A case ``compute_<r>x_write``
sets the compute time per shard to ``r * W``. ``W`` is measured in every trial,
right before its candidates: the mean time of ``shards`` durable whole-shard writes
on the caller's thread (after a first one that creates the directory), so that compute and write times
come from the same state of the machine -- on a VM the write of a shard costs
2-3x more when its page-cache pages are fresh memory than when they recycle
memory just freed (e.g. by the previous run's directory removal), and a ``W``
measured in another state than the timed runs would set ``r`` wrong. Each
trial's times are taken in units of its ``W``; the medians over trials are
reported at the median ``W``. Full runs report the curve r = 0.25, 0.5, 1, 2, 4;
``--quick`` r = 1 (the gated point).

Throughput is the producer's steady state, what a cache of thousands of shards
sees: samples per second between the end of the first shard's last
``compute_batch`` and the end of the last one (every candidate timed over the
same window of batches). What happens once per run -- the directory setup and
lock, the first shard, and after the loop the write of the last shard (nothing
can hide it) and the manifest -- is left out there and reported in
``extra["whole_run"]`` (samples/s of the full call per candidate).
``extra["loss_s_per_shard"]`` = what writing added per shard in the steady
state (``t_ours - t_no_write``), ``extra["hidden_fraction"]`` = ``1 - loss / W``.
"""

from __future__ import annotations

import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
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


def _write_times(tmp: str, table: dict[str, torch.Tensor], count: int) -> tuple[list[float], float]:
    """Seconds of each of ``count`` consecutive durable shard writes (serialise, checksum,
    write, fsync, rename, directory fsync) into a fresh directory, removed afterwards, and
    the CPU seconds (all threads) per write after the first."""
    from te_thd.offline_cache.write.writer import DurableShardWriter

    d = os.path.join(tmp, "calibrate")
    shard = {k: v[:SHARD].clone() for k, v in table.items()}
    times = []
    with DurableShardWriter(KEYS, "bench", pipelined=False) as w:
        for i in range(count):
            if i == 1:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            w(d, i, shard)
            times.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / (count - 1)
    shutil.rmtree(d)
    return times, cpu


class _CpuBusy:
    """``no_write`` plus a thread that burns ``seconds`` of CPU per shard the loop finishes
    (``zlib.crc32``, which releases the GIL): the CPU a perfectly overlapped write takes
    from the machine, without writing anything."""

    def __init__(self, compute: _Compute, loader: torch.utils.data.DataLoader) -> None:
        self.compute, self.loader = compute, loader
        self.seconds = 0.0
        self.buf = bytearray(1 << 20)

    def _burn(self, shards: queue.Queue[bool | None]) -> None:
        while shards.get():
            end = time.thread_time() + self.seconds
            while time.thread_time() < end:
                zlib.crc32(self.buf)

    def __call__(self) -> None:
        shards: queue.Queue[bool | None] = queue.Queue()
        t = threading.Thread(target=self._burn, args=(shards,), daemon=True)
        t.start()
        for i, batch in enumerate(self.loader):
            self.compute(batch)
            if (i + 1) % (SHARD // BATCH) == 0:
                shards.put(True)
        shards.put(None)
        t.join()


def _candidates(tmp: str, n: int, compute: _Compute, busy: bool) -> tuple[dict[str, Any], _CpuBusy]:
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

    cpu_busy = _CpuBusy(compute, loader)
    found = {"ours": ours, "no_write": no_write}
    if busy:
        found.update(inline_write=inline_write, no_write_cpu_busy=cpu_busy)
    return found, cpu_busy


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
    trials = 4 if quick else 5
    n = shards * SHARD
    n_batches = n // BATCH
    table = _table()
    records = []
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_produce_") as tmp:
        for r in factors:
            compute = _Compute(table, 0.0)
            # --quick times what the gate compares (ours, no_write); full runs add the curve's
            # old producer and the CPU-contention baseline
            candidates, cpu_busy = _candidates(tmp, n, compute, busy=not quick)
            # per trial: seconds per batch (steady window) and per sample (whole call), in units of that trial's W
            steady: dict[str, list[float]] = {k: [] for k in candidates}
            whole: dict[str, list[float]] = {k: [] for k in candidates}
            ws: list[float] = []
            cpus: list[float] = []
            for trial in range(trials + 1):  # trial 0 warms up
                times, cpu = _write_times(tmp, table, shards + 1)
                w = statistics.mean(times[1:])
                compute.seconds = r * w * BATCH / SHARD
                cpu_busy.seconds = cpu
                for name, fn in candidates.items():
                    compute.ends = []
                    t0 = time.perf_counter()
                    fn()
                    if trial:
                        whole[name].append((time.perf_counter() - t0) / n / w)
                        steady[name].append(_steady(compute, n_batches) / w)
                if trial:
                    ws.append(w)
                    cpus.append(cpu)
            w = statistics.median(ws)
            per_batch = {k: statistics.median(v) * w for k, v in steady.items()}
            loss = (per_batch["ours"] - per_batch["no_write"]) * SHARD / BATCH
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
                        "write_s_trials": ws,
                        "write_cpu_s_per_shard": statistics.median(cpus),
                        "compute_s_per_shard": r * w,
                        "shards": shards,
                        "shard_mb": sum(v[0].numel() * v.element_size() for v in table.values())
                        * SHARD
                        / 1e6,
                        "loss_s_per_shard": loss,
                        "hidden_fraction": 1.0 - loss / w,
                        "whole_run": {
                            k: 1.0 / (statistics.median(v) * w) for k, v in whole.items()
                        },
                        "load_average": os.getloadavg()[0],
                    },
                )
            )
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_records(run("--quick" in sys.argv))
