"""The boundary rules of a packed (THD) batch, once: TE's ``cu_seqlens`` contract and CP's partition
rule.

Every place that accepts boundary arrays checks them here, so each rule has one
implementation and one message: :class:`~te_thd.layout.ThdLayout` where a layout is
built, the attention contract (:mod:`te_thd.attention.contract`) where TE's kwargs
are checked, and the context-parallel partition (``te_thd._partition``) on every
shard. Pure host-side math on ``[N+1]`` int arrays; nothing here reads a device
tensor except :func:`host_int64`, whose callers do so only for CPU tensors or on
purpose.

The rules (TE ``dot_product_attention.py`` and ``thd_get_partitioned_indices``):

- a boundary tensor is int32 ``[N+1]`` (:func:`require_boundary_tensor`);
- boundaries start at 0 and never decrease (:func:`check_starts_at_zero`,
  :func:`check_non_decreasing`);
- under CP of size ``C`` every padded length is a multiple of ``2 * C``
  (:func:`check_cp_multiple`) and the padded boundaries cover the whole stream
  (:func:`check_covers`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from te_thd.args import check_int

__all__ = [
    "ThdContractError",
    "check_boundary_values",
    "check_covers",
    "check_cp_args",
    "check_cp_multiple",
    "check_non_decreasing",
    "check_starts_at_zero",
    "check_stream_divisible",
    "cp_padding_fix",
    "host_int64",
    "require_boundary_tensor",
]


class ThdContractError(ValueError):
    """Arguments that break Transformer Engine's THD attention contract."""


def check_cp_args(cp_size: Any, *cp_rank: Any, error: type[ValueError] = ValueError) -> None:
    """Check ``cp_size`` (an int >= 1) and, when given, ``cp_rank`` (in ``[0, cp_size)``).

    The one check of the context-parallel arguments; every module that takes them calls
    it. ``error`` lets the attention contract raise its own ``ValueError`` subclass.
    """
    check_int("cp_size", cp_size, 1, error=error)
    for rank in cp_rank:
        check_int(
            "cp_rank",
            rank,
            0,
            below=cp_size,
            bound_name="cp_size",
            error=error,
            meaning="; pass this process's rank in its context-parallel group",
        )


def cp_padding_fix(cp_size: int) -> str:
    """What to do about a document whose length is not a multiple of ``2 * cp_size``.

    TE's THD context parallelism (and Megatron's per-document CP slicing, which calls
    TE's partition on ``cu_seqlens`` when a batch has no padded boundaries) splits every
    document into ``2 * cp_size`` equal chunks; te_thd's packer pads them so.
    """
    return (
        f"pad every document to a multiple of {2 * cp_size}: "
        f"te_thd.packing.PackingCollator(seq_len, pad_to_multiple_of=pad_to_multiple_for("
        f"cp_size={cp_size})) does"
    )


def require_boundary_tensor(
    name: str, t: Any, ref_name: str | None = None, ref: torch.Tensor | None = None
) -> None:
    """``t`` must be an int32 ``[N+1]`` tensor (shaped like ``ref``, named ``ref_name``, when
    given)."""
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


def host_int64(t: torch.Tensor) -> np.ndarray:
    """int64 host copy (or view) of a boundary tensor, int64 ``[N+1]`` (reading a device tensor is a
    sync)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return t.numpy().astype(np.int64, copy=False)


def longest_segment(cu: torch.Tensor) -> int:
    """Longest segment of CPU boundaries ``cu`` (int ``[N+1]``); 0 without sequences."""
    if cu.shape[0] < 2:
        return 0
    c = cu.numpy()
    return int((c[1:] - c[:-1]).max())


def check_starts_at_zero(name: str, cu: np.ndarray) -> None:
    """``cu[0] == 0``: the first sequence starts at the stream's first token."""
    if cu.size and cu[0] != 0:
        raise ThdContractError(
            f"{name}[0] must be 0, got {int(cu[0])}: boundaries start at the stream's first token"
        )


def check_non_decreasing(name: str, cu: np.ndarray, hint: str | None = None) -> np.ndarray:
    """``cu`` never decreases; returns the lengths ``cu[1:] - cu[:-1]`` (int64 ``[N]``)."""
    lengths = cu[1:] - cu[:-1]
    if np.count_nonzero(lengths < 0):
        i = int((lengths < 0).argmax())
        raise ThdContractError(
            f"{name} must be non-decreasing: sequence {i} has length {int(lengths[i])} (boundaries "
            f"{int(cu[i])} -> {int(cu[i + 1])}); "
            + (hint or "sentinel-padded rows must be trimmed to their valid length on the host")
        )
    return lengths


def check_cp_multiple(name: str, padded_lengths: np.ndarray, cp_size: int) -> None:
    """Under CP (``cp_size > 1``) every padded length is a multiple of ``2 * cp_size``."""
    multiple = 2 * cp_size
    if cp_size > 1 and np.count_nonzero(padded_lengths % multiple):
        i = int((padded_lengths % multiple != 0).argmax())
        raise ThdContractError(
            f"sequence {i} has padded length {int(padded_lengths[i])} ({name}), not a multiple of "
            f"2*cp_size={multiple}; TE's THD context parallelism splits every sequence into "
            f"{multiple} equal chunks (thd_get_partitioned_indices asserts seqlen % "
            "(world_size * 2) "
            f"== 0) -- {cp_padding_fix(cp_size)}"
        )


def check_stream_divisible(total_tokens: int, cp_size: int) -> None:
    """Under CP the stream splits into ``2 * cp_size`` equal parts of whole chunks."""
    multiple = 2 * cp_size
    if cp_size > 1 and total_tokens % multiple != 0:
        raise ThdContractError(
            f"total_tokens={total_tokens} is not divisible by 2*cp_size={multiple}; "
            f"{cp_padding_fix(cp_size)} (and so pads the stream)"
        )


def check_pieces(total_tokens: int, cp_size: int) -> None:
    """Under ``no_load_balance`` CP the stream splits into ``cp_size`` equal pieces."""
    if cp_size > 1 and total_tokens % cp_size:
        raise ThdContractError(
            f"total_tokens={total_tokens} is not divisible by cp_size={cp_size}, which "
            "strategy='no_load_balance' cuts into equal contiguous pieces; pad the stream "
            f"to a multiple of {cp_size}"
        )


def check_covers(name: str, end: int, total_tokens: int, exact: bool) -> None:
    """The padded boundaries end inside the stream of ``total_tokens`` tokens; ``exact``: at its
    end.

    Under CP (``exact``) TE assigns tokens past the last boundary to the last
    sequence and produces overlapping partitions, so the boundaries must cover the
    whole stream.
    """
    if end > total_tokens:
        raise ThdContractError(
            f"{name} ends at {end}, beyond the {total_tokens} tokens of the global stream; "
            "the boundaries do not belong to these tensors"
        )
    if exact and end != total_tokens:
        raise ThdContractError(
            f"{name} ends at {end} but the global stream has {total_tokens} tokens; under context "
            "parallelism the padded boundaries must cover the whole stream -- grow the last "
            "sequence's padded length to the end of the stream"
        )


def check_boundary_values(
    cu: torch.Tensor,
    cu_padded: torch.Tensor,
    *,
    max_seqlen: int | None,
    total_tokens: int | None,
    cp_size: int,
    pad_between_seqs: bool | None,
    names: tuple[str, str, str] = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"),
    strategy: str = "dual_chunk_swap",
) -> None:
    """Host-side value rules of one boundary pair (their one implementation).

    Args:
        cu, cu_padded: int ``[N+1]`` real and physical boundaries, read on the host.
        max_seqlen: host int that must be ``>=`` every real segment, or None.
        total_tokens: length of the global stream, or None to skip the coverage rules.
        cp_size: context-parallel size (``> 1`` adds TE's CP divisibility and coverage).
        pad_between_seqs: False requires equal arrays (NVIDIA/TransformerEngine#3331); None/True
        skip it.
        names: how the messages call ``cu``, ``cu_padded`` and ``max_seqlen``.
        strategy: the CP partition; ``"no_load_balance"`` needs no padded length to be a
            multiple of ``2 * cp_size``, only the stream a multiple of ``cp_size``.

    Raises:
        ThdContractError: the first violated rule, naming the value and the fix.
    """
    cu_name, cup_name, max_name = names
    c = host_int64(cu)
    p = host_int64(cu_padded)
    check_starts_at_zero(cu_name, c)
    check_starts_at_zero(cup_name, p)
    lens = check_non_decreasing(cu_name, c)
    plens = check_non_decreasing(cup_name, p)
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
    if total_tokens is not None:
        check_covers(cup_name, int(p[-1]), total_tokens, exact=False)
    if strategy != "no_load_balance":
        check_cp_multiple(cup_name, plens, cp_size)
    elif total_tokens is not None:
        check_pieces(total_tokens, cp_size)
    if total_tokens is not None and cp_size > 1:
        check_covers(cup_name, int(p[-1]), total_tokens, exact=True)
    if pad_between_seqs is False and not np.array_equal(c, p):
        raise ThdContractError(
            f"pad_between_seqs=False but {cu_name} {c.tolist()} differs from {cup_name} "
            f"{p.tolist()}: TE would take the no-padding path and attend across the wrong "
            "slots (NVIDIA/TransformerEngine#3331) -- compute pad_between_seqs on the "
            "complete arrays "
            "(process_input_for_thd does) or pass True"
        )
