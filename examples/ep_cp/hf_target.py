"""A Hugging Face causal LM from a local directory as the frozen target.

``AutoModelForCausalLM.from_pretrained(DIR, local_files_only=True)`` -- Llama, Qwen,
Mistral, GPT-style: any model ``transformers`` can build from its ``config.json``.
Nothing is downloaded. For a right-padded batch it produces what the synthetic target
produces (:func:`ep_cp.supervision.cache_rows`): the top-k of the next-token
distribution and the final hidden states -- ``hidden_states[-1]`` of the model's
``output_hidden_states``, the state its LM head reads -- plus, on request, the hidden
states of chosen layers (EAGLE-3's auxiliary states).

``transformers`` comes with the ``examples`` extra (``pip install -e '.[examples]'``);
it is imported here only, never by ``te_thd``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ep_cp.supervision import cache_rows

#: ``--dtype`` names -> the dtype the model's weights are loaded in
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INSTALL_HINT = "pip install -e '.[examples]'"


def import_transformers() -> Any:
    """``transformers`` with its progress bars and info logs off, or a clear ImportError."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"a Hugging Face target or JSONL data needs transformers ({exc}); install the "
            f"examples extra: {INSTALL_HINT}"
        ) from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def check_model_dir(path: str, flag: str) -> str:
    """Absolute ``path`` if it holds a saved model's ``config.json``; else a ValueError."""
    full = os.path.abspath(path)
    if not os.path.isfile(os.path.join(full, "config.json")):
        what = "does not exist" if not os.path.exists(full) else "has no config.json"
        raise ValueError(
            f"{flag}: {path} {what}; pass the directory of a Hugging Face model on disk (what "
            "save_pretrained() writes or a downloaded model snapshot: config.json, weights, "
            "tokenizer files)"
        )
    return full


def parse_layers(spec: str | None) -> list[int]:
    """``--layers "2,5,8"`` -> ``[2, 5, 8]``: indices into Hugging Face's ``hidden_states``.

    Index 0 is the embedding output, ``i`` the output of decoder layer ``i`` (counting
    from 1), ``num_hidden_layers`` the final (normalised) state; the range is checked
    against the model by :class:`HFTarget`. ``None`` / ``""`` -> ``[]``.
    """
    if not spec:
        return []
    try:
        layers = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"--layers={spec!r} must be comma-separated layer indices, e.g. --layers 2,5,8"
        ) from None
    if len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(
            f"--layers={spec!r} must list distinct indices >= 0 (0 = the embedding output), "
            "e.g. --layers 2,5,8"
        )
    return layers


def _text_config(config: Any) -> Any:
    # Multimodal configs nest the language model's sizes in a text config.
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_config(path: str) -> Any:
    """The model's ``config.json`` as ``transformers`` reads it (no weights are loaded)."""
    full = check_model_dir(path, f"--target hf:{path}")
    return import_transformers().AutoConfig.from_pretrained(full, local_files_only=True)


def text_dims(config: Any) -> tuple[int, int, int]:
    """``(num_hidden_layers, hidden_size, vocab_size)`` of the language model of ``config``."""
    text = _text_config(config)
    return int(text.num_hidden_layers), int(text.hidden_size), int(text.vocab_size)


def check_layers(layers: list[int], num_layers: int, path: str) -> None:
    """Refuse ``--layers`` indices outside ``hidden_states`` of a model with ``num_layers`` layers."""
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"--layers {','.join(map(str, layers))}: {bad} out of range for {path}, "
            f"which has {num_layers} layers: indices run from 0 (embedding output) to "
            f"{num_layers} (final hidden state)"
        )


def describe_config(path: str, config: Any, dtype: str, vocab_size: int) -> dict[str, Any]:
    """The manifest's ``target`` record of the model at ``path``: what the trainer sizes its student from."""
    num_layers, hidden_size, _ = text_dims(config)
    return {
        "kind": "hf",
        "path": path,
        "model_type": getattr(config, "model_type", None),
        "architectures": list(getattr(config, "architectures", None) or []),
        "dtype": dtype,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
    }


class HFTarget:
    """A frozen ``AutoModelForCausalLM`` loaded from ``path``.

    Args:
        path: local model directory (``config.json`` + weights).
        dtype: ``"bf16"`` or ``"fp32"``: the dtype the weights are loaded and run in.
        device: where the model runs.
        layers: indices into ``hidden_states`` to store besides the final state
            (:func:`parse_layers`); ``[]`` stores none.
    """

    def __init__(
        self, path: str, dtype: str, device: torch.device, layers: list[int] | None = None
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"--dtype={dtype!r} must be one of {sorted(DTYPES)}")
        self.path = check_model_dir(path, f"--target hf:{path}")
        transformers = import_transformers()
        # transformers >= 4.56 names the argument ``dtype``; older releases ``torch_dtype``.
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            self.path, local_files_only=True, **{dtype_kw: DTYPES[dtype]}
        )
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = device
        self.dtype = dtype
        self.num_layers, self.hidden_size, _ = text_dims(model.config)
        # The LM head's rows, which may exceed the tokenizer's length (padded vocabularies).
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.layers = list(layers or [])
        check_layers(self.layers, self.num_layers, path)

    def describe(self) -> dict[str, Any]:
        """The manifest's ``target`` record: what the trainer sizes its student from."""
        return describe_config(self.path, self.model.config, self.dtype, self.vocab_size)

    @torch.no_grad()
    def supervision(
        self, input_ids: torch.Tensor, seq_len: torch.Tensor, loss_mask: torch.Tensor, topk: int
    ) -> dict[str, torch.Tensor]:
        """The cache rows of a right-padded batch.

        Args:
            input_ids: int64 ``[B, L]``, right-padded (any id on padding).
            seq_len: int64 ``[B]``, real lengths.
            loss_mask: bool ``[B, L]``, the data's supervised tokens.
            topk: next-token candidates kept per position.

        Returns:
            :func:`ep_cp.supervision.cache_rows` (with ``layer_hidden`` bf16
            ``[B, L, len(layers), H]`` when layers were chosen).
        """
        ids = input_ids.to(self.device, non_blocking=True)
        lens = seq_len.to(self.device, non_blocking=True)
        real = torch.arange(ids.shape[1], device=ids.device)[None, :] < lens[:, None]
        # Right padding: position ids count from 0 in every row, and the attention mask
        # keeps real tokens from seeing padding slots, so a sample's outputs do not depend
        # on the batch it was padded into.
        out = self.model(
            input_ids=ids.masked_fill(~real, 0),
            attention_mask=real.long(),
            output_hidden_states=True,
            use_cache=False,
        )
        states = out.hidden_states
        layer_hidden = torch.stack([states[i] for i in self.layers], dim=2) if self.layers else None
        return cache_rows(
            ids, lens, loss_mask.to(self.device), out.logits, states[-1], topk, layer_hidden
        )
