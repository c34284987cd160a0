"""The THD attention contract of Transformer Engine, as one named value and one check.

:class:`TeThdKwargs` is exactly the keyword set ``DotProductAttention.forward`` takes
for packed (THD) input; :func:`check_te_thd_args` enforces what TE's source asserts
about it (``dot_product_attention.py`` forward, the THD context-parallel path and
``thd_get_partitioned_indices``), plus the value-level rules TE documents but does
not check (``max_seqlen >= every segment``, every sequence fits its slot, an explicit
``pad_between_seqs`` that agrees with the complete boundary arrays --
NVIDIA/TransformerEngine#3331).

Every violation raises :class:`ThdContractError` (a ``ValueError``) whose message
names the argument, the offending value, TE's own wording where it has one, and the
fix. Layout math only: nothing here communicates or launches kernels.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from te_thd.args import check_int
from te_thd.boundaries import (
    ThdContractError,
    check_boundary_values,
    check_cp_args,
    require_boundary_tensor,
)

__all__ = [
    "TE_ATTN_MASK_TYPES",
    "TeThdKwargs",
    "ThdContractError",
    "check_te_thd_args",
    "normalize_attn_mask_type",
]

# TE ``transformer_engine.pytorch.constants.AttnMaskTypes``.
TE_ATTN_MASK_TYPES: tuple[str, ...] = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)


class TeThdKwargs(TypedDict):
    """Keyword arguments of TE ``DotProductAttention.forward`` for THD input.

    ``cu_seqlens_*`` are int32 ``[N+1]``; the ``*_padded`` arrays are the physical
    start offsets (the same object as the unpadded array when ``pad_between_seqs`` is
    False, so TE's identity-based auto-detection would agree with the explicit flag).
    ``max_seqlen_*`` are host ints (TE would otherwise compute them with a device
    sync); ``pad_between_seqs`` is a bool (TE would otherwise guess it).
    """

    qkv_format: str
    attn_mask_type: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    pad_between_seqs: bool


def normalize_attn_mask_type(attn_mask_type: Any) -> str:
    """TE's spelling rules: ``","`` -> ``"_"`` and ``"causal_padding"`` -> ``"padding_causal"``.

    Raises:
        ThdContractError: not a string, or not one of :data:`TE_ATTN_MASK_TYPES`.
    """
    if not isinstance(attn_mask_type, str):
        raise ThdContractError(
            f"attn_mask_type must be a string such as 'padding_causal', got {attn_mask_type!r}"
        )
    mask = attn_mask_type.replace(",", "_")
    if mask == "causal_padding":
        mask = "padding_causal"
    if mask not in TE_ATTN_MASK_TYPES:
        raise ThdContractError(
            f"attn_mask_type={attn_mask_type!r} is not supported (TE: 'Attention mask type "
            f"{mask} is not supported!'); use one of {TE_ATTN_MASK_TYPES}"
        )
    return mask


def _require_int(name: str, v: Any) -> int:
    return check_int(
        name,
        v,
        error=ThdContractError,
        meaning=" (a Python int: a tensor makes TE sync the device to read it); pass the "
        "host-side value, "
        "e.g. thd['max_seqlen_int']",
    )


def check_mask_for_thd(attn_mask_type: Any, cp_size: int) -> str:
    """TE's mask rules for THD input: a padding mask, and under CP one of two.

    Returns:
        The normalised mask type.

    Raises:
        ThdContractError: an unknown mask, one without padding, or one TE's THD
            context parallelism does not support.
    """
    mask = normalize_attn_mask_type(attn_mask_type)
    if "padding" not in mask:
        raise ThdContractError(
            f"attn_mask_type={attn_mask_type!r} has no padding mask (TE: 'Attention mask type "
            "must be padding or padding_causal for qkv_format=thd!'); use 'padding_causal' "
            "(causal) or 'padding' (bidirectional)"
        )
    if cp_size > 1 and mask not in ("padding", "padding_causal"):
        raise ThdContractError(
            f"attn_mask_type={mask!r} with context parallelism (cp_size={cp_size}): TE's THD "
            "CP supports only 'padding' and 'padding_causal' (TE: 'Context parallelism is "
            f"not supported for {mask} mask type and thd format')"
        )
    return mask


def check_te_thd_boundaries(
    *,
    qkv_format: str = "thd",
    attn_mask_type: str = "padding_causal",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    pad_between_seqs: bool | None = None,
    cp_size: int = 1,
    total_tokens_q: int | None = None,
    total_tokens_kv: int | None = None,
    check_values: bool | None = None,
    strategy: str = "dual_chunk_swap",
) -> str:
    """The boundary half of :func:`check_te_thd_args` (no q/k/v needed).

    Args:
        qkv_format, attn_mask_type, cu_seqlens_*, max_seqlen_*, pad_between_seqs,
            cp_size, check_values: as in :func:`check_te_thd_args`.
        total_tokens_q, total_tokens_kv: length of the *global* query / key stream
            (local tokens x ``cp_size``), or ``None`` to skip the coverage checks.
        strategy: the CP partition's name (``te_thd.cp.STRATEGIES``): its divisibility rules.

    Returns:
        The normalised mask type.

    Raises:
        ThdContractError: the first violated rule, with the fix.
    """
    if qkv_format != "thd":
        raise ThdContractError(
            f"qkv_format must be 'thd' for packed sequences, got {qkv_format!r}; "
            "te_thd's kwargs are for DotProductAttention(qkv_format='thd')"
        )
    check_cp_args(cp_size, error=ThdContractError)
    mask = check_mask_for_thd(attn_mask_type, cp_size)
    require_boundary_tensor("cu_seqlens_q", cu_seqlens_q, None, None)
    require_boundary_tensor("cu_seqlens_kv", cu_seqlens_kv, "cu_seqlens_q", cu_seqlens_q)
    assert cu_seqlens_q is not None and cu_seqlens_kv is not None  # for type checkers
    for name, t in (
        ("cu_seqlens_q_padded", cu_seqlens_q_padded),
        ("cu_seqlens_kv_padded", cu_seqlens_kv_padded),
    ):
        if t is not None:
            require_boundary_tensor(name, t, "cu_seqlens_q", cu_seqlens_q)
        elif cp_size > 1:
            raise ThdContractError(
                f"{name} is required with context parallelism (cp_size={cp_size}): TE "
                "partitions and offsets every sequence by its padded boundaries "
                "(cu_seqlens_padded // cp_size); pass thd['cu_seqlens_padded']"
            )
    mq = None if max_seqlen_q is None else _require_int("max_seqlen_q", max_seqlen_q)
    mkv = None if max_seqlen_kv is None else _require_int("max_seqlen_kv", max_seqlen_kv)
    if pad_between_seqs is not None and not isinstance(pad_between_seqs, bool):
        raise ThdContractError(
            "pad_between_seqs must be a Python bool or None, got "
            f"{type(pad_between_seqs).__name__} {pad_between_seqs!r}; use "
            "thd['pad_between_seqs'] (a bool)"
        )

    cu_q_pad = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
    cu_kv_pad = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
    if check_values is None:
        check_values = all(
            t.device.type == "cpu" for t in (cu_seqlens_q, cu_seqlens_kv, cu_q_pad, cu_kv_pad)
        )
    if not check_values:
        return mask
    for tag, c, p, m, total in (
        ("q", cu_seqlens_q, cu_q_pad, mq, total_tokens_q),
        ("kv", cu_seqlens_kv, cu_kv_pad, mkv, total_tokens_kv),
    ):
        check_boundary_values(
            c,
            p,
            max_seqlen=m,
            total_tokens=total,
            cp_size=cp_size,
            pad_between_seqs=pad_between_seqs,
            names=(f"cu_seqlens_{tag}", f"cu_seqlens_{tag}_padded", f"max_seqlen_{tag}"),
            strategy=strategy,
        )
    return mask


def check_te_thd_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    qkv_format: str = "thd",
    attn_mask_type: str = "padding_causal",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    pad_between_seqs: bool | None = None,
    cp_size: int = 1,
    check_values: bool | None = None,
    strategy: str = "dual_chunk_swap",
) -> str:
    """Enforce TE's THD contract for ``DotProductAttention.forward(query, key, value, **kwargs)``.

    Call it as ``check_te_thd_args(q, k, v, **te_attention_kwargs(thd))``.

    Args:
        query: ``[T_q, H, D]`` (local tokens under CP).
        key, value: ``[T_kv, H_kv, D]`` / ``[T_kv, H_kv, D_v]``, ``H % H_kv == 0``.
        qkv_format: must be ``"thd"``.
        attn_mask_type: must contain ``"padding"`` (TE's THD requirement); under CP only
            ``"padding"`` / ``"padding_causal"``.
        cu_seqlens_q, cu_seqlens_kv: int32 ``[N+1]`` real (attention) boundaries.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: int32 ``[N+1]`` physical offsets;
            ``None`` means equal to the unpadded arrays (required when ``cp_size > 1``).
        max_seqlen_q, max_seqlen_kv: host ints ``>=`` every real segment, or ``None``.
        pad_between_seqs: ``None`` or a bool that must be True whenever the complete
            physical and real arrays differ.
        cp_size: context-parallel size (the tensors hold ``T / cp_size`` local tokens
            and the boundaries stay global).
        check_values: also check boundary *values* (start at 0, monotone, every
            sequence fits its slot, max_seqlen, coverage, CP divisibility, the pad
            flag). Default: only when the boundaries are on the CPU -- reading a CUDA
            tensor would sync the device.
        strategy: the CP partition's name (``"dual_chunk_swap"``, whose local token
            counts must be even, or ``"no_load_balance"``).

    Returns:
        The normalised mask type (``"padding,causal"`` -> ``"padding_causal"``).

    Raises:
        ThdContractError: the first violated rule, with the fix.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ThdContractError(
                f"{name} must be a 3-D [T, H, D] tensor when qkv_format='thd', got {shape} "
                "(TE: 'Queries, keys and values must be 3D tensors when qkv_format = thd!'); "
                "reshape the projection output to [tokens, heads, head_dim]"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise ThdContractError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype} (TE: 'Queries, keys and values must have the same data type!')"
        )
    if key.shape[:-1] != value.shape[:-1]:
        raise ThdContractError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in tokens and "
            "heads (TE: 'Keys and values must have the same batch size, sequence length and "
            "number of heads!')"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ThdContractError(
            f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]} (TE: 'Queries "
            "and keys must have the same head dimension!')"
        )
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] != 0:
        raise ThdContractError(
            f"query has {query.shape[1]} heads, not a multiple of key/value's {key.shape[1]} "
            "(TE: 'The number of attention heads must be divisible by the number of GQA "
            "groups!')"
        )
    even = strategy == "dual_chunk_swap"  # TE skips the check for no_load_balance
    if (
        even
        and isinstance(cp_size, int)
        and cp_size > 1
        and (query.shape[0] % 2 or key.shape[0] % 2)
    ):
        raise ThdContractError(
            f"local token counts query {query.shape[0]} / key {key.shape[0]} must be even under "
            f"context parallelism (cp_size={cp_size}; TE: 'Sequence length per GPU needs to be "
            "divisible by 2!'); pad every sequence to a multiple of 2*cp_size"
        )
    return check_te_thd_boundaries(
        qkv_format=qkv_format,
        attn_mask_type=attn_mask_type,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        pad_between_seqs=pad_between_seqs,
        cp_size=cp_size,
        total_tokens_q=query.shape[0] * cp_size if isinstance(cp_size, int) else None,
        total_tokens_kv=key.shape[0] * cp_size if isinstance(cp_size, int) else None,
        check_values=check_values,
        strategy=strategy,
    )
