"""``te-thd cache info DIR``, ``te-thd cache verify DIR [--quick]``, ``te-thd cache repair DIR``,
``te-thd cache plan``, ``te-thd cache unlock URL``: what each command does (:func:`run`; their
arguments: ``te_thd._cache_parser``).

Thin shells over :func:`cache_info`, :func:`verify_cache`, :func:`repair_cache` and
:func:`~te_thd.offline_cache.tools.plan.plan_cache` (which reads and writes no cache).
``verify`` reads every shard (checksums of every row, headers, whole files) unless
``--quick`` (sizes only); it exits 0 when the cache is sound, printing what it
checked and what it could not, and 1 with every bad file named (on stderr) when
not. ``repair`` exits 0 when the cache is sound, was reopened for a resume, or its
lost or damaged manifest was rebuilt from the shards.
``info`` exits 1 when the manifest cannot be read. Every command exits 2 when the store
cannot be used as configured (an object store that does not answer, no such bucket,
access denied: ``storage.StorageError``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from te_thd.offline_cache.format.schema import PRODUCE_CACHE_HINT
from te_thd.offline_cache.storage.schemes import open_storage
from te_thd.offline_cache.tools.plan import (
    CacheSpec,
    default_token_keys,
    format_plan,
    human_bytes,
    parse_key,
    plan_cache,
    plan_json,
    read_lengths,
)
from te_thd.offline_cache.tools.repair import REBUILD_ARGS, repair_cache, shard_span
from te_thd.offline_cache.tools.verify import cache_info, verify_cache


class _BadInput(ValueError):
    """A bad argument of a command: its line on stderr, exit status 2."""

    exit_status = 2


def _shards_line(info: dict[str, Any]) -> str:
    """``"3 x 4 samples (the last holds 1)"``: how the samples sit in the shards."""
    n, size, count = info["num_samples"], info["shard_size"], info["num_shards"]
    if count == 0:
        return f"0 (shard_size {size})"
    last = n - (count - 1) * size
    if count == 1:
        return f"1 of {last} samples (shard_size {size})"
    return f"{count} x {size} samples" + (f" (the last holds {last})" if last != size else "")


def format_info(info: dict[str, Any]) -> str:
    """The human-readable text ``te-thd cache info`` prints."""
    lines = [
        f"cache:          {info['cache_dir']}",
        f"format_version: {info['format_version']}",
        "layout_version: "
        + (
            str(info["layout_version"])
            if info["layout_version"] is not None
            else "- (reference manifest: no checksums)"
        ),
        f"samples:        {info['num_samples']}",
        f"shards:         {_shards_line(info)}",
        f"bytes:          {info['bytes']} ({human_bytes(info['bytes'])})",
        f"checksum:       {info['checksum'] or '-'}",
        "keys:",
    ]
    for key, spec in info["schema"].items():
        shape = ", ".join(["n", *map(str, spec["shape"])])
        line = f"  {key:<20} {spec['dtype']:<10} [{shape}]"
        stored = info.get("storage", {}).get(key, "rows")
        if stored != "rows":
            line += f"  {stored}"
        fid = info.get("fidelity", {}).get(key)
        if fid is not None:
            line += (
                f"; relative L2 error per token: max {fid['max_rel_l2']:.2e}, mean "
                f"{fid['mean_rel_l2']:.2e}"
            )
        lines.append(line)
    lines.append("producer options:" if info["options"] else "producer options: -")
    for k, v in sorted(info["options"].items()):
        lines.append(f"  {k} = {json.dumps(v)}")
    return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
    info = cache_info(args.dir)
    print(json.dumps(info, indent=2, sort_keys=True) if args.json else format_info(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    result = verify_cache(args.dir, deep=not args.quick)
    print(f"OK: {args.dir}: {result['num_samples']} samples in {result['num_shards']} shards")
    for line in result["checked"]:
        print(f"  checked: {line}")
    for line in result["not_checked"]:
        print(f"  NOT checked: {line}")
    print(f"  lengths: {result['lengths']}")
    if result["not_checked"] and not args.quick:
        print(
            "WARNING: parts of this cache cannot be verified (see NOT checked above)",
            file=sys.stderr,
        )
    return 0


def _cmd_repair(args: argparse.Namespace) -> int:
    try:
        options = json.loads(args.options) if args.options is not None else None
    except json.JSONDecodeError as exc:
        print(
            f"te-thd cache repair: --options {args.options!r} is not JSON ({exc}); pass "
            "an object, e.g. "
            "--options '{\"cp_size\": 2}'",
            file=sys.stderr,
        )
        return 2
    given = {k: getattr(args, k) for k in REBUILD_ARGS}  # argparse's dest of each flag
    result = repair_cache(args.dir, **{**given, "options": options})
    for note in result["notes"]:
        print(f"note: {note}")
    if result["removed"]:
        print(f"removed: {len(result['removed'])} temp file(s) a killed writer left")
    # none when the cache was sound; only extra shards when a manifest was rebuilt
    for name, why in result["damaged"].items():
        print(f"set aside: {name}: {why}")
    if result["extra"]:
        print(f"set aside: {shard_span(result['extra'])}: not part of this cache")
    if result["missing"]:
        print(f"missing: {shard_span(result['missing'])}")
    if result["rebuilt"]:
        passed = (
            f" and the arguments ({', '.join(result['from_arguments'])})"
            if result["from_arguments"]
            else ""
        )
        aside = (
            f"; the damaged one is in {result['set_aside_in']}" if result["set_aside_in"] else ""
        )
        print(
            f"rebuilt: {args.dir}: manifest.json written from its shards{passed}, every "
            f"shard verified{aside}"
        )
        return 0
    if not result["reopened"]:
        print(f"OK: {args.dir}: every shard verified; nothing to repair")
        kept = result["kept_aside"]
        if kept is not None:
            print(
                f"kept: {kept['dir']} holds {kept['files']} file(s) "
                f"({human_bytes(kept['bytes'])}) that "
                "earlier repairs set aside for inspection; the cache does not need them: "
                f"{kept['remove']}"
            )
        return 0
    where = f" (moved to {result['set_aside_in']})" if result["set_aside_in"] else ""
    # the produce_cache hint says itself that it computes only the missing shards
    then = (
        "it writes the manifest"
        if result["producer"] == PRODUCE_CACHE_HINT
        else ("it recomputes only these shards and writes the manifest")
    )
    print(f"{args.dir} is reopened for a resume{where}: re-run {result['producer']}; {then}.")
    return 0


def _cmd_unlock(args: argparse.Namespace) -> int:
    try:
        storage = open_storage(args.dir, "dir")
    except ValueError as exc:
        raise _BadInput(str(exc)) from None
    # a CacheError (exit 1, or the store's exit_status): no lock to remove here (a local
    # directory's flock; a holder that runs on this host), no cache at the path, or a store that
    # cannot be used
    holder = storage.unlock()
    print(
        f"removed the producer lock of {storage.name} (held by {holder})"
        if holder is not None
        else f"{storage.name} has no producer lock; nothing to remove"
    )
    return 0


def _key_list(text: str | None) -> tuple[str, ...] | None:
    """The keys of a ``K1,K2`` flag (``None``: the flag was not given)."""
    return None if text is None else tuple(k for k in text.split(",") if k)


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        if args.lengths is None or not args.key:
            raise ValueError(
                "pass --lengths FILE with a --key NAME=DTYPE[:SHAPE] per stored key (any "
                "producer's "
                "cache), or the example producer's flags, e.g. --num-samples 1024 (see "
                "te-thd cache "
                "plan --help)"
            )
        for flag, value, meaning in (
            ("--max-len", args.max_len, "the padded length L of the token keys"),
            ("--shard-size", args.shard_size, "samples per shard, e.g. --shard-size 128"),
            ("--cp", args.cp, "the context-parallel size of training, e.g. --cp 2"),
            ("--pack-seq-len", args.pack_seq_len, "the packed row length S of training"),
            ("--batch-size", args.batch_size, "samples per training batch"),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag}={value} must be >= 1: {meaning}")
        try:
            with open(args.lengths, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"--lengths {args.lengths}: cannot be read ({exc.__class__.__name__}: "
                f"{exc}); pass a text "
                "file with one length per line"
            ) from None
        lengths = read_lengths(text, f"--lengths {args.lengths}")
        max_len = args.max_len if args.max_len is not None else int(lengths.max())
        schema = dict(parse_key(k, max_len) for k in args.key)
        if len(schema) != len(args.key):
            raise ValueError(
                f"--key names a key twice ({[k.partition('=')[0] for k in args.key]}); "
                "give each key once"
            )
        listed, codec_keys = _key_list(args.token_keys), _key_list(args.codec_keys)
        token_keys = default_token_keys(schema, max_len) if listed is None else listed
        named = [("--length-key", args.length_key), ("--input-key", args.input_key)]
        named += [("--token-keys", k) for k in listed or ()]
        named += [("--codec-keys", k) for k in codec_keys or ()]
        for flag, value in named:
            if value is not None and value not in schema:
                raise ValueError(
                    f"{flag}: {value!r} is not a --key ({sorted(schema)}); name one of them"
                )
        if token_keys and args.length_key is None and "input_ids" not in schema:
            raise ValueError(
                "--length-key: none given and no --key input_ids, but a ragged layout "
                "stores each sample's "
                "real tokens: pass --length-key KEY naming the key that holds each length"
            )
        spec = CacheSpec(
            schema,
            token_keys,
            args.shard_size,
            args.cp,
            length_key=args.length_key,
            input_key=args.input_key or "input_ids",
            pack_seq_len=args.pack_seq_len,
            codec_keys=codec_keys,
            batch_size=args.batch_size,
            vocab_size=args.vocab_size,
            strategy=args.cp_strategy,
        )
        costs = plan_cache(lengths, spec)
    except ValueError as exc:  # the library names its argument; the flag is named here
        raise _BadInput(str(exc).replace("pack_seq_len=", "--pack-seq-len=")) from None
    print(
        json.dumps(plan_json(costs, spec, lengths), indent=2)
        if args.json
        else format_plan(costs, spec, lengths)
    )
    return 0


#: ``te-thd cache <command>``: the function that runs it (its arguments: ``te_thd._cache_parser``)
#: and what its error line says before the error
COMMANDS = {
    "info": (_cmd_info, ""),
    "verify": (_cmd_verify, "FAILED: "),
    "repair": (_cmd_repair, "cannot repair {dir}: "),
    "plan": (_cmd_plan, ""),
    "unlock": (_cmd_unlock, ""),
}


def run(args: argparse.Namespace) -> int:
    """Run the ``te-thd cache`` command ``args.cache_command`` with its parsed arguments; the exit
    status: a failure prints one line on stderr and exits 1 (a :class:`CacheError` is a
    ``ValueError``, a bad URL too), 2 when the store as configured cannot be used (its
    ``exit_status``) or on a bad argument."""
    command, first = COMMANDS[args.cache_command]
    try:
        return command(args)
    except (ValueError, ImportError) as exc:
        print(
            f"te-thd cache {args.cache_command}: {first.format_map(vars(args))}{exc}",
            file=sys.stderr,
        )
        return getattr(exc, "exit_status", 1)
