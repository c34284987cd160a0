"""Megatron-style expert-parallel + context-parallel distillation on the te_thd offline cache.

Launch with torchrun (CPU + gloo by default; ``--device cuda`` for NCCL + TE)::

    python examples/precompute_cache.py --out runs/cache --cp 2
    torchrun --nproc-per-node 4 examples/train_ep_cp.py --cache-dir runs/cache --cp 2 --ep 2

The student's vocabulary, its hidden-state head and the top-k it distils come from the
cache's manifest, so the same command trains on a cache of the synthetic target or of
a Hugging Face model (``precompute_cache.py --target hf:DIR``, see docs/own-model.md).

What one step does, and which te_thd piece does it:

1. ``build_cached_dataloader`` (``te_thd.offline_cache``) hands every data-parallel
   replica its own samples -- the CP ranks of a replica get the same ones -- read in
   batches from the memory-mapped shards;
2. its collate, ``CachedThdCollator``, packs them into rows (every document padded
   to ``2*cp``), converts to THD (``cu_seqlens``, ``cu_seqlens_padded``,
   ``pad_between_seqs``, ...) and keeps this CP rank's tokens (``te_thd.cp``), all
   on the CPU in the loader;
3. ``te_attention_kwargs`` turns the batch into TE's ``DotProductAttention`` keyword
   arguments (host ints and bools: no device sync), and ``ThdAttention`` runs TE with
   the CP group on CUDA, the reference CP attention over gloo on CPU;
4. the MoE layers dispatch tokens to the experts of the expert-parallel group with
   ``all_to_all`` and back (``ep_cp.moe``);
5. the loss (KL to the cached top-k distribution + hidden-state regression, masked by
   the padding mask and the loss mask) is a token mean over the whole global batch;
6. dense gradients are summed over data-parallel x CP, expert gradients over the
   expert-data-parallel group, the global norm is clipped, AdamW steps;
7. every ``--save-every`` steps a checkpoint (model, optimizer, LR schedule, sampler
   position, RNG) is written; ``--resume`` continues from the latest one, keeping the
   checkpoint's LR schedule (``--resume --steps N`` past the schedule's end trains at
   its floor LR, and says so).

A run starts in a new or empty ``--out``, or over a run that stopped before its first
checkpoint (it left nothing to resume: the same command starts it again). An ``--out``
with an earlier run's checkpoint is refused unless ``--resume`` continues it, one with
other files is refused, and ``--resume`` with no checkpoint there is refused too (each
exits with status 2, changing nothing).

Rank 0 logs loss, tokens/s and the data-wait share of the step time, shows a tqdm
bar on a terminal, appends every step to ``<out>/metrics.jsonl`` and ends with a
``summary:`` line, which also gives the fastest and the slowest rank's compute time per
step (``--balance`` plans every step's global batch so that they come close).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ep_cp.cache_format import (  # noqa: E402
    CACHE_NAME,
    FORMAT_VERSION,
    KEYS,
    TOKEN_KEYS,
    cache_dims,
    check_student_fits,
    producer_command,
)
from ep_cp.checkpoint import (  # noqa: E402
    LATEST,
    latest_step,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ep_cp.cli_help import HelpFormatter  # noqa: E402
from ep_cp.config import StudentConfig, config_to_dict  # noqa: E402
from ep_cp.errors import UsageError, run_main  # noqa: E402
from ep_cp.parallel import (  # noqa: E402
    ParallelContext,
    clip_grad_norm,
    init_parallel,
    reduce_gradients,
    shutdown_parallel,
)
from ep_cp.step import forward_backward, global_stats  # noqa: E402
from ep_cp.student import StudentMoE  # noqa: E402
from ep_cp.timing import ComputeTimer, spread  # noqa: E402

from te_thd.attention import ThdAttention, te_attention_kwargs  # noqa: E402
from te_thd.offline_cache import (  # noqa: E402
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    ensure_supervision_options_match,
    read_manifest,
    to_device,
)
from te_thd.packing import pad_to_multiple_for  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--cache-dir", required=True, help="cache written by examples/precompute_cache.py"
    )
    p.add_argument(
        "--out",
        default="runs/train",
        help="metrics.jsonl, summary.json and checkpoints (<out>/ckpt); a new or empty "
        "directory, or an earlier run's with --resume",
    )
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo and the reference CP attention; cuda: NCCL and Transformer Engine, one "
        "GPU per local rank",
    )
    p.add_argument(
        "--steps", type=int, default=200, help="training steps (the LR schedule's length)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="samples per data-parallel replica and step"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="packed row length (default: the cache's pack_seq_len)",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="fixed number of packed rows per step (default: as many as the samples need)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="pad cu_seqlens to N+1 every step (with --rows: identical shapes, for CUDA graphs)",
    )
    p.add_argument(
        "--cp-comm-type",
        choices=("p2p", "all_gather", "a2a"),
        default="p2p",
        help="TE's context-parallel communication (a2a: heads divisible by --cp)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, as a fraction of --lr"
    )
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument(
        "--hidden-weight", type=float, default=1.0, help="weight of the hidden-state regression"
    )
    p.add_argument(
        "--aux-weight", type=float, default=0.01, help="weight of the load-balancing loss"
    )
    p.add_argument(
        "--experts", type=int, default=StudentConfig.num_experts, help="experts per MoE layer"
    )
    p.add_argument(
        "--topk-experts",
        type=int,
        default=StudentConfig.router_topk,
        help="experts each token is routed to",
    )
    p.add_argument(
        "--layers", type=int, default=StudentConfig.num_layers, help="student transformer layers"
    )
    p.add_argument("--seed", type=int, default=1, help="data order seed")
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="DataLoader workers per rank (default: 0 on cpu -- collating inline costs less than "
        "receiving the batch from a worker there --, 2 on cuda)",
    )
    p.add_argument(
        "--mask-prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="insist on a cache whose prompts are (or, --no-mask-prompt, are not) masked "
        "(checked against the manifest; default: train on the cache's loss mask as it is)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=50,
        help="checkpoint interval in steps (0: only at the end)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from <out>/ckpt's latest checkpoint"
    )
    p.add_argument("--log-every", type=int, default=10, help="print a log line every N steps")
    p.add_argument(
        "--balance",
        action="store_true",
        help="work-balanced steps: each step's global batch (the same samples as without it) "
        "is planned over the data-parallel replicas, equal rows and near-equal compute each "
        "(te_thd.balance.plan_global_batch, from the cache's sample lengths)",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="train while the producer still writes the cache: start after its first shard "
        "(or before: wait for it); epoch 0 reads the shards in index order 0, 1, 2, ..., "
        "the same batches as on the finished cache with --follow (docs/follow.md)",
    )
    p.add_argument(
        "--follow-timeout",
        type=float,
        default=600.0,
        help="with --follow: seconds a read waits for a shard the producer has not committed "
        "before the run stops (resume the producer, then --resume)",
    )
    p.add_argument(
        "--attn-scale",
        type=float,
        default=None,
        help="with --balance: cost of a document of length L is L + L^2 / attn-scale "
        "(default: 12 x the student's hidden size)",
    )
    return p


def check_args(args: argparse.Namespace) -> None:
    """Bad flags -> ValueError naming the flag, its value and the fix."""
    for name in ("steps", "batch_size", "experts", "topk_experts", "layers", "log_every"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    for name in ("rows", "max_num_seqs"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    for name in ("save_every", "num_workers", "warmup"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 0")
    if args.topk_experts > args.experts:
        raise ValueError(
            f"--topk-experts={args.topk_experts} exceeds --experts={args.experts}; lower it"
        )
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be > 0")
    if args.attn_scale is not None and not args.attn_scale > 0:
        raise ValueError(f"--attn-scale={args.attn_scale} must be > 0")
    if not args.follow_timeout > 0:
        raise ValueError(
            f"--follow-timeout={args.follow_timeout} must be > 0 (seconds); pass e.g. 600"
        )


#: what a run writes into its ``--out``
RUN_FILES = frozenset({"metrics.jsonl", "summary.json", "ckpt"})


def check_out(args: argparse.Namespace) -> None:
    """Refuse ``--out`` when the run would lose or miss what is there (:class:`UsageError`).

    Without ``--resume`` a run writes ``metrics.jsonl``, ``summary.json`` and ``ckpt/``
    from step 0, and its first checkpoint removes the older ones: in ``--out`` of a run
    that published a checkpoint that deletes the earlier run. A run that stopped before
    its first checkpoint cannot be resumed and holds only its own files: a new run starts
    over there. ``--resume`` needs a published checkpoint (``<out>/ckpt/latest.json``);
    without one it would silently start at step 0. Every rank runs this before the
    process group exists, so none has written yet.
    """
    out, ckpt = args.out, os.path.join(args.out, "ckpt")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a directory; pass a new --out")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    saved = os.path.isfile(os.path.join(ckpt, LATEST))
    others = [name for name in held if name not in RUN_FILES]
    if args.resume and not saved:
        if not held:
            fix = f"drop --resume to start a new run in {out}, or pass the --out of the run to continue"
        elif others:
            fix = f"pass a new --out to start a new run ({out} holds {_listed(others)}, not a run)"
        else:
            fix = (
                "the run there stopped before its first checkpoint: drop --resume to start it over"
            )
        raise UsageError(
            f"--resume: nothing to resume, no checkpoint in {ckpt} (no {LATEST}); {fix}"
        )
    if args.resume:
        return
    if saved:
        raise UsageError(
            f"--out {out} already holds a run ({_listed(held)}); pass --resume to continue it, or a "
            "new --out to start another (nothing was changed)"
        )
    if others:
        raise UsageError(
            f"--out {out} holds {_listed(others)}, which a run does not write; pass a new --out "
            "(nothing was changed)"
        )


def _listed(names: list[str]) -> str:
    """The first three of ``names``, then ``...``."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_resume_cache(
    args: argparse.Namespace,
    saved: dict[str, Any],
    num_samples: int,
    shard_size: int,
    meta: dict[str, Any],
) -> None:
    """``--resume`` on the cache the checkpoint's data position belongs to, or :class:`UsageError`.

    ``saved`` is the checkpoint's sampler state (``num_samples``, ``shard_size``), ``meta``
    its ``latest.json`` (which names the cache it was trained on, when recorded).
    """
    was = (saved.get("num_samples"), saved.get("shard_size"))
    if was == (num_samples, shard_size):
        return
    original = meta.get("cache_dir")
    fix = f"--cache-dir {original}" if original else "the --cache-dir it was trained on"
    raise UsageError(
        f"--resume: the checkpoint in {os.path.join(args.out, 'ckpt')} was trained on a cache of "
        f"{was[0]} samples in shards of {was[1]}, but --cache-dir {args.cache_dir} holds "
        f"{num_samples} samples in shards of {shard_size}; resume with {fix}, or train on this "
        "cache into a new --out"
    )


def check_resume_follow(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    """``--resume`` with the ``--follow`` of the checkpoint's run, or :class:`UsageError`.

    ``saved`` is the checkpoint's sampler state: the order of epoch 0's samples, and so the
    position it records, depends on ``--follow``.
    """
    was = bool(saved.get("follow", False))  # a state saved before follow existed did not follow
    if was == args.follow:
        return
    raise UsageError(
        f"--resume: the checkpoint in {os.path.join(args.out, 'ckpt')} was trained "
        f"{'with' if was else 'without'} --follow, which orders epoch 0's samples; "
        f"{'pass' if was else 'drop'} --follow to resume it, or train into a new --out"
    )


def loss_summary(losses: list[float]) -> tuple[float, float, int, str]:
    """``(first, last, k, text)``: the mean loss of the first and of the last ``k`` steps.

    The two windows never overlap (``k`` is at most half the steps, and at most 10), so
    a short run compares its start with its end instead of one window with itself.
    """
    n = len(losses)
    k = max(1, min(10, n // 2))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if n == 1:
        return first, last, k, f"loss {first:.4f} (a single step)"
    how = "first vs last step" if k == 1 else f"mean of first/last {k} steps"
    return first, last, k, f"loss {first:.4f} -> {last:.4f} ({how})"


class LrSchedule:
    """LR factor per step: linear warm-up, then cosine decay to ``min_lr_ratio`` at ``steps``.

    A callable object, not a closure: ``LambdaLR.state_dict`` saves a callable object's
    attributes, so every checkpoint carries the schedule it was trained with and
    ``--resume`` keeps it (:func:`schedule_note` says so when the flags differ).
    """

    def __init__(self, steps: int, warmup: int, min_lr_ratio: float) -> None:
        self.steps = steps
        self.warmup = warmup
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )


def schedule_note(
    scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any], args: argparse.Namespace
) -> str | None:
    """What ``--resume`` did with the LR schedule, when that is not what the flags say.

    ``saved`` is the checkpoint's scheduler state (already loaded into ``scheduler``).
    """
    sched: LrSchedule = scheduler.lr_lambdas[0]  # type: ignore[assignment]
    if not saved.get("lr_lambdas") or saved["lr_lambdas"][0] is None:
        return (
            f"--resume: the checkpoint holds no LR schedule; it is recomputed from the flags "
            f"(cosine over --steps {args.steps}), so the LR may jump at the resumed step"
        )
    base_lr = scheduler.base_lrs[0]
    ours = {"--steps": sched.steps, "--warmup": sched.warmup,
            "--min-lr-ratio": sched.min_lr_ratio, "--lr": base_lr}  # fmt: skip
    flags = {"--steps": args.steps, "--warmup": args.warmup,
             "--min-lr-ratio": args.min_lr_ratio, "--lr": args.lr}  # fmt: skip
    changed = [f"{k} {flags[k]:g}" for k in ours if ours[k] != flags[k]]
    if not changed:
        return None
    floor = base_lr * sched.min_lr_ratio
    tail = (
        f"; steps {sched.steps + 1}-{args.steps} run at its floor lr {floor:.2e}"
        if args.steps > sched.steps
        else ""
    )
    return (
        f"--resume: keeping the checkpoint's LR schedule (lr {base_lr:.2e}, warm-up "
        f"{sched.warmup}, cosine to {floor:.2e} over {sched.steps} steps); {', '.join(changed)} "
        f"does not change it{tail}. For a new schedule, train into a new --out"
    )


def open_cache(
    args: argparse.Namespace, cp: int, manifest: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int]:
    """Read the manifest (``manifest``: what a dataset following its producer read), refuse a cache
    built for other options; return it and the row length."""
    if manifest is None:
        manifest = read_manifest(
            args.cache_dir,
            CACHE_NAME,
            FORMAT_VERSION,
            f"`{producer_command(args.cache_dir, cp=cp)}`",
        )
    seq_len = args.seq_len or int(manifest.get("pack_seq_len", 0)) or 256
    expected: dict[str, Any] = {
        "cp_size": cp,
        "pad_to_multiple_of": pad_to_multiple_for(cp),
        "pack_seq_len": seq_len,
    }
    if args.mask_prompt is not None:
        expected["mask_prompt"] = args.mask_prompt
    # A cache for other options goes to a new directory, built by the same producer command.
    rebuilt = f"{args.cache_dir.rstrip('/')}-cp{cp}-seq{seq_len}"
    overrides = {"cp": cp, "pack_seq_len": seq_len}
    if args.mask_prompt is not None:
        overrides["mask_prompt"] = args.mask_prompt
    ensure_supervision_options_match(
        manifest,
        expected,
        CACHE_NAME,
        args.cache_dir,
        f"`{producer_command(rebuilt, manifest, **overrides)}` (then train with --cache-dir {rebuilt})",
    )
    return manifest, seq_len


def build_student(
    args: argparse.Namespace, manifest: dict[str, Any], ctx: ParallelContext
) -> StudentMoE:
    """The MoE student, sized for the cache's target (:func:`cache_dims`)."""
    dims = cache_dims(manifest, args.cache_dir)
    cfg = StudentConfig(
        vocab_size=dims.vocab_size,
        target_hidden_size=dims.hidden_size,
        num_layers=args.layers,
        num_experts=args.experts,
        router_topk=args.topk_experts,
    )

    def make_attention() -> ThdAttention:
        # TE DotProductAttention(cp_group=...) on CUDA; reference CP attention over gloo on CPU.
        return ThdAttention(
            cfg.num_heads,
            cfg.head_dim,
            cp_group=ctx.cp_group if ctx.cp_size > 1 else None,
            cp_comm_type=args.cp_comm_type,
        )

    model = StudentMoE(cfg, make_attention, ep_group=ctx.ep_group, cp_group=ctx.cp_group)
    return model.to(ctx.device)


def build_collate(
    seq_len: int,
    cp_size: int,
    cp_rank: int,
    rows: int | None = None,
    max_num_seqs: int | None = None,
) -> CachedThdCollator:
    """Cached samples -> packed rows (documents padded to 2*cp) -> THD -> this CP rank's tokens.

    ``rows`` and ``max_num_seqs`` give every step identical shapes (CUDA graphs): a fixed
    number of packed rows, and boundary arrays padded to ``max_num_seqs + 1``.
    """
    return CachedThdCollator(
        seq_len,
        length_key="seq_len",
        token_keys=TOKEN_KEYS,
        cp_size=cp_size,
        cp_rank=cp_rank,
        rows=rows,
        max_num_seqs=max_num_seqs,
    )


def check_batch_fits(args: argparse.Namespace, num_samples: int, dp_size: int) -> None:
    """A step takes ``--batch-size`` samples on each data-parallel replica: the cache must hold one."""
    per = num_samples // dp_size
    if per == 0:
        raise ValueError(
            f"the cache at {args.cache_dir} holds {num_samples} samples, too few for {dp_size} data-parallel "
            f"replicas (each step gives every replica at least one); build a cache of at least {dp_size} samples, "
            "or run fewer replicas"
        )
    if per < args.batch_size:
        step = dp_size * args.batch_size
        raise ValueError(
            f"--batch-size {args.batch_size}: the cache at {args.cache_dir} holds {num_samples} samples, too few for "
            f"{dp_size} data-parallel replicas at {args.batch_size} samples each (a step takes {step}); pass "
            f"--batch-size {per} or less, or build a cache of at least {step} samples"
        )


def build_loader(
    args: argparse.Namespace,
    dataset: CachedTensorDataset,
    collate: CachedThdCollator,
    epoch: int = 0,
    state: dict[str, Any] | None = None,
    attn_scale: float | None = None,
):
    """The cached dataloader: shard-block shuffled, sharded over data-parallel replicas only.

    ``--balance``: every step's global batch planned over the replicas from the
    ``seq_len`` lengths the cache records (a cache built before they were recorded
    is scanned once, the result kept beside it).
    """
    balance: dict[str, Any] = {}
    if args.balance:
        balance = dict(
            balance=True,  # lengths: the collator's seq_len, as the cache records them
            attn_scale=args.attn_scale or attn_scale or 49152.0,
        )
    loader = build_cached_dataloader(
        dataset,
        args.batch_size,
        True,
        collate,
        num_workers=args.num_workers,
        distributed=True,  # DP ranks only: the CP ranks of a replica read the same samples
        seed=args.seed,
        drop_last=True,
        persistent_workers=args.num_workers > 0,
        **balance,
    )
    loader.sampler.set_epoch(epoch)
    if state is not None:
        loader.load_state_dict(state)
    return loader


class MetricsLog:
    """Rank 0's ``metrics.jsonl``: one JSON object per step; truncated to the resume step."""

    def __init__(self, path: str, resume_step: int, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        kept: list[str] = []
        if resume_step and os.path.exists(path):
            with open(path) as f:
                kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= resume_step]
        with open(path, "w") as f:
            f.writelines(kept)
        self.f = open(path, "a")  # noqa: SIM115 -- kept open for the run

    def write(self, rec: dict[str, Any]) -> None:
        if self.enabled:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.enabled:
            self.f.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    check_out(args)
    if args.num_workers is None:
        args.num_workers = 2 if args.device == "cuda" else 0
    ctx = init_parallel(args.cp, args.ep, args.device, args.experts)
    rank0 = ctx.rank == 0
    if (
        args.follow
    ):  # the producer may still run: its record stands in for the manifest until it is written
        dataset = CachedTensorDataset(
            args.cache_dir, CACHE_NAME, FORMAT_VERSION, KEYS,
            follow=True, follow_timeout=args.follow_timeout,
        )  # fmt: skip
        manifest, seq_len = open_cache(args, ctx.cp_size, dataset.manifest)
    else:
        manifest, seq_len = open_cache(args, ctx.cp_size)
        dataset = CachedTensorDataset(
            args.cache_dir, CACHE_NAME, FORMAT_VERSION, KEYS,
            producer_name=f"`{producer_command(args.cache_dir, manifest)}`",
        )  # fmt: skip
    collate = build_collate(seq_len, ctx.cp_size, ctx.cp_rank, args.rows, args.max_num_seqs)
    model = build_student(args, manifest, ctx)
    dense, expert = model.dense_parameters(), model.expert_parameters()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, LrSchedule(args.steps, args.warmup, args.min_lr_ratio)
    )

    layout = {
        "world_size": ctx.world_size,
        "cp": ctx.cp_size,
        "ep": ctx.ep_size,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "student": config_to_dict(model.cfg),
    }
    ckpt_dir = os.path.join(args.out, "ckpt")
    cache_at = args.cache_dir if "://" in args.cache_dir else os.path.abspath(args.cache_dir)
    step, epoch, loader_state = 0, 0, None
    if args.resume:
        meta = latest_step(ckpt_dir) or {}  # check_out saw it published
        if "student" in meta:
            check_student_fits(meta["student"], cache_dims(manifest, args.cache_dir), ckpt_dir)
        found = load_checkpoint(ckpt_dir, layout)
        if found is None:
            raise UsageError(
                f"--resume: nothing to resume, no checkpoint in {ckpt_dir} (no {LATEST})"
            )
        step, state = found
        check_resume_cache(
            args, state["loader"]["sampler"], len(dataset), int(manifest["shard_size"]), meta
        )
        check_resume_follow(args, state["loader"]["sampler"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        epoch, loader_state = int(state["epoch"]), state["loader"]
        if rank0:
            print(f"resumed from step {step} ({ckpt_dir})", flush=True)
            note = schedule_note(scheduler, state["scheduler"], args)
            if note:
                print(note, flush=True)
    if step >= args.steps:
        if rank0:
            print(
                f"nothing to do: checkpoint is at step {step} >= --steps {args.steps}", flush=True
            )
        shutdown_parallel()
        return 0

    check_batch_fits(args, len(dataset), ctx.dp_size)
    loader = build_loader(args, dataset, collate, epoch, loader_state, 12.0 * model.cfg.hidden_size)
    batches = iter(loader)

    metrics = MetricsLog(os.path.join(args.out, "metrics.jsonl"), step, rank0)
    bar = None
    if rank0:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=args.steps, initial=step, desc="train", unit="step", disable=None, file=sys.stderr
        )
        print(
            f"training: {ctx.world_size} ranks = dp {ctx.dp_size} x cp {ctx.cp_size} (ep {ctx.ep_size}), "
            f"{args.device}, attention backend {model.blocks[0].attn.preferred_backend}, "
            f"{sum(p.numel() for p in dense)} dense + {sum(p.numel() for p in expert)} expert params "
            f"on rank 0, rows of {seq_len} tokens",
            flush=True,
        )

    # TE's fused THD attention takes bf16/fp16: on CUDA the matmuls run in bf16 autocast
    # (parameters, optimizer state, router and loss stay float32); on CPU all is float32.
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if ctx.device.type == "cuda"
        else contextlib.nullcontext()
    )
    history: list[dict[str, Any]] = []
    timer = ComputeTimer(ctx.device)
    t_start = time.perf_counter()
    while step < args.steps:
        t0 = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            epoch += 1
            loader.sampler.set_epoch(epoch)
            batches = iter(loader)
            batch = next(batches)
        # Host decisions (max_seqlen, pad_between_seqs) on the CPU batch, then move.
        attn_kwargs = te_attention_kwargs(batch, cp_size=ctx.cp_size, device=ctx.device)
        batch = to_device(batch, ctx.device)
        t1 = time.perf_counter()

        optimizer.zero_grad(set_to_none=True)
        with autocast, timer:
            local = forward_backward(
                model, batch, attn_kwargs, ctx, args.hidden_weight, args.aux_weight
            )
        reduce_gradients(dense, expert, ctx)
        grad_norm = clip_grad_norm(dense, expert, args.clip, ctx)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        stats = global_stats(local, grad_norm, ctx)  # one small all-reduce, one host copy
        step += 1
        t2 = time.perf_counter()

        rec = {
            "step": step,
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()},
            "lr": lr,
            "step_s": round(t2 - t0, 6),
            "data_wait_s": round(t1 - t0, 6),
            "tokens_per_s": round(stats["tokens"] / (t2 - t0), 1),
        }
        history.append(rec)
        metrics.write(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.4f}", refresh=False)
        if rank0 and (step % args.log_every == 0 or step == args.steps):
            line = (
                f"step {step:5d}/{args.steps} | loss {stats['loss']:.4f} (kl {stats['kl']:.4f}, "
                f"hidden {stats['mse']:.4f}, aux {stats['aux']:.3f}) | grad norm {stats['grad_norm']:.3f} | "
                f"lr {lr:.2e} | {rec['tokens_per_s']:.0f} tok/s | data wait "
                f"{100 * (t1 - t0) / (t2 - t0):.1f}%"
            )
            if bar is not None and not bar.disable:
                bar.write(line, file=sys.stdout)  # above the progress bar
            else:
                print(line, flush=True)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            save_checkpoint(
                ckpt_dir,
                step,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "loader": loader.state_dict(),
                    "epoch": epoch,
                    "rng": rng_state(),
                },
                layout,
                # not part of the layout (a moved cache resumes): it names the fix when
                # --resume meets another cache
                info={"cache_dir": cache_at},
            )
    wall = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    metrics.close()
    compute = spread(timer.gather())  # every rank takes part: one collective, after the run

    if rank0 and history:
        first, last, k, loss_text = loss_summary([r["loss"] for r in history])
        timed = history[1:] or history  # the first step includes worker start-up
        step_s = sum(r["step_s"] for r in timed)
        wait = sum(r["data_wait_s"] for r in timed) / step_s if step_s else 0.0
        tok_s = sum(r["tokens"] for r in timed) / step_s if step_s else 0.0
        summary = {
            "steps": step,
            "first_step": history[0]["step"],
            "loss_first": round(first, 6),
            "loss_last": round(last, 6),
            "loss_window": k,
            "tokens_per_s": round(tok_s, 1),
            "data_wait_pct": round(100 * wait, 3),
            "wall_s": round(wall, 3),
            "world_size": ctx.world_size,
            "dp": ctx.dp_size,
            "cp": ctx.cp_size,
            "ep": ctx.ep_size,
            "device": args.device,
            "balance": args.balance,
            **compute,
        }
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(
            f"summary: steps {history[0]['step'] - 1}->{step} | {loss_text} "
            f"| {tok_s:.0f} tok/s | data wait {100 * wait:.1f}% of step time "
            f"| compute per step {compute['compute_min_s']:.3f}-{compute['compute_max_s']:.3f} s "
            f"(fastest-slowest rank{', balanced' if args.balance else ''}) "
            f"| dp {ctx.dp_size} x cp {ctx.cp_size}, ep {ctx.ep_size} on {ctx.world_size} {args.device} ranks "
            f"| {wall:.1f} s | checkpoint {ckpt_dir}",
            flush=True,
        )
    shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
