"""The THD attention contract of Transformer Engine, as one named value and one check.

:class:`TeThdKwargs` is exactly the keyword set ``DotProductAttention.forward`` takes
for packed (THD) input; :func:`check_te_thd_args` enforces what TE's source asserts
about it (``dot_product_attention.py`` forward, the THD context-parallel path and
``thd_get_partitioned_indices``), plus the value-level rules TE documents but does
not check (``max_seqlen >= every segment``, every sequence fits its slot, an explicit
``pad_between_seqs`` that agrees with the complete boundary arrays -- NVIDIA/TransformerEngine#3331).

Every violation raises :class:`ThdContractError` (a ``ValueError``) whose message
names the argument, the offending value, TE's own wording where it has one, and the
fix. Layout math only: nothing here communicates or launches kernels.
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np
import torch

from te_thd.layout import check_cp_args, cp_padding_fix

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


class ThdContractError(ValueError):
    """Arguments that break Transformer Engine's THD attention contract."""


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


def _require_boundary(name: str, t: Any, ref_name: str | None, ref: torch.Tensor | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ThdContractError(
            f"{name} must be an int32 [N+1] tensor when qkv_format='thd', got "
            f"{type(t).__name__} (TE: 'cu_seqlens_q and cu_seqlens_kv can not be None when "
            "qkv_format = thd!'); build it with te_thd.thd_utils.process_input_for_thd"
        )
    if t.dim() != 1:
        raise ThdContractError(
            f"{name} must be 1-D [N+1], got shape {tuple(t.shape)} (TE: 'cu_seqlens_q and "
            "cu_seqlens_q must both have shape [batch_size + 1]!'); for a chunked batch pass "
            "one row per chunk, trimmed to its valid length on the host"
        )
    if t.dtype != torch.int32:
        raise ThdContractError(
            f"{name} must have dtype torch.int32, got {t.dtype} (TE: 'cu_seqlens_q and "
            f"cu_seqlens_q must both be in dtype torch.int32!'); use {name}.to(torch.int32)"
        )
    if ref is not None and t.shape != ref.shape:
        raise ThdContractError(
            f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            "all boundary arrays must describe the same N sequences ([N+1] each)"
        )


def _require_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ThdContractError(
            f"{name} must be a Python int (a tensor makes TE sync the device to read it), "
            f"got {type(v).__name__} {v!r}; pass the host-side value, e.g. "
            "thd['max_seqlen_int']"
        )
    return v


def _host(t: torch.Tensor) -> np.ndarray:
    """int64 host copy of a boundary tensor (reading a device tensor is a sync)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return t.numpy().astype(np.int64)


def check_boundary_values(
    cu: torch.Tensor,
    cu_padded: torch.Tensor,
    *,
    max_seqlen: int | None,
    total_tokens: int | None,
    cp_size: int,
    pad_between_seqs: bool | None,
    names: tuple[str, str, str] = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"),
) -> None:
    """Host-side value rules of one boundary pair (their one implementation).

    Args:
        cu, cu_padded: int ``[N+1]`` real and physical boundaries, read on the host.
        max_seqlen: host int that must be ``>=`` every real segment, or None.
        total_tokens: length of the global stream, or None to skip the coverage rules.
        cp_size: context-parallel size (``> 1`` adds TE's CP divisibility and coverage).
        pad_between_seqs: False requires equal arrays (NVIDIA/TransformerEngine#3331); None/True skip it.
        names: how the messages call ``cu``, ``cu_padded`` and ``max_seqlen``.

    Raises:
        ThdContractError: the first violated rule, naming the value and the fix.
    """
    cu_name, cup_name, max_name = names
    c = _host(cu)
    p = _host(cu_padded)
    if c[0] != 0 or p[0] != 0:
        raise ThdContractError(f"{cu_name} and {cup_name} must start at 0, got {int(c[0])} and {int(p[0])}")
    lens = c[1:] - c[:-1]
    plens = p[1:] - p[:-1]
    for name, arr in ((cu_name, lens), (cup_name, plens)):
        neg = arr < 0
        if neg.any():
            i = int(neg.argmax())
            raise ThdContractError(
                f"{name} must be non-decreasing: sequence {i} has length {int(arr[i])}; "
                "sentinel-padded rows must be trimmed to their valid length on the host"
            )
    over = lens > plens
    if over.any():
        i = int(over.argmax())
        raise ThdContractError(
            f"sequence {i} has real length {int(lens[i])} ({cu_name}) but only "
            f"{int(plens[i])} slots ({cup_name}); the padded length must be >= "
            "the real length -- were the two arrays swapped?"
        )
    if plens.size and max_seqlen is not None:
        i = int(lens.argmax())
        if max_seqlen < lens[i]:
            raise ThdContractError(
                f"{max_name}={max_seqlen} is smaller than sequence {i}'s length "
                f"{int(lens[i])}; TE requires {max_name} >= max({cu_name}[i+1] - "
                f"{cu_name}[i]) -- pass the max over the padded lengths"
            )
    if total_tokens is not None and p[-1] > total_tokens:
        raise ThdContractError(
            f"{cup_name} ends at {int(p[-1])}, beyond the {total_tokens} tokens "
            f"of the global stream ({'local tokens x cp_size' if cp_size > 1 else 'T'}); "
            "the boundaries do not belong to these tensors"
        )
    if cp_size > 1:
        multiple = 2 * cp_size
        bad = plens % multiple != 0
        if bad.any():
            i = int(bad.argmax())
            raise ThdContractError(
                f"sequence {i} has padded length {int(plens[i])} ({cup_name}), "
                f"not a multiple of 2*cp_size={multiple}; TE's THD context parallelism "
                f"splits every sequence into {multiple} equal chunks (thd_get_partitioned_"
                f"indices asserts seqlen % (world_size * 2) == 0) -- {cp_padding_fix(cp_size)}"
            )
        if total_tokens is not None and p[-1] != total_tokens:
            raise ThdContractError(
                f"{cup_name} ends at {int(p[-1])} but the global stream has "
                f"{total_tokens} tokens; under context parallelism the padded boundaries "
                "must cover the whole stream -- grow the last sequence's padded length"
            )
    if pad_between_seqs is False and not np.array_equal(c, p):
        raise ThdContractError(
            f"pad_between_seqs=False but {cu_name} {c.tolist()} differs from {cup_name} "
            f"{p.tolist()}: TE would take the no-padding path and attend across the wrong "
            "slots (NVIDIA/TransformerEngine#3331) -- compute pad_between_seqs on the complete arrays "
            "(process_input_for_thd does) or pass True"
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
) -> str:
    """The boundary half of :func:`check_te_thd_args` (no q/k/v needed).

    Args:
        qkv_format, attn_mask_type, cu_seqlens_*, max_seqlen_*, pad_between_seqs,
            cp_size, check_values: as in :func:`check_te_thd_args`.
        total_tokens_q, total_tokens_kv: length of the *global* query / key stream
            (local tokens x ``cp_size``), or ``None`` to skip the coverage checks.

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
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        check_cp_args(cp_size, error=ThdContractError)
    mask = check_mask_for_thd(attn_mask_type, cp_size)
    _require_boundary("cu_seqlens_q", cu_seqlens_q, None, None)
    _require_boundary("cu_seqlens_kv", cu_seqlens_kv, "cu_seqlens_q", cu_seqlens_q)
    assert cu_seqlens_q is not None and cu_seqlens_kv is not None  # for type checkers
    for name, t in (
        ("cu_seqlens_q_padded", cu_seqlens_q_padded),
        ("cu_seqlens_kv_padded", cu_seqlens_kv_padded),
    ):
        if t is not None:
            _require_boundary(name, t, "cu_seqlens_q", cu_seqlens_q)
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
    if isinstance(cp_size, int) and cp_size > 1 and (query.shape[0] % 2 or key.shape[0] % 2):
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
    )
