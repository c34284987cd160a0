"""A synthetic variable-length token dataset, generated in-process (no downloads).

Tokens follow a Zipf-like unigram law over the vocabulary (so the target model's
outputs are not uniform noise), lengths are uniform in ``[min_len, max_len]``.
Everything is a pure function of ``seed``: any rank can materialise any slice and
two runs produce identical data.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticTokens(Dataset):
    """``num_samples`` token sequences, right-padded to ``max_len`` with ``pad_id``.

    Item ``i`` is ``{"input_ids": int64 [max_len], "seq_len": int64 []}``.
    """

    def __init__(
        self,
        num_samples: int,
        min_len: int,
        max_len: int,
        vocab_size: int,
        seed: int = 0,
        pad_id: int = 0,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be > 0, got {num_samples}")
        if not 2 <= min_len <= max_len:
            raise ValueError(
                f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}"
            )
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        g = torch.Generator().manual_seed(seed)
        self.seq_len = torch.randint(min_len, max_len + 1, (num_samples,), generator=g)
        # Zipf-like unigram law; id ``pad_id`` never appears as content.
        weights = 1.0 / (torch.arange(vocab_size, dtype=torch.float64) + 8.0)
        weights[pad_id] = 0.0
        flat = torch.multinomial(weights, num_samples * max_len, replacement=True, generator=g)
        ids = flat.view(num_samples, max_len)
        pad = torch.arange(max_len)[None, :] >= self.seq_len[:, None]
        self.input_ids = ids.masked_fill(pad, pad_id)
        self.max_len = max_len

    def __len__(self) -> int:
        return int(self.seq_len.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "seq_len": self.seq_len[i]}
