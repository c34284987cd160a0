"""Which sequence, and which position in it, each slot of a THD stream holds.

Pure layout math shared by the reference attention and its CP variant. A THD stream
places sequence ``i`` at physical offset ``cu_seqlens_padded[i]``; only its first
``cu_seqlens[i+1] - cu_seqlens[i]`` slots are real (TE's rule), the rest of its slot
range and everything past ``cu_seqlens_padded[-1]`` is padding.

Note the absorbed-tail layout (``pad_between_seqs`` False after the trailing pad was
grown into the last sequence): there ``cu_seqlens == cu_seqlens_padded`` and the tail
slots *are* real positions of the last sequence, exactly as TE treats them.
"""

from __future__ import annotations

import torch


def slot_segments(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Locate global slot indices in a THD layout (vectorised, no host sync).

    Args:
        cu_seqlens: int ``[N+1]`` real boundaries.
        cu_seqlens_padded: int ``[N+1]`` physical boundaries (same device).
        slots: int64 ``[M]`` global slot indices (any order, e.g. a CP rank's partition).

    Returns:
        ``(seg, pos, real, seg_len)``, each ``[M]``: ``seg`` int64 sequence index, ``N``
        for slots past the last boundary; ``pos`` int64 offset from the sequence's
        physical start; ``real`` bool, True iff the slot holds one of the sequence's
        real tokens; ``seg_len`` int64 real length of the slot's sequence (0 for ``N``).
    """
    cu = cu_seqlens.to(torch.int64)
    cup = cu_seqlens_padded.to(torch.int64)
    slots = slots.to(device=cup.device, dtype=torch.int64)
    # Number of sequence ends <= slot is the index of the sequence holding it; right=True
    # steps over zero-length sequences (repeated boundaries).
    seg = torch.searchsorted(cup[1:].contiguous(), slots, right=True)
    zero = cup.new_zeros(1)
    starts = torch.cat((cup[:-1], cup[-1:]))  # [N+1]; entry N: the end of the stream
    lens = torch.cat((cu[1:] - cu[:-1], zero))  # [N+1]; entry N: nothing is real there
    pos = slots - starts[seg]
    seg_len = lens[seg]
    real = (pos >= 0) & (pos < seg_len)
    return seg, pos, real, seg_len
