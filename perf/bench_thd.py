"""THD conversion time per call: te_thd vs the reference implementation.

``te_thd.thd_utils.process_input_for_thd`` against NeMo AutoModel 0.7.0's
``nemo_automodel.components.distributed.thd_utils.process_input_for_thd`` on the
SAME batches, timed interleaved. Goal: >= 5x faster at every
shape ``(B, S, sequences per row)`` = (1,4096,4), (8,4096,8), (8,8192,32),
(32,2048,4). ``split_batch_into_thd_chunks`` is reported as extra cases (the
reference converts chunk by chunk in a Python loop).

Batches look like a CP-aware packer's output: every row holds its sequences back
to back and is filled (padded lengths are multiples of 8 and sum to S, real
lengths up to 7 shorter), odd rows hold one sequence fewer (a sentinel slot), so
sentinel dropping, padding between sequences and absorption are all exercised.
Rows are filled because the reference's offsets are only right then; before
timing, each case checks that both implementations agree on that batch.

Both run with ONE torch thread (restored afterwards): the conversion runs in
DataLoader workers, where torch sets one thread per worker. This is also the
reference's best case on a shared machine -- with two threads on two busy cores
its many small torch ops slow down by 5-100x, which would inflate the ratios.

Without the reference installed (or with ``TE_THD_PERF_NO_REFERENCE=1``) only
te_thd's times are reported, without ratios.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from harness import Record, print_records, reference_thd_utils, time_interleaved

BENCH = "thd_conversion"
SHAPES = ((1, 4096, 4), (8, 4096, 8), (8, 8192, 32), (32, 2048, 4))
CHUNKED = ((8, 4096, 8, 4), (32, 2048, 4, 8))  # (B, S, n, num_chunks)
SENTINEL = -1000


def make_batch(bsz: int, seq_len: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A filled packed batch ``[B, S]`` with ``n`` slots per row (odd rows use n-1)."""
    rng = np.random.default_rng(seed)
    seq_lens = np.full((bsz, n), SENTINEL, dtype=np.int64)
    padded = np.full((bsz, n), SENTINEL, dtype=np.int64)
    unit = 8  # padded lengths are multiples of 2*cp (cp = 4)
    for b in range(bsz):  # batch construction, not timed
        k = max(1, n - (b % 2))
        cuts = np.sort(rng.choice(np.arange(1, seq_len // unit), size=k - 1, replace=False))
        slots = np.diff(np.concatenate([[0], cuts, [seq_len // unit]])) * unit
        padded[b, :k] = slots
        seq_lens[b, :k] = slots - rng.integers(0, unit, size=k)
    return {
        "input_ids": torch.from_numpy(rng.integers(1, 32000, (bsz, seq_len))),
        "labels": torch.from_numpy(rng.integers(1, 32000, (bsz, seq_len))),
        "position_ids": torch.arange(seq_len).repeat(bsz, 1),
        "seq_lens": torch.from_numpy(seq_lens),
        "seq_lens_padded": torch.from_numpy(padded),
    }


def check_agree(ours: dict[str, Any], ref: dict[str, Any]) -> None:
    """Raise if the two conversions of one (filled) batch disagree."""
    for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "padding_mask", "max_seqlen"):
        if not torch.equal(ours[key], ref[key]):
            raise AssertionError(f"te_thd and the reference disagree on {key!r}")
    # The reference emits cu_seqlens_padded only when it differs from cu_seqlens.
    ref_padded = ref.get("cu_seqlens_padded", ref["cu_seqlens"])
    if not torch.equal(ours["cu_seqlens_padded"], ref_padded):
        raise AssertionError("te_thd and the reference disagree on 'cu_seqlens_padded'")
    if ours["pad_between_seqs"] != ("cu_seqlens_padded" in ref):
        raise AssertionError("pad_between_seqs disagrees with the reference's emit gate")


def _time(cands: dict[str, Callable[[], Any]], quick: bool, per_call_s: float) -> dict[str, float]:
    # Aim for ~2 ms per trial per candidate so timer resolution and scheduler
    # noise stay small, and enough trials for a stable median.
    inner = max(1, int(0.002 / max(per_call_s, 1e-6)))
    return time_interleaved(cands, trials=21 if quick else 25, inner=inner, warmup=2)


def run(quick: bool) -> list[Record]:
    from te_thd.thd_utils import process_input_for_thd, split_batch_into_thd_chunks

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(quick, process_input_for_thd, split_batch_into_thd_chunks)
    finally:
        torch.set_num_threads(previous_threads)


def _run(
    quick: bool, process_input_for_thd: Callable, split_batch_into_thd_chunks: Callable
) -> list[Record]:
    ref = reference_thd_utils()
    records: list[Record] = []
    threads = torch.get_num_threads()
    for bsz, seq_len, n in SHAPES:
        batch = make_batch(bsz, seq_len, n)
        cands: dict[str, Callable[[], Any]] = {"te_thd": lambda b=batch: process_input_for_thd(b)}
        if ref is not None:
            check_agree(process_input_for_thd(batch), ref.process_input_for_thd(batch))
            cands["reference"] = lambda b=batch: ref.process_input_for_thd(b)
        times = _time(cands, quick, 1e-4)
        records.append(
            Record(
                bench=BENCH,
                case=f"B={bsz},S={seq_len},n={n}",
                metric="time",
                unit="s/call",
                ours=times["te_thd"],
                baselines={"reference": times["reference"]} if ref is not None else {},
                extra={"function": "process_input_for_thd", "torch_threads": threads},
            )
        )
    for bsz, seq_len, n, chunks in CHUNKED:
        batch = make_batch(bsz, seq_len, n, seed=1)
        cands = {"te_thd": lambda b=batch, c=chunks: split_batch_into_thd_chunks(b, c)}
        if ref is not None:
            ours_c = split_batch_into_thd_chunks(batch, chunks)
            ref_c = ref.split_batch_into_thd_chunks(batch, chunks)
            for key in ("input_ids", "cu_seqlens", "padding_mask", "max_seqlen"):
                if not torch.equal(ours_c[key], ref_c[key]):
                    raise AssertionError(f"chunked: te_thd and the reference disagree on {key!r}")
            cands["reference"] = lambda b=batch, c=chunks: ref.split_batch_into_thd_chunks(b, c)
        times = _time(cands, quick, 3e-4)
        records.append(
            Record(
                bench=BENCH,
                case=f"chunked B={bsz},S={seq_len},n={n},C={chunks}",
                metric="time",
                unit="s/call",
                ours=times["te_thd"],
                baselines={"reference": times["reference"]} if ref is not None else {},
                extra={"function": "split_batch_into_thd_chunks", "torch_threads": threads},
            )
        )
    if ref is None:
        print("reference (nemo-automodel 0.7.0) not importable: te_thd times only, no ratios")
    return records


if __name__ == "__main__":
    print_records(run("--quick" in sys.argv[1:]))
