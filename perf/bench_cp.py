"""CP sharding of a converted THD batch vs the data-movement floor.

``shard_thd_batch_for_cp`` (one rank; index computation from ``cu_seqlens_padded``
plus the gathers) is timed against ``index_select`` of the same per-token tensors
(``input_ids``, ``labels``, ``position_ids``, ``padding_mask``) with indices
precomputed outside the timed region -- the cost of moving those tokens, nothing
else. Goal (``cp-shard-vs-index-select`` in thresholds.json): sharding takes <= 2x that floor, i.e.
``ratios["index_select"] = floor_time / ours_time >= 0.5``.

Batches are realistic: documents with lognormal lengths packed by
``PackingCollator`` (every document padded to 2*cp) and converted by
``process_input_for_thd``. Shapes: T = 32k and 128k tokens, cp = 2 and 8.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch
from harness import Record, print_records, time_interleaved

BENCH = "cp"
TOKEN_KEYS = ("input_ids", "labels", "position_ids", "padding_mask")


def converted_batch(total_tokens: int, cp_size: int, row_len: int = 8192, seed: int = 0) -> dict:
    """A ``process_input_for_thd`` batch of ``total_tokens`` tokens packed for ``cp_size``."""
    from te_thd.packing import PackingCollator, pad_to_multiple_for
    from te_thd.thd_utils import process_input_for_thd

    rng = np.random.default_rng(seed)
    rows = total_tokens // row_len
    collate = PackingCollator(
        row_len, pad_to_multiple_of=pad_to_multiple_for(cp_size), overlong="truncate", rows=rows
    )
    lengths: list[int] = []
    # draw documents until FFD needs all rows (~90% fill), median ~600 tokens, long tail
    budget = int(0.9 * total_tokens)
    while sum(lengths) < budget:
        lengths.append(int(np.clip(rng.lognormal(6.4, 1.0), 8, row_len)))
    while True:
        try:
            samples = [{"input_ids": torch.from_numpy(rng.integers(1, 32000, n))} for n in lengths]
            packed = collate(samples)
            break
        except ValueError:
            lengths.pop()  # did not fit the fixed rows: drop the last document
    return process_input_for_thd(packed)


def run(quick: bool) -> list[Record]:
    from te_thd.cp import partition_indices, shard_thd_batch_for_cp

    records: list[Record] = []
    sizes = [32 * 1024, 128 * 1024]
    for total in sizes:
        for cp in (2, 8):
            thd = converted_batch(total, cp, seed=total + cp)
            rank = 0
            idx = partition_indices(thd["cu_seqlens_padded"], total, cp, rank)
            tensors = [thd[k] for k in TOKEN_KEYS]

            def ours(thd: dict[str, Any] = thd, cp: int = cp, rank: int = rank) -> Any:
                return shard_thd_batch_for_cp(thd, cp, rank)

            def floor(tensors: list[torch.Tensor] = tensors, idx: torch.Tensor = idx) -> Any:
                return [t.index_select(0, idx) for t in tensors]

            # same tokens out of both
            got = ours()
            for k, f in zip(TOKEN_KEYS, floor(), strict=True):
                assert torch.equal(got[k], f), k
            # ~2 ms per timing sample (more under load is fine: medians of many trials)
            t0 = time.perf_counter()
            floor()
            inner = max(5, min(200, int(0.002 / max(time.perf_counter() - t0, 1e-6))))
            times = time_interleaved(
                {"ours": ours, "index_select": floor},
                trials=31
                if quick
                else 41,  # medians of many short trials: the small case sits near its goal
                inner=inner,
                warmup=2,
            )
            records.append(
                Record(
                    bench=BENCH,
                    case=f"T={total // 1024}k cp={cp}",
                    metric="time",
                    unit="s",
                    ours=times["ours"],
                    baselines={"index_select": times["index_select"]},
                    extra={
                        "tokens": total,
                        "cp_size": cp,
                        "num_seqs": int(thd["cu_seqlens_padded"].numel() - 1),
                        "keys": list(TOKEN_KEYS),
                        "goal": "ratio index_select >= 0.5 (<= 2x the floor)",
                    },
                )
            )
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_records(run("--quick" in sys.argv))
