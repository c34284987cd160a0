"""How te_thd's costs grow: conversion, CP sharding and cache reads at 4 sizes per axis.

Every series varies one quantity by 4x steps and keeps the rest fixed; each
record carries ``extra`` = ``{"series", "axis", "size", "work", "work_unit",
"expect"}`` so ``report.py`` prints the per-unit cost (time / work) and the
fitted exponent ``k`` of ``time ∝ size**k``:

- ``convert`` (``process_input_for_thd``) vs tokens per batch — expect at most
  linear (k <= 1; flattening is a view, only the padding mask touches every
  token, so a fixed per-call cost dominates small batches); vs sequences per row
  at fixed tokens — expect flat (k ~ 0: metadata is vectorised, no per-sequence loop).
  Baseline: the reference implementation at the same sizes.
- ``cp shard`` (``shard_thd_batch_for_cp``, one rank) vs tokens per batch — at most
  linear; vs cp size at fixed tokens — each rank gets T/cp tokens, expect k <= 0
  (falling towards -1 once the per-token copy outweighs the per-call cost). Baseline: ``index_select`` of the same precomputed
  indices on the same tensors (the data-movement floor).
- ``cache read`` (one shuffled epoch through ``build_cached_dataloader``, batch 32,
  small samples) vs cache size — at most linear (constant per-sample cost once
  the per-epoch setup is amortised: nothing loads the whole cache). Baseline: raw safetensors slice reads of the same batches.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from harness import Record, print_records, reference_thd_utils, time_interleaved

BENCH = "scaling"
SENTINEL = -1000


def make_packed_batch(
    b: int, s: int, p: int, multiple: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A packed BSHD batch whose rows are exactly filled by ``p`` sequences each.

    Every padded length is a multiple of ``multiple`` (2*cp), every real length is
    1..``multiple`` tokens short of it. Returns int64 ``input_ids`` / ``labels`` /
    ``position_ids`` ``[b, s]`` and ``seq_lens`` / ``seq_lens_padded`` ``[b, p]``.
    """
    units = s // multiple
    if s % multiple or units < p:
        raise ValueError(f"s={s} cannot hold p={p} sequences padded to multiples of {multiple}")
    rng = np.random.default_rng(seed)
    # p positive parts of `units` per row: sorted distinct cut points
    cuts = (
        np.sort(
            np.stack([rng.choice(np.arange(1, units), p - 1, replace=False) for _ in range(b)]),
            axis=1,
        )
        if p > 1
        else np.zeros((b, 0), dtype=np.int64)
    )
    bounds = np.concatenate([np.zeros((b, 1), np.int64), cuts, np.full((b, 1), units)], axis=1)
    padded = np.diff(bounds, axis=1) * multiple
    real = padded - rng.integers(0, multiple, size=padded.shape)
    real = np.maximum(real, 1)
    starts = np.repeat(
        np.concatenate([np.zeros((b, 1), np.int64), np.cumsum(padded, 1)[:, :-1]], 1).reshape(-1),
        padded.reshape(-1),
    )
    pos = (np.arange(b * s) % s) - starts
    return {
        "input_ids": torch.from_numpy(rng.integers(1, 32000, size=(b, s))),
        "labels": torch.from_numpy(rng.integers(1, 32000, size=(b, s))),
        "position_ids": torch.from_numpy(pos.reshape(b, s)),
        "seq_lens": torch.from_numpy(real),
        "seq_lens_padded": torch.from_numpy(padded),
    }


def _inner_for(fn: Callable[[], Any], target_s: float) -> int:
    """Calls per timing sample so one sample lasts about ``target_s``."""
    fn()  # first call pays one-off costs (allocator, lazy imports)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return max(1, min(1000, int(target_s / max(dt, 1e-7))))


def _timed(cands: dict[str, Callable[[], Any]], quick: bool) -> dict[str, float]:
    # the slowest candidate sets the inner count, so all share one
    inner = min(_inner_for(fn, 0.004 if quick else 0.02) for fn in cands.values())
    return time_interleaved(cands, trials=5 if quick else 11, inner=inner, warmup=0)


def _record(
    series: str,
    axis: str,
    size: float,
    work: float,
    unit: str,
    expect: str,
    times: dict[str, float],
    **extra: Any,
) -> Record:
    ours = times.pop("te_thd")
    return Record(
        bench=BENCH,
        case=f"{series} {axis}={size:g}",
        metric="time",
        unit="s",
        ours=ours,
        baselines=times,
        extra={
            "series": series,
            "axis": axis,
            "size": size,
            "work": work,
            "work_unit": unit,
            "expect": expect,
            **extra,
        },
    )


# --------------------------------------------------------------------------- conversion


def bench_convert(quick: bool) -> list[Record]:
    from te_thd.thd_utils import process_input_for_thd

    ref = reference_thd_utils()
    out: list[Record] = []
    b, p = 8, 8
    for s in [256, 1024, 4096, 16384] if quick else [1024, 4096, 16384, 65536]:
        batch = make_packed_batch(b, s, p, multiple=8, seed=s)
        cands: dict[str, Callable[[], Any]] = {"te_thd": lambda bt=batch: process_input_for_thd(bt)}
        if ref is not None:
            cands["reference"] = lambda bt=batch: ref.process_input_for_thd(bt)
        out.append(
            _record(
                "convert",
                "tokens per batch",
                b * s,
                b * s,
                "token",
                "at most linear (k <= 1)",
                _timed(cands, quick),
                batch=b,
                seqs_per_row=p,
            )
        )
    s = 4096 if quick else 8192
    for p in [1, 8, 64, 512]:
        batch = make_packed_batch(b, s, p, multiple=8, seed=p)
        cands = {"te_thd": lambda bt=batch: process_input_for_thd(bt)}
        if ref is not None:
            cands["reference"] = lambda bt=batch: ref.process_input_for_thd(bt)
        out.append(
            _record(
                "convert",
                "sequences per row",
                p,
                b * s,
                "token",
                "flat (k ~ 0) at fixed tokens",
                _timed(cands, quick),
                batch=b,
                seq_len=s,
            )
        )
    return out


# --------------------------------------------------------------------------- CP sharding


def _shard_cands(thd: dict[str, Any], cp: int, rank: int) -> dict[str, Callable[[], Any]]:
    from te_thd.cp import partition_indices, shard_thd_batch_for_cp

    total = thd["input_ids"].shape[0]
    idx = partition_indices(thd["cu_seqlens_padded"], total, cp, rank)
    tensors = [thd[k] for k in ("input_ids", "labels", "position_ids", "padding_mask")]

    def floor() -> list[torch.Tensor]:
        return [t.index_select(0, idx) for t in tensors]

    return {"te_thd": lambda: shard_thd_batch_for_cp(thd, cp, rank), "index_select": floor}


def bench_shard(quick: bool) -> list[Record]:
    from te_thd.thd_utils import process_input_for_thd

    out: list[Record] = []
    b, p, cp = 8, 8, 4
    for s in [256, 1024, 4096, 16384] if quick else [1024, 4096, 16384, 65536]:
        thd = process_input_for_thd(make_packed_batch(b, s, p, multiple=2 * cp, seed=s))
        out.append(
            _record(
                "cp shard",
                "tokens per batch",
                b * s,
                b * s // cp,
                "output token",
                "at most linear (k <= 1)",
                _timed(_shard_cands(thd, cp, 1), quick),
                cp=cp,
            )
        )
    s = 4096 if quick else 8192
    for cp in [2, 4, 8, 16]:
        thd = process_input_for_thd(make_packed_batch(b, s, p, multiple=2 * cp, seed=cp))
        out.append(
            _record(
                "cp shard",
                "cp size",
                cp,
                b * s // cp,
                "output token",
                "k <= 0 (T/cp tokens per rank)",
                _timed(_shard_cands(thd, cp, cp - 1), quick),
                tokens=b * s,
            )
        )
    return out


# --------------------------------------------------------------------------- cache reads

SMALL_KEYS = ("input_ids", "loss_mask", "position_mask")


def write_small_cache(cache_dir: str, num_samples: int, shard_size: int) -> None:
    """A cache in the reference on-disk format (plain safetensors shards + manifest).

    The small samples of ``bench_cache_read.py``: ``input_ids`` [256] int64, ``loss_mask`` [256] int64,
    ``position_mask`` [256, 1] bool. Written with plain ``save_file`` so the read
    cost measured does not depend on the writer.
    """
    from safetensors.torch import save_file

    os.makedirs(cache_dir, exist_ok=True)
    g = torch.Generator().manual_seed(num_samples)
    for i, start in enumerate(range(0, num_samples, shard_size)):
        n = min(shard_size, num_samples - start)
        save_file(
            {
                "input_ids": torch.randint(0, 32000, (n, 256), generator=g),
                "loss_mask": torch.randint(0, 2, (n, 256), generator=g),
                "position_mask": torch.randint(0, 2, (n, 256, 1), generator=g).bool(),
            },
            os.path.join(cache_dir, f"shard-{i:06d}.safetensors"),
        )
    with open(os.path.join(cache_dir, "manifest.json"), "w") as f:
        json.dump({"format_version": 1, "num_samples": num_samples, "shard_size": shard_size}, f)


def bench_read(quick: bool) -> list[Record]:
    from safetensors import safe_open

    from te_thd.offline_cache import CachedTensorDataset, build_cached_dataloader, collate_cached

    out: list[Record] = []
    shard_size, batch = 1024, 32
    sizes = [512, 2048, 8192, 32768] if quick else [2048, 8192, 32768, 131072]
    root = tempfile.mkdtemp(prefix="te_thd_scaling_")
    try:
        for n in sizes:
            d = os.path.join(root, f"c{n}")
            write_small_cache(d, n, shard_size)
            ds = CachedTensorDataset(d, "scaling", 1, SMALL_KEYS)
            loader = build_cached_dataloader(
                ds, batch, True, functools.partial(collate_cached, keys=SMALL_KEYS)
            )
            paths = [
                os.path.join(d, f"shard-{i:06d}.safetensors")
                for i in range((n + shard_size - 1) // shard_size)
            ]

            def ours(loader=loader) -> int:
                k = 0
                for bt in loader:
                    k += bt["input_ids"].shape[0]
                return k

            def raw(paths=paths, n=n) -> int:
                k = 0
                for i, path in enumerate(paths):
                    with safe_open(path, framework="pt") as f:
                        rows = min(shard_size, n - i * shard_size)
                        sl = {key: f.get_slice(key) for key in SMALL_KEYS}
                        for a in range(0, rows, batch):
                            got = {key: s[a : a + batch] for key, s in sl.items()}
                            k += got["input_ids"].shape[0]
                return k

            assert ours() == raw() == n
            times = time_interleaved(
                {"te_thd": ours, "raw_slice": raw}, trials=3 if quick else 7, warmup=0
            )
            out.append(
                _record(
                    "cache read",
                    "cache size (samples)",
                    n,
                    n,
                    "sample",
                    "at most linear (k <= 1)",
                    times,
                    shard_size=shard_size,
                    batch=batch,
                    order="shuffled",
                )
            )
            shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def run(quick: bool) -> list[Record]:
    torch.manual_seed(0)
    return [*bench_convert(quick), *bench_shard(quick), *bench_read(quick)]


if __name__ == "__main__":
    torch.set_num_threads(1)  # as perf/run.py runs it: the collate path runs in 1-thread workers
    print_records(run(quick="--quick" in sys.argv))
