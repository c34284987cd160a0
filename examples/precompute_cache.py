"""Precompute the distillation cache: a frozen target model's per-token supervision.

Generates a synthetic variable-length token dataset in-process (no downloads), runs
the frozen target transformer (:mod:`ep_cp.target`) over it and stores, per sample,
the tokens, a loss mask, the target's top-k next-token distribution and its final
hidden states as a ``te_thd`` offline cache (sharded safetensors + manifest).

Single process::

    python examples/precompute_cache.py --out runs/cache --cp 2

or on every rank of a job (each rank computes and writes its own contiguous block of
shards; rank 0 writes the manifest last)::

    torchrun --nproc-per-node 4 examples/precompute_cache.py --out runs/cache --cp 2

It is resumable: run the same command again after a crash and only the missing
shards are computed (the finished cache is byte-identical to an uninterrupted run);
on a finished cache with the same options it does nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION, KEYS, PRODUCER  # noqa: E402
from ep_cp.config import TargetConfig, config_to_dict  # noqa: E402
from ep_cp.synthetic import SyntheticTokens  # noqa: E402
from ep_cp.target import TargetTransformer  # noqa: E402

from te_thd.offline_cache import produce_cache  # noqa: E402
from te_thd.packing import pad_to_multiple_for  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="cache directory")
    p.add_argument("--num-samples", type=int, default=1024)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=96, help="longest sample (cache row width L)")
    p.add_argument("--shard-size", type=int, default=128, help="samples per shard")
    p.add_argument("--batch-size", type=int, default=32, help="target forward batch")
    p.add_argument("--topk", type=int, default=8, help="next-token candidates kept per position")
    p.add_argument(
        "--mask-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="supervise only the last 3/4 of each sample (default: on)",
    )
    p.add_argument(
        "--cp", type=int, default=1, help="context-parallel size the cache is packed for"
    )
    p.add_argument("--pack-seq-len", type=int, default=256, help="packed row length S of training")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--target-seed", type=int, default=TargetConfig.seed)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Bad flags -> ValueError naming the flag, its value and the fix."""
    for name in (
        "num_samples",
        "min_len",
        "max_len",
        "shard_size",
        "batch_size",
        "topk",
        "cp",
        "pack_seq_len",
    ):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    cfg = TargetConfig()
    if args.topk > cfg.vocab_size:
        raise ValueError(
            f"--topk={args.topk} exceeds the vocabulary ({cfg.vocab_size}); use --topk <= {cfg.vocab_size}"
        )
    m = pad_to_multiple_for(args.cp)
    padded = -(-args.max_len // m) * m
    if args.pack_seq_len % m or padded > args.pack_seq_len:
        raise ValueError(
            f"--pack-seq-len={args.pack_seq_len} must be a multiple of 2*cp={m} and hold the longest "
            f"sample padded to that multiple ({padded} slots for --max-len={args.max_len}); use "
            f"--pack-seq-len {max(padded, -(-args.pack_seq_len // m) * m)}"
        )


def producer_options(args: argparse.Namespace, cfg: TargetConfig) -> dict:
    """Everything that shaped the stored tensors, recorded in the manifest."""
    return {
        "producer": PRODUCER,
        "target": config_to_dict(cfg),
        "topk": args.topk,
        "mask_prompt": bool(args.mask_prompt),
        "data": {
            "num_samples": args.num_samples,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "seed": args.data_seed,
        },
        "cp_size": args.cp,
        "pad_to_multiple_of": pad_to_multiple_for(args.cp),
        "pack_seq_len": args.pack_seq_len,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )

    cfg = TargetConfig(seed=args.target_seed)
    target = TargetTransformer(cfg).to(device)
    data = SyntheticTokens(
        args.num_samples, args.min_len, args.max_len, cfg.vocab_size, seed=args.data_seed
    )
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)

    def compute_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"].to(device, non_blocking=True)
        lens = batch["seq_len"].to(device, non_blocking=True)
        out = target.supervision(ids, lens, args.topk, args.mask_prompt)
        out["loss_mask"] = out["loss_mask"].bool()
        out["topk_indices"] = out["topk_indices"].to(torch.int32)
        return {k: v.cpu() for k, v in out.items()}

    t0 = time.perf_counter()
    manifest = produce_cache(
        loader,
        args.out,
        shard_size=args.shard_size,
        compute_batch=compute_batch,
        keys=KEYS,
        options=producer_options(args, cfg),
        format_version=FORMAT_VERSION,
        cache_name=CACHE_NAME,
        producer_name=PRODUCER,
        progress=None,  # tqdm on rank 0 when stderr is a terminal
    )
    if rank == 0:
        n_bytes = sum(s["bytes"] for s in manifest.get("shards", []))
        print(
            f"cache ready: {args.out} | {manifest['num_samples']} samples in {len(manifest.get('shards', []))} "
            f"shards, {n_bytes / 2**20:.1f} MiB | packed for cp={args.cp} "
            f"(pad multiple {manifest['pad_to_multiple_of']}, rows of {args.pack_seq_len}) | "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
