"""A tiny Hugging Face model directory built in-process: nothing to download.

``make_tiny_model_dir`` trains a byte-level BPE tokenizer with ``tokenizers`` on the
texts of a JSONL file, gives it a ChatML chat template, builds a small randomly
initialised causal LM of a real architecture (``LlamaForCausalLM`` or
``Qwen2ForCausalLM``) from a ``transformers`` config and saves both with
``save_pretrained`` -- a directory shaped like any model snapshot, for trying
``precompute_cache.py --target hf:DIR`` without a checkpoint, and for the tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

from ep_cp.hf_target import import_transformers

#: a ChatML template (the Qwen family's), with a generation prompt
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<pad>", "<s>", "<|im_start|>", "<|im_end|>")
ARCHITECTURES = ("llama", "qwen2")


def corpus_texts(jsonl_path: str) -> Iterator[str]:
    """Every string of every line of a JSONL file (texts and message contents)."""

    def strings(x: Any) -> Iterator[str]:
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)

    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield from strings(json.loads(line))


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` (BOS ``<s>``, ChatML specials, template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    transformers = import_transformers()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
            ),
        ]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, tokenizer: Any) -> Any:
    """A small config of a real architecture (4 layers, hidden 48, grouped-query attention)."""
    transformers = import_transformers()
    common = dict(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Wider than the usual 0.02 so the random model's next-token distribution is not
        # flat: the top-k then carries a real signal for the student.
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    raise ValueError(f"--arch={arch!r} must be one of {ARCHITECTURES}")


def make_tiny_model_dir(out: str, arch: str, corpus_jsonl: str, seed: int = 0) -> str:
    """Save a tiny ``arch`` model and its tokenizer (trained on ``corpus_jsonl``) to ``out``.

    The model's vocabulary is the tokenizer's rounded up to a multiple of 64, as real
    checkpoints pad it: the LM head has rows no token id reaches.
    """
    transformers = import_transformers()
    tokenizer = train_tokenizer(list(corpus_texts(corpus_jsonl)), vocab_size=600)
    vocab = -(-len(tokenizer) // 64) * 64
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, vocab, tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
