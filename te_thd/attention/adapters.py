"""Arguments for the attention kernels, built from a batch's THD layout.

Every function here takes a :class:`~te_thd.layout.ThdLayout` or the dict
``te_thd.thd_utils.process_input_for_thd`` returns (optionally sliced for one CP rank
by ``te_thd.cp.shard_thd_batch_for_cp``, which records ``cp_size``); a dict is
converted once, by :func:`te_thd.layout.as_layout`, and gives the same result.

- :func:`te_attention_kwargs` -> the exact kwargs of TE ``DotProductAttention.forward``;
- :func:`packed_seq_params` -> a Megatron-Core ``PackedSeqParams``;
- :func:`flash_attn_varlen_kwargs` / :func:`torch_varlen_kwargs` -> the boundary
  arguments of ``flash_attn_varlen_func`` / ``torch.nn.attention.varlen.varlen_attn``,
  which cannot express padding between sequences (a :class:`VarlenLayoutError` says so).

Host ints (``max_seqlen``) and the ``pad_between_seqs`` bool are decided on the CPU
where the DataLoader worker built the batch (the layout holds them); ``device=`` then
moves the boundary tensors with ``non_blocking=True``, so the GPU step never syncs to
get them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from te_thd._cp_strategy import (
    DUAL_CHUNK_SWAP,
    NO_LOAD_BALANCE,
    installed_te_version,
    normalize_strategy,
    te_strategy_member,
)
from te_thd.attention.contract import (
    TeThdKwargs,
    ThdContractError,
    check_mask_for_thd,
    normalize_attn_mask_type,
)
from te_thd.attention.pitfalls import check_te_thd_kwargs
from te_thd.boundaries import longest_segment
from te_thd.layout import ThdLayout, as_layout, derive_unchecked

#: What megatron-core warns on import without Transformer Engine and Apex
#: (:func:`packed_seq_params`).
_MEGATRON_NO_TE_WARNING = "Transformer Engine and Apex are not installed"

__all__ = [
    "VarlenLayoutError",
    "flash_attn_varlen_kwargs",
    "packed_seq_params",
    "te_attention_kwargs",
    "torch_varlen_kwargs",
]


class VarlenLayoutError(ValueError):
    """The THD layout cannot be expressed with a varlen kernel's ``cu_seqlens`` alone."""


def _reject_absorbed_tail_for_bidirectional(thd: Any, layout: ThdLayout) -> None:
    """Bidirectional attention must not see a trailing pad grown into the last sequence.

    ``process_input_for_thd`` absorbs a pure tail pad into the last sequence
    (``pad_between_seqs`` False) -- correct for causal masks only: with a bidirectional
    mask the last sequence's real tokens would attend to the pad. The layout records it
    (:attr:`ThdLayout.absorbed_trailing_pad`); the batch's host ``padding_mask``, when
    there is one, names the first such slot.
    """
    if not layout.absorbed_trailing_pad:
        return
    cp = layout.cp_size
    where = "stream" if cp == 1 else f"rank-local (cp_size={cp})"
    pm = thd.get("padding_mask") if isinstance(thd, Mapping) else None
    if isinstance(pm, torch.Tensor) and pm.dim() == 1 and pm.device.type == "cpu":
        inside = pm[: int(layout.cu_seqlens[-1])] if cp == 1 else pm
        slot = f"{where} padding slot {int(inside.nonzero()[0, 0])}" if inside.any() else where
    else:
        slot = f"{where} padding"
    raise ValueError(
        f"bidirectional attention over a batch whose trailing padding was absorbed into "
        f"the last sequence ({slot} lies inside a sequence while "
        "pad_between_seqs=False): real tokens would attend to padding. Use a causal mask, "
        "or convert with process_input_for_thd(batch, absorb_trailing_pad=False) so the "
        "pad stays outside the last sequence"
    )


def _attention_layout(
    thd: ThdLayout | Mapping[str, Any],
    mask: str,
    cp_size: int | None,
    max_seqlen: int | None,
    device: torch.device | str | None,
    check: bool,
    varlen_kernel: str | None = None,
    max_num_seqs: int | None = None,
) -> ThdLayout:
    """The batch's layout (converted once), checked for ``mask`` (and for a varlen
    kernel, when named), in fixed-shape form when ``max_num_seqs`` is given, moved to
    ``device``."""
    if max_num_seqs is not None:
        layout = as_layout(thd, cp_size=cp_size, validate=check)
        layout = layout.padded_to(max_num_seqs, max_seqlen)
    else:
        layout = as_layout(thd, cp_size=cp_size, max_seqlen=max_seqlen, validate=check)
    if check:
        check_mask_for_thd(mask, layout.cp_size)
    if varlen_kernel is not None:
        _reject_for_varlen(layout, varlen_kernel, "causal" in mask)
    if "causal" not in mask:
        _reject_absorbed_tail_for_bidirectional(thd, layout)
    return layout if device is None else layout.to(device, non_blocking=True)


def _te_boundary_fields(layout: ThdLayout) -> dict[str, Any]:
    """The boundary kwargs TE's ``forward`` and Megatron's ``PackedSeqParams`` share:
    ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` (int32 ``[N+1]``, one object
    when there is no padding between sequences) and ``max_seqlen_q/kv`` (ints)."""
    cu, cup = layout.cu_seqlens, layout.cu_seqlens_padded
    return {
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cup,
        "cu_seqlens_kv_padded": cup,
        "max_seqlen_q": layout.max_seqlen,
        "max_seqlen_kv": layout.max_seqlen,
    }


def te_attention_kwargs(
    thd: ThdLayout | Mapping[str, Any],
    attn_mask_type: str = "padding_causal",
    *,
    cp_size: int | None = None,
    max_seqlen: int | None = None,
    device: torch.device | str | None = None,
    check: bool = True,
    max_num_seqs: int | None = None,
    strategy: Any = None,
) -> TeThdKwargs:
    """The exact THD kwargs of TE ``DotProductAttention.forward``.

    ``out = dpa(q, k, v, **te_attention_kwargs(thd))`` with ``q/k/v`` ``[T, H, D]``
    (local tokens under CP; the boundaries stay global, as TE expects with a
    ``cp_group``).

    Args:
        thd: the batch's ``ThdLayout``, or the converted (sharded) batch dict.
        attn_mask_type: ``"padding_causal"`` (default), ``"padding"`` (bidirectional) or
            ``"padding_causal_bottom_right"``; TE spellings like ``"padding,causal"``.
        cp_size: context-parallel size; default the layout's (a dict's ``cp_size``, 1).
        max_seqlen: override the host int passed as ``max_seqlen_q/kv``. Default: the
            layout's ``max_seqlen`` (the longest real *or padded* sequence, read from
            the CPU boundaries; ``thd["max_seqlen_int"]`` when a dict's boundaries are
            already on a device and that is provably enough).
        device: move the boundary tensors there (``non_blocking=True``) after all host
            decisions are made.
        check: build the layout from a dict with its checks (TE's THD contract; value
            checks only for CPU boundaries, so no sync) and check the mask type.
        max_num_seqs: fixed shapes for CUDA graphs: every ``cu_seqlens*`` array is
            padded to ``[max_num_seqs + 1]`` by repeating its last offset (zero-length
            trailing sequences; TE >= 2.18) and ``max_seqlen_q/kv`` is the fixed bound
            ``max_seqlen`` (default: the stream length). Outputs and gradients are
            unchanged (:meth:`~te_thd.layout.ThdLayout.padded_to`).
        strategy: the CP load-balancing strategy the batch is sharded by
            (``"dual_chunk_swap"``, ``"no_load_balance"`` or TE's enum member); default
            the batch's own (``shard_thd_batch_for_cp`` records it), else the default.
            It picks the layout rules; ``"no_load_balance"`` under CP also needs a
            causal mask and, where TE is installed, a TE that has the strategy.
            TE takes the strategy in ``set_context_parallel_group``:
            :func:`te_thd.attention.te_cp_group_kwargs` gives its kwargs.

    With ``check``, :func:`~te_thd.attention.pitfalls.check_te_thd_kwargs` also runs on
    the result for the installed TE (before any move to ``device``): a known TE pitfall
    raises. The kwargs built here never hit one.

    Returns:
        :class:`~te_thd.attention.contract.TeThdKwargs`: ``qkv_format="thd"``,
        ``attn_mask_type``, int32 ``[N+1]`` ``cu_seqlens_q/kv`` and
        ``cu_seqlens_q/kv_padded``, int ``max_seqlen_q/kv``, bool ``pad_between_seqs``.

    Raises:
        ThdContractError: the batch breaks TE's THD contract.
        ValueError: missing keys, a value that would need a device sync, a
            bidirectional mask over an absorbed trailing pad, more than
            ``max_num_seqs`` sequences, an unknown ``strategy`` or one the installed TE
            lacks.
    """
    mask = normalize_attn_mask_type(attn_mask_type)
    if strategy is not None:
        strategy = normalize_strategy(strategy)
        if strategy != DUAL_CHUNK_SWAP and isinstance(thd, Mapping):
            thd = {**thd, "cp_strategy": strategy}  # the rules to build its layout by
    layout = _attention_layout(
        thd, mask, cp_size, max_seqlen, None, check, max_num_seqs=max_num_seqs
    )
    if strategy is not None and strategy != layout.cp_strategy:
        rebuild = dataclasses.replace if check else derive_unchecked
        layout = rebuild(layout, cp_strategy=strategy)
    if layout.cp_strategy == NO_LOAD_BALANCE and layout.cp_size > 1:
        _check_no_load_balance(mask, layout.cp_size)
    kwargs = TeThdKwargs(
        qkv_format="thd",
        attn_mask_type=mask,
        **_te_boundary_fields(layout),
        pad_between_seqs=layout.pad_between_seqs,
    )
    if check and layout.cu_seqlens.device.type == "cpu":
        problems = check_te_thd_kwargs(kwargs)
        if problems:
            raise ThdContractError("; ".join(problems))
    if device is not None:
        moved = layout.to(device, non_blocking=True)
        kwargs.update(_te_boundary_fields(moved))  # type: ignore[typeddict-item]
    return kwargs


def _check_no_load_balance(mask: str, cp_size: int) -> None:
    """TE's asserts for ``NO_LOAD_BALANCE`` that the kwargs decide, and the TE feature."""
    if "causal" not in mask:
        raise ThdContractError(
            f"attn_mask_type={mask!r} with strategy='no_load_balance' (cp_size={cp_size}): TE "
            "asserts 'No-load-balance THD partitioning requires causal attention without a "
            "sliding window'; use 'padding_causal', or strategy='dual_chunk_swap'"
        )
    if installed_te_version() is not None:
        te_strategy_member(NO_LOAD_BALANCE)  # one line naming the TE version needed


def packed_seq_params(
    thd: ThdLayout | Mapping[str, Any],
    *,
    causal: bool = True,
    cp_size: int | None = None,
    max_seqlen: int | None = None,
    device: torch.device | str | None = None,
    cp_group: Any = None,
    local_cp_size: int | None = None,
    check: bool = True,
    max_num_seqs: int | None = None,
) -> Any:
    """A Megatron-Core ``PackedSeqParams`` for the batch (``qkv_format="thd"``).

    Megatron's ``TEDotProductAttention`` forwards its fields to TE as kwargs. Which
    fields exist depends on the installed megatron-core (read from the dataclass, not
    from a version number): every field te_thd knows is set when the class has it --
    the boundaries and ``max_seqlen_q/kv``, ``local_cp_size`` / ``cp_group``,
    ``total_tokens`` (the global stream length; 0.17 and later) and
    ``pad_between_seqs`` (0.19 and later, forwarded to TE >= 2.2, so TE never guesses
    it). Without that field (megatron-core 0.16) TE infers it: TE >= 2.18 from whether
    the padded arrays are the unpadded tensor *objects* -- here they are exactly when
    there is no padding between sequences, so it infers right; older TE compares
    ``cu_seqlens[:-1]`` by value (a device sync) and misses padding that sits only at
    the last sequence's tail (NVIDIA/TransformerEngine#3331) -- call TE with
    :func:`te_attention_kwargs` there.

    The dataclass is built from the host boundaries and its tensor fields are then
    moved to ``device``: Megatron's ``__post_init__`` (``seq_idx`` from
    ``total_tokens``, for Mamba layers) runs on the CPU instead of syncing the device.

    Args:
        thd: the batch's ``ThdLayout``, or the converted (sharded) batch dict.
        causal: whether the model's mask is causal; False rejects an absorbed trailing
            pad (see :func:`te_attention_kwargs`).
        cp_size, max_seqlen, device, check, max_num_seqs: as in :func:`te_attention_kwargs`.
        cp_group, local_cp_size: Megatron's dynamic-CP fields, passed through.

    Returns:
        ``megatron.core.packed_seq_params.PackedSeqParams``.
    """
    with warnings.catch_warnings():  # restored on exit: the process's filters are left as they were
        # megatron-core warns once per module, on import, that it falls back from TE/Apex fused
        # kernels (optimizer, grad clipping, FSDP) that a PackedSeqParams never uses: noise for this
        # call
        warnings.filterwarnings("ignore", message=_MEGATRON_NO_TE_WARNING, category=UserWarning)
        from megatron.core import packed_seq_params as mcore

    cls = mcore.PackedSeqParams  # read at call time: the installed release's class
    mask = "padding_causal" if causal else "padding"
    layout = _attention_layout(
        thd, mask, cp_size, max_seqlen, None, check, max_num_seqs=max_num_seqs
    )
    known: dict[str, Any] = {
        "qkv_format": "thd",
        **_te_boundary_fields(layout),
        "local_cp_size": local_cp_size,
        "cp_group": cp_group,
        "pad_between_seqs": layout.pad_between_seqs,
        "total_tokens": layout.total_tokens,
    }
    names = {f.name for f in dataclasses.fields(cls)}
    params = cls(**{k: v for k, v in known.items() if k in names and v is not None})
    if device is not None:
        _move_tensor_fields(params, device)
    return params


def _move_tensor_fields(params: Any, device: torch.device | str) -> None:
    """Move every tensor field of a dataclass in place (``non_blocking``), keeping shared
    tensors shared (TE's same-object rule for ``cu_seqlens*_padded``)."""
    moved: dict[int, torch.Tensor] = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if isinstance(v, torch.Tensor):
            if id(v) not in moved:
                moved[id(v)] = v.to(device, non_blocking=True)
            setattr(params, f.name, moved[id(v)])


def _reject_for_varlen(layout: ThdLayout, kernel: str, causal: bool) -> None:
    """Varlen kernels take one boundary array and no CP group; say so for layouts that need more.

    Padding between sequences is expressible for a causal mask only (see
    :func:`_varlen_boundaries`)."""
    if layout.pad_between_seqs and not causal:
        raise VarlenLayoutError(
            f"{kernel} cannot express padding between sequences for bidirectional attention "
            "(thd['pad_between_seqs'] is True: cu_seqlens and cu_seqlens_padded differ, so "
            "sequences do not start where the previous one's real tokens end). Use causal=True, "
            "TE DotProductAttention with te_attention_kwargs(thd), or pack without per-sequence "
            "padding (pad_to_multiple_of=1, no context parallelism) so only the pack's "
            "tail is padded"
        )
    if layout.cp_size != 1:
        raise VarlenLayoutError(
            f"{kernel} has no context parallelism, but thd is sharded for "
            f"cp_size={layout.cp_size}; pass the unsharded batch, or use TE "
            "DotProductAttention with a cp_group"
        )


def _varlen_boundaries(layout: ThdLayout) -> tuple[torch.Tensor, int]:
    """The one boundary array (int32 ``[N+1]``) and its longest segment for a varlen kernel.

    A varlen kernel reads ``cu_seqlens`` as physical offsets. With padding between
    sequences the offsets are ``cu_seqlens_padded``: each segment is a sequence's real
    tokens followed by its padding. Under a causal mask a real token attends only to
    earlier slots of its segment, which are all real, so every real token's output and
    gradient is exactly TE's; the padding slots attend to their own sequence and carry no
    loss. The longest segment is then a padded length, read from the host array."""
    if not layout.pad_between_seqs:
        return layout.cu_seqlens, layout.max_seqlen
    cup = layout.cu_seqlens_padded
    if cup.device.type != "cpu":
        raise VarlenLayoutError(
            "a varlen kernel over padding between sequences needs the longest padded "
            f"sequence, but thd's cu_seqlens_padded is on {cup.device}; build the kwargs from "
            "the CPU batch (pass device= to move them)"
        )
    return cup, max(longest_segment(cup), layout.max_seqlen)


def _varlen_layout(
    thd: ThdLayout | Mapping[str, Any],
    mask: str,
    max_seqlen: int | None,
    device: torch.device | str | None,
    check: bool,
    kernel: str,
) -> tuple[torch.Tensor, int]:
    """The checked boundary array of a varlen kernel (moved to ``device``) and its
    longest segment, decided on the host before the move."""
    layout = _attention_layout(thd, mask, None, max_seqlen, None, check, kernel)
    cu, longest = _varlen_boundaries(layout)
    return (cu if device is None else cu.to(device, non_blocking=True)), longest


@functools.cache
def _varlen_accepts(name: str) -> bool:
    """Whether the installed ``torch.nn.attention.varlen.varlen_attn`` takes keyword ``name``
    (torch 2.11 has no ``enable_gqa``; 2.13 has)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # no varlen_attn at all: the kwargs are for a newer torch elsewhere
        return True
    return name in inspect.signature(varlen_attn).parameters


def flash_attn_varlen_kwargs(
    thd: ThdLayout | Mapping[str, Any],
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
    With padding between sequences (causal only) the boundaries are
    ``cu_seqlens_padded``: exact at every real token, the padding slots written too.

    Raises:
        VarlenLayoutError: padding between sequences with ``causal=False``, or a
            CP-sharded batch.
    """
    mask = "padding_causal" if causal else "padding"
    kernel = "flash_attn_varlen_func"
    cu, longest = _varlen_layout(thd, mask, max_seqlen, device, check, kernel)
    return {
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": longest,
        "max_seqlen_k": longest,
        "causal": causal,
        "softmax_scale": softmax_scale,
    }


def torch_varlen_kwargs(
    thd: ThdLayout | Mapping[str, Any],
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
    causal by tuple equality -- else ``(-1, -1)``), ``scale`` and, where the installed
    ``varlen_attn`` takes it, ``enable_gqa``. With padding between sequences (causal
    only) the boundaries are ``cu_seqlens_padded``: exact at every real token.

    Raises:
        VarlenLayoutError: padding between sequences with ``causal=False``, or a
            CP-sharded batch.
        ValueError: ``enable_gqa=True`` on a torch whose ``varlen_attn`` lacks it.
    """
    mask = "padding_causal" if causal else "padding"
    kernel = "torch.nn.attention.varlen.varlen_attn"
    cu, longest = _varlen_layout(thd, mask, max_seqlen, device, check, kernel)
    kw: dict[str, Any] = {
        "cu_seq_q": cu,
        "cu_seq_k": cu,
        "max_q": longest,
        "max_k": longest,
        "window_size": (-1, 0) if causal else (-1, -1),
        "scale": scale,
    }
    if _varlen_accepts("enable_gqa"):
        kw["enable_gqa"] = enable_gqa
    elif enable_gqa:
        raise ValueError(
            f"enable_gqa=True, but this torch's ({torch.__version__}) varlen_attn has no "
            "enable_gqa; repeat the key/value heads to the query's "
            "(k.repeat_interleave(H // H_kv, dim=1), likewise v) and pass enable_gqa=False"
        )
    return kw
