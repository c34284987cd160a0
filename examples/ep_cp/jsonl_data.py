"""Real text in: a JSONL file tokenized into right-padded samples with a loss mask.

One JSON object per line. Two kinds of samples:

* ``--text-key KEY``: ``{"KEY": "plain text"}`` -- tokenized with the tokenizer's own
  special tokens (its BOS, ...); every token is supervised;
* ``--messages-key KEY``: ``{"KEY": [{"role": "user", "content": ...},
  {"role": "assistant", "content": ...}, ...]}`` -- rendered with the tokenizer's
  chat template; only the tokens of assistant turns (their content and the template's
  end-of-turn tokens) are supervised, the prompt tokens are masked.

Samples longer than ``max_len`` tokens are truncated (the tail is dropped). The whole
file is tokenized up front, so a bad line is reported before any forward runs, by its
line number, with what to change.

Loss-mask convention (the synthetic data's too): ``loss_mask[t] = 1`` marks token
``t`` as part of a response; the trainer then distils the target's next-token
distribution *at* ``t``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ep_cp.hf_target import import_transformers


def load_tokenizer(path: str, flag: str) -> Any:
    """``AutoTokenizer`` from a local directory (no download), or a ValueError naming ``flag``."""
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        raise ValueError(f"{flag}: {path} is not a directory; pass a model or tokenizer directory")
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(full, local_files_only=True)
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split())  # transformers' messages span lines
        raise ValueError(
            f"{flag}: no tokenizer could be loaded from {path} ({why}); pass a directory with "
            "tokenizer files (tokenizer.json / tokenizer_config.json) via --tokenizer DIR"
        ) from None


def read_jsonl(path: str, flag: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of every non-blank line of ``path``."""
    if not os.path.isfile(path):
        raise ValueError(
            f"{flag}: {path} does not exist; pass a JSONL file, one JSON object per line"
        )
    rows: list[tuple[int, dict[str, Any]]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{n} is not valid JSON ({exc}); fix or remove the line"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{path}:{n} holds a {type(obj).__name__}, not a JSON object; write one "
                    'object per line, e.g. {"text": "..."}'
                )
            rows.append((n, obj))
    if not rows:
        raise ValueError(
            f"{flag}: {path} is empty (no JSON lines); write one object per line, e.g. "
            '{"text": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}'
        )
    return rows


def _field(path: str, n: int, obj: dict[str, Any], key: str, flag: str) -> Any:
    if key not in obj:
        have = ", ".join(repr(k) for k in obj) or "none"
        raise ValueError(
            f"{path}:{n} has no {key!r} key (its keys: {have}); pass {flag} with the key that "
            "holds the sample"
        )
    return obj[key]


def _no_supervised(path: str, n: int, why: str) -> ValueError:
    return ValueError(f"{path}:{n} has no supervised token: {why}")


def _text_tokens(
    tok: Any, path: str, rows: Sequence[tuple[int, dict[str, Any]]], key: str
) -> list[tuple[list[int], list[bool]]]:
    texts = []
    for n, obj in rows:
        text = _field(path, n, obj, key, "--text-key")
        if not isinstance(text, str):
            raise ValueError(
                f"{path}:{n}: {key!r} holds a {type(text).__name__}; it must be a string"
            )
        if not text.strip():
            raise _no_supervised(path, n, f"its {key!r} is empty; remove the line")
        texts.append(text)
    ids = tok(texts, add_special_tokens=True)["input_ids"]  # one batched (parallel) call
    return [(list(x), [True] * len(x)) for x in ids]


def _render(tok: Any, path: str, n: int, messages: list, generation_prompt: bool) -> str:
    try:
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # jinja errors of arbitrary templates
        raise ValueError(f"{path}:{n}: the tokenizer's chat template failed ({exc})") from None


def _assistant_spans(
    tok: Any, path: str, n: int, messages: list
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    Turn ``i``'s span runs from the end of ``messages[:i]`` rendered with the generation
    prompt to the end of ``messages[:i + 1]``: the reply and the template's end-of-turn
    text. Both renderings must be prefixes of the whole one (true of chat templates
    that render history as it was; checked).
    """
    full = _render(tok, path, n, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tok, path, n, messages[:i], True)) if i else 0
        upto = _render(tok, path, n, messages[: i + 1], False)
        if not full.startswith(upto) or start > len(upto):
            raise ValueError(
                f"{path}:{n}: the chat template renders earlier turns differently once later "
                "turns follow, so the assistant tokens cannot be located; split the "
                "conversation into one line per assistant turn"
            )
        spans.append((start, len(upto)))
    return full, spans


def _check_messages(path: str, n: int, key: str, messages: Any) -> list[dict[str, Any]]:
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise ValueError(
            f'{path}:{n}: {key!r} must be a list of {{"role": str, "content": str}} objects'
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise _no_supervised(
            path, n, "no message has role 'assistant'; add the reply or remove the line"
        )
    return messages


def _message_tokens(
    tok: Any, path: str, rows: Sequence[tuple[int, dict[str, Any]]], key: str
) -> list[tuple[list[int], list[bool]]]:
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            "--messages-key: the tokenizer has no chat template; use a chat model's tokenizer "
            "(--tokenizer DIR) or plain text (--text-key)"
        )
    if not getattr(tok, "is_fast", False):
        raise ValueError(
            "--messages-key needs a fast tokenizer (character offsets locate the assistant "
            "tokens); the tokenizer directory has only a slow one: add its tokenizer.json"
        )
    rendered, all_spans = [], []
    for n, obj in rows:
        messages = _check_messages(path, n, key, _field(path, n, obj, key, "--messages-key"))
        full, spans = _assistant_spans(tok, path, n, messages)
        rendered.append(full)
        all_spans.append(spans)
    # The template writes the special tokens (BOS, turn markers) itself.
    enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, spans in zip(enc["input_ids"], enc["offset_mapping"], all_spans, strict=True):
        mask = [any(a <= s < b for a, b in spans) for s, _ in offsets]
        out.append((list(ids), mask))
    return out


@dataclass(frozen=True)
class JsonlSource:
    """Where the samples came from: recorded in the manifest's ``data`` option."""

    path: str
    text_key: str | None
    messages_key: str | None


class JsonlTokens(Dataset):
    """Tokenized JSONL samples, right-padded to ``max_len`` on access.

    Item ``i`` is ``{"input_ids": int64 [max_len], "seq_len": int64 [],
    "loss_mask": bool [max_len]}`` (0 / False on padding). Tokens are held ragged
    (int32 + offsets), so memory follows the real lengths, not ``max_len``.

    Attributes:
        truncated: how many samples lost tokens to ``max_len``.
        digest: sha256 of every sample's tokens and mask -- changes with the file,
            the tokenizer, the chat template or ``max_len``.
    """

    def __init__(self, samples: Sequence[tuple[list[int], list[bool]]], max_len: int) -> None:
        lens = np.array([min(len(ids), max_len) for ids, _ in samples], dtype=np.int64)
        self.offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lens, out=self.offsets[1:])
        self.tokens = np.concatenate(
            [np.asarray(ids[:max_len], dtype=np.int32) for ids, _ in samples]
        )
        self.mask = np.concatenate([np.asarray(m[:max_len], dtype=bool) for _, m in samples])
        self.truncated = int(sum(len(ids) > max_len for ids, _ in samples))
        self.max_len = max_len
        h = hashlib.sha256()
        for arr in (self.offsets, self.tokens, self.mask):
            h.update(arr.tobytes())
        self.digest = h.hexdigest()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = torch.zeros(self.max_len, dtype=torch.int64)
        mask = torch.zeros(self.max_len, dtype=torch.bool)
        ids[: b - a] = torch.from_numpy(self.tokens[a:b].astype(np.int64))
        mask[: b - a] = torch.from_numpy(self.mask[a:b])
        return {"input_ids": ids, "seq_len": torch.tensor(b - a), "loss_mask": mask}

    def max_token_id(self) -> int:
        return int(self.tokens.max())


def build_jsonl_dataset(
    source: JsonlSource,
    tokenizer: Any,
    max_len: int,
    limit: int | None = None,
    mask_prompt: bool = True,
) -> JsonlTokens:
    """Read, tokenize and check every sample of ``source`` (the first ``limit`` lines).

    ``mask_prompt=False`` supervises every token of a chat sample too (plain text is
    always fully supervised).

    Raises ValueError naming the file and line for an empty file, a missing key, a
    value of the wrong type, or a sample with no supervised token within ``max_len``.
    """
    if (source.text_key is None) == (source.messages_key is None):
        raise ValueError("pass exactly one of --text-key and --messages-key for --data jsonl:")
    rows = read_jsonl(source.path, f"--data jsonl:{source.path}")
    if limit is not None:
        if limit > len(rows):
            raise ValueError(
                f"--num-samples={limit} but {source.path} has {len(rows)} samples; lower it or "
                "leave it out to use the whole file"
            )
        rows = rows[:limit]
    if source.text_key is not None:
        samples = _text_tokens(tokenizer, source.path, rows, source.text_key)
    else:
        samples = _message_tokens(tokenizer, source.path, rows, source.messages_key)
        if not mask_prompt:
            samples = [(ids, [True] * len(ids)) for ids, _ in samples]
    for (n, _), (_, mask) in zip(rows, samples, strict=True):
        first = mask.index(True) if True in mask else None
        if first is None:
            raise _no_supervised(
                source.path, n, "the tokenizer left no token of it; remove the line"
            )
        if first >= max_len:
            raise _no_supervised(
                source.path,
                n,
                f"its first reply token is at position {first}, past --max-len={max_len}; "
                f"raise --max-len above {first} or shorten the prompt",
            )
    return JsonlTokens(samples, max_len)
