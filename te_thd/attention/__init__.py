"""Attention for packed (THD) batches: TE/Megatron/varlen adapters and a reference.

The last arrow of a batch's path (``packing -> thd_utils -> cp -> attention``):

- :mod:`.contract`: :class:`TeThdKwargs` and :func:`check_te_thd_args`, TE's THD
  contract as its source states it;
- :mod:`.pitfalls`: :func:`check_te_thd_kwargs`, the known TE / Megatron THD pitfalls
  of one call's kwargs for a TE version;
- :mod:`.adapters`: :func:`te_attention_kwargs`, :func:`packed_seq_params`,
  :func:`flash_attn_varlen_kwargs`, :func:`torch_varlen_kwargs`;
- :mod:`.reference`: :func:`thd_attention_reference`, plain torch, same kwargs as TE;
- :mod:`.cp_reference`: :func:`thd_attention_cp_reference` over a real process group;
- :mod:`.module`: :class:`ThdAttention`, TE when available, the reference otherwise.

The adapters and :class:`ThdAttention` take the batch's :class:`te_thd.ThdLayout` or
the converted batch dict.
"""

from __future__ import annotations

from te_thd._cp_strategy import te_cp_group_kwargs
from te_thd.attention.adapters import (
    VarlenLayoutError,
    flash_attn_varlen_kwargs,
    packed_seq_params,
    te_attention_kwargs,
    torch_varlen_kwargs,
)
from te_thd.attention.contract import (
    TE_ATTN_MASK_TYPES,
    TeThdKwargs,
    ThdContractError,
    check_te_thd_args,
    normalize_attn_mask_type,
)
from te_thd.attention.cp_reference import thd_attention_cp_reference
from te_thd.attention.module import ThdAttention, te_available
from te_thd.attention.pitfalls import check_te_thd_kwargs
from te_thd.attention.reference import thd_attention_reference

__all__ = [
    "TE_ATTN_MASK_TYPES",
    "TeThdKwargs",
    "ThdAttention",
    "ThdContractError",
    "VarlenLayoutError",
    "check_te_thd_args",
    "check_te_thd_kwargs",
    "flash_attn_varlen_kwargs",
    "normalize_attn_mask_type",
    "packed_seq_params",
    "te_attention_kwargs",
    "te_available",
    "te_cp_group_kwargs",
    "thd_attention_cp_reference",
    "thd_attention_reference",
    "torch_varlen_kwargs",
]
