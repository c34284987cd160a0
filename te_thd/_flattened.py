"""Hugging Face flattened batches -> per-document samples for ``te_thd.packing``.

``DataCollatorWithFlattening`` puts a batch's documents back to back in one row with
position ids that restart at 0 for every document; these helpers recover the
documents so the packer can lay them out again (re-exported by ``te_thd.packing``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def seq_lens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document lengths of a flattened stream whose position ids restart at 0 per document.

    The convention of Hugging Face's ``DataCollatorWithFlattening``: one row, documents
    back to back, position ids ``0, 1, ..., n_i - 1`` for each.

    Args:
        position_ids: integer ``[T]`` or ``[B, T]`` (rows are concatenated in order;
            every row must start a document).

    Returns:
        int64 ``[N]`` lengths, summing to the number of tokens.

    Raises:
        ValueError: the stream does not start at 0, or a position id is neither 0 (a new
            document) nor its predecessor + 1.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else None
        raise ValueError(
            "position_ids must be a [T] or [B, T] tensor, got "
            f"{shape or type(position_ids).__name__}"
        )
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must have an integer dtype, got {position_ids.dtype}")
    pos = position_ids.detach().reshape(-1).to("cpu", torch.int64)
    if pos.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if int(pos[0]) != 0:
        raise ValueError(
            f"position_ids must start a document with 0 at index 0, got {int(pos[0])}; "
            "expected Hugging Face flattening (positions restart at 0 for every document)"
        )
    if position_ids.dim() == 2:
        row_starts = position_ids.detach().to("cpu", torch.int64)[:, 0]
        if bool((row_starts != 0).any()):
            b = int((row_starts != 0).nonzero()[0, 0])
            raise ValueError(
                f"position_ids row {b} starts at {int(row_starts[b])}, not 0; every row of a "
                "flattened batch must start a document"
            )
    starts = pos == 0
    ok = starts[1:] | (pos[1:] == pos[:-1] + 1)
    if not bool(ok.all()):
        k = int((~ok).nonzero()[0, 0]) + 1
        raise ValueError(
            f"position_ids[{k}]={int(pos[k])} follows {int(pos[k - 1])}: within a document "
            "position ids must count up by 1 and restart at 0 for the next document"
        )
    begin = starts.nonzero().view(-1)
    return torch.diff(begin, append=torch.tensor([pos.numel()]))


def unflatten_from_position_ids(
    batch: Mapping[str, Any], position_key: str = "position_ids"
) -> list[dict[str, torch.Tensor]]:
    """Split a flattened batch (HF ``DataCollatorWithFlattening`` output) into samples.

    Every tensor shaped like ``batch[position_key]`` (``[T]`` or ``[B, T]``) is split
    into per-document 1-D views; other keys (e.g. ``cu_seq_lens_q``, ``max_length_q``)
    describe the old layout and are dropped -- the packer recomputes them. HF's labels
    (unshifted, -100 on each document's first token) are already in this module's
    sample convention.

    Returns:
        ``list`` of ``{key: [n_i] tensor}``, one per document, in stream order.
    """
    if not isinstance(batch, Mapping) or position_key not in batch:
        raise ValueError(
            f"a flattened batch must be a mapping holding {position_key!r} (position ids that "
            "restart at 0 per document)"
        )
    pos = batch[position_key]
    lengths = seq_lens_from_position_ids(pos).tolist()
    split: dict[str, tuple[torch.Tensor, ...]] = {}
    for key, value in batch.items():
        if key == position_key:
            continue
        if isinstance(value, torch.Tensor) and value.shape == pos.shape:
            split[key] = torch.split(value.reshape(-1), lengths)
    return [{k: parts[i] for k, parts in split.items()} for i in range(len(lengths))]
