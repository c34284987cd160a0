"""Context-parallel (CP) token partition for THD batches, bit-identical to Transformer Engine.

TE's THD context parallelism splits every sequence into ``2 * cp_size`` equal chunks
and gives rank ``r`` chunks ``r`` and ``2 * cp_size - 1 - r`` (the causal-attention
load balance: an early chunk with little work paired with a late one with much).
Rank ``r``'s local stream is, for each sequence in order, its chunk ``r`` followed by
its chunk ``2 * cp_size - 1 - r``. This module computes that partition on the CPU or a
GPU, with the same values as TE's ``tex.thd_get_partitioned_indices``:

    sequence i, padded length L_i, start s_i, chunk c_i = L_i / (2 * cp_size):
    rank r receives  [s_i + r*c_i, s_i + (r+1)*c_i)  then
                     [s_i + (2cp-1-r)*c_i, s_i + (2cp-r)*c_i)

Layout math only: no communication lives here (that is ``te_thd.attention``); the rule
itself is written once per place it runs in ``te_thd._partition``.

Everything is vectorised: one repeat of 2N per-run shifts plus an arange, no loop
over tokens or sequences. Boundaries on the CPU (where the DataLoader worker computed
them) take a numpy path -- the layout is tiny and numpy's per-call cost is a fraction
of torch's -- with the checks folded into the index math; boundaries on a device take
a pure-torch path (``repeat_interleave`` with a host-known output size) with no
host-device synchronisation, so it can run in the training step. Layout *checks*
need host values: they run automatically for CPU boundaries and are otherwise left to
:func:`validate_cp_layout`, which the caller runs on the CPU copy.

Sentinel-padded boundary arrays (fixed-shape / chunked batches, e.g. one row of
``split_batch_into_thd_chunks``'s ``cu_seqlens_padded``) are accepted: pass the
host-side valid count as ``num_seqs`` to slice them, or leave it ``None`` and the
trailing sentinels (negative, e.g. -1000) are neutralised with a running maximum,
which turns them into zero-length sequences -- no device ``argmin`` and no sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from te_thd._cp_strategy import DUAL_CHUNK_SWAP, NO_LOAD_BALANCE, STRATEGIES, normalize_strategy
from te_thd._partition import (
    check_boundaries_tensor,
    check_total_tokens,
    indices,
    partition_np,
    validated_np,
)
from te_thd.args import check_names
from te_thd.boundaries import check_cp_args, host_int64
from te_thd.layout import LAYOUT_KEY, ThdLayout, derive_unchecked

__all__ = [
    "STRATEGIES",
    "cp_rank_to_sequence_order",
    "partition_indices",
    "sequence_to_cp_rank_order",
    "shard_thd_batch_for_cp",
    "validate_cp_layout",
]

# Keys of a converted THD batch (``process_input_for_thd``) that are per-token
# ``[T, ...]`` tensors and therefore get sliced for a CP rank. Everything else
# (``cu_seqlens*``, ``max_seqlen*``, ``pad_between_seqs``, ...) stays global, as TE
# expects when it is given a ``cp_group``.
_TOKEN_KEYS = ("input_ids", "labels", "padding_mask")


# --------------------------------------------------------------------------- rule


def validate_cp_layout(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    num_seqs: int | None = None,
    *,
    strategy: Any = DUAL_CHUNK_SWAP,
) -> None:
    """Check that a THD layout can be partitioned for ``cp_size`` CP ranks (host-side).

    Args:
        cu_seqlens_padded: ``[N+1]`` (or sentinel-right-padded ``[M]``) integer physical
            boundaries. Read on the host: pass the CPU copy (a CUDA tensor costs a sync).
        total_tokens: length ``T`` of the packed token stream.
        cp_size: context-parallel world size.
        num_seqs: host-side count of valid sequences when the array is sentinel-padded;
            ``None`` treats every entry from the first negative one on as a sentinel.
        strategy: ``"dual_chunk_swap"`` (default) or ``"no_load_balance"``, or TE's
            ``CPLoadBalancingStrategy`` member (see :data:`STRATEGIES`).

    Raises:
        ValueError: naming the first offending sequence, its padded length and the
            required multiple ``2 * cp_size``; or ``total_tokens`` not divisible by
            ``2 * cp_size``; or boundaries that do not start at 0, decrease, or do not
            end at ``total_tokens``. Under ``"no_load_balance"`` the padded lengths
            need no multiple and ``total_tokens`` a multiple of ``cp_size`` only.
    """
    check_cp_args(cp_size)
    strategy = normalize_strategy(strategy)
    check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    check_total_tokens(total_tokens)
    validated_np(
        host_int64(cu_seqlens_padded),
        total_tokens,
        cp_size,
        num_seqs,
        balanced=strategy != NO_LOAD_BALANCE,
    )


def partition_indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
    num_seqs: int | None = None,
    *,
    check: bool | None = None,
    strategy: Any = DUAL_CHUNK_SWAP,
) -> torch.Tensor:
    """Token indices CP rank ``cp_rank`` owns, exactly as TE's ``thd_get_partitioned_indices``.

    Args:
        cu_seqlens_padded: int32/int64 ``[N+1]`` physical boundaries (``cu_seqlens_padded``
            of ``process_input_for_thd``), or a sentinel-right-padded row ``[M]``.
        total_tokens: length ``T`` of the packed stream; ``T % (2*cp_size) == 0``.
        cp_size: context-parallel world size.
        cp_rank: this rank in the CP group, ``0 <= cp_rank < cp_size``.
        num_seqs: host-side number of valid sequences in a sentinel-padded array (slices
            it without a device ``argmin``); ``None``: trailing negative sentinels are
            neutralised sync-free.
        check: run :func:`validate_cp_layout` first. Default: only when the boundaries
            are on the CPU (a check on a CUDA tensor would sync the device).
        strategy: ``"dual_chunk_swap"`` (default), ``"no_load_balance"``, or TE's
            ``CPLoadBalancingStrategy`` member: the partition TE's
            ``get_thd_partitioned_indices`` computes for it.

    Returns:
        int64 ``[total_tokens // cp_size]`` on the device of ``cu_seqlens_padded``. Dual
        chunk swap: for each sequence in order, its chunk ``cp_rank`` then its chunk
        ``2*cp_size-1-cp_rank``. No load balance: ``arange(cp_rank * T/cp, (cp_rank+1)
        * T/cp)``, whatever the sequences. ``cp_size == 1`` gives ``arange(total_tokens)``.

    Raises:
        ValueError: a bad argument or layout (see :func:`validate_cp_layout`); an unknown
            ``strategy``, in one line listing the accepted values.
    """
    check_cp_args(cp_size, cp_rank)
    strategy = normalize_strategy(strategy)
    return indices(cu_seqlens_padded, total_tokens, cp_size, (cp_rank,), num_seqs, check, strategy)


def _rank_order_permutation(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    num_seqs: int | None,
    check: bool | None,
    strategy: Any,
) -> torch.Tensor:
    """int64 ``[T]``: concatenation of ``partition_indices`` for ranks 0..cp_size-1."""
    check_cp_args(cp_size)
    strategy = normalize_strategy(strategy)
    ranks = tuple(range(cp_size))
    return indices(cu_seqlens_padded, total_tokens, cp_size, ranks, num_seqs, check, strategy)


def _dim_size(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for x of shape {tuple(x.shape)}")
    return x.shape[dim]


def sequence_to_cp_rank_order(
    x: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    dim: int = 0,
    num_seqs: int | None = None,
    *,
    check: bool | None = None,
    strategy: Any = DUAL_CHUNK_SWAP,
) -> torch.Tensor:
    """Reorder ``x`` from sequence order to CP-rank order along ``dim``.

    The result is rank 0's partition, then rank 1's, ... -- i.e. what the per-rank
    shards look like when all-gathered and concatenated in rank order. The index is
    built on the host from CPU boundaries, or sync-free on the boundaries' device.
    Moving between Megatron's contiguous path and TE's load-balanced one is
    ``sequence_to_cp_rank_order(cp_rank_to_sequence_order(x, cu, cp,
    strategy="no_load_balance"), cu, cp)``; under ``"no_load_balance"`` the rank order
    *is* the sequence order (TE's all-gather returns it as is).

    Args:
        x: ``[..., T, ...]`` with the token axis at ``dim`` (any dtype, autograd-safe).
        cu_seqlens_padded: int ``[N+1]`` (or sentinel-padded) physical boundaries.
        cp_size: context-parallel world size.
        dim: token axis of ``x``.
        num_seqs, check, strategy: as in :func:`partition_indices`.

    Returns:
        A new tensor shaped like ``x`` (``index_select`` along ``dim``).
    """
    total = _dim_size(x, dim)
    perm = _rank_order_permutation(cu_seqlens_padded, total, cp_size, num_seqs, check, strategy)
    return x.index_select(dim, perm.to(x.device, non_blocking=True))


def cp_rank_to_sequence_order(
    x: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    dim: int = 0,
    num_seqs: int | None = None,
    *,
    check: bool | None = None,
    strategy: Any = DUAL_CHUNK_SWAP,
) -> torch.Tensor:
    """Exact inverse of :func:`sequence_to_cp_rank_order` along ``dim`` (same ``strategy``).

    Use it on per-rank shards all-gathered and concatenated in rank order (e.g. K/V
    under CP) to restore the original sequence order. Autograd-safe (``index_select``).

    Args/Returns: as in :func:`sequence_to_cp_rank_order`; ``x`` is ``[..., T, ...]``.
    """
    total = _dim_size(x, dim)
    perm = _rank_order_permutation(cu_seqlens_padded, total, cp_size, num_seqs, check, strategy)
    # The inverse permutation by one scatter (O(T)) instead of an argsort (O(T log T)).
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(total, device=perm.device, dtype=perm.dtype)
    return x.index_select(dim, inverse.to(x.device, non_blocking=True))


# --------------------------------------------------------------------------- batches


def _index_on(
    idx: torch.Tensor, device: torch.device, moved: dict[torch.device, torch.Tensor]
) -> torch.Tensor:
    """``idx`` on ``device``, copied (``non_blocking``) at most once per device via ``moved``."""
    out = moved.get(device)
    if out is None:
        out = moved[device] = idx.to(device, non_blocking=True)
    return out


def shard_thd_batch_for_cp(
    thd: Mapping[str, Any] | ThdLayout,
    cp_size: int,
    cp_rank: int,
    extra_keys: Sequence[str] = (),
    *,
    num_seqs: int | None = None,
    layout: ThdLayout | None = None,
    strategy: Any = DUAL_CHUNK_SWAP,
) -> dict[str, Any]:
    """Slice a converted THD batch (``process_input_for_thd`` output) for one CP rank.

    Sliced with :func:`partition_indices` (each ``[T, ...]`` tensor becomes
    ``[T // cp_size, ...]``): ``input_ids`` (``[T]`` or ``[T, H]``), ``labels``,
    ``padding_mask``, ``position_ids`` (``[T]``, or ``[n_rope, 1, T]`` for mRoPE, sliced
    along its last axis) and every key named in ``extra_keys`` (``[T, ...]``, dim 0).
    ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``, ``max_seqlen_int``,
    ``pad_between_seqs`` and all other keys stay global -- TE's THD attention with a
    ``cp_group`` expects the global boundaries. The output also records ``cp_size`` and
    ``cp_rank``.

    The partition uses the batch's :class:`~te_thd.layout.ThdLayout` when there is one
    (``layout=``, or the batch's ``"thd_layout"`` entry; the output then carries
    ``layout.sharded(cp_size, cp_rank)`` under ``"thd_layout"``), else the dict's
    ``cu_seqlens_padded`` (``cu_seqlens`` when it has no padded boundaries), with
    ``num_seqs`` the host-side valid count of a sentinel-padded boundary array. Index
    tensors are built on the boundaries' device and moved to each tensor's device
    with ``non_blocking=True``.

    ``cp_size == 1`` returns ``thd`` itself, unchanged. A bare :class:`~te_thd.layout.ThdLayout`
    (no tokens) returns ``thd.sharded(cp_size, cp_rank)``: the rank's view of the layout.

    ``strategy`` (see :func:`partition_indices`) picks the partition; a batch sharded
    with ``"no_load_balance"`` also records ``cp_strategy`` (and its layout's
    ``cp_strategy``), which the attention adapters read.

    Raises:
        ValueError: bad ``cp_size`` / ``cp_rank``; missing ``input_ids`` or boundaries;
            an ``extra_keys`` entry missing or not ``[T, ...]``; a layout that cannot be
            partitioned (see :func:`validate_cp_layout`).
    """
    # This runs once per batch around ~4 gathers of ~4 us each (32k tokens, cp=8), so
    # the Python here is kept lean: valid arguments are accepted by cheap exact tests
    # and only anything else goes to the full checks (same errors, same messages).
    if type(cp_size) is not int or type(cp_rank) is not int or not 0 <= cp_rank < cp_size:
        check_cp_args(cp_size, cp_rank)
    if strategy is not DUAL_CHUNK_SWAP:
        strategy = normalize_strategy(strategy)
    if extra_keys:
        extra_keys = check_names("extra_keys", extra_keys)  # type: ignore[assignment]
    if isinstance(thd, ThdLayout):  # a layout alone, no tokens: the rank's view of it
        return thd.sharded(cp_size, cp_rank, strategy=strategy)  # type: ignore[return-value]
    if cp_size == 1:
        return thd  # type: ignore[return-value]
    total = _token_count(thd)
    if layout is None:
        layout = thd.get(LAYOUT_KEY)
    if isinstance(layout, ThdLayout):
        cu, num_seqs = _layout_boundaries(layout, total)
    else:
        layout = None
        cu, num_seqs = _dict_boundaries(thd, num_seqs)
    if strategy == DUAL_CHUNK_SWAP:
        idx = _rank_indices(cu, total, cp_size, cp_rank, num_seqs)
    else:
        idx = partition_indices(cu, total, cp_size, cp_rank, num_seqs, strategy=strategy)
    out = _gather_tokens(thd, idx, extra_keys)
    out["cp_size"] = cp_size
    out["cp_rank"] = cp_rank
    more = {}
    if strategy != DUAL_CHUNK_SWAP:
        out["cp_strategy"] = more["cp_strategy"] = strategy
    if layout is not None:
        # layout.sharded(cp_size, cp_rank) without its re-validation: the layout was
        # checked when built, and the partition above just proved the cp_size rules
        # (padded lengths multiples of 2*cp_size, boundaries covering the stream)
        out[LAYOUT_KEY] = derive_unchecked(layout, cp_size=cp_size, cp_rank=cp_rank, **more)
    return out


def _token_count(thd: Mapping[str, Any]) -> int:
    """``T`` of an unsharded converted batch, from its ``input_ids`` ``[T]`` / ``[T, H]``."""
    # (an exact type test first: the ABC isinstance check costs ~0.3 us per batch)
    mapping = type(thd) is dict or isinstance(thd, Mapping)
    input_ids = thd.get("input_ids") if mapping else None
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(
            "thd must hold the flattened token tensor 'input_ids' ([T] or [T, H]); "
            "convert the BSHD batch with te_thd.thd_utils.process_input_for_thd first"
        )
    if input_ids.dim() not in (1, 2):
        raise ValueError(
            f"thd['input_ids'] must be [T] or [T, H], got shape {tuple(input_ids.shape)}; "
            "a chunked batch ([C, ...]) must be sharded one chunk at a time"
        )
    return input_ids.shape[0]


def _layout_boundaries(layout: ThdLayout, total: int) -> tuple[torch.Tensor, int]:
    """Partition input of a batch whose layout is known: its padded boundaries and ``N``."""
    if layout.cp_size != 1:
        raise ValueError(
            f"the batch's ThdLayout is already sharded (cp_size={layout.cp_size}, "
            f"cp_rank={layout.cp_rank}); shard the unsharded batch once per rank"
        )
    if layout.total_tokens is not None and layout.total_tokens != total:
        raise ValueError(
            f"the ThdLayout covers total_tokens={layout.total_tokens} but thd['input_ids'] "
            f"holds {total} tokens; pass the layout built from this batch "
            "(ThdLayout.from_thd(thd))"
        )
    return layout.cu_seqlens_padded, layout.num_seqs


def _dict_boundaries(thd: Mapping[str, Any], num_seqs: int | None) -> tuple[Any, int | None]:
    """Partition input read from a batch dict: padded boundaries and the host count."""
    cu = thd.get("cu_seqlens_padded")
    if cu is None:
        cu = thd.get("cu_seqlens")
    if not isinstance(cu, torch.Tensor):
        raise ValueError(
            "thd must hold 'cu_seqlens_padded' (or 'cu_seqlens') as a tensor; "
            "convert the BSHD batch with te_thd.thd_utils.process_input_for_thd first"
        )
    if num_seqs is None:
        stored = thd.get("num_seqs")
        if isinstance(stored, int):
            num_seqs = stored  # host-side count from process_input_for_thd
    return cu, num_seqs


def _rank_indices(
    cu: torch.Tensor, total: int, cp_size: int, cp_rank: int, num_seqs: int | None
) -> torch.Tensor:
    """This rank's token indices; CPU int32/int64 boundaries take the checked fast path."""
    if cu.is_cpu and cu.dtype in (torch.int32, torch.int64):
        # hot path (the DataLoader worker): native-dtype host indices; anything the
        # fast path cannot prove valid goes through partition_indices' full checks
        n = cu.shape[0]
        if num_seqs is None or (type(num_seqs) is int and 0 <= num_seqs < n):
            cu_np = cu.numpy()
            if num_seqs is not None and num_seqs + 1 != n:
                cu_np = cu_np[: num_seqs + 1]
            fast = partition_np(cu_np, total, cp_size, (cp_rank,))
            if fast is not None:
                return torch.from_numpy(fast)
    return partition_indices(cu, total, cp_size, cp_rank, num_seqs)


def _gather_tokens(
    thd: Mapping[str, Any], idx: torch.Tensor, extra_keys: Sequence[str]
) -> dict[str, Any]:
    """A copy of ``thd`` with every per-token tensor replaced by its rows at ``idx``."""
    get = thd.get
    total = get("input_ids").shape[0]
    # Tensors on the index's device (the common case: all on the CPU) use it directly;
    # copies for other devices are made once per device, on first use.
    idx_device = idx.device
    idx_on_cpu = idx_device.type == "cpu"
    moved: dict[torch.device, torch.Tensor] = {}

    out = dict(thd)
    for k in (*_TOKEN_KEYS, *extra_keys) if extra_keys else _TOKEN_KEYS:
        v = get(k)
        if v is None and k in _TOKEN_KEYS:
            continue
        if not isinstance(v, torch.Tensor) or not v.dim() or v.shape[0] != total:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"thd[{k!r}] must be a [T, ...] tensor with T={total} (the length of "
                f"input_ids), got {shape}; name only per-token tensors in extra_keys"
            )
        same = v.is_cpu if idx_on_cpu else v.device == idx_device
        out[k] = v.index_select(0, idx if same else _index_on(idx, v.device, moved))
    pos = get("position_ids")
    if isinstance(pos, torch.Tensor):
        ndim = pos.dim()
        if ndim == 3 and pos.shape[1:] == (1, total):
            dim = 2  # mRoPE [n_rope, 1, T]
        elif ndim and pos.shape[0] == total:
            dim = 0
        else:
            raise ValueError(
                f"thd['position_ids'] must be [T] or [n_rope, 1, T] with T={total}, "
                f"got {tuple(pos.shape)}"
            )
        same = pos.is_cpu if idx_on_cpu else pos.device == idx_device
        out["position_ids"] = pos.index_select(
            dim, idx if same else _index_on(idx, pos.device, moved)
        )
    return out
