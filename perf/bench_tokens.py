"""What ragged token keys and the codecs buy: bytes on disk, bytes fetched per CP rank, tokens/s.

The same samples are produced four times with ``produce_cache``: padded (every row
``L`` tokens), ragged (``token_keys``: only the real tokens), ragged with
``hidden`` in fp8_e4m3, and ragged with ``topk_indices`` in ``topk_index`` (a
vocabulary of 128,256 tokens, Llama 3's: 17 bits an index). Two length distributions:

- ``demo``: the demo's cache (lengths uniform in 16..96, ``L`` = 96, hidden 64,
  top-k 8), 512 samples (``--quick``: 256);
- ``long_tail``: lognormal lengths with median 0.3 L (sigma 0.8), clipped to
  ``[16, L]``, ``L`` = 4096, hidden 1024 (2 KiB per token: hidden states are most of
  such a cache -- an EAGLE-3 cache of a 4096-wide target with 3 layers holds 24 KiB),
  top-k 8; 96 samples in both modes (an epoch of fewer is too short for its
  tokens/s to be more than its fixed costs).

Keys: ``input_ids`` int64 ``[L]``, ``seq_len`` int64, ``loss_mask`` bool ``[L]``,
``topk_logprobs`` float32 ``[L, 8]``, ``topk_indices`` int32 ``[L, 8]`` (ids below 128,256), ``hidden``
bf16 ``[L, H]``; every per-token key ragged in the ragged caches.

Records per distribution:

- ``disk_<dist>``: shard bytes per real token (lower is better), against the real
  tokens' own bytes (``real_tokens``, goal: ragged <= 1.05x of them plus headers)
  and against the padded cache (``padded``).
- ``fp8_hidden_<dist>``: stored bytes of ``hidden`` (fp8 values + float32 scales)
  against its bf16 bytes in the ragged cache (goal: <= 0.55x).
- ``topk_index_<dist>``: stored bytes of ``topk_indices`` with ``topk_index``
  (16-bit ids + their packed 17th bits) against its int32 bytes in the ragged cache
  (goal: <= 0.54x; 17/32 is the floor).
- ``topk_cache_<dist>``: the whole cache's shard bytes with ``topk_index`` on
  ``topk_indices`` against the same ragged cache without it (goal on ``demo``: <= 0.93x).
- ``cp<C>_fetch_<dist>`` (C = 2, 4): bytes one CP rank fetches from storage in an
  epoch through ``CachedThdCollator(cp_size=C, cp_rank=r)``, the most of any rank,
  against its share of its replica's epoch at cp = 1 (``replica_share`` = the cp = 1
  bytes / C; goal: a rank <= 1.2/C of the replica, i.e. ratio >= 1/1.2). Measured
  as ``/proc/self/io`` ``read_bytes`` (what the kernel fetched from the block
  device), every shard dropped from the page cache first
  (``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``, after ``os.sync()``). ``extra`` has the
  padded cache's and a whole-sample ragged read's bytes for the same rank.
- ``cp2_tokens_per_s_<dist>``: real tokens delivered per second to CP rank 0 at
  cp = 2 (``build_cached_dataloader`` + ``CachedThdCollator``, one epoch from cold
  storage, median of 5 interleaved trials), ragged against padded (goal on ``long_tail``: >= 2x).
- ``cp2_tokens_per_s_warm_<dist>``: the same with the page cache warm, median of 7 interleaved
  trials after one that warms it (goal: >= 1x on both distributions).

Run: ``.venv/bin/python perf/run.py --only tokens``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from harness import Record
from torch.utils.data import DataLoader

from te_thd.offline_cache import (
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    produce_cache,
)
from te_thd.offline_cache.format.integrity import read_shard_header

BENCH = "tokens"
KEYS = ("input_ids", "seq_len", "loss_mask", "topk_logprobs", "topk_indices", "hidden")
TOKEN_KEYS = ("input_ids", "loss_mask", "topk_logprobs", "topk_indices", "hidden")
TOPK = 8
#: the vocabulary of the top-k ids (Llama 3's: past 65,536, so the 17-bit form)
TOPK_VOCAB = 128256


def _lengths(dist: str, n: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dist == "demo":
        return rng.integers(16, 97, n)
    return np.clip(np.round(np.exp(rng.normal(np.log(0.3 * width), 0.8, n))), 16, width).astype(
        np.int64
    )


def _produce(out: str, lengths: np.ndarray, width: int, hidden: int, **kw) -> None:
    samples = [
        {"seq_len": torch.tensor(int(v)), "i": torch.tensor(i)} for i, v in enumerate(lengths)
    ]

    def compute(batch):
        n = batch["seq_len"]
        real = torch.arange(width).unsqueeze(0) < n.unsqueeze(1)
        g = torch.Generator().manual_seed(int(batch["i"][0]))
        b = n.shape[0]
        return {
            "input_ids": torch.randint(1, 32000, (b, width), generator=g) * real,
            "seq_len": n,
            "loss_mask": real,
            "topk_logprobs": -torch.rand(b, width, TOPK, generator=g) * real.unsqueeze(-1),
            "topk_indices": torch.randint(
                0, TOPK_VOCAB, (b, width, TOPK), generator=g, dtype=torch.int32
            )
            * real.unsqueeze(-1),
            "hidden": (torch.randn(b, width, hidden, generator=g) * real.unsqueeze(-1)).to(
                torch.bfloat16
            ),
        }

    produce_cache(
        DataLoader(samples, batch_size=8),
        out,
        32,
        compute,
        KEYS,
        progress=False,
        length_key="seq_len",
        **kw,
    )


def _shards(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.startswith("shard-"))


def _bytes(d: str) -> int:
    return sum(os.path.getsize(p) for p in _shards(d))


def _stored(d: str, names: tuple[str, ...]) -> int:
    total = 0
    for p in _shards(d):
        entries = read_shard_header(p).entries
        total += sum(entries[n].end - entries[n].start for n in names)
    return total


def _drop(d: str) -> None:
    os.sync()
    for p in _shards(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _epoch(d: str, collate, batch: int = 16) -> int:
    """Real tokens the collator delivered over one epoch of cache ``d``."""
    ds = CachedTensorDataset(d, "bench", 1, KEYS)
    loader = build_cached_dataloader(
        dataset=ds, batch_size=batch, shuffle=False, collate_fn=collate
    )
    tokens = 0
    for out in loader:
        tokens += (
            int((~out["padding_mask"]).sum())
            if isinstance(out, dict) and "padding_mask" in out
            else 0
        )
    return tokens


def _fetched(d: str, collate) -> int:
    _drop(d)
    before = _read_bytes()
    _epoch(d, collate)
    return _read_bytes() - before


def _tokens_per_s(
    dirs: dict[str, str], seq: int, cold: bool, trials: int
) -> dict[str, list[float]]:
    """Real tokens/s delivered to CP rank 0 at cp = 2 in an epoch of the ragged and the padded cache,
    ``trials`` interleaved trials each: from cold storage, or with the page cache warm (after one round
    that warms it)."""
    rates: dict[str, list[float]] = {"ragged": [], "padded": []}
    for trial in range(trials + (not cold)):
        for name in rates:
            col = CachedThdCollator(seq, length_key="seq_len", cp_size=2, cp_rank=0)
            if cold:
                _drop(dirs[name])
            t0 = time.perf_counter()
            tokens = _epoch(dirs[name], col)
            if cold or trial:
                rates[name].append(tokens / (time.perf_counter() - t0))
    return rates


def _whole(batch):  # a whole-sample read: every key of every sample, zero-padded
    return batch.tensors


def run(quick: bool) -> list[Record]:
    records: list[Record] = []
    if not os.path.exists("/proc/self/io"):
        return records
    configs = {"demo": (96, 64, 512 if quick else 1024), "long_tail": (4096, 1024, 96)}
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_tokens_") as tmp:
        for dist, (width, hidden, n) in configs.items():
            lengths = _lengths(dist, n, width)
            dirs = {
                k: os.path.join(tmp, f"{dist}-{k}") for k in ("padded", "ragged", "fp8", "topk")
            }
            _produce(dirs["padded"], lengths, width, hidden)
            _produce(dirs["ragged"], lengths, width, hidden, token_keys=TOKEN_KEYS)
            _produce(
                dirs["fp8"],
                lengths,
                width,
                hidden,
                token_keys=TOKEN_KEYS,
                codecs={"hidden": "fp8_e4m3"},
            )
            _produce(dirs["topk"], lengths, width, hidden, token_keys=TOKEN_KEYS,
                     codecs={"topk_indices": f"topk_index:{TOPK_VOCAB}"})  # fmt: skip
            real = int(lengths.sum())
            per_token = 8 + 1 + TOPK * 4 + TOPK * 4 + hidden * 2
            records.append(Record(
                bench=BENCH, case=f"disk_{dist}", metric="time", unit="B/real token",
                ours=_bytes(dirs["ragged"]) / real,
                baselines={"real_tokens": (real * per_token + n * 8) / real, "padded": _bytes(dirs["padded"]) / real},
                extra={"fp8_bytes_per_token": _bytes(dirs["fp8"]) / real, "samples": n, "L": width,
                       "mean_length": float(lengths.mean()), "real_token_bytes": real * per_token},
            ))  # fmt: skip
            fp8 = _stored(dirs["fp8"], ("hidden@tokens", "hidden@scale"))
            records.append(Record(
                bench=BENCH, case=f"fp8_hidden_{dist}", metric="time", unit="bytes",
                ours=fp8, baselines={"bf16": _stored(dirs["ragged"], ("hidden@tokens",))}, extra={"hidden": hidden},
            ))  # fmt: skip
            records.append(Record(
                bench=BENCH, case=f"topk_index_{dist}", metric="time", unit="bytes",
                ours=_stored(dirs["topk"], ("topk_indices@tokens", "topk_indices@high")),
                baselines={"int32": _stored(dirs["ragged"], ("topk_indices@tokens",))},
                extra={"vocab": TOPK_VOCAB, "topk": TOPK, "real_tokens": real},
            ))  # fmt: skip
            records.append(Record(
                bench=BENCH, case=f"topk_cache_{dist}", metric="time", unit="bytes",
                ours=_bytes(dirs["topk"]), baselines={"no_codec": _bytes(dirs["ragged"])},
                extra={"vocab": TOPK_VOCAB, "hidden": hidden, "real_tokens": real},
            ))  # fmt: skip
            seq = 1 << int(np.ceil(np.log2(width * 2)))  # packed rows hold the longest sample
            replica = _fetched(dirs["ragged"], CachedThdCollator(seq, length_key="seq_len"))
            for cp in (2, 4):
                ranks = [_fetched(dirs["ragged"], CachedThdCollator(seq, length_key="seq_len", cp_size=cp, cp_rank=r))
                         for r in range(cp)]  # fmt: skip
                padded = _fetched(
                    dirs["padded"],
                    CachedThdCollator(seq, length_key="seq_len", cp_size=cp, cp_rank=0),
                )
                records.append(Record(
                    bench=BENCH, case=f"cp{cp}_fetch_{dist}", metric="time", unit="bytes",
                    ours=max(ranks), baselines={"replica_share": replica / cp},
                    extra={"ranks": ranks, "replica_cp1": replica, "padded_rank0": padded,
                           "whole_sample_ragged": _fetched(dirs["ragged"], _whole),
                           "rank_over_replica": max(ranks) / replica},
                ))  # fmt: skip
            for case, cold, trials in (
                (f"cp2_tokens_per_s_{dist}", True, 5),
                (f"cp2_tokens_per_s_warm_{dist}", False, 7),
            ):
                rates = _tokens_per_s(dirs, seq, cold, trials)
                med = {k: statistics.median(v) for k, v in rates.items()}
                records.append(Record(
                    bench=BENCH, case=case, metric="throughput", unit="real tokens/s",
                    ours=med["ragged"], baselines={"padded": med["padded"]}, extra={"trials": rates},
                ))  # fmt: skip
    return records


if __name__ == "__main__":
    from harness import print_records

    print_records(run("--quick" in sys.argv))
