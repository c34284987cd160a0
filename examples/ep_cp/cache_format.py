"""What the example's offline cache holds, shared by the producer and the trainer.

One cache row per sample, right-padded to ``max_len`` tokens:

==================  ===============  =========================================
key                 dtype, shape     meaning
==================  ===============  =========================================
``input_ids``       int64 ``[L]``    tokens (0 on padding)
``seq_len``         int64 ``[]``     real length
``loss_mask``       bool ``[L]``     supervised tokens (the prompt is masked
                                     when ``mask_prompt``)
``topk_logprobs``   float32 ``[L,K]``  target's top-k next-token log-probs
``topk_indices``    int32 ``[L,K]``    their vocabulary ids
``hidden``          bf16 ``[L,H]``     target's final hidden states
``layer_hidden``    bf16 ``[L,n,H]``   only with ``--layers``: the hidden states
                                     of the ``n`` chosen layers, in the order
                                     of the manifest's ``layers``
==================  ===============  =========================================

Padding slots hold zeros in every key. ``precompute_cache.py`` stores every per-token key
(``input_ids`` too) ragged by default (``--layout ragged``: only the real tokens are on
disk; every reader still returns the rows above), ``--hidden-codec fp8_e4m3`` stores
``hidden`` / ``layer_hidden`` as fp8 with a float32 scale per token (read back as bf16),
and ``--compact-dtypes`` stores ``topk_logprobs`` as bf16 and ``input_ids`` as int32. The
manifest's ``storage`` option records the choice. ``hidden`` is the state the target's output
head reads (Hugging Face's ``hidden_states[-1]``); ``layer_hidden[:, j]`` is
``hidden_states[layers[j]]`` (0 = embedding output, ``i`` = after decoder layer
``i``) -- EAGLE-3's auxiliary states; ``reshape(L, n * H)`` gives their concatenation.
The manifest's ``target`` records ``vocab_size`` and ``hidden_size``, ``topk`` the
``K`` above: the trainer sizes its student from them (:func:`cache_dims`).

The manifest records the producer options below; the trainer refuses a cache
whose options differ from its own (``ensure_supervision_options_match``),
including the packing it was produced for: ``cp_size`` fixes the pad multiple
``2*cp`` of every document, and the producer checked that every sample fits a
packed row of ``pack_seq_len`` slots at that multiple.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from te_thd.offline_cache.format.schema import TensorSpec

CACHE_NAME = "ep_cp_distill"
FORMAT_VERSION = 1
PRODUCER = "examples/precompute_cache.py"
#: the producer script where it is now, for commands that must run from any directory
PRODUCER_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "precompute_cache.py"
)
KEYS = ("input_ids", "seq_len", "loss_mask", "topk_logprobs", "topk_indices", "hidden")
#: hidden states of the layers chosen with ``--layers`` (not read by the trainer)
LAYER_KEY = "layer_hidden"
#: per-token supervision the trainer packs alongside the ids
TOKEN_KEYS = ("loss_mask", "topk_logprobs", "topk_indices", "hidden")
#: each key's stored dtype (:func:`ep_cp.supervision.cache_rows` casts to it)
DTYPES = {
    "input_ids": torch.int64, "seq_len": torch.int64, "loss_mask": torch.bool, "topk_logprobs": torch.float32,
    "topk_indices": torch.int32, "hidden": torch.bfloat16, LAYER_KEY: torch.bfloat16,
}  # fmt: skip
#: what ``--compact-dtypes`` stores instead (the trainer reads them back as DTYPES)
COMPACT_DTYPES = {"topk_logprobs": torch.bfloat16, "input_ids": torch.int32}
#: the keys a codec may take: the hidden states (``--hidden-codec``) and the top-k ids
CODEC_KEYS = ("hidden", LAYER_KEY, "topk_indices")


def stored_schema(
    max_len: int, topk: int, hidden_size: int, num_layers: int = 0, compact_dtypes: bool = False
) -> dict[str, TensorSpec]:
    """``{key: TensorSpec}`` of the cache's rows (the table above): what the producer stores for
    ``--max-len``, ``--topk``, the target's hidden size and ``num_layers`` chosen with ``--layers``."""
    shapes = {
        "input_ids": (max_len,), "seq_len": (), "loss_mask": (max_len,), "topk_logprobs": (max_len, topk),
        "topk_indices": (max_len, topk), "hidden": (max_len, hidden_size),
    }  # fmt: skip
    if num_layers:
        shapes[LAYER_KEY] = (max_len, num_layers, hidden_size)
    dtypes = {**DTYPES, **COMPACT_DTYPES} if compact_dtypes else DTYPES
    return {k: TensorSpec(dtypes[k], shape) for k, shape in shapes.items()}


#: options that change the stored supervision or the packing it was validated for
CHECKED_OPTIONS = ("mask_prompt", "topk", "cp_size", "pad_to_multiple_of", "pack_seq_len")


@dataclass(frozen=True)
class CacheDims:
    """The sizes a student must have to train on a cache."""

    vocab_size: int  # rows of the target's output head: every cached top-k id is below it
    hidden_size: int  # width of the cached ``hidden``
    topk: int  # next-token candidates per position


def cache_dims(manifest: Mapping[str, Any], cache_dir: str) -> CacheDims:
    """Read the student's sizes from a manifest, checked against the stored schema.

    Raises ValueError when the manifest's ``target`` / ``topk`` are missing or disagree
    with the shapes of the stored ``hidden`` / ``topk_logprobs`` (a hand-edited or
    foreign manifest).
    """
    target, topk = manifest.get("target"), manifest.get("topk")
    if not isinstance(target, Mapping) or not isinstance(topk, int):
        raise ValueError(
            f"the cache at {cache_dir} does not record its target's sizes (manifest 'target' / "
            f"'topk'); rebuild it with {PRODUCER}"
        )
    dims = CacheDims(int(target["vocab_size"]), int(target["hidden_size"]), topk)
    schema = manifest.get("schema")  # {key: {"dtype", "shape"}}, checked by read_manifest
    if isinstance(schema, Mapping):
        stored = (schema["hidden"]["shape"][-1], schema["topk_logprobs"]["shape"][-1])
        if stored != (dims.hidden_size, dims.topk):
            raise ValueError(
                f"the cache at {cache_dir} stores hidden width {stored[0]} and top-{stored[1]}, "
                f"but its manifest records hidden_size={dims.hidden_size}, topk={dims.topk}; "
                f"the manifest does not describe these shards: rebuild the cache with {PRODUCER}"
            )
    return dims


def check_student_fits(student: Mapping[str, Any], dims: CacheDims, where: str) -> None:
    """Refuse a student (a ``StudentConfig`` dict) sized for another cache's target.

    ``where`` names the student's origin (a checkpoint) in the message.
    """
    have = (int(student["vocab_size"]), int(student["target_hidden_size"]))
    if have != (dims.vocab_size, dims.hidden_size):
        raise ValueError(
            f"{where} holds a student for a target with vocabulary {have[0]} and hidden size "
            f"{have[1]}, but this cache's target has vocabulary {dims.vocab_size} and hidden "
            f"size {dims.hidden_size}: train on the cache it was trained on, or start a new run "
            "in another --out directory"
        )


#: The place of the output directory in :func:`producer_args` (te_thd's manifest convention).
CACHE_DIR = "{cache_dir}"


def producer_args(manifest: Mapping[str, Any] | None = None, **flags: Any) -> list[str]:
    """The ``precompute_cache.py`` arguments that build the cache ``manifest`` describes, ``--out``
    given as :data:`CACHE_DIR`.

    Every option the manifest records becomes its flag, so the command rebuilds the
    same cache (or, into the cache's own directory, recomputes its missing shards).
    ``flags`` override single flags, e.g. ``cp=4`` for a cache packed for another CP
    size. Without a manifest (a damaged one) only ``--out`` and ``flags`` are given.
    The producer records them in the manifest (``producer_args``), so te_thd's own
    messages about the cache print the exact command.
    """
    m = dict(manifest or {})
    if "mask_prompt" in flags:
        m["mask_prompt"] = flags.pop("mask_prompt")
    data = m.get("data") if isinstance(m.get("data"), Mapping) else {}
    target = m.get("target") if isinstance(m.get("target"), Mapping) else {}
    opts: dict[str, Any] = {
        "shard-size": m.get("shard_size"),
        "topk": m.get("topk"),
        "cp": m.get("cp_size"),
        "pack-seq-len": m.get("pack_seq_len"),
        "max-len": data.get("max_len"),
        "num-samples": data.get("num_samples"),
    }
    if data.get("kind") == "jsonl":
        opts.update({"data": f"jsonl:{data.get('path')}", "text-key": data.get("text_key"),
                     "messages-key": data.get("messages_key"), "tokenizer": data.get("tokenizer")})  # fmt: skip
    else:
        opts.update({"min-len": data.get("min_len"), "data-seed": data.get("seed")})
    if target.get("kind") == "hf":
        opts.update({"target": f"hf:{target.get('path')}", "dtype": target.get("dtype")})
        if m.get("layers"):
            opts["layers"] = ",".join(str(x) for x in m["layers"])
    elif "seed" in target:
        opts["target-seed"] = target["seed"]
    storage = m.get("storage") if isinstance(m.get("storage"), Mapping) else {}
    opts.update({"layout": storage.get("layout"), "hidden-codec": storage.get("hidden_codec")})
    opts.update({k.replace("_", "-"): v for k, v in flags.items()})
    argv = ["--out", CACHE_DIR]
    for name, value in opts.items():
        if value is not None:
            argv += [f"--{name}", str(value)]
    if isinstance(m.get("mask_prompt"), bool):
        argv.append("--mask-prompt" if m["mask_prompt"] else "--no-mask-prompt")
    if storage.get("compact_dtypes"):
        argv.append("--compact-dtypes")
    return argv


def producer_command(out: str, manifest: Mapping[str, Any] | None = None, **flags: Any) -> str:
    """The shell line that runs :func:`producer_args` into ``out``, with this interpreter (which has torch).

    The script and a local ``out`` are absolute paths, so the line works from any directory.
    """
    out = out if "://" in out else os.path.abspath(out)
    args = [out if a == CACHE_DIR else a for a in producer_args(manifest, **flags)]
    return shlex.join([sys.executable, PRODUCER_PATH, *args])
