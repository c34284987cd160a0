"""Reading and checking the batch ``te_thd.thd_utils`` converts (host side).

Every check of the input dict lives here: required keys, token tensor shapes, integer
length tables moved to the host as int64 numpy arrays, and the token-id fallback when
a batch carries no pack metadata. Each error names the argument, its value and the
fix; the valid common case (a collate's ``[B, S]`` tensors and CPU ``int64`` tables)
takes a few exact type and shape tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_REQUIRED_KEYS = ("input_ids", "position_ids", "seq_lens")
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def read_token_tensors(
    batch: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor | None, torch.Size, bool]:
    """``(input_ids, position_ids, seq_lens, labels, input_ids.shape, plain)`` of a batch.

    ``plain`` is True for what collates produce -- ``[B, S]`` ids, positions and labels
    of one shape -- which then needs no per-argument checks (and flattens to views).
    """
    if not (type(batch) is dict or isinstance(batch, Mapping)):
        check_keys(batch)
    try:
        input_ids = batch["input_ids"]
        position_ids = batch["position_ids"]
        seq_lens = batch["seq_lens"]
    except KeyError:
        check_keys(batch)
        raise
    labels = batch.get("labels")
    # ``shape`` is read once: each ``.shape`` builds a new torch.Size.
    plain = type(input_ids) is torch.Tensor and (
        position_ids is None or type(position_ids) is torch.Tensor
    )
    if plain:
        shape = input_ids.shape
        plain = (
            len(shape) == 2
            and (position_ids is None or position_ids.shape == shape)
            and (labels is None or (type(labels) is torch.Tensor and labels.shape == shape))
        )
    if not plain:
        check_token_tensors(input_ids, position_ids, labels)
        shape = input_ids.shape
    return input_ids, position_ids, seq_lens, labels, shape, plain


def length_tables(
    batch: Mapping[str, Any],
    seq_lens: Any,
    input_ids: torch.Tensor,
    num_chunks: int,
    padding_token_id: int,
    sentinel: int,
) -> tuple[np.ndarray, np.ndarray, torch.device | None]:
    """int64 host ``[B, P]`` tables ``(seq_lens, seq_lens_padded)`` and the lengths' device.

    The device (None for the CPU) is where the boundary tensors belong. Without
    ``seq_lens`` the tables come from token ids (one sequence per row).
    """
    bsz = input_ids.shape[0]
    seq_lens_padded = batch.get("seq_lens_padded")
    if seq_lens is None:
        if seq_lens_padded is not None:
            raise ValueError(
                "seq_lens is None but seq_lens_padded is given; pass both length tables "
                "(or neither, to infer padding from token ids)."
            )
        return lengths_from_token_ids(input_ids, num_chunks, padding_token_id, sentinel)
    sl = lengths_to_host(seq_lens, "seq_lens", bsz)
    meta_device = None if seq_lens.is_cpu else seq_lens.device
    if seq_lens_padded is None:
        return sl, sl, meta_device
    sp = lengths_to_host(seq_lens_padded, "seq_lens_padded", bsz)
    if sp.shape != sl.shape:
        raise ValueError(
            f"seq_lens_padded shape {sp.shape} does not match seq_lens shape {sl.shape}; "
            "both tables need one entry per pack slot [B, P] (sentinel where unused)."
        )
    return sl, sp, meta_device


def token_padding_mask_rows(ids: torch.Tensor, padding_token_id: int, name: str) -> torch.Tensor:
    """Validated token-value padding mask of each row of ``ids`` ``[R, T]``."""
    padding = ids == padding_token_id
    # Valid iff every row is non-decreasing (content..., pad...): a pad followed
    # by content anywhere means the id is also content.
    collision = padding[:, :-1] & ~padding[:, 1:]
    if bool(collision.any()):
        r, t = (int(v) for v in collision.nonzero()[0])
        where = f"{name}[{t}]" if ids.shape[0] == 1 else f"{name} stream {r} at token {t}"
        raise ValueError(
            f"padding_token_id={padding_token_id} also occurs as content ({where} is the pad id "
            "but a non-pad token follows it), so padding cannot be inferred from token values. "
            "Supply seq_lens/seq_lens_padded (or a padding_token_id that is never content)."
        )
    return padding


def check_keys(batch: Any) -> None:
    """Raise the right error for a batch that is not a mapping with the required keys."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"batch must be a dict of tensors, got {type(batch).__name__}; pass the collate's "
            "output dict (input_ids, position_ids, seq_lens, ...)."
        )
    missing = [k for k in _REQUIRED_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"batch is missing required key(s) {missing} (has {sorted(batch)}); "
            "process_input_for_thd needs input_ids [B, S(, H)], position_ids [B, S] or "
            "[n_rope, B, S] (or None), and seq_lens [B, P] (seq_lens=None to infer "
            "padding from token ids)."
        )


def check_token_tensors(input_ids: Any, position_ids: Any, labels: Any) -> None:
    """Per-argument checks of the token tensors; returns when they are valid."""
    check_tensor(input_ids, "input_ids")
    if input_ids.dim() not in (2, 3):
        raise ValueError(
            f"input_ids must be [B, S] token ids or [B, S, H] embeddings, got shape "
            f"{tuple(input_ids.shape)}; add or remove the batch axis."
        )
    if input_ids.dim() == 3 and not input_ids.dtype.is_floating_point:
        ids_shape = list(input_ids.shape)
        fix = (
            "input_ids[0]"
            if ids_shape[0] == 1
            else "input_ids.squeeze(-1)"
            if ids_shape[2] == 1
            else "input_ids"
        )
        raise ValueError(
            f"input_ids has shape {ids_shape} and dtype {input_ids.dtype}: a 3-D "
            "input_ids is read as "
            f"embeddings [B, S, H], which are floating point; token ids are [B, S] -- pass {fix} "
            "with shape [B, S] (or float embeddings [B, S, H])."
        )
    bsz, seq_len = int(input_ids.shape[0]), int(input_ids.shape[1])
    if position_ids is not None:  # None is passed through as None (the reference's behaviour)
        check_position_ids(position_ids, bsz, seq_len)
    if labels is not None:
        check_tensor(labels, "labels")
        if labels.dim() < 2 or tuple(labels.shape[:2]) != (bsz, seq_len):
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match the batch [B, S]=[{bsz}, "
                f"{seq_len}] of input_ids; pass labels [B, S] aligned with input_ids."
            )


def check_position_ids(position_ids: Any, bsz: int, seq_len: int) -> None:
    """``position_ids`` is ``[B, S]`` or ``[n_rope, B, S]`` (mRoPE) for a batch of ``[B, S]``
    tokens."""
    check_tensor(position_ids, "position_ids")
    if not (
        (position_ids.dim() == 2 and tuple(position_ids.shape) == (bsz, seq_len))
        or (position_ids.dim() == 3 and tuple(position_ids.shape[1:]) == (bsz, seq_len))
    ):
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} does not match the batch "
            f"[B, S]=[{bsz}, {seq_len}] of input_ids; pass [B, S] or [n_rope, B, S] (mRoPE)."
        )


def check_tensor(value: Any, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"batch[{name!r}] must be a torch.Tensor, got {type(value).__name__}; "
            "convert it with torch.as_tensor in the collate."
        )


def host_ints(value: Any, name: str) -> np.ndarray:
    """Integer tensor -> host numpy array (zero-copy on the CPU)."""
    check_tensor(value, name)
    if value.dtype not in _INT_DTYPES:
        raise ValueError(
            f"{name} must have an integer dtype, got {value.dtype}; lengths are counts, build "
            f"them with dtype=torch.int32 or torch.int64 (e.g. {name}.long())."
        )
    # A GPU tensor costs one device->host copy here (a sync): the sequence count
    # is data-dependent. Collates should build lengths on the CPU.
    arr = value.numpy() if value.is_cpu else value.detach().cpu().numpy()
    # The layout math runs in int64 so offsets and sums of narrow tables cannot wrap.
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def lengths_to_host(value: Any, name: str, bsz: int) -> np.ndarray:
    """``[B, P]`` integer length table -> int64 host array, validated."""
    # Fast path for what collates produce (int64 on the CPU): zero-copy view.
    if (
        isinstance(value, torch.Tensor)
        and value.dtype is torch.int64
        and value.is_cpu
        and value.dim() == 2
        and value.shape[0] == bsz
    ):
        return value.numpy()
    arr = host_ints(value, name)
    if arr.ndim != 2 or arr.shape[0] != bsz:
        raise ValueError(
            f"{name} must be [B, P] with B={bsz} (input_ids.shape[0]), got shape "
            f"{tuple(arr.shape)}; give one row of pack-slot lengths per batch row "
            "(use unsqueeze(1) for one sequence per row)."
        )
    return arr


def lengths_from_token_ids(
    input_ids: torch.Tensor, num_chunks: int, padding_token_id: int, sentinel: int
) -> tuple[np.ndarray, np.ndarray, torch.device | None]:
    """Fallback length tables when no pack metadata exists: one sequence per row.

    Padding is inferred from token values, validated per chunk stream (pad only
    in the stream's tail). Row ``b`` becomes one sequence of its non-pad tokens
    (rows entirely of pad get the sentinel); its padded length is ``S``.
    """
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(
            f"seq_lens is None and input_ids has shape {tuple(input_ids.shape)} / dtype "
            f"{input_ids.dtype}: padding can only be inferred from integer token ids [B, S]. "
            "Supply seq_lens and seq_lens_padded."
        )
    bsz, seq_len = input_ids.shape
    padding = token_padding_mask_rows(
        input_ids.reshape(num_chunks, -1), padding_token_id, "input_ids"
    )
    real = (~padding).reshape(bsz, seq_len).sum(dim=1).cpu().numpy()
    rows = bsz // num_chunks
    if (real[::rows] == 0).any():
        c = int(np.argmax(real[::rows] == 0))
        raise ValueError(
            f"seq_lens is None and input_ids row {c * rows} is entirely padding_token_id="
            f"{padding_token_id}, so the {'chunk' if num_chunks > 1 else 'batch'} holds no "
            "sequence at its start. Supply seq_lens, or drop empty rows."
        )
    sl = np.where(real > 0, real, sentinel)[:, None]
    sp = np.where(real > 0, seq_len, sentinel)[:, None]
    return sl, sp, None if input_ids.is_cpu else input_ids.device
