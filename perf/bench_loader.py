"""End-to-end cached loader: cache -> pack -> THD -> CP shard, samples/s.

te_thd: ``CachedTensorDataset`` + ``build_cached_dataloader`` with
``CachedThdCollator(cp_size=2, cp_rank=0)`` (batched reads, then packing,
``process_input_for_thd`` and the CP shard in the collate, i.e. in the workers).

Baseline ``reference``: the reference's ``CachedTensorDataset`` +
``build_cached_dataloader`` + ``collate_cached`` + ``process_input_for_thd``
(nemo-automodel 0.7.0) on the SAME files. The reference has no packer and no CP
sharding, so its collate uses te_thd's ``PackingCollator`` (per-sample dicts cut
to their lengths, as a user would write it) and ``te_thd.cp.shard_thd_batch_for_cp``
for those two steps: the comparison is of everything around them.

Cache: 256-token rows (``input_ids`` and ``loss_mask`` int64 [256],
``position_mask`` bool [256, 1] marking the real prefix of 16..256 tokens),
shard_size 4096; batches of 32 samples packed into rows of 4096 tokens, every
document padded to 2*cp = 4. Baseline ``unverified``: the same te_thd loader with
``verify=False``, so ``ours / unverified`` is the cost of checking every row read
against its checksum (goal: <= 10% with workers). One timed call = one shuffled epoch (8192 samples;
``--quick``: 2048). ``num_workers`` 0 and 2 (workers restart each epoch, as the
reference loader has no ``persistent_workers``).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import warnings
from typing import Any

import torch
from harness import (
    Record,
    print_records,
    reference_offline_cache,
    reference_thd_utils,
    time_interleaved,
)

BENCH = "loader"
FORMAT_VERSION = 1
KEYS = ("input_ids", "loss_mask", "position_mask")
WIDTH, SEQ_LEN, CP, BATCH = 256, 4096, 2, 32


def write_cache(cache_dir: str, num_samples: int, shard_size: int = 4096) -> None:
    """Self-verifying shards through ``write_tensor_shard``, then ``write_manifest`` (random rows)."""
    from te_thd.offline_cache import write_manifest, write_tensor_shard

    os.makedirs(cache_dir, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for s, start in enumerate(range(0, num_samples, shard_size)):
        n = min(shard_size, num_samples - start)
        length = torch.randint(16, WIDTH + 1, (n, 1), generator=g)
        valid = torch.arange(WIDTH).unsqueeze(0) < length
        write_tensor_shard(
            cache_dir,
            s,
            {
                "input_ids": torch.randint(1, 150_000, (n, WIDTH), generator=g) * valid,
                "loss_mask": torch.randint(0, 2, (n, WIDTH), generator=g) * valid,
                "position_mask": valid.unsqueeze(-1),
            },
            KEYS,
            "bench",
        )
    write_manifest(
        cache_dir, {"num_samples": num_samples, "shard_size": shard_size}, FORMAT_VERSION
    )


class ReferenceThdCollate:
    """Reference collate + te_thd packing + reference THD conversion + te_thd CP shard."""

    def __init__(self, ref_cache: Any, ref_thd: Any) -> None:
        from te_thd.packing import PackingCollator

        self.ref_cache, self.ref_thd = ref_cache, ref_thd
        self.packer = PackingCollator(SEQ_LEN, pad_to_multiple_of=2 * CP, label_key=None)

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        from te_thd.cp import shard_thd_batch_for_cp

        b = self.ref_cache.collate_cached(features, KEYS)
        lengths = b["position_mask"].reshape(len(features), WIDTH).sum(1).tolist()
        samples = [
            {
                "input_ids": b["input_ids"][i, :n],
                "loss_mask": b["loss_mask"][i, :n],
                "position_mask": b["position_mask"][i, :n, 0],
            }
            for i, n in enumerate(lengths)
        ]
        packed = self.packer(samples)
        packed.pop("packing_efficiency")
        thd = self.ref_thd.process_input_for_thd(packed)
        thd["loss_mask"] = thd["loss_mask"].reshape(-1)
        thd["position_mask"] = thd["position_mask"].reshape(-1, 1)
        return shard_thd_batch_for_cp(thd, CP, 0, extra_keys=("loss_mask", "position_mask"))


def _epoch(loader: Any, epochs: Any) -> int:
    """One epoch of ``loader`` (the next epoch number from ``epochs``); samples read."""
    epoch = next(epochs)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    n = 0
    for batch in loader:
        n += batch["num_samples"] if "num_samples" in batch else BATCH
        assert batch["input_ids"].numel() > 0
    return n


def run(quick: bool) -> list[Record]:
    from te_thd.offline_cache import (
        CachedTensorDataset,
        CachedThdCollator,
        UnverifiedCacheWarning,
        build_cached_dataloader,
    )

    ref_cache, ref_thd = reference_offline_cache(), reference_thd_utils()
    n = 2048 if quick else 8192
    trials = 3 if quick else 5
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_loader_") as tmp:
        write_cache(tmp, n)
        collate = CachedThdCollator(SEQ_LEN, cp_size=CP, cp_rank=0, mask_key="position_mask")
        for workers in (0, 2):
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", UnverifiedCacheWarning
                )  # verify=False: measured on purpose
                loaders: dict[str, Any] = {
                    name: build_cached_dataloader(
                        CachedTensorDataset(tmp, "bench", FORMAT_VERSION, KEYS, verify=verify),
                        BATCH,
                        True,
                        collate,
                        workers,
                    )
                    for name, verify in (("ours", True), ("unverified", False))
                }
            if ref_cache is not None and ref_thd is not None:
                loaders["reference"] = ref_cache.build_cached_dataloader(
                    dataset=ref_cache.CachedTensorDataset(
                        cache_dir=tmp,
                        cache_name="bench",
                        format_version=FORMAT_VERSION,
                        disk_keys=KEYS,
                    ),
                    batch_size=BATCH,
                    shuffle=True,
                    collate_fn=ReferenceThdCollate(ref_cache, ref_thd),
                    num_workers=workers,
                )
            counter = iter(range(10**9))
            candidates = {
                name: functools.partial(_epoch, ld, counter) for name, ld in loaders.items()
            }
            times = time_interleaved(candidates, trials=trials, warmup=1)
            rate = {k: n / t for k, t in times.items()}
            records.append(
                Record(
                    bench=BENCH,
                    case=f"cache_pack_thd_cp2_workers{workers}",
                    metric="throughput",
                    unit="samples/s",
                    ours=rate.pop("ours"),
                    baselines=rate,
                    extra={
                        "num_samples": n,
                        "batch_size": BATCH,
                        "seq_len": SEQ_LEN,
                        "cp_size": CP,
                        "num_workers": workers,
                    },
                )
            )
    return records


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_records(run("--quick" in sys.argv))
