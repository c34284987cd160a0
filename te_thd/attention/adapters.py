"""Arguments for the attention kernels, built from a converted THD batch.

A *THD batch* is the dict ``te_thd.thd_utils.process_input_for_thd`` returns
(``cu_seqlens``, ``cu_seqlens_padded``, ``pad_between_seqs``, ``max_seqlen``,
``max_seqlen_int``, ``padding_mask``, ...), optionally sliced for one CP rank by
``te_thd.cp.shard_thd_batch_for_cp`` (which records ``cp_size``).

- :func:`te_attention_kwargs` -> the exact kwargs of TE ``DotProductAttention.forward``;
- :func:`packed_seq_params` -> a Megatron-Core ``PackedSeqParams``;
- :func:`flash_attn_varlen_kwargs` / :func:`torch_varlen_kwargs` -> the boundary
  arguments of ``flash_attn_varlen_func`` / ``torch.nn.attention.varlen.varlen_attn``,
  which cannot express padding between sequences (a :class:`VarlenLayoutError` says so).

Host ints (``max_seqlen``) and the ``pad_between_seqs`` bool are decided here, on the
CPU where the DataLoader worker built the batch; ``device=`` then moves the boundary
tensors with ``non_blocking=True``, so the GPU step never syncs to get them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from te_thd.attention.contract import (
    TeThdKwargs,
    check_te_thd_boundaries,
    normalize_attn_mask_type,
)

__all__ = [
    "VarlenLayoutError",
    "flash_attn_varlen_kwargs",
    "packed_seq_params",
    "te_attention_kwargs",
    "torch_varlen_kwargs",
]


class VarlenLayoutError(ValueError):
    """The THD layout cannot be expressed with a varlen kernel's ``cu_seqlens`` alone."""


@dataclass(frozen=True)
class _Boundaries:
    """The resolved attention metadata of one THD batch (host decisions made)."""

    cu_seqlens: torch.Tensor  # int32 [N+1], real boundaries
    cu_seqlens_padded: torch.Tensor  # int32 [N+1]; the same object when not pad_between_seqs
    pad_between_seqs: bool
    max_seqlen: int
    cp_size: int


def _on_host(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in ts)


def _host_max_len(cu: torch.Tensor) -> int:
    if cu.numel() < 2:
        return 0
    c = cu.detach().to(torch.int64)
    return int((c[1:] - c[:-1]).max())


def _resolve(
    thd: Mapping[str, Any],
    *,
    cp_size: int | None,
    max_seqlen: int | None,
    attn_mask_type: str,
    check: bool,
) -> _Boundaries:
    """Read and validate a THD batch's boundaries; decide the host-side values."""
    if not isinstance(thd, Mapping):
        raise ValueError(
            f"thd must be the dict returned by te_thd.thd_utils.process_input_for_thd, got "
            f"{type(thd).__name__}"
        )
    cu = thd.get("cu_seqlens")
    if not isinstance(cu, torch.Tensor):
        raise ValueError(
            "thd['cu_seqlens'] is missing or not a tensor (got "
            f"{type(cu).__name__}); convert the BSHD batch with "
            "te_thd.thd_utils.process_input_for_thd first"
        )
    cup = thd.get("cu_seqlens_padded")
    if cup is None:
        cup = cu
    if not isinstance(cup, torch.Tensor):
        raise ValueError(
            f"thd['cu_seqlens_padded'] must be a tensor or absent, got {type(cup).__name__}"
        )
    if cp_size is None:
        cp_size = thd.get("cp_size", 1)
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")

    host = _on_host(cu, cup)
    pad = thd.get("pad_between_seqs")
    if pad is None:
        if not host:
            raise ValueError(
                "thd['pad_between_seqs'] is missing and the boundaries are on "
                f"{cu.device}: deciding it would sync the device; compute it on the host "
                "(process_input_for_thd does) or build the kwargs before moving the batch"
            )
        pad = not torch.equal(cu.to(torch.int64), cup.to(torch.int64))
    if not isinstance(pad, bool):
        raise ValueError(
            f"thd['pad_between_seqs'] must be a Python bool, got {type(pad).__name__} {pad!r}; "
            "a tensor would make every consumer sync to read it"
        )

    if max_seqlen is None:
        if host:
            # Over the padded lengths too: TE divides max_seqlen by cp_size for each CP
            # step, and a rank's share of a tail-padded sequence can hold more real tokens
            # than real_len / cp_size. max(padded) >= max(real) keeps TE's contract.
            max_seqlen = max(_host_max_len(cu), _host_max_len(cup))
        elif isinstance(thd.get("max_seqlen_int"), int) and (cp_size == 1 or not pad):
            max_seqlen = int(thd["max_seqlen_int"])
        else:
            raise ValueError(
                f"cannot decide max_seqlen without a device sync: the boundaries are on "
                f"{cu.device} and thd has no usable 'max_seqlen_int' (cp_size={cp_size}, "
                f"pad_between_seqs={pad}); build the kwargs on the CPU batch and pass "
                "device=..., or pass max_seqlen= (the longest padded sequence)"
            )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative Python int, got {max_seqlen!r}")

    if check:
        ids = thd.get("input_ids")
        total = ids.shape[0] * cp_size if isinstance(ids, torch.Tensor) and ids.dim() else None
        check_te_thd_boundaries(
            attn_mask_type=attn_mask_type,
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cup,
            cu_seqlens_kv_padded=cup,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            pad_between_seqs=pad,
            cp_size=cp_size,
            total_tokens_q=total,
            total_tokens_kv=total,
        )
    if not pad:
        # Value-equal arrays (checked above when on the host): hand TE the very same
        # object, so even its identity-based auto-detection (TE issue 3487) agrees.
        cup = cu
    return _Boundaries(cu, cup, pad, max_seqlen, cp_size)


def _reject_absorbed_tail_for_bidirectional(thd: Mapping[str, Any], b: _Boundaries) -> None:
    """Bidirectional attention must not see a trailing pad grown into the last sequence.

    ``process_input_for_thd`` absorbs a pure tail pad into the last sequence
    (``pad_between_seqs`` False) -- correct for causal masks only: with a bidirectional
    mask the last sequence's real tokens would attend to the pad. Detected from the
    host ``padding_mask``: a padding slot inside ``[0, cu_seqlens[-1])``. A CP-sharded
    mask holds local slots, but there the padded boundaries cover the whole stream, so
    any padding slot at all lies inside a sequence.
    """
    if b.pad_between_seqs:
        return
    pm = thd.get("padding_mask")
    if not isinstance(pm, torch.Tensor) or pm.dim() != 1 or not _on_host(pm, b.cu_seqlens):
        return
    end = int(b.cu_seqlens[-1]) if b.cu_seqlens.numel() else 0
    inside = pm[:end] if b.cp_size == 1 else pm
    if bool(inside.any()):
        first = int(inside.nonzero()[0, 0])
        where = "stream" if b.cp_size == 1 else f"rank-local (cp_size={b.cp_size})"
        raise ValueError(
            f"bidirectional attention over a batch whose trailing padding was absorbed into "
            f"the last sequence ({where} padding slot {first} lies inside a sequence while "
            "pad_between_seqs=False): real tokens would attend to padding. Use a causal mask, "
            "or convert with process_input_for_thd(batch, absorb_trailing_pad=False) so the "
            "pad stays outside the last sequence"
        )


def _move(b: _Boundaries, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if device is None:
        return b.cu_seqlens, b.cu_seqlens_padded
    cu = b.cu_seqlens.to(device, non_blocking=True)
    cup = (
        cu
        if b.cu_seqlens_padded is b.cu_seqlens
        else b.cu_seqlens_padded.to(device, non_blocking=True)
    )
    return cu, cup


def _te_boundary_fields(
    thd: Mapping[str, Any],
    mask: str,
    cp_size: int | None,
    max_seqlen: int | None,
    device: torch.device | str | None,
    check: bool,
) -> tuple[_Boundaries, dict[str, Any]]:
    """The boundary kwargs TE's ``forward`` and Megatron's ``PackedSeqParams`` share.

    Resolves the batch for the normalised ``mask``, rejects an absorbed trailing pad
    when the mask is bidirectional, then moves the boundaries to ``device``.

    Returns:
        The resolved boundaries and ``cu_seqlens_q/kv`` (int32 ``[N+1]``),
        ``cu_seqlens_q/kv_padded`` (int32 ``[N+1]``), ``max_seqlen_q/kv`` (ints).
    """
    b = _resolve(thd, cp_size=cp_size, max_seqlen=max_seqlen, attn_mask_type=mask, check=check)
    if "causal" not in mask:
        _reject_absorbed_tail_for_bidirectional(thd, b)
    cu, cup = _move(b, device)
    return b, {
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cup,
        "cu_seqlens_kv_padded": cup,
        "max_seqlen_q": b.max_seqlen,
        "max_seqlen_kv": b.max_seqlen,
    }


def te_attention_kwargs(
    thd: Mapping[str, Any],
    attn_mask_type: str = "padding_causal",
    *,
    cp_size: int | None = None,
    max_seqlen: int | None = None,
    device: torch.device | str | None = None,
    check: bool = True,
) -> TeThdKwargs:
    """The exact THD kwargs of TE ``DotProductAttention.forward``.

    ``out = dpa(q, k, v, **te_attention_kwargs(thd))`` with ``q/k/v`` ``[T, H, D]``
    (local tokens under CP; the boundaries stay global, as TE expects with a
    ``cp_group``).

    Args:
        thd: a converted THD batch (see the module docstring).
        attn_mask_type: ``"padding_causal"`` (default), ``"padding"`` (bidirectional) or
            ``"padding_causal_bottom_right"``; TE spellings like ``"padding,causal"``.
        cp_size: context-parallel size; default ``thd.get("cp_size", 1)``.
        max_seqlen: override the host int passed as ``max_seqlen_q/kv``. Default: the
            longest real *or padded* sequence, read from the CPU boundaries (or
            ``thd["max_seqlen_int"]`` when the boundaries are already on a device and
            that is provably enough).
        device: move the boundary tensors there (``non_blocking=True``) after all host
            decisions are made.
        check: validate with :func:`~te_thd.attention.contract.check_te_thd_boundaries`
            (value checks only for CPU boundaries, so no sync).

    Returns:
        :class:`~te_thd.attention.contract.TeThdKwargs`: ``qkv_format="thd"``,
        ``attn_mask_type``, int32 ``[N+1]`` ``cu_seqlens_q/kv`` and
        ``cu_seqlens_q/kv_padded``, int ``max_seqlen_q/kv``, bool ``pad_between_seqs``.

    Raises:
        ThdContractError: the batch breaks TE's THD contract.
        ValueError: missing keys, a value that would need a device sync, or a
            bidirectional mask over an absorbed trailing pad.
    """
    mask = normalize_attn_mask_type(attn_mask_type)
    b, fields = _te_boundary_fields(thd, mask, cp_size, max_seqlen, device, check)
    return TeThdKwargs(
        qkv_format="thd",
        attn_mask_type=mask,
        **fields,
        pad_between_seqs=b.pad_between_seqs,
    )


def packed_seq_params(
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    cp_size: int | None = None,
    max_seqlen: int | None = None,
    device: torch.device | str | None = None,
    cp_group: Any = None,
    local_cp_size: int | None = None,
    check: bool = True,
) -> Any:
    """A Megatron-Core ``PackedSeqParams`` for the batch (``qkv_format="thd"``).

    Megatron's ``TEDotProductAttention`` forwards its fields to TE as kwargs. It has no
    ``pad_between_seqs`` field, so TE auto-detects it: when there is no padding
    between sequences the padded arrays here *are* the unpadded tensor objects, which
    every TE version detects as "no padding"; when there is, TE versions whose check
    compares only ``cu_seqlens[:-1]`` mis-detect a batch padded only at the last
    sequence's tail (TE issue 3331) -- call TE with :func:`te_attention_kwargs` there.

    Args:
        thd: a converted THD batch.
        causal: whether the model's mask is causal; False rejects an absorbed trailing
            pad (see :func:`te_attention_kwargs`).
        cp_size, max_seqlen, device, check: as in :func:`te_attention_kwargs`.
        cp_group, local_cp_size: Megatron's dynamic-CP fields, passed through.

    Returns:
        ``megatron.core.packed_seq_params.PackedSeqParams``.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    mask = "padding_causal" if causal else "padding"
    _, fields = _te_boundary_fields(thd, mask, cp_size, max_seqlen, device, check)
    return PackedSeqParams(
        qkv_format="thd",
        **fields,
        local_cp_size=local_cp_size,
        cp_group=cp_group,
    )


def _varlen_boundaries(
    thd: Mapping[str, Any], kernel: str, causal: bool, max_seqlen: int | None, check: bool
) -> _Boundaries:
    mask = "padding_causal" if causal else "padding"
    b = _resolve(thd, cp_size=None, max_seqlen=max_seqlen, attn_mask_type=mask, check=check)
    if b.pad_between_seqs:
        raise VarlenLayoutError(
            f"{kernel} cannot express padding between sequences (thd['pad_between_seqs'] is "
            "True: cu_seqlens and cu_seqlens_padded differ, so sequences do not start where "
            "the previous one's real tokens end). Use TE DotProductAttention with "
            "te_attention_kwargs(thd), or pack without per-sequence padding "
            "(pad_to_multiple_of=1, no context parallelism) so only the pack's tail is padded"
        )
    if b.cp_size != 1:
        raise VarlenLayoutError(
            f"{kernel} has no context parallelism, but thd is sharded for cp_size={b.cp_size}; "
            "pass the unsharded batch, or use TE DotProductAttention with a cp_group"
        )
    if not causal:
        _reject_absorbed_tail_for_bidirectional(thd, b)
    return b


def flash_attn_varlen_kwargs(
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    max_seqlen: int | None = None,
    device: torch.device | str | None = None,
    check: bool = True,
) -> dict[str, Any]:
    """Boundary kwargs of flash-attn's ``flash_attn_varlen_func(q, k, v, **kw)``.

    Returns ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 ``[N+1]``), ``max_seqlen_q``,
    ``max_seqlen_k`` (ints), ``causal`` and ``softmax_scale``. Slots past
    ``cu_seqlens[-1]`` (if any) are not written by the kernel: mask them downstream.

    Raises:
        VarlenLayoutError: padding between sequences, or a CP-sharded batch.
    """
    b = _varlen_boundaries(thd, "flash_attn_varlen_func", causal, max_seqlen, check)
    cu, _ = _move(b, device)
    return {
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": b.max_seqlen,
        "max_seqlen_k": b.max_seqlen,
        "causal": causal,
        "softmax_scale": softmax_scale,
    }


def torch_varlen_kwargs(
    thd: Mapping[str, Any],
    *,
    causal: bool = True,
    scale: float | None = None,
    enable_gqa: bool = False,
    max_seqlen: int | None = None,
    device: torch.device | str | None = None,
    check: bool = True,
) -> dict[str, Any]:
    """Boundary kwargs of ``torch.nn.attention.varlen.varlen_attn(q, k, v, **kw)`` (torch 2.13).

    Returns ``cu_seq_q``, ``cu_seq_k`` (int32 ``[N+1]``), ``max_q``, ``max_k`` (ints),
    ``window_size`` (the tuple ``(-1, 0)`` for causal -- ``varlen_attn`` recognises
    causal by tuple equality -- else ``(-1, -1)``), ``scale`` and ``enable_gqa``.

    Raises:
        VarlenLayoutError: padding between sequences, or a CP-sharded batch.
    """
    b = _varlen_boundaries(thd, "torch.nn.attention.varlen.varlen_attn", causal, max_seqlen, check)
    cu, _ = _move(b, device)
    return {
        "cu_seq_q": cu,
        "cu_seq_k": cu,
        "max_q": b.max_seqlen,
        "max_k": b.max_seqlen,
        "window_size": (-1, 0) if causal else (-1, -1),
        "scale": scale,
        "enable_gqa": enable_gqa,
    }
