r"""Precompute the distillation cache: a frozen target model's per-token supervision.

Runs a frozen target model over a dataset and stores, per sample, the tokens, a loss
mask, the target's top-k next-token distribution and its final hidden states as a
``te_thd`` offline cache (sharded safetensors + manifest). Two sources:

* default: a synthetic variable-length token dataset generated in-process and a tiny
  target transformer initialised from a seed (:mod:`ep_cp.target`) -- no downloads;
* ``--target hf:DIR --data jsonl:PATH``: a Hugging Face causal LM from a local
  directory (:mod:`ep_cp.hf_target`) over real text, one JSON object per line, plain
  (``--text-key``) or chat messages (``--messages-key``, prompt tokens masked), see
  :mod:`ep_cp.jsonl_data`; ``--layers 2,5,8`` also stores those layers' hidden states.

Single process::

    python examples/precompute_cache.py --out runs/cache --cp 2
    python examples/precompute_cache.py --out runs/hf-cache --cp 2 --target hf:models/my-llm \
        --data jsonl:chats.jsonl --messages-key messages --max-len 2048 --pack-seq-len 4096

or on every rank of a job (each rank computes and writes its own contiguous block of
shards; rank 0 writes the manifest last)::

    torchrun --nproc-per-node 4 examples/precompute_cache.py --out runs/cache --cp 2

It is resumable: run the same command again after a crash and only the missing
shards are computed (the finished cache is byte-identical to an uninterrupted run);
on a finished cache with the same options it does nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ep_cp.cache_format import (  # noqa: E402
    CACHE_NAME,
    CODEC_KEYS,
    COMPACT_DTYPES,
    FORMAT_VERSION,
    KEYS,
    LAYER_KEY,
    PRODUCER,
    TOKEN_KEYS,
    producer_args,
    producer_command,
    stored_schema,
)
from ep_cp.cli_help import HelpFormatter  # noqa: E402
from ep_cp.config import TargetConfig, config_to_dict  # noqa: E402
from ep_cp.errors import USER_ERRORS, UsageError, run_main  # noqa: E402
from ep_cp.hf_target import DTYPES, parse_layers  # noqa: E402
from ep_cp.parallel import check_device  # noqa: E402
from ep_cp.synthetic import SyntheticTokens  # noqa: E402
from ep_cp.target import TargetTransformer  # noqa: E402

from te_thd.offline_cache import produce_cache  # noqa: E402
from te_thd.packing import pad_to_multiple_for  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", default=None, help="cache directory (required unless --plan)")
    p.add_argument(
        "--target",
        default="synthetic",
        help="frozen target: 'synthetic' (tiny seeded transformer) or hf:DIR (a Hugging Face "
        "causal LM in a local directory)",
    )
    p.add_argument(
        "--data",
        default="synthetic",
        help="samples: 'synthetic' (generated tokens) or jsonl:PATH (one JSON object per line; "
        "needs --target hf:DIR)",
    )
    p.add_argument("--text-key", default=None, help="JSONL key of plain text (default: text)")
    p.add_argument(
        "--messages-key",
        default=None,
        help="JSONL key of chat messages [{role, content}, ...], rendered with the chat "
        "template; only assistant tokens are supervised",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights and compute of --target hf: (default: bf16 on cuda, fp32 on cpu)",
    )
    p.add_argument(
        "--layers",
        default=None,
        help="also store these hidden states of --target hf: as 'layer_hidden', e.g. 2,5,8 "
        "(indices into Hugging Face's hidden_states: 0 = embeddings, i = after layer i)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=None,
        help="synthetic samples to generate, or the first lines of --data jsonl: to read "
        "(default: 1024 synthetic ones, every line of the file)",
    )
    p.add_argument("--min-len", type=int, default=16, help="shortest synthetic sample")
    p.add_argument("--max-len", type=int, default=96, help="longest sample (cache row width L)")
    p.add_argument("--shard-size", type=int, default=128, help="samples per shard")
    p.add_argument("--batch-size", type=int, default=32, help="target forward batch")
    p.add_argument("--topk", type=int, default=8, help="next-token candidates kept per position")
    p.add_argument(
        "--mask-prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mask prompt tokens in the loss mask (default: on for synthetic data -- the first "
        "quarter of each sample is its prompt -- and for --messages-key, where all "
        "non-assistant tokens are; plain --text-key has no prompt)",
    )
    p.add_argument(
        "--cp", type=int, default=1, help="context-parallel size the cache is packed for"
    )
    p.add_argument("--pack-seq-len", type=int, default=256, help="packed row length S of training")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic samples")
    p.add_argument(
        "--target-seed",
        type=int,
        default=TargetConfig.seed,
        help="seed of the synthetic target's weights",
    )
    p.add_argument(
        "--layout",
        choices=("ragged", "padded"),
        default="ragged",
        help="ragged: store only each sample's real tokens of the per-token keys (the size "
        "follows the real tokens); padded: every row right-padded to --max-len",
    )
    p.add_argument(
        "--hidden-codec",
        choices=("none", "fp8_e4m3"),
        default="none",
        help="store 'hidden' (and 'layer_hidden') as float8 e4m3 with one float32 scale per "
        "token (needs --layout ragged); read back as bfloat16",
    )
    p.add_argument(
        "--compact-dtypes",
        action="store_true",
        help="store topk_logprobs as bfloat16 and input_ids as int32 (the vocabulary fits), and "
        "with --layout ragged topk_indices in the topk_index codec (16 or 17 bits per index "
        "for vocabularies up to 131,072, read back as int32); the trainer reads them as "
        "float32 / int64",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="compute nothing: print the cache's bytes, shards and each CP rank's reads per epoch, "
        "padded, ragged and ragged with each codec (te_thd.offline_cache.tools.plan); the samples are "
        "read and tokenized, the model's config.json alone is read",
    )
    p.add_argument("--json", action="store_true", help="with --plan: print the figures as JSON")
    p.add_argument(
        "--plan-batch-size",
        type=int,
        default=16,
        help="with --plan: samples per training batch, packed together into rows of --pack-seq-len "
        "(train_ep_cp.py's --batch-size); a row's unused tail joins its last sample's CP chunks",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the target runs: cpu (ranks talk over gloo), or cuda (each rank on its "
        "LOCAL_RANK GPU, NCCL)",
    )
    return p


def _source_path(flag: str, value: str, prefix: str) -> str | None:
    """``prefix:PATH`` -> PATH, ``synthetic`` -> None, anything else -> ValueError."""
    if value == "synthetic":
        return None
    if value.startswith(prefix + ":") and len(value) > len(prefix) + 1:
        return value[len(prefix) + 1 :]
    raise ValueError(
        f"--{flag}={value!r} must be 'synthetic' or {prefix}:PATH, e.g. --{flag} {prefix}:"
        + ("models/my-llm" if prefix == "hf" else "data/chats.jsonl")
    )


def check_args(args: argparse.Namespace) -> None:
    """Bad flags -> ValueError naming the flag, its value and the fix.

    Also fills in the defaults that depend on other flags (``num_samples``,
    ``mask_prompt``, ``text_key``, ``dtype``) and sets ``model_dir`` / ``jsonl_path``
    (``None`` for the synthetic source).
    """
    if args.out is None and not args.plan:
        raise ValueError(
            "--out is required: pass the cache directory, e.g. --out runs/cache (or --plan to cost it)"
        )
    if args.json and not args.plan:
        raise ValueError("--json applies to --plan only: add --plan, or drop --json")
    for name in (
        "min_len",
        "max_len",
        "shard_size",
        "batch_size",
        "topk",
        "cp",
        "pack_seq_len",
        "plan_batch_size",
    ):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError(f"--num-samples={args.num_samples} must be >= 1")
    if args.hidden_codec != "none" and args.layout != "ragged":
        raise ValueError(
            f"--hidden-codec {args.hidden_codec} needs --layout ragged (codecs apply to ragged token keys); "
            "drop --layout padded"
        )
    args.model_dir = _source_path("target", args.target, "hf")
    args.jsonl_path = _source_path("data", args.data, "jsonl")
    if args.model_dir is None and args.jsonl_path is not None:
        raise ValueError(
            f"--data {args.data} needs --target hf:DIR: text is tokenized with the model's "
            "tokenizer, and the synthetic target has none"
        )
    if args.model_dir is not None and args.jsonl_path is None:
        raise ValueError(
            f"--target {args.target} needs --data jsonl:PATH (real text: synthetic token ids "
            "mean nothing to a real model); try --data jsonl:examples/data/sample_chat.jsonl "
            "--messages-key messages"
        )
    if args.model_dir is None:
        hf_only = ("text_key", "messages_key", "tokenizer", "dtype", "layers")
        given = [f"--{n.replace('_', '-')}" for n in hf_only if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --target hf:DIR --data jsonl:PATH only")
        cfg = TargetConfig()
        if args.topk > cfg.vocab_size:
            raise ValueError(
                f"--topk={args.topk} exceeds the vocabulary ({cfg.vocab_size}); use --topk <= {cfg.vocab_size}"
            )
        args.num_samples = 1024 if args.num_samples is None else args.num_samples
        args.mask_prompt = True if args.mask_prompt is None else args.mask_prompt
    else:
        if args.text_key is not None and args.messages_key is not None:
            raise ValueError(
                f"--text-key={args.text_key!r} and --messages-key={args.messages_key!r}: pass one "
                "(plain text or chat messages per line)"
            )
        if args.messages_key is None:
            args.text_key = args.text_key or "text"
            if args.mask_prompt:
                raise ValueError(
                    "--mask-prompt needs --messages-key: plain text (--text-key) has no prompt, "
                    "every token is supervised"
                )
            args.mask_prompt = False
        elif args.mask_prompt is None:
            args.mask_prompt = True
        args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
        parse_layers(args.layers)
    m = pad_to_multiple_for(args.cp)
    padded = -(-args.max_len // m) * m
    if args.pack_seq_len % m or padded > args.pack_seq_len:
        raise ValueError(
            f"--pack-seq-len={args.pack_seq_len} must be a multiple of 2*cp={m} and hold the longest "
            f"sample padded to that multiple ({padded} slots for --max-len={args.max_len}); use "
            f"--pack-seq-len {max(padded, -(-args.pack_seq_len // m) * m)}"
        )


def packing_options(args: argparse.Namespace) -> dict[str, Any]:
    """The packing a cache is checked for (the trainer refuses another)."""
    return {
        "cp_size": args.cp,
        "pad_to_multiple_of": pad_to_multiple_for(args.cp),
        "pack_seq_len": args.pack_seq_len,
    }


def producer_options(args: argparse.Namespace, cfg: TargetConfig) -> dict:
    """Everything that shaped the stored tensors of the synthetic source, recorded in the manifest."""
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
        **packing_options(args),
    }


#: what a source hands produce_cache: dataset, batch -> rows, manifest options, keys
Source = tuple[Any, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], dict, tuple]


def synthetic_source(args: argparse.Namespace, device: torch.device) -> Source:
    """Generated tokens through the seeded target transformer."""
    cfg = TargetConfig(seed=args.target_seed)
    target = TargetTransformer(cfg).to(device)
    data = SyntheticTokens(
        args.num_samples, args.min_len, args.max_len, cfg.vocab_size, seed=args.data_seed
    )

    def compute_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"].to(device, non_blocking=True)
        lens = batch["seq_len"].to(device, non_blocking=True)
        return target.supervision(ids, lens, args.topk, args.mask_prompt)

    return data, compute_batch, producer_options(args, cfg), KEYS


def hf_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(dataset, source)``: the JSONL samples tokenized as the producer stores them."""
    from ep_cp.hf_target import check_model_dir
    from ep_cp.jsonl_data import JsonlSource, build_jsonl_dataset, load_tokenizer

    check_model_dir(args.model_dir, f"--target {args.target}")
    tok_dir = args.tokenizer or args.model_dir
    tokenizer = load_tokenizer(
        tok_dir, "--tokenizer" if args.tokenizer else f"--target {args.target}"
    )
    source = JsonlSource(os.path.abspath(args.jsonl_path), args.text_key, args.messages_key)
    data = build_jsonl_dataset(source, tokenizer, args.max_len, args.num_samples, args.mask_prompt)
    return data, source


def check_vocab(args: argparse.Namespace, data: Any, vocab_size: int) -> None:
    """Refuse a top-k or a tokenizer that does not fit the model's ``vocab_size`` rows."""
    if args.topk > vocab_size:
        raise ValueError(
            f"--topk={args.topk} exceeds the vocabulary of {args.model_dir} ({vocab_size}); "
            f"use --topk <= {vocab_size}"
        )
    if data.max_token_id() >= vocab_size:
        raise ValueError(
            f"the tokenizer of {args.tokenizer or args.model_dir} produces token id {data.max_token_id()}, "
            f"but the model {args.model_dir} has {vocab_size} vocabulary rows; use the model's own "
            "tokenizer (leave out --tokenizer, or point it at a tokenizer of this model)"
        )


def hf_options(
    args: argparse.Namespace, data: Any, source: Any, target: dict[str, Any], layers: list[int]
) -> dict:
    """The manifest options of ``--target hf:``: the target's record (``target``) and the data's."""
    options = {
        "producer": PRODUCER,
        "target": target,
        "topk": args.topk,
        "mask_prompt": bool(args.mask_prompt),
        "data": {
            "kind": "jsonl",
            "path": source.path,
            "text_key": source.text_key,
            "messages_key": source.messages_key,
            "tokenizer": os.path.abspath(args.tokenizer or args.model_dir),
            "num_samples": len(data),
            "max_len": args.max_len,
            "truncated": data.truncated,
            "tokens_sha256": data.digest,
        },
        **packing_options(args),
    }
    if layers:
        options["layers"] = layers
    return options


def hf_source(args: argparse.Namespace, device: torch.device) -> Source:
    """JSONL text, tokenized with the model's tokenizer, through a Hugging Face model."""
    from ep_cp.hf_target import HFTarget

    # The data first: a bad line is reported before a large model is loaded.
    data, source = hf_data(args)
    target = HFTarget(args.model_dir, args.dtype, device, parse_layers(args.layers))
    check_vocab(args, data, target.vocab_size)
    options = hf_options(args, data, source, target.describe(), target.layers)
    keys = (*KEYS, LAYER_KEY) if target.layers else KEYS

    def compute_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return target.supervision(
            batch["input_ids"], batch["seq_len"], batch["loss_mask"], args.topk
        )

    return data, compute_batch, options, keys


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """How the cache stores its tensors (recorded, so the recorded command rebuilds the same bytes)."""
    return {
        "layout": args.layout,
        "hidden_codec": args.hidden_codec,
        "compact_dtypes": bool(args.compact_dtypes),
    }


def ragged_keys(keys: tuple) -> tuple[str, ...]:
    """The per-token keys of ``keys``: stored ragged by ``--layout ragged``."""
    return tuple(k for k in keys if k in ("input_ids", *TOKEN_KEYS, LAYER_KEY))


def storage_layout(
    args: argparse.Namespace, keys: tuple, vocab_size: int
) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(token_keys, codecs)`` for ``produce_cache``: every per-token key ragged unless --layout padded;
    with --compact-dtypes the top-k ids in the narrowest width that holds ``vocab_size``."""
    if args.layout == "padded":
        return (), {}
    token_keys = ragged_keys(keys)
    codec = (
        {}
        if args.hidden_codec == "none"
        else {k: args.hidden_codec for k in ("hidden", LAYER_KEY) if k in keys}
    )
    if args.compact_dtypes:
        codec["topk_indices"] = f"topk_index:{vocab_size}"
    return token_keys, codec


def compact(compute_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]):
    """``compute_batch`` storing log-probs as bfloat16 and ids as int32 (every example vocabulary fits)."""

    def wrapped(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(compute_batch(batch))
        return {**out, **{k: out[k].to(dtype) for k, dtype in COMPACT_DTYPES.items()}}

    return wrapped


def print_plan(args: argparse.Namespace) -> int:
    """``--plan``: the cache's cost in every layout (te_thd.offline_cache.tools.plan), nothing computed.

    The samples are read as the producer reads them; the stored keys and their shapes are
    :func:`ep_cp.cache_format.stored_schema` of the target's sizes (``config.json`` of ``hf:DIR``).
    """
    from te_thd.offline_cache.tools.plan import CacheSpec, format_plan, plan_cache, plan_json

    if args.model_dir is None:
        cfg = TargetConfig(seed=args.target_seed)
        data = SyntheticTokens(
            args.num_samples, args.min_len, args.max_len, cfg.vocab_size, seed=args.data_seed
        )
        lengths, hidden_size, layers, vocab_size = (
            data.seq_len.numpy(),
            cfg.hidden_size,
            [],
            cfg.vocab_size,
        )
        options = producer_options(args, cfg)
    else:
        from ep_cp.hf_target import check_layers, describe_config, load_config, text_dims

        data, source = hf_data(args)
        config = load_config(args.model_dir)
        num_layers, hidden_size, vocab_size = text_dims(config)
        layers = parse_layers(args.layers)
        check_layers(layers, num_layers, args.model_dir)
        check_vocab(args, data, vocab_size)
        target = describe_config(os.path.abspath(args.model_dir), config, args.dtype, vocab_size)
        options = hf_options(args, data, source, target, layers)
        lengths = data.offsets[1:] - data.offsets[:-1]
    schema = stored_schema(args.max_len, args.topk, hidden_size, len(layers), args.compact_dtypes)
    options = {**options, "storage": storage_options(args)}
    options = {
        **options,
        "producer_args": producer_args({**options, "shard_size": args.shard_size}),
    }
    spec = CacheSpec(schema, ragged_keys(tuple(schema)), args.shard_size, args.cp, length_key="seq_len",
                     codec_keys=CODEC_KEYS, options=options, format_version=FORMAT_VERSION,
                     pack_seq_len=args.pack_seq_len, batch_size=args.plan_batch_size,
                     vocab_size=vocab_size)  # fmt: skip
    costs = plan_cache(lengths, spec)
    # the column of what these flags produce: padded, or ragged with exactly the codecs they pick
    _, codecs = storage_layout(args, tuple(schema), vocab_size)
    ragged = [c.name for c in costs[1:] if c.codecs == codecs]
    produced = "padded" if args.layout == "padded" else (ragged or [None])[0]
    if args.json:
        print(json.dumps(plan_json(costs, spec, lengths, produced), indent=2))
    else:
        print(format_plan(costs, spec, lengths, produced))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plan:
        try:
            check_args(args)
            return print_plan(args)
        except USER_ERRORS as exc:  # a question about flags: a bad one exits 2, as argparse's do
            raise UsageError(str(exc)) from None
    check_args(args)
    check_device(args.device)  # before any CUDA call: one line, not a traceback per rank
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

    build = synthetic_source if args.model_dir is None else hf_source
    data, compute_batch, options, keys = build(args, device)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    if rank == 0 and getattr(data, "truncated", 0):
        print(
            f"note: {data.truncated} of {len(data)} samples are longer than --max-len="
            f"{args.max_len} tokens and were truncated",
            flush=True,
        )

    token_keys, codecs = storage_layout(args, keys, int(options["target"]["vocab_size"]))
    options = {**options, "storage": storage_options(args)}
    options = {
        **options,
        "producer_args": producer_args({**options, "shard_size": args.shard_size}),
    }
    compute_batch = compact(compute_batch) if args.compact_dtypes else compute_batch
    t0 = time.perf_counter()
    manifest = produce_cache(
        loader,
        args.out,
        shard_size=args.shard_size,
        compute_batch=compute_batch,
        keys=keys,
        options=options,
        format_version=FORMAT_VERSION,
        cache_name=CACHE_NAME,
        producer_name=f"`{producer_command(args.out, {**options, 'shard_size': args.shard_size})}`",
        progress=None,  # tqdm on rank 0 when stderr is a terminal
        # each sample's real length, recorded in the manifest for balanced loading
        length_key="seq_len" if "seq_len" in keys else None,
        token_keys=token_keys,
        codecs=codecs,
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
    sys.exit(run_main(main))
