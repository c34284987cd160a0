"""Where ``preadv`` beats the mapped gather: the reader's engine crossover, measured.

    python perf/measure_read_crossover.py [--quick] [--json PATH]

For each row size (256 B .. 1 MiB) a one-key cache (``x`` uint8 ``[rows, row]``,
one ~32 MiB shard, in the page cache) is read through
``CachedTensorDataset.__getitems__`` with each engine forced
(``copy_engine`` ``"preadv"`` or ``"mapped"``; plain ``save_file`` shards, so no row
checksums: the copy engines alone), batches of 8 and 32 rows, two patterns:
``scattered`` (random rows of the shard: one run per row) and ``contiguous``
(consecutive rows: one run per batch). The mapped engine is timed twice: with
its mapping kept across batches (``warm``: a small cache that stays open) and
remapped before every batch (``cold``: the upper bound of what a fresh mapping
per shard visit costs in a cache larger than ``max_open_shards``). Candidates
run interleaved; the median per batch is printed with ``mapped / preadv``
ratios (> 1: preadv is faster), and the smallest bytes-per-run where preadv
wins on both warm and cold mappings.

The crossover ``PREADV_MIN_RUN_BYTES`` in ``te_thd/offline_cache/reader.py`` and
the table in docs/performance-io.md come from this script.
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
    save_file({"x": torch.randint(0, 255, (rows, row), generator=g, dtype=torch.uint8)}, shard_path(d, 0))
    write_manifest(d, {"num_samples": rows, "shard_size": rows}, 1)
    return rows


def measure(quick: bool) -> list[dict[str, Any]]:
    from te_thd.offline_cache import CachedTensorDataset

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
                    if pattern == "scattered":
                        idx = [rng.choice(rows, batch, replace=False).tolist() for _ in range(batches_per_trial)]
                    else:
                        starts = rng.integers(0, rows - batch, batches_per_trial).tolist()
                        idx = [list(range(s, s + batch)) for s in starts]
                    dss = {}
                    for name, engine in (("preadv", "preadv"), ("mapped_warm", "mapped"), ("mapped_cold", "mapped")):
                        ds = CachedTensorDataset(d, "crossover", 1, ("x",))
                        ds.copy_engine = engine
                        dss[name] = ds

                    def run(name: str, dss: dict[str, Any] = dss, idx: list[list[int]] = idx) -> None:
                        ds = dss[name]
                        for b in idx:
                            if name == "mapped_cold":
                                ds._views.clear()
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
    print(f"{'row':>8} {'batch':>5} {'pattern':>10} {'run bytes':>9} {'preadv us':>10} {'warm us':>9} {'cold us':>9} "
          f"{'warm/preadv':>11} {'cold/preadv':>11}")
    for r in rows:
        us = r["us_per_batch"]
        print(f"{r['row_bytes']:>8} {r['batch']:>5} {r['pattern']:>10} {r['bytes_per_run']:>9} {us['preadv']:>10.1f} "
              f"{us['mapped_warm']:>9.1f} {us['mapped_cold']:>9.1f} {r['warm_over_preadv']:>11.2f} {r['cold_over_preadv']:>11.2f}")
    c = crossover(rows)
    print(f"crossover: preadv at least as fast as both mapped variants from {c} bytes per run" if c else
          "crossover: none (the mapped gather won somewhere at every size)")
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"rows": rows, "crossover_bytes_per_run": c}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
