"""``ThdLayout``: the packed-sequence (THD) contract as one validated value.

A converted batch travels with its layout -- the boundary arrays Transformer Engine
reads plus the host-side decisions (``max_seqlen``, ``pad_between_seqs``) made once
on the CPU. :class:`ThdLayout` holds exactly that, is checked once when it is built,
and every consumer (``te_thd.cp``, the attention adapters, ``ThdAttention``, the cache
collator) trusts it afterwards. It plays the part Megatron-Core's ``PackedSeqParams``
plays there: one small typed value instead of a dict whose keys each consumer checks.

``process_input_for_thd`` keeps returning its reference dict;
:meth:`ThdLayout.from_thd` reads the layout out of it without recomputing what the
dict already carries, and every consumer that accepts a ``ThdLayout`` also accepts
that dict (converted here, once, by :func:`as_layout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_thd._cp_strategy import DUAL_CHUNK_SWAP, normalize_strategy
from te_thd.args import check_int, is_int
from te_thd.boundaries import (
    ThdContractError,
    check_boundary_values,
    check_cp_args,
    longest_segment,
    require_boundary_tensor,
)

__all__ = ["ThdLayout"]

#: Key under which a batch dict may carry its ``ThdLayout`` (the cache collator's
#: output does; ``shard_thd_batch_for_cp`` carries it over, sharded).
LAYOUT_KEY = "thd_layout"


@dataclass(frozen=True, eq=False)
class ThdLayout:
    """The THD layout of one packed stream: what TE's THD attention needs, decided on the host.

    Attributes:
        cu_seqlens: int32 ``[N+1]`` cumulative real lengths (TE's ``cu_seqlens_q/kv``).
        cu_seqlens_padded: int32 ``[N+1]`` physical start offsets, last entry the stream
            length (TE's ``cu_seqlens_q/kv_padded``). When ``pad_between_seqs`` is
            False it *is* ``cu_seqlens`` (the same object: TE's identity-based
            auto-detection then agrees with the explicit flag).
        num_seqs: ``N``, a Python int.
        max_seqlen: host int for TE's ``max_seqlen_q/kv``: at least the longest real
            sequence and, when read from CPU boundaries, the longest padded one (TE
            splits padded sequences under CP). Equals ``process_input_for_thd``'s
            ``max_seqlen_int`` when ``pad_between_seqs`` is False.
        total_tokens: ``T``, the global stream length (all CP ranks together); None
            only for a dict that carried no token tensor and kept its boundaries on a
            device (unknown without a sync; the coverage rules are then skipped).
        pad_between_seqs: Python bool; the two complete arrays differ.
        cp_size: context-parallel size the batch is sharded for (1: not sharded).
        cp_rank: the rank whose tokens the batch holds (0 when not sharded).
        absorbed_trailing_pad: the last sequence was grown over trailing padding
            (``process_input_for_thd(absorb_trailing_pad=True)``): right for causal
            masks only, so the adapters reject a bidirectional mask over it.
        cp_strategy: the CP load-balancing strategy the batch is sharded by
            (``"dual_chunk_swap"``, TE's default, or ``"no_load_balance"``, whose
            padded lengths need no multiple of ``2*cp_size``; see :mod:`te_thd.cp`).

    Building one checks it (types, shapes, int32, and -- for CPU boundaries -- every
    value rule of TE's THD contract, with CP divisibility when ``cp_size > 1``);
    consumers do not check it again.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    num_seqs: int
    max_seqlen: int
    total_tokens: int | None
    pad_between_seqs: bool
    cp_size: int = 1
    cp_rank: int = 0
    absorbed_trailing_pad: bool = False
    cp_strategy: str = DUAL_CHUNK_SWAP

    def __post_init__(self) -> None:
        _validate(self)
        if not self.pad_between_seqs:
            object.__setattr__(self, "cu_seqlens_padded", self.cu_seqlens)

    def __eq__(self, other: object) -> bool:
        """Value equality: equal host fields and equal boundary values (a read of each)."""
        if not isinstance(other, ThdLayout):
            return NotImplemented
        for field in dataclasses.fields(ThdLayout):
            a, b = getattr(self, field.name), getattr(other, field.name)
            if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside

    @classmethod
    def from_thd(cls, thd: Mapping[str, Any]) -> ThdLayout:
        """The layout of a converted batch (``process_input_for_thd`` output, possibly
        sharded by ``shard_thd_batch_for_cp``).

        Reads ``cu_seqlens``, ``cu_seqlens_padded``, ``pad_between_seqs``,
        ``max_seqlen_int``, ``cp_size``/``cp_rank`` and the token count from the dict;
        only what it does not carry is derived (on the host, from CPU boundaries: the
        longest padded sequence when ``pad_between_seqs`` is True). A dict that already
        carries a ``ThdLayout`` under ``"thd_layout"`` returns it.

        Raises:
            ValueError: a missing or malformed key, a value that would need a device
                sync to decide, or a layout that breaks TE's THD contract.
        """
        return as_layout(thd)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> ThdLayout:
        """The same layout with its boundaries on ``device`` (host ints unchanged).

        Copies are ``non_blocking``; without padding between sequences one tensor is
        moved and both fields name it (``cu_seqlens_padded is cu_seqlens``).
        """
        cu = self.cu_seqlens.to(device, non_blocking=non_blocking)
        if self.cu_seqlens_padded is self.cu_seqlens:
            cup = cu
        else:
            cup = self.cu_seqlens_padded.to(device, non_blocking=non_blocking)
        if cu is self.cu_seqlens and cup is self.cu_seqlens_padded:
            return self
        return derive_unchecked(self, cu_seqlens=cu, cu_seqlens_padded=cup)

    def sharded(self, cp_size: int, cp_rank: int, *, strategy: Any = DUAL_CHUNK_SWAP) -> ThdLayout:
        """This (global) layout as seen by CP rank ``cp_rank`` of ``cp_size``.

        The boundaries stay global (TE with a ``cp_group`` expects that); the result
        is validated for ``cp_size`` and ``strategy`` (dual chunk swap: every padded
        length a multiple of ``2*cp_size``; both: boundaries covering the stream).
        """
        check_cp_args(cp_size, cp_rank)
        strategy = normalize_strategy(strategy)
        if (cp_size, cp_rank, strategy) == (self.cp_size, self.cp_rank, self.cp_strategy):
            return self
        return dataclasses.replace(self, cp_size=cp_size, cp_rank=cp_rank, cp_strategy=strategy)

    def padded_to(self, max_num_seqs: int, max_seqlen: int | None = None) -> ThdLayout:
        """This layout with fixed shapes, for CUDA graphs: ``[max_num_seqs + 1]`` boundaries.

        Both boundary arrays are padded by repeating their last offset -- zero-length
        trailing sequences, the form TE >= 2.18 and Megatron's CUDA-graph path take --
        and ``max_seqlen`` becomes the fixed bound ``max_seqlen`` (default: the stream
        length ``total_tokens``, which no sequence exceeds). Attention over the result
        equals attention over this layout; every step padded to the same
        ``max_num_seqs`` and bound hands TE identical shapes and host ints.

        Raises:
            ValueError: the batch has more than ``max_num_seqs`` sequences, or the bound
                is below its longest sequence (or unknown: pass ``max_seqlen``).
        """
        check_int("max_num_seqs", max_num_seqs, 1)
        n, total = self.num_seqs, self.total_tokens
        if n > max_num_seqs:
            # one sequence per padding multiple at most: that count always fits
            multiple = 2 * self.cp_size if self.cp_size > 1 else 1
            enough = (
                ""
                if total is None
                else (
                    f" (max_num_seqs={total // multiple} always suffices for these {total} tokens)"
                )
            )
            raise ValueError(
                f"the batch has {n} sequences, more than max_num_seqs={max_num_seqs}: its "
                f"boundary arrays cannot be padded to the fixed length {max_num_seqs + 1}; "
                f"raise max_num_seqs{enough} or pack fewer documents per step"
            )
        bound = total if max_seqlen is None else max_seqlen
        if bound is None:
            raise ValueError(
                "the stream length is unknown (a batch without token tensors whose boundaries "
                "are on a device), so it cannot be the default max_seqlen bound; pass "
                "max_seqlen= (e.g. the packed row length)"
            )
        _check_max_seqlen(bound)
        if bound < self.max_seqlen:
            raise ValueError(
                f"max_seqlen={bound} is below the batch's longest sequence ({self.max_seqlen} "
                "slots, padded length included); the fixed bound must hold every step's "
                "longest sequence -- use the packed row length"
            )
        k = max_num_seqs - n

        def pad(t: torch.Tensor) -> torch.Tensor:
            return t if k == 0 else torch.cat((t, t[-1:].expand(k)))

        cu = pad(self.cu_seqlens)
        cup = cu if self.cu_seqlens_padded is self.cu_seqlens else pad(self.cu_seqlens_padded)
        # proven, not re-checked: zero-length sequences break no rule, bound >= longest
        return derive_unchecked(
            self, cu_seqlens=cu, cu_seqlens_padded=cup, num_seqs=max_num_seqs, max_seqlen=bound
        )

    @property
    def local_tokens(self) -> int | None:
        """Tokens this CP rank holds, ``total_tokens // cp_size`` (None if unknown)."""
        return None if self.total_tokens is None else self.total_tokens // self.cp_size


def derive_unchecked(layout: ThdLayout, **changes: Any) -> ThdLayout:
    """``layout`` with ``changes`` applied, *not* re-validated (a move, or a proven rule)."""
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(ThdLayout)}
    return _trusted(**{**fields, **changes})


def _trusted(**fields: Any) -> ThdLayout:
    """A layout built without checks; the same-object rule still holds."""
    out = object.__new__(ThdLayout)
    for field in dataclasses.fields(ThdLayout):
        object.__setattr__(out, field.name, fields.get(field.name, field.default))
    if not out.pad_between_seqs:
        object.__setattr__(out, "cu_seqlens_padded", out.cu_seqlens)
    return out


def _validate(layout: ThdLayout) -> None:
    """Check a layout once, where it is built (see :class:`ThdLayout`)."""
    cu, cup = layout.cu_seqlens, layout.cu_seqlens_padded
    require_boundary_tensor("cu_seqlens", cu, None, None)
    require_boundary_tensor("cu_seqlens_padded", cup, "cu_seqlens", cu)
    check_cp_args(layout.cp_size, layout.cp_rank, error=ThdContractError)
    for name in ("num_seqs", "max_seqlen", "total_tokens"):
        value = getattr(layout, name)
        if value is None and name == "total_tokens":
            continue
        check_int(
            name,
            value,
            0,
            error=ThdContractError,
            meaning=(
                " (a Python int: host ints keep consumers from syncing the device to read them)"
            ),
        )
    if layout.num_seqs != cu.shape[0] - 1:
        raise ThdContractError(
            f"num_seqs={layout.num_seqs} but cu_seqlens holds {cu.shape[0]} boundaries "
            f"({cu.shape[0] - 1} sequences); pass num_seqs=cu_seqlens.numel() - 1"
        )
    normalize_strategy(layout.cp_strategy, "cp_strategy")
    for name in ("pad_between_seqs", "absorbed_trailing_pad"):
        value = getattr(layout, name)
        if not isinstance(value, bool):
            raise ThdContractError(
                f"{name} must be a Python bool, got {type(value).__name__} {value!r}; "
                "a tensor would make every consumer sync to read it"
            )
    if cu.device.type == "cpu" and cup.device.type == "cpu":
        check_boundary_values(
            cu,
            cup,
            max_seqlen=layout.max_seqlen,
            total_tokens=layout.total_tokens,
            cp_size=layout.cp_size,
            pad_between_seqs=layout.pad_between_seqs,
            strategy=layout.cp_strategy,
        )


def as_layout(
    thd: ThdLayout | Mapping[str, Any],
    *,
    cp_size: int | None = None,
    max_seqlen: int | None = None,
    validate: bool = True,
) -> ThdLayout:
    """The layout of ``thd`` -- a ``ThdLayout``, or a converted batch dict -- with overrides.

    The one conversion at every consumer's boundary. ``cp_size`` / ``max_seqlen``
    override what ``thd`` says (the adapters' keyword arguments); ``validate=False``
    (their ``check=False``) builds the layout without checks.
    """
    if isinstance(thd, ThdLayout):
        layout = thd
    elif isinstance(thd, Mapping) and isinstance(thd.get(LAYOUT_KEY), ThdLayout):
        layout = thd[LAYOUT_KEY]
    else:
        return _from_mapping(thd, cp_size, max_seqlen, validate)
    changes: dict[str, Any] = {}
    if cp_size is not None and cp_size != layout.cp_size:
        check_cp_args(cp_size)
        changes.update(cp_size=cp_size, cp_rank=0)
    if max_seqlen is not None and max_seqlen != layout.max_seqlen:
        _check_max_seqlen(max_seqlen)
        changes["max_seqlen"] = max_seqlen
    if not changes:
        return layout
    return (
        dataclasses.replace(layout, **changes) if validate else derive_unchecked(layout, **changes)
    )


def _check_max_seqlen(max_seqlen: Any) -> None:
    check_int(
        "max_seqlen",
        max_seqlen,
        0,
        meaning=" (a Python int: host ints keep consumers from syncing the device)",
    )


def _boundaries_of(thd: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, cu_seqlens_padded)`` of a batch dict, with today's errors."""
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
    return cu, cup


def _pad_flag_of(thd: Mapping[str, Any], cu: torch.Tensor, cup: torch.Tensor, host: bool) -> bool:
    pad = thd.get("pad_between_seqs")
    if pad is None:
        if not host:
            raise ValueError(
                "thd['pad_between_seqs'] is missing and the boundaries are on "
                f"{cu.device}: deciding it would sync the device; compute it on the host "
                "(process_input_for_thd does) or build the kwargs before moving the batch"
            )
        pad = cu.shape != cup.shape or not np.array_equal(cu.numpy(), cup.numpy())
    if not isinstance(pad, bool):
        raise ValueError(
            f"thd['pad_between_seqs'] must be a Python bool, got {type(pad).__name__} {pad!r}; "
            "a tensor would make every consumer sync to read it"
        )
    return pad


def _max_seqlen_of(
    thd: Mapping[str, Any], cu: torch.Tensor, cup: torch.Tensor, host: bool, pad: bool, cp_size: int
) -> int:
    """TE's ``max_seqlen``: the dict's host int where it suffices, else from CPU boundaries."""
    stored = thd.get("max_seqlen_int")
    usable = is_int(stored)
    if host:
        if usable and not pad:
            return stored
        # Over the padded lengths too: TE divides max_seqlen by cp_size for each CP
        # step, and a rank's share of a tail-padded sequence can hold more real tokens
        # than real_len / cp_size. max(padded) >= max(real) keeps TE's contract.
        return max(stored if usable else longest_segment(cu), longest_segment(cup))
    if usable and (cp_size == 1 or not pad):
        return stored
    raise ValueError(
        f"cannot decide max_seqlen without a device sync: the boundaries are on "
        f"{cu.device} and thd has no usable 'max_seqlen_int' (cp_size={cp_size}, "
        f"pad_between_seqs={pad}); build the kwargs on the CPU batch and pass "
        "device=..., or pass max_seqlen= (the longest padded sequence)"
    )


def _absorbed_of(thd: Mapping[str, Any], cu: torch.Tensor, pad: bool, cp_size: int) -> bool:
    """Whether a padding slot lies inside a sequence (a trailing pad grown into the last one).

    Read from the host ``padding_mask``. A CP-sharded mask holds local slots, but there
    the padded boundaries cover the whole stream, so any padding slot at all lies
    inside a sequence.
    """
    pm = thd.get("padding_mask")
    if pad or not isinstance(pm, torch.Tensor) or pm.dim() != 1:
        return False
    if pm.device.type != "cpu" or cu.device.type != "cpu":
        return False
    if cp_size == 1:
        pm = pm[: int(cu[-1]) if cu.numel() else 0]
    return bool(pm.any())


def _from_mapping(
    thd: Any, cp_size: int | None, max_seqlen: int | None, validate: bool
) -> ThdLayout:
    """Build the layout of a batch dict (see :func:`as_layout`)."""
    cu, cup = _boundaries_of(thd)
    stored_cp = thd.get("cp_size", 1)
    if cp_size is None:
        cp_size = stored_cp
    check_cp_args(cp_size)
    cp_rank = thd.get("cp_rank", 0) if cp_size == stored_cp else 0
    host = cu.device.type == "cpu" and cup.device.type == "cpu"
    pad = _pad_flag_of(thd, cu, cup, host)
    if max_seqlen is None:
        max_seqlen = _max_seqlen_of(thd, cu, cup, host, pad, cp_size)
    else:
        _check_max_seqlen(max_seqlen)
    ids = thd.get("input_ids")
    total = ids.shape[0] * cp_size if isinstance(ids, torch.Tensor) and ids.dim() else None
    fields = dict(
        cu_seqlens=cu,
        cu_seqlens_padded=cup,
        num_seqs=cu.shape[0] - 1 if cu.dim() == 1 else -1,
        max_seqlen=max_seqlen,
        total_tokens=total,
        pad_between_seqs=pad,
        cp_size=cp_size,
        cp_rank=cp_rank,
        absorbed_trailing_pad=_absorbed_of(thd, cu, pad, cp_size),
    )
    if cp_size > 1 and thd.get("cp_strategy", DUAL_CHUNK_SWAP) != DUAL_CHUNK_SWAP:
        fields["cp_strategy"] = thd["cp_strategy"]
    return ThdLayout(**fields) if validate else _trusted(**fields)
