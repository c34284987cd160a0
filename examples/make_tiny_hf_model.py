"""Write a tiny Hugging Face model directory to try ``--target hf:DIR`` with no download.

A byte-level BPE tokenizer trained on the JSONL file's texts (with a ChatML chat
template) and a randomly initialised 4-layer Llama or Qwen2 causal LM, saved with
``save_pretrained``::

    python examples/make_tiny_hf_model.py --out runs/tiny-llama
    python examples/precompute_cache.py --target hf:runs/tiny-llama \\
        --data jsonl:examples/data/sample_chat.jsonl --messages-key messages --out runs/hf-cache

Needs the ``examples`` extra (``pip install -e '.[examples]'``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ep_cp.tiny_hf import ARCHITECTURES, make_tiny_model_dir  # noqa: E402

SAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample_chat.jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    p.add_argument("--corpus", default=SAMPLE, help="JSONL file whose texts train the tokenizer")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = p.parse_args(argv)
    make_tiny_model_dir(args.out, args.arch, args.corpus, args.seed)
    print(f"tiny {args.arch} model and tokenizer written to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
