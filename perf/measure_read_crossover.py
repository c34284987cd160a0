"""Where ``preadv`` beats the mapped gather, and where two threads beat one: the reader's crossovers, measured.

    python perf/measure_read_crossover.py [--quick] [--json PATH]

For each row size (256 B .. 1 MiB) a one-key cache (``x`` uint8 ``[rows, row]``,
one ~32 MiB shard, in the page cache) is read through
``CachedTensorDataset.__getitems__`` with each engine forced
(``planner.COPY_ENGINE`` ``"preadv"`` or ``"mapped"``; plain ``save_file`` shards, so no row
checksums: the copy engines alone), batches of 8 and 32 rows, two patterns:
``scattered`` (random rows of the shard: one run per row) and ``contiguous``
(consecutive rows: one run per batch). The mapped engine is timed twice: with
its mapping kept across batches (``warm``: a small cache that stays open) and
remapped before every batch (``cold``: the upper bound of what a fresh mapping
per shard visit costs in a cache larger than ``max_open_shards``). Candidates
run interleaved; the median per batch is printed with ``mapped / preadv``
ratios (> 1: preadv is faster), and the smallest bytes-per-run where preadv
wins on both warm and cold mappings.

Second table (``threads``): batches of 1-16 MiB (rows of 256 KiB and 1 MiB,
scattered and contiguous), read by ``preadv`` on one thread and on two
(``read_threads`` 1 and 2, ``executor.PARALLEL_MIN_BYTES`` 0 so that every batch is
split), interleaved; printed with ``1 thread / 2 threads`` and the smallest
batch size from which two threads win every pattern.

The crossovers ``PREADV_MIN_RUN_BYTES`` in ``te_thd/offline_cache/read/planner.py`` and
``PARALLEL_MIN_BYTES`` in ``te_thd/offline_cache/read/executor.py`` and the tables in
docs/performance-io.md come from this script.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

ROW_SIZES = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
SHARD_BYTES = 32 << 20


def _cache(d: str, row: int) -> int:
    from safetensors.torch import save_file

    from te_thd.offline_cache import shard_path, write_manifest

    rows = max(64, SHARD_BYTES // row)
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(row)
    save_file(
        {"x": torch.randint(0, 255, (rows, row), generator=g, dtype=torch.uint8)}, shard_path(d, 0)
    )
    write_manifest(d, {"num_samples": rows, "shard_size": rows}, 1)
    return rows


def _index_batches(
    rng: np.random.Generator, rows: int, batch: int, pattern: str, count: int
) -> list[list[int]]:
    """``count`` batches of ``batch`` row indices of a ``rows``-row shard: random rows
    (``"scattered"``: one run per row) or consecutive ones (``"contiguous"``: one run)."""
    if pattern == "scattered":
        return [rng.choice(rows, batch, replace=False).tolist() for _ in range(count)]
    return [list(range(s, s + batch)) for s in rng.integers(0, rows - batch, count).tolist()]


def measure(quick: bool) -> list[dict[str, Any]]:
    from te_thd.offline_cache import CachedTensorDataset
    from te_thd.offline_cache.read import planner as readplan

    trials = 5 if quick else 9
    batches_per_trial = 20 if quick else 60
    out = []
    with tempfile.TemporaryDirectory(prefix="te_thd_crossover_") as tmp:
        for row in ROW_SIZES:
            d = os.path.join(tmp, str(row))
            rows = _cache(d, row)
            rng = np.random.default_rng(row)
            for batch in (8, 32):
                for pattern in ("scattered", "contiguous"):
                    idx = _index_batches(rng, rows, batch, pattern, batches_per_trial)
                    dss = {}
                    for name in ("preadv", "mapped_warm", "mapped_cold"):
                        dss[name] = CachedTensorDataset(d, "crossover", 1, ("x",))

                    def run(
                        name: str, dss: dict[str, Any] = dss, idx: list[list[int]] = idx
                    ) -> None:
                        ds = dss[name]
                        planner.COPY_ENGINE = name.split("_")[
                            0
                        ]  # the engine forced for this candidate
                        for b in idx:
                            if name == "mapped_cold":
                                ds._files.close()  # every mapping (and descriptor) made again
                            ds.__getitems__(b)

                    for name in dss:
                        run(name)
                    samples: dict[str, list[float]] = {k: [] for k in dss}
                    for _ in range(trials):
                        for name in dss:
                            t0 = time.perf_counter()
                            run(name)
                            samples[name].append((time.perf_counter() - t0) / batches_per_trial)
                    us = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
                    run_bytes = row * (batch if pattern == "contiguous" else 1)
                    out.append(
                        {
                            "row_bytes": row,
                            "batch": batch,
                            "pattern": pattern,
                            "bytes_per_run": run_bytes,
                            "us_per_batch": us,
                            "warm_over_preadv": us["mapped_warm"] / us["preadv"],
                            "cold_over_preadv": us["mapped_cold"] / us["preadv"],
                        }
                    )
    return out


THREAD_ROWS = (262144, 1048576)
THREAD_BATCH_BYTES = (1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)


def measure_threads(quick: bool) -> list[dict[str, Any]]:
    """One vs two reading threads per batch size (see the module docstring)."""
    from te_thd.offline_cache import CachedTensorDataset
    from te_thd.offline_cache.read import executor as readexec
    from te_thd.offline_cache.read import planner as readplan

    trials = 5 if quick else 9
    batches_per_trial = 10 if quick else 30
    out = []
    with tempfile.TemporaryDirectory(prefix="te_thd_threads_") as tmp:
        for row in THREAD_ROWS:
            d = os.path.join(tmp, str(row))
            rows = _cache(d, row)
            rng = np.random.default_rng(row)
            for batch_bytes in THREAD_BATCH_BYTES:
                batch = max(1, batch_bytes // row)
                for pattern in ("scattered", "contiguous"):
                    idx = _index_batches(rng, rows, batch, pattern, batches_per_trial)
                    dss = {}
                    planner.COPY_ENGINE = "preadv"
                    executor.PARALLEL_MIN_BYTES = 0  # split every batch: this measures the split
                    for threads in (1, 2):
                        dss[threads] = CachedTensorDataset(
                            d, "crossover", 1, ("x",), read_threads=threads
                        )
                    samples: dict[int, list[float]] = {1: [], 2: []}
                    for _ in range(trials + 1):
                        for threads, ds in dss.items():
                            t0 = time.perf_counter()
                            for b in idx:
                                ds.__getitems__(b)
                            samples[threads].append((time.perf_counter() - t0) / batches_per_trial)
                    us = {
                        k: statistics.median(v[1:]) * 1e6 for k, v in samples.items()
                    }  # first: warm-up
                    out.append({"row_bytes": row, "batch_bytes": batch * row, "pattern": pattern,
                                "us_1_thread": us[1], "us_2_threads": us[2], "one_over_two": us[1] / us[2]})  # fmt: skip
    return out


def thread_crossover(rows: list[dict[str, Any]]) -> int | None:
    """Smallest batch bytes from which two threads are at least as fast as one for every pattern."""
    sizes = sorted({r["batch_bytes"] for r in rows})
    for s in sizes:
        if all(r["one_over_two"] >= 1.0 for r in rows if r["batch_bytes"] >= s):
            return s
    return None


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """Smallest bytes-per-run from which preadv is at least as fast as both mapped variants."""
    sizes = sorted({r["bytes_per_run"] for r in rows})
    for s in sizes:
        at_or_above = [r for r in rows if r["bytes_per_run"] >= s]
        if all(r["warm_over_preadv"] >= 1.0 and r["cold_over_preadv"] >= 1.0 for r in at_or_above):
            return s
    return None


def main(argv: list[str]) -> int:
    import warnings

    from te_thd.offline_cache import UnverifiedCacheWarning

    torch.set_num_threads(1)
    # the shards carry no checksums on purpose: this measures the copy engines alone
    warnings.simplefilter("ignore", UnverifiedCacheWarning)
    rows = measure("--quick" in argv)
    print(
        f"{'row':>8} {'batch':>5} {'pattern':>10} {'run bytes':>9} {'preadv us':>10} {'warm us':>9} {'cold us':>9} "
        f"{'warm/preadv':>11} {'cold/preadv':>11}"
    )
    for r in rows:
        us = r["us_per_batch"]
        print(
            f"{r['row_bytes']:>8} {r['batch']:>5} {r['pattern']:>10} {r['bytes_per_run']:>9} {us['preadv']:>10.1f} "
            f"{us['mapped_warm']:>9.1f} {us['mapped_cold']:>9.1f} {r['warm_over_preadv']:>11.2f} {r['cold_over_preadv']:>11.2f}"
        )
    c = crossover(rows)
    print(
        f"crossover: preadv at least as fast as both mapped variants from {c} bytes per run"
        if c
        else "crossover: none (the mapped gather won somewhere at every size)"
    )
    threads = measure_threads("--quick" in argv)
    print(
        f"\n{'row':>8} {'batch bytes':>11} {'pattern':>10} {'1 thread us':>11} {'2 threads us':>12} {'1t/2t':>6}"
    )
    for r in threads:
        print(
            f"{r['row_bytes']:>8} {r['batch_bytes']:>11} {r['pattern']:>10} {r['us_1_thread']:>11.1f} "
            f"{r['us_2_threads']:>12.1f} {r['one_over_two']:>6.2f}"
        )
    t = thread_crossover(threads)
    print(
        f"threads: two at least as fast as one from {t} bytes per batch"
        if t
        else "threads: none (one thread won somewhere at every size)"
    )
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"rows": rows, "crossover_bytes_per_run": c, "threads": threads,
                       "thread_crossover_batch_bytes": t}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
