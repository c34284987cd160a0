"""Context-parallel (CP) token partition for THD batches, bit-identical to Transformer Engine.

TE's THD context parallelism splits every sequence into ``2 * cp_size`` equal chunks
and gives rank ``r`` chunks ``r`` and ``2 * cp_size - 1 - r`` (the causal-attention
load balance: an early chunk with little work paired with a late one with much).
Rank ``r``'s local stream is, for each sequence in order, its chunk ``r`` followed by
its chunk ``2 * cp_size - 1 - r``. This module computes that partition in pure torch
(CPU or GPU), with the same values as TE's ``tex.thd_get_partitioned_indices``:

    sequence i, padded length L_i, start s_i, chunk c_i = L_i / (2 * cp_size):
    rank r receives  [s_i + r*c_i, s_i + (r+1)*c_i)  then
                     [s_i + (2cp-1-r)*c_i, s_i + (2cp-r)*c_i)

Layout math only: no communication lives here (that is ``te_thd.attention``).

Everything is vectorised (one ``repeat_interleave`` with a host-known output size)
and free of host-device synchronisation, so it can run on the GPU in the training
step. Layout *checks* need host values; they run automatically when the boundary
array is on the CPU (where the DataLoader worker computed it) and are otherwise
left to :func:`validate_cp_layout`, which the caller runs on the CPU copy.

Sentinel-padded boundary arrays (fixed-shape / chunked batches, e.g. one row of
``split_batch_into_thd_chunks``'s ``cu_seqlens_padded``) are accepted: pass the
host-side valid count as ``num_seqs`` to slice them, or leave it ``None`` and the
trailing sentinels (negative, e.g. -1000) are neutralised with a running maximum,
which turns them into zero-length sequences -- no device ``argmin`` and no sync
(SPEC §6, Megatron-Bridge PR 4489).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
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


# --------------------------------------------------------------------------- checks


def _check_cp_args(cp_size: Any, *cp_rank: Any) -> None:
    """Check ``cp_size`` and, when given, ``cp_rank``."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    for rank in cp_rank:
        _check_cp_rank(cp_size, rank)


def _check_cp_rank(cp_size: int, cp_rank: Any) -> None:
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}; "
            "pass this process's rank in its context-parallel group"
        )


def _check_total_tokens(total_tokens: Any) -> None:
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
        raise ValueError(f"total_tokens must be an int >= 0, got {total_tokens!r}")


def _check_boundaries_tensor(cu_seqlens_padded: Any, num_seqs: int | None) -> torch.Tensor:
    if not isinstance(cu_seqlens_padded, torch.Tensor):
        raise ValueError(
            f"cu_seqlens_padded must be a torch.Tensor, got {type(cu_seqlens_padded).__name__}"
        )
    if cu_seqlens_padded.dim() != 1:
        raise ValueError(
            f"cu_seqlens_padded must be 1-D [N+1], got shape {tuple(cu_seqlens_padded.shape)}; "
            "for a chunked batch ([C, maxN+1]) pass one row per chunk together with its "
            "host-side valid count as num_seqs"
        )
    if cu_seqlens_padded.dtype.is_floating_point or cu_seqlens_padded.dtype in (
        torch.bool,
        torch.complex64,
        torch.complex128,
    ):
        raise ValueError(
            f"cu_seqlens_padded must have an integer dtype (int32/int64), got {cu_seqlens_padded.dtype}"
        )
    if cu_seqlens_padded.numel() < 1:
        raise ValueError("cu_seqlens_padded must hold at least one boundary (the leading 0), got 0")
    if num_seqs is not None:
        if isinstance(num_seqs, bool) or not isinstance(num_seqs, int):
            raise ValueError(f"num_seqs must be an int or None, got {num_seqs!r}")
        if not 0 <= num_seqs <= cu_seqlens_padded.numel() - 1:
            raise ValueError(
                f"num_seqs={num_seqs} is out of range for cu_seqlens_padded of length "
                f"{cu_seqlens_padded.numel()} (it must be in [0, {cu_seqlens_padded.numel() - 1}])"
            )
    return cu_seqlens_padded


def _valid_boundaries(cu_seqlens_padded: torch.Tensor, num_seqs: int | None) -> torch.Tensor:
    """The ``[N+1]`` int64 boundary array with sentinels removed or neutralised (no sync)."""
    cu = cu_seqlens_padded.to(torch.int64)
    if num_seqs is not None:
        return cu[: num_seqs + 1]
    # Sentinels are negative and trail the valid prefix, so a running maximum turns
    # them into repeats of the last real boundary, i.e. zero-length sequences that
    # contribute no tokens. On a valid array (non-decreasing) this is the identity.
    return torch.cummax(cu, dim=0).values


def validate_cp_layout(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    num_seqs: int | None = None,
) -> None:
    """Check that a THD layout can be partitioned for ``cp_size`` CP ranks (host-side).

    Args:
        cu_seqlens_padded: ``[N+1]`` (or sentinel-right-padded ``[M]``) integer physical
            boundaries. Read on the host: pass the CPU copy (a CUDA tensor costs a sync).
        total_tokens: length ``T`` of the packed token stream.
        cp_size: context-parallel world size.
        num_seqs: host-side count of valid sequences when the array is sentinel-padded;
            ``None`` treats every entry from the first negative one on as a sentinel.

    Raises:
        ValueError: naming the first offending sequence, its padded length and the
            required multiple ``2 * cp_size``; or ``total_tokens`` not divisible by
            ``2 * cp_size``; or boundaries that do not start at 0, decrease, or do not
            end at ``total_tokens``.
    """
    _check_cp_args(cp_size)
    cu_t = _check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    _check_total_tokens(total_tokens)
    multiple = 2 * cp_size
    if cp_size > 1 and total_tokens % multiple != 0:
        raise ValueError(
            f"total_tokens={total_tokens} is not divisible by 2*cp_size={multiple}; "
            f"pad every sequence (and so the stream) to a multiple of {multiple}, e.g. "
            f"PackingCollator(pad_to_multiple_of=pad_to_multiple_for(cp_size={cp_size}))"
        )
    cu = cu_t.detach().to("cpu", torch.int64)
    if num_seqs is not None:
        cu = cu[: num_seqs + 1]
    else:
        negative = (cu < 0).nonzero()
        if negative.numel():
            first = int(negative[0, 0])
            tail = cu[first:]
            if bool((tail >= 0).any()):
                bad = first + int((tail >= 0).nonzero()[0, 0])
                raise ValueError(
                    f"cu_seqlens_padded has a non-negative entry {int(cu[bad])} at index {bad} "
                    f"after the sentinel at index {first}; sentinels (negative) must only "
                    "right-pad the array -- pass num_seqs to say how many sequences are valid"
                )
            cu = cu[:first]
            if cu.numel() == 0:
                raise ValueError(
                    "cu_seqlens_padded holds only sentinels; it must start with boundary 0"
                )
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_padded[0] must be 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    decreasing = (lengths < 0).nonzero()
    if decreasing.numel():
        i = int(decreasing[0, 0])
        raise ValueError(
            f"cu_seqlens_padded must be non-decreasing: sequence {i} has negative padded "
            f"length {int(lengths[i])} (boundaries {int(cu[i])} -> {int(cu[i + 1])})"
        )
    if cp_size > 1:
        bad_div = (lengths % multiple != 0).nonzero()
        if bad_div.numel():
            i = int(bad_div[0, 0])
            raise ValueError(
                f"sequence {i} has padded length {int(lengths[i])}, which is not a multiple of "
                f"2*cp_size={multiple} (TE's THD context parallelism splits every sequence into "
                f"{multiple} equal chunks); pad every sequence to a multiple of {multiple}, e.g. "
                f"PackingCollator(pad_to_multiple_of=pad_to_multiple_for(cp_size={cp_size}))"
            )
    last = int(cu[-1])
    if last != total_tokens:
        raise ValueError(
            f"cu_seqlens_padded ends at {last} but total_tokens={total_tokens}; the padded "
            "boundaries must cover the whole stream (TE assigns tokens past the last boundary "
            "to the last sequence and produces overlapping partitions) -- grow the last "
            "sequence's padded length to the end of the stream"
        )


# --------------------------------------------------------------------------- partition


def _chunk_ranges(
    cu: torch.Tensor, cp_size: int, ranks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source starts and lengths of the chunks ranks ``ranks`` own, in their output order.

    ``cu`` is the ``[N+1]`` int64 boundary array, ``ranks`` an int64 ``[R]`` tensor.
    Returns ``(starts, lengths)``, each int64 ``[R * N * 2]``, ordered rank-major, then
    sequence, then (chunk r, chunk 2cp-1-r).
    """
    begin = cu[:-1]  # [N]
    chunk = (cu[1:] - begin) // (2 * cp_size)  # [N]
    r = ranks.view(-1, 1)  # [R, 1]
    first = begin + r * chunk  # [R, N]
    second = begin + (2 * cp_size - 1 - r) * chunk  # [R, N]
    starts = torch.stack((first, second), dim=-1).reshape(-1)
    lengths = chunk.view(1, -1, 1).expand(r.shape[0], -1, 2).reshape(-1)
    return starts, lengths


def _gather_ranges(starts: torch.Tensor, lengths: torch.Tensor, output_size: int) -> torch.Tensor:
    """Concatenate ``arange(starts[k], starts[k] + lengths[k])`` over k -> int64 ``[output_size]``.

    One ``repeat_interleave`` with a host-known ``output_size`` (no device sync) of the
    per-range shift, plus an arange: index j of range k is ``j_out + starts[k] - offset[k]``.
    """
    out_offsets = torch.cumsum(lengths, dim=0) - lengths
    shift = torch.repeat_interleave(starts - out_offsets, lengths, output_size=output_size)
    return shift.add_(torch.arange(output_size, device=starts.device, dtype=torch.int64))


def _maybe_validate(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    num_seqs: int | None,
    check: bool | None,
) -> None:
    _check_total_tokens(total_tokens)
    if check is None:
        check = cu_seqlens_padded.device.type == "cpu"
    if check:
        validate_cp_layout(cu_seqlens_padded, total_tokens, cp_size, num_seqs)


def partition_indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
    num_seqs: int | None = None,
    *,
    check: bool | None = None,
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

    Returns:
        int64 ``[total_tokens // cp_size]`` on the device of ``cu_seqlens_padded``: for each
        sequence in order, its chunk ``cp_rank`` then its chunk ``2*cp_size-1-cp_rank``.
        ``cp_size == 1`` gives ``arange(total_tokens)`` (TE's rule reduces to the identity).
    """
    _check_cp_args(cp_size, cp_rank)
    _check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    _maybe_validate(cu_seqlens_padded, total_tokens, cp_size, num_seqs, check)
    device = cu_seqlens_padded.device
    if cp_size == 1:
        return torch.arange(total_tokens, device=device, dtype=torch.int64)
    cu = _valid_boundaries(cu_seqlens_padded, num_seqs)
    ranks = torch.full((1,), cp_rank, dtype=torch.int64, device=device)
    starts, lengths = _chunk_ranges(cu, cp_size, ranks)
    return _gather_ranges(starts, lengths, total_tokens // cp_size)


def _rank_order_permutation(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    num_seqs: int | None,
    check: bool | None,
) -> torch.Tensor:
    """int64 ``[T]``: concatenation of ``partition_indices`` for ranks 0..cp_size-1."""
    _check_cp_args(cp_size)
    _check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    _maybe_validate(cu_seqlens_padded, total_tokens, cp_size, num_seqs, check)
    device = cu_seqlens_padded.device
    if cp_size == 1:
        return torch.arange(total_tokens, device=device, dtype=torch.int64)
    cu = _valid_boundaries(cu_seqlens_padded, num_seqs)
    ranks = torch.arange(cp_size, device=device, dtype=torch.int64)
    starts, lengths = _chunk_ranges(cu, cp_size, ranks)
    return _gather_ranges(starts, lengths, total_tokens)


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
) -> torch.Tensor:
    """Reorder ``x`` from sequence order to CP-rank order along ``dim``.

    The result is rank 0's partition, then rank 1's, ... -- i.e. what the per-rank
    shards look like when all-gathered and concatenated in rank order.

    Args:
        x: ``[..., T, ...]`` with the token axis at ``dim`` (any dtype, autograd-safe).
        cu_seqlens_padded: int ``[N+1]`` (or sentinel-padded) physical boundaries.
        cp_size: context-parallel world size.
        dim: token axis of ``x``.
        num_seqs, check: as in :func:`partition_indices`.

    Returns:
        A new tensor shaped like ``x`` (``index_select`` along ``dim``).
    """
    total = _dim_size(x, dim)
    perm = _rank_order_permutation(cu_seqlens_padded, total, cp_size, num_seqs, check)
    return x.index_select(dim, perm.to(x.device, non_blocking=True))


def cp_rank_to_sequence_order(
    x: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    dim: int = 0,
    num_seqs: int | None = None,
    *,
    check: bool | None = None,
) -> torch.Tensor:
    """Exact inverse of :func:`sequence_to_cp_rank_order` along ``dim``.

    Use it on per-rank shards all-gathered and concatenated in rank order (e.g. K/V
    under CP) to restore the original sequence order. Autograd-safe (``index_select``).

    Args/Returns: as in :func:`sequence_to_cp_rank_order`; ``x`` is ``[..., T, ...]``.
    """
    total = _dim_size(x, dim)
    perm = _rank_order_permutation(cu_seqlens_padded, total, cp_size, num_seqs, check)
    # The inverse permutation by one scatter (O(T)) instead of an argsort (O(T log T)).
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(total, device=perm.device, dtype=perm.dtype)
    return x.index_select(dim, inverse.to(x.device, non_blocking=True))


# --------------------------------------------------------------------------- batches


def shard_thd_batch_for_cp(
    thd_batch: Mapping[str, Any],
    cp_size: int,
    cp_rank: int,
    extra_keys: Sequence[str] = (),
    *,
    num_seqs: int | None = None,
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

    The partition uses ``cu_seqlens_padded`` (``cu_seqlens`` when the batch has no
    padded boundaries). ``num_seqs`` is the host-side valid count for a sentinel-padded
    boundary array. Index tensors are built on the boundaries' device and moved to
    each tensor's device with ``non_blocking=True``.

    ``cp_size == 1`` returns ``thd_batch`` itself, unchanged.

    Raises:
        ValueError: bad ``cp_size`` / ``cp_rank``; missing ``input_ids`` or boundaries;
            an ``extra_keys`` entry missing or not ``[T, ...]``; a layout that cannot be
            partitioned (see :func:`validate_cp_layout`).
    """
    _check_cp_args(cp_size, cp_rank)
    if isinstance(extra_keys, str):
        raise ValueError(
            f"extra_keys must be a sequence of key names, got the string {extra_keys!r}; "
            f"write extra_keys=({extra_keys!r},)"
        )
    if cp_size == 1:
        return thd_batch  # type: ignore[return-value]
    if "input_ids" not in thd_batch or not isinstance(thd_batch["input_ids"], torch.Tensor):
        raise ValueError(
            "thd_batch must hold the flattened token tensor 'input_ids' ([T] or [T, H]); "
            "convert the BSHD batch with te_thd.thd_utils.process_input_for_thd first"
        )
    input_ids = thd_batch["input_ids"]
    if input_ids.dim() not in (1, 2):
        raise ValueError(
            f"thd_batch['input_ids'] must be [T] or [T, H], got shape {tuple(input_ids.shape)}; "
            "a chunked batch ([C, ...]) must be sharded one chunk at a time"
        )
    total = input_ids.shape[0]
    key = "cu_seqlens_padded" if thd_batch.get("cu_seqlens_padded") is not None else "cu_seqlens"
    cu = thd_batch.get(key)
    if not isinstance(cu, torch.Tensor):
        raise ValueError(
            "thd_batch must hold 'cu_seqlens_padded' (or 'cu_seqlens') as a tensor; "
            "convert the BSHD batch with te_thd.thd_utils.process_input_for_thd first"
        )
    if num_seqs is None and isinstance(thd_batch.get("num_seqs"), int):
        num_seqs = thd_batch["num_seqs"]  # host-side count from process_input_for_thd
    idx = partition_indices(cu, total, cp_size, cp_rank, num_seqs)
    on_device: dict[torch.device, torch.Tensor] = {idx.device: idx}

    def take(t: torch.Tensor, dim: int) -> torch.Tensor:
        i = on_device.get(t.device)
        if i is None:
            i = on_device[t.device] = idx.to(t.device, non_blocking=True)
        return t.index_select(dim, i)

    out = dict(thd_batch)
    for k in (*_TOKEN_KEYS, *extra_keys):
        v = thd_batch.get(k)
        if v is None and k in _TOKEN_KEYS:
            continue
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != total:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"thd_batch[{k!r}] must be a [T, ...] tensor with T={total} (the length of "
                f"input_ids), got {shape}; name only per-token tensors in extra_keys"
            )
        out[k] = take(v, 0)
    pos = thd_batch.get("position_ids")
    if isinstance(pos, torch.Tensor):
        if pos.dim() == 3 and pos.shape[1] == 1 and pos.shape[2] == total:
            out["position_ids"] = take(pos, 2)  # mRoPE [n_rope, 1, T]
        elif pos.dim() >= 1 and pos.shape[0] == total:
            out["position_ids"] = take(pos, 0)
        else:
            raise ValueError(
                f"thd_batch['position_ids'] must be [T] or [n_rope, 1, T] with T={total}, "
                f"got {tuple(pos.shape)}"
            )
    out["cp_size"] = cp_size
    out["cp_rank"] = cp_rank
    return out
