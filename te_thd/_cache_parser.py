"""The arguments of ``te-thd cache info / verify / repair / plan / unlock``, and the call that runs
them.

Apart from :mod:`te_thd.offline_cache.tools.cli`, which runs the commands: that imports the cache,
and with it torch, which ``te-thd cache --help`` and a bad argument must not wait for.
"""

from __future__ import annotations

import argparse

#: the help of --length-key, which repair and plan both take
_LENGTH_KEY_HELP = "the producer's length_key (default: input_ids when stored)"
#: what a command's DIR may be
_DIR_HELP = "s3://bucket/prefix or msc://profile/path"
#: samples per shard when --shard-size is not given: the example producer's default too
DEFAULT_SHARD_SIZE = 128
#: ``te-thd cache plan`` flags of the example producer's route: any of them runs
#: ``examples/precompute_cache.py --plan`` (with its help text, shown in ``cache plan --help``)
PRODUCER_FLAGS = {
    "--target": (
        "synthetic|hf:DIR",
        "frozen target (default: synthetic); hf:DIR's config.json gives the shapes",
    ),
    "--data": (
        "synthetic|jsonl:PATH",
        "samples (default: synthetic), tokenized as the producer does",
    ),
    "--num-samples": (
        "N",
        "synthetic samples, or the first lines of --data jsonl: (default: 1024 / all)",
    ),
    "--compact-dtypes": (None, "plan the producer's compact dtypes and its top-k index codec"),
    "--hidden-codec": ("CODEC", "fp8_e4m3: plan the hidden states in fp8 (default: none)"),
    "--layout": ("LAYOUT", "ragged (default) or padded: the layout the producer writes"),
    "--messages-key": ("KEY", "JSONL key of chat messages (prompt tokens masked)"),
    "--text-key": ("KEY", "JSONL key of plain text (default: text)"),
    "--tokenizer": ("DIR", "tokenizer directory (default: the model's)"),
    "--layers": ("I,J", "also plan these hidden states of --target hf:, e.g. 2,5,8"),
    "--topk": ("K", "next-token candidates kept per position (default: 8)"),
    "--min-len": ("N", "shortest synthetic sample (default: 16)"),
    "--plan-batch-size": ("B", "samples per training batch the CP figure packs (default: 16)"),
}
#: ``te-thd cache repair``'s flags for a rebuild from shards that do not record their producer run:
#: ``(flag, type, metavar, help)``; each is ``repair_cache``'s keyword of the same name
_REBUILD_FLAGS = (
    ("--format-version", int, "N", "the format_version the cache's readers pass"),
    (
        "--options",
        str,
        "JSON",
        "the producer options (every manifest field te_thd does not write itself) as a JSON "
        "object; also adds fields to what the shards record",
    ),
    ("--shard-size", int, "N", "samples per shard (a single shard does not tell)"),
    ("--num-samples", int, "N", "samples of the cache, when shards at its end are lost too"),
    ("--length-key", str, "KEY", _LENGTH_KEY_HELP),
)
_PLAN_EXAMPLES = """two ways in (docs/cache-plan.md):

  the example producer's cache, from its own flags (examples/precompute_cache.py --plan of a
  source checkout; any flag of its group above chooses this way):
    te-thd cache plan --num-samples 1024 --compact-dtypes --hidden-codec fp8_e4m3 --cp 2
    te-thd cache plan --target hf:models/my-llm --data jsonl:chats.jsonl --messages-key messages \\
        --max-len 2048 --pack-seq-len 4096 --cp 2

  any producer's cache, from its samples' lengths and its keys:
    te-thd cache plan --lengths lengths.txt --max-len 8192 --key input_ids=int64:L \\
        --key seq_len=int64 --key hidden=bfloat16:L,4096 --length-key seq_len --cp 2
"""


def _run(args: argparse.Namespace) -> int:
    """Run the parsed ``te-thd cache`` command (the cache, and torch, are imported here)."""
    from te_thd.offline_cache.tools.cli import run

    return run(args)


def add_cache_commands(cache: argparse.ArgumentParser) -> None:
    """Register ``info``, ``verify``, ``repair`` and ``unlock`` on the ``te-thd cache`` parser."""
    sub = cache.add_subparsers(dest="cache_command", required=True)
    cache.set_defaults(func=_run)

    info = sub.add_parser(
        "info", help="samples, shards, keys (dtype/shape), bytes, producer options"
    )
    info.add_argument("dir", help=f"cache directory (holds manifest.json), {_DIR_HELP}")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")

    verify = sub.add_parser(
        "verify",
        help="read every shard and check its checksums (exit 0 sound, 1 with the bad shards named)",
    )
    verify.add_argument("dir", help=f"cache directory (holds manifest.json), {_DIR_HELP}")
    depth = verify.add_mutually_exclusive_group()
    depth.add_argument(
        "--quick",
        action="store_true",
        help="only check that every shard exists with its recorded size",
    )
    depth.add_argument("--deep", action="store_true", help="the default (kept for older scripts)")

    repair = sub.add_parser(
        "repair",
        help="set damaged shards aside and reopen the cache so its producer recomputes them; "
        "rebuild a "
        "lost or damaged manifest.json from the shards",
    )
    repair.add_argument("dir", help=f"cache directory (holds the shards), {_DIR_HELP}")
    lost = repair.add_argument_group(
        "rebuilding a manifest from shards that do not record their producer run (repair "
        "names the ones it needs)"
    )
    for flag, kind, metavar, text in _REBUILD_FLAGS:
        lost.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)

    plan = sub.add_parser(
        "plan",
        help="before producing: bytes per sample and in all, shards, each CP rank's reads per "
        "epoch, "
        "padded / ragged / ragged with each codec",
        description="What a cache will cost before anything is computed: bytes per sample and in "
        "all,\n"
        "the manifest, shards, and the bytes each CP rank fetches per epoch, for the padded, the\n"
        "ragged and the ragged layout with each codec (and with them combined), side by side.",
        epilog=_PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--lengths",
        metavar="FILE",
        help=(
            "every sample's real token count, one integer per line ('#' lines and blank "
            "lines skipped)"
        ),
    )
    plan.add_argument(
        "--key",
        action="append",
        metavar="NAME=DTYPE[:SHAPE]",
        help="a stored key and its per-sample shape, L for the padded length; repeat per key, e.g. "
        "--key input_ids=int64:L --key seq_len=int64 --key hidden=bfloat16:L,4096",
    )
    plan.add_argument(
        "--max-len",
        type=int,
        default=None,
        metavar="L",
        help="padded length L (default: the longest sample)",
    )
    plan.add_argument(
        "--token-keys",
        default=None,
        metavar="K1,K2",
        help="keys the ragged layouts store ragged (default: every key shaped [L, ...])",
    )
    plan.add_argument(
        "--codec-keys",
        default=None,
        metavar="K1,K2",
        help="token keys a codec may store (default: every token key it can store)",
    )
    plan.add_argument("--length-key", default=None, metavar="KEY", help=_LENGTH_KEY_HELP)
    plan.add_argument(
        "--input-key",
        default=None,
        metavar="KEY",
        help=(
            "the token ids CachedThdCollator packs, read whole by every CP rank (default: "
            "input_ids)"
        ),
    )
    plan.add_argument(
        "--shard-size",
        type=int,
        default=DEFAULT_SHARD_SIZE,
        metavar="N",
        help=f"samples per shard (default: {DEFAULT_SHARD_SIZE}, both ways in)",
    )
    plan.add_argument(
        "--cp",
        type=int,
        default=1,
        metavar="N",
        help="context-parallel size of training (default: 1)",
    )
    plan.add_argument(
        "--cp-strategy",
        default="dual_chunk_swap",
        choices=("dual_chunk_swap", "no_load_balance"),
        help="the collator's CP partition: dual_chunk_swap (TE's default: chunks r and 2cp-1-r "
        "of every document) or no_load_balance (the r-th contiguous piece of each batch's "
        "stream, no document padded; --pack-seq-len a multiple of --cp)",
    )
    plan.add_argument(
        "--pack-seq-len",
        type=int,
        default=None,
        metavar="S",
        help="packed row length of training: a row's unused tail joins its last sample's CP chunks "
        "(default: each sample alone, padded to 2*cp)",
    )
    plan.add_argument(
        "--batch-size",
        type=int,
        default=16,
        metavar="B",
        help="with --pack-seq-len: samples per training batch, packed together (default: 16)",
    )
    plan.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="V",
        help="the target's vocabulary: plans the top-k index codec on integer token keys "
        "(16 bits an index up to 65,536, 17 up to 131,072, else 32; default: not planned)",
    )
    plan.add_argument("--json", action="store_true", help="print the figures as JSON")
    producer = plan.add_argument_group(
        "the example producer's cache (examples/precompute_cache.py --plan; also takes --max-len, "
        "--shard-size, --cp, --pack-seq-len, --json, and its other flags)"
    )
    # shown here; ``te_thd.cli.main`` hands a command line holding any of them to the producer
    for flag, (metavar, text) in PRODUCER_FLAGS.items():
        if metavar is None:
            producer.add_argument(flag, action="store_true", help=text)
        else:
            producer.add_argument(flag, metavar=metavar, help=text)

    unlock = sub.add_parser(
        "unlock",
        help=(
            "remove the producer lock of an s3:// or msc:// cache whose producer was killed "
            "on another host"
        ),
    )
    unlock.add_argument("dir", help=f"{_DIR_HELP} of the cache")
