"""Packing collator throughput and packing efficiency on a long-tailed length distribution.

Documents have lognormal lengths (median ~600 tokens, a long tail clipped at the row
length S) -- the shape of real SFT / pre-training corpora, where a few long documents
and many short ones make naive packing waste rows.

Records:
- ``collate ...`` (throughput, samples/s): ``PackingCollator`` (FFD + vectorised
  placement) end to end; baseline ``first_fit`` is the same collator with
  ``bin_packing="first_fit"`` (plain first fit in arrival order) -- so the ratio is
  the cost of the FFD decision (sorting) relative to the same work without it.
- ``efficiency ...`` (throughput-oriented, real tokens / slots): FFD's packing
  efficiency vs first fit in arrival order (``first_fit``) and vs next fit in arrival
  order (``next_fit``: close the row as soon as a document does not fit -- the policy
  of the reference's ``pack_dataset``); ratio > 1 = FFD fills rows better. ``extra``
  also holds the row counts and the lower bound ceil(sum of padded lengths / S).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from harness import Record, print_records, time_interleaved

BENCH = "packing"


def lognormal_samples(
    n: int, seq_len: int, median: float, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """``n`` documents of lognormal length (given median, sigma 1.0), clipped to [8, S]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, size=n), 8, seq_len).astype(np.int64)
    return [{"input_ids": torch.from_numpy(rng.integers(1, 32000, int(k)))} for k in lengths]


def next_fit_rows(padded: list[int], seq_len: int) -> int:
    """Rows used by next fit in arrival order (a new row whenever a document does not fit)."""
    rows, room = 0, 0
    for p in padded:
        if p > room:
            rows, room = rows + 1, seq_len
        room -= p
    return rows


def run(quick: bool) -> list[Record]:
    from te_thd.packing import PackingCollator, assign_bins, pad_to_multiple_for

    records: list[Record] = []
    # (documents, S, cp, median length): short documents (median S/8: many per row)
    # and long ones (median S/3: few per row, where packing order matters most)
    cases = [(256, 4096, 1, 512), (1024, 8192, 8, 1024), (512, 8192, 2, 2730)]
    if not quick:
        cases += [(4096, 16384, 8, 2048), (2048, 16384, 4, 5461)]
    for n, seq_len, cp, median in cases:
        samples = lognormal_samples(n, seq_len, median, seed=n + cp)
        m = pad_to_multiple_for(cp)
        collate = PackingCollator(seq_len, pad_to_multiple_of=m, overlong="truncate")
        baseline = PackingCollator(
            seq_len, pad_to_multiple_of=m, overlong="truncate", bin_packing="first_fit"
        )
        ours_out, base_out = collate(samples), baseline(samples)
        times = time_interleaved(
            {
                "ours": lambda c=collate, s=samples: c(s),
                "first_fit": lambda c=baseline, s=samples: c(s),
            },
            trials=5 if quick else 11,
            inner=1,
        )
        case = f"n={n} S={seq_len} cp={cp} median={median}"
        records.append(
            Record(
                bench=BENCH,
                case=f"collate {case}",
                metric="throughput",
                unit="samples/s",
                ours=n / times["ours"],
                baselines={"first_fit": n / times["first_fit"]},
                extra={
                    "samples": n,
                    "tokens": int(sum(int(x["input_ids"].numel()) for x in samples)),
                    "seq_len": seq_len,
                    "pad_to_multiple_of": m,
                },
            )
        )
        padded = [-(-min(int(s["input_ids"].numel()), seq_len) // m) * m for s in samples]
        real_tokens = sum(min(int(x["input_ids"].numel()), seq_len) for x in samples)
        rows_ffd = int(assign_bins(padded, seq_len).max()) + 1
        rows_ff = int(assign_bins(padded, seq_len, decreasing=False).max()) + 1
        assert rows_ffd == ours_out["input_ids"].shape[0]
        assert rows_ff == base_out["input_ids"].shape[0]
        records.append(
            Record(
                bench=BENCH,
                case=f"efficiency {case}",
                metric="throughput",
                unit="real tokens / slot",
                ours=ours_out["packing_efficiency"],
                baselines={
                    "first_fit": base_out["packing_efficiency"],
                    "next_fit": real_tokens / (next_fit_rows(padded, seq_len) * seq_len),
                },
                extra={
                    "rows_ffd": rows_ffd,
                    "rows_first_fit": rows_ff,
                    "rows_next_fit": next_fit_rows(padded, seq_len),
                    "lower_bound_rows": -(-sum(padded) // seq_len),
                },
            )
        )
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_records(run("--quick" in sys.argv))
