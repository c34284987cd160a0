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

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from te_thd.layout import LAYOUT_KEY, ThdLayout, check_cp_args

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


def _host_boundaries(cu_seqlens_padded: torch.Tensor) -> np.ndarray:
    """int64 numpy copy/view of the boundaries (a device tensor is copied: a sync)."""
    if cu_seqlens_padded.device.type != "cpu":
        cu_seqlens_padded = cu_seqlens_padded.detach().cpu()
    return cu_seqlens_padded.numpy().astype(np.int64, copy=False)  # read-only use below


def _strip_sentinels(cu: np.ndarray) -> np.ndarray:
    """Valid prefix of a boundary array right-padded with negative sentinels."""
    negative = cu < 0
    first = int(negative.argmax())
    tail = negative[first:]
    if np.count_nonzero(tail) != tail.size:
        bad = first + int((~tail).argmax())
        raise ValueError(
            f"cu_seqlens_padded has a non-negative entry {int(cu[bad])} at index {bad} "
            f"after the sentinel at index {first}; sentinels (negative) must only "
            "right-pad the array -- pass num_seqs to say how many sequences are valid"
        )
    if first == 0:
        raise ValueError("cu_seqlens_padded holds only sentinels; it must start with boundary 0")
    return cu[:first]


def _validated_np(
    cu: np.ndarray, total_tokens: int, cp_size: int, num_seqs: int | None
) -> np.ndarray:
    """Check a host boundary array (see :func:`validate_cp_layout`); return its valid ``[N+1]``.

    The common, valid case costs a handful of numpy calls (this runs on every shard);
    the error paths take their time to name the offending entry.
    """
    multiple = 2 * cp_size
    if cp_size > 1 and total_tokens % multiple != 0:
        raise ValueError(
            f"total_tokens={total_tokens} is not divisible by 2*cp_size={multiple}; "
            f"pad every sequence (and so the stream) to a multiple of {multiple}, e.g. "
            f"PackingCollator(pad_to_multiple_of=pad_to_multiple_for(cp_size={cp_size}))"
        )
    if num_seqs is not None:
        cu = cu[: num_seqs + 1]
    elif cu[-1] < 0:  # sentinels trail; one in the middle shows up as a decrease below
        cu = _strip_sentinels(cu)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_padded[0] must be 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if np.count_nonzero(lengths < 0):
        if num_seqs is None and np.count_nonzero(cu < 0):
            _strip_sentinels(cu)  # raises, naming the misplaced sentinel
        i = int((lengths < 0).argmax())
        raise ValueError(
            f"cu_seqlens_padded must be non-decreasing: sequence {i} has negative padded "
            f"length {int(lengths[i])} (boundaries {int(cu[i])} -> {int(cu[i + 1])})"
        )
    if cp_size > 1 and np.count_nonzero(lengths % multiple):
        i = int((lengths % multiple != 0).argmax())
        raise ValueError(
            f"sequence {i} has padded length {int(lengths[i])}, which is not a multiple of "
            f"2*cp_size={multiple} (TE's THD context parallelism splits every sequence into "
            f"{multiple} equal chunks); pad every sequence to a multiple of {multiple}, e.g. "
            f"PackingCollator(pad_to_multiple_of=pad_to_multiple_for(cp_size={cp_size}))"
        )
    if cu[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens_padded ends at {int(cu[-1])} but total_tokens={total_tokens}; the "
            "padded boundaries must cover the whole stream (TE assigns tokens past the last "
            "boundary to the last sequence and produces overlapping partitions) -- grow the "
            "last sequence's padded length to the end of the stream"
        )
    return cu


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
    check_cp_args(cp_size)
    _check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    _check_total_tokens(total_tokens)
    _validated_np(_host_boundaries(cu_seqlens_padded), total_tokens, cp_size, num_seqs)


# --------------------------------------------------------------------------- partition
#
# Two transcriptions of one rule: numpy for boundaries on the CPU (the DataLoader
# case; numpy's per-call overhead is ~1 us against torch's ~3-5 us, and the arrays are
# tiny until the final per-token pass) and torch for boundaries on a device (no sync).
# tests/test_cp.py checks both against the loop oracle.
#
# Both use TE's own arithmetic: with c_i = L_i / (2cp), rank r's local stream holds
# sequence i's chunk r at local offset s_i / cp and its chunk 2cp-1-r right after, so
# local token j of those two runs comes from j + shift, where
#   shift_first  = s_i - s_i / cp + r * c_i
#   shift_second = s_i - s_i / cp + (2cp - 2 - r) * c_i
# (TE: ``index += cu_s[seq] * world_size + seq_len / 2 * offset``). One repeat of the
# 2N shifts over the run lengths plus an arange gives every index.


@functools.lru_cache(maxsize=8)
def _arange_np(n: int, dtype: type = np.int64) -> np.ndarray:
    """Read-only ``arange(n)``, cached: the partition length repeats batch after batch."""
    out = np.arange(n, dtype=dtype)
    out.flags.writeable = False
    return out


def _indices_np(cu: np.ndarray, total_tokens: int, cp_size: int, ranks: list[int]) -> np.ndarray:
    """Host path. ``cu``: int64 ``[N+1]`` boundaries; returns int64 ``[len(ranks) * T / cp]``."""
    local = total_tokens // cp_size
    begin = cu[:-1]
    chunk = (cu[1:] - begin) // (2 * cp_size)  # [N]
    base = begin - begin // cp_size  # [N]
    if len(ranks) == 1:  # the hot path: a handful of numpy calls on [N] arrays
        r = ranks[0]
        shifts = np.empty((chunk.shape[0], 2), dtype=np.int64)
        shifts[:, 0] = base + r * chunk
        shifts[:, 1] = base + (2 * cp_size - 2 - r) * chunk
        runs = np.repeat(chunk, 2)
    else:
        rr = np.asarray(ranks, dtype=np.int64).reshape(-1, 1)  # [R, 1]
        # rank-major: rank k's block starts at local offset k * T / cp
        base = base - np.arange(len(ranks), dtype=np.int64).reshape(-1, 1) * local  # [R, N]
        shifts = np.empty((len(ranks), chunk.shape[0], 2), dtype=np.int64)
        shifts[..., 0] = base + rr * chunk
        shifts[..., 1] = base + (2 * cp_size - 2 - rr) * chunk
        runs = np.tile(np.repeat(chunk, 2), len(ranks))
    index = np.repeat(shifts.reshape(-1), runs)
    if index.shape[0] != local * len(ranks):  # only reachable with check=False
        raise ValueError(
            f"cu_seqlens_padded describes {index.shape[0] // len(ranks)} tokens per rank, "
            f"expected total_tokens // cp_size = {local}; run validate_cp_layout on it"
        )
    index += _arange_np(index.shape[0])
    return index


def _indices_torch(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    ranks: list[int],
    num_seqs: int | None,
    total_tokens: int,
) -> torch.Tensor:
    """Device path: pure torch, no host-device synchronisation (output size is host-known)."""
    device = cu_seqlens_padded.device
    local = total_tokens // cp_size
    cu = _valid_boundaries(cu_seqlens_padded, num_seqs)
    begin = cu[:-1]
    chunk = (cu[1:] - begin) // (2 * cp_size)  # [N]
    if len(ranks) == 1:
        r = torch.full((1, 1), ranks[0], dtype=torch.int64, device=device)
    else:
        r = torch.arange(cp_size, dtype=torch.int64, device=device).view(-1, 1)
    block = torch.arange(len(ranks), dtype=torch.int64, device=device).view(-1, 1) * local
    base = (begin - torch.div(begin, cp_size, rounding_mode="floor")) - block  # [R, N]
    shifts = torch.stack((base + r * chunk, base + (2 * cp_size - 2 - r) * chunk), dim=-1)
    runs = chunk.view(1, -1, 1).expand(shifts.shape).reshape(-1)
    out_size = local * len(ranks)
    if device.type == "cpu":
        # no sync to avoid on the CPU, and torch 2.13's CPU kernel with output_size
        # dispatches to its thread pool even for tiny inputs (milliseconds when loaded)
        index = torch.repeat_interleave(shifts.reshape(-1), runs)
    else:
        index = torch.repeat_interleave(shifts.reshape(-1), runs, output_size=out_size)
    return index.add_(torch.arange(out_size, dtype=torch.int64, device=device))


@functools.lru_cache(maxsize=64)
def _rank_constants(
    cp_size: int, cp_rank: int, dtype: type = np.int64
) -> tuple[np.ndarray, np.ndarray]:
    """``(2*cp_size as a 0-d array, M)`` in ``dtype``, ``M`` ``[2, 2, 2]``.

    ``(q_i, q_{i+1}) @ M[0]`` = rank r's two shifts, ``@ M[1]`` = its two run lengths.
    (The 0-d divisor skips numpy's Python-int scalar promotion, ~0.25 us a call.)

    With ``a = 2cp-2-r`` and ``b = r``, sequence i (boundaries ``q_i, q_{i+1}`` in
    chunk units, chunk ``c_i = q_{i+1} - q_i``) has
        shift_first  = s_i - s_i/cp + r*c_i         = a*q_i + b*q_{i+1}
        shift_second = s_i - s_i/cp + (2cp-2-r)*c_i = b*q_i + a*q_{i+1}
    and both runs are ``c_i`` long. Every term is at most ``total_tokens``: no overflow.
    """
    a, b = 2 * cp_size - 2 - cp_rank, cp_rank
    mats = np.array([[[a, b], [b, a]], [[-1, -1], [1, 1]]], dtype=dtype)
    divisor = np.array(2 * cp_size, dtype=dtype)
    mats.flags.writeable = divisor.flags.writeable = False
    return divisor, mats


def _checked_rank_indices_np(
    cu: np.ndarray, total_tokens: int, cp_size: int, cp_rank: int
) -> np.ndarray | None:
    """One rank's indices for a *valid* layout in the fewest numpy calls, else None.

    The hot path of sharding: checks and index math share their arrays. It proves
    validity as it goes -- ends 0 and ``total_tokens``, every boundary (so every
    padded length) a multiple of 2*cp, none negative (``ndarray.repeat`` rejects a
    negative run length) -- and returns None on anything else, so the caller's full
    validation names the problem. Computes in ``cu``'s dtype (int32 or int64): int32
    boundaries (what ``process_input_for_thd`` emits) give int32 indices, half the
    memory traffic of int64 -- the index pass competes with the gathers for cache.

    Why it looks like this: it runs on every batch, and at 32k tokens / cp=8 the whole
    shard is ~4 gathers of ~4 us each, so every numpy call (~0.3-1 us of fixed cost on
    these tiny ``[N]`` arrays) counts: one divmod, one count, one matmul for shifts and
    run lengths together, one repeat, one add.
    """
    n = cu.shape[0] - 1  # sequences
    # (.item: Python ints, cheaper than numpy scalars)
    if total_tokens % (2 * cp_size) or n < 0 or cu.item(0) != 0 or cu.item(-1) != total_tokens:
        return None
    dtype = cu.dtype.type
    # chunk units q = cu / (2*cp); the remainder proves every boundary a multiple
    divisor, mats = _rank_constants(cp_size, cp_rank, dtype)
    q, rem = np.divmod(cu, divisor)
    if np.count_nonzero(rem):
        return None
    # [N, 2] overlapping view (q_i, q_{i+1}) of the fresh, contiguous q (no copy)
    step = q.itemsize
    pairs = np.ndarray((n, 2), dtype, q, 0, (step, step))  # positional: kwargs cost
    # [2, N, 2] -> rows: flat [2N] shifts and run lengths, in output order
    shifts_runs = (pairs @ mats).reshape(2, 2 * n)
    # ndarray.repeat, not np.repeat: same kernel without the ~0.7 us dispatch wrapper
    try:
        index = shifts_runs[0].repeat(shifts_runs[1])
    except ValueError:  # a negative run: the boundaries decrease somewhere
        return None
    # the runs sum to 2 * (q_N - q_0) = total_tokens / cp_size: cu starts at 0, ends at T
    index += _arange_np(total_tokens // cp_size, dtype)
    return index


def _host_indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    ranks: list[int],
    num_seqs: int | None,
    check: bool,
) -> np.ndarray:
    """Host path of :func:`_indices` (``cu_seqlens_padded`` on the CPU): int64 numpy."""
    cu = _host_boundaries(cu_seqlens_padded)
    if check and cp_size > 1 and len(ranks) == 1:
        fast = _checked_rank_indices_np(
            cu if num_seqs is None else cu[: num_seqs + 1], total_tokens, cp_size, ranks[0]
        )
        if fast is not None:
            return fast
    if check:
        cu = _validated_np(cu, total_tokens, cp_size, num_seqs)
    elif num_seqs is not None:
        cu = cu[: num_seqs + 1]
    else:
        cu = np.maximum.accumulate(cu)  # neutralise trailing sentinels, as on the device
    if cp_size == 1:
        return np.arange(total_tokens, dtype=np.int64)
    return _indices_np(cu, total_tokens, cp_size, ranks)


def _indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    ranks: list[int],
    num_seqs: int | None,
    check: bool | None,
) -> torch.Tensor:
    """Concatenated partition indices of ``ranks`` (int64, on the boundaries' device)."""
    _check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    _check_total_tokens(total_tokens)
    on_host = cu_seqlens_padded.device.type == "cpu"
    if on_host:
        check = True if check is None else check
        return torch.from_numpy(
            _host_indices(cu_seqlens_padded, total_tokens, cp_size, ranks, num_seqs, check)
        )
    if check:
        _validated_np(_host_boundaries(cu_seqlens_padded), total_tokens, cp_size, num_seqs)
    if cp_size == 1:
        return torch.arange(total_tokens, device=cu_seqlens_padded.device, dtype=torch.int64)
    return _indices_torch(cu_seqlens_padded, cp_size, ranks, num_seqs, total_tokens)


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
    check_cp_args(cp_size, cp_rank)
    return _indices(cu_seqlens_padded, total_tokens, cp_size, [cp_rank], num_seqs, check)


def _rank_order_permutation(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    num_seqs: int | None,
    check: bool | None,
) -> torch.Tensor:
    """int64 ``[T]``: concatenation of ``partition_indices`` for ranks 0..cp_size-1."""
    check_cp_args(cp_size)
    return _indices(cu_seqlens_padded, total_tokens, cp_size, list(range(cp_size)), num_seqs, check)


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


def _index_on(
    idx: torch.Tensor, device: torch.device, moved: dict[torch.device, torch.Tensor]
) -> torch.Tensor:
    """``idx`` on ``device``, copied (``non_blocking``) at most once per device via ``moved``."""
    out = moved.get(device)
    if out is None:
        out = moved[device] = idx.to(device, non_blocking=True)
    return out


def shard_thd_batch_for_cp(
    thd: Mapping[str, Any],
    cp_size: int,
    cp_rank: int,
    extra_keys: Sequence[str] = (),
    *,
    num_seqs: int | None = None,
    layout: ThdLayout | None = None,
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

    ``cp_size == 1`` returns ``thd`` itself, unchanged.

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
    if isinstance(extra_keys, str):
        raise ValueError(
            f"extra_keys must be a sequence of key names, got the string {extra_keys!r}; "
            f"write extra_keys=({extra_keys!r},)"
        )
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
    out = _gather_tokens(thd, _rank_indices(cu, total, cp_size, cp_rank, num_seqs), extra_keys)
    out["cp_size"] = cp_size
    out["cp_rank"] = cp_rank
    if layout is not None:
        out[LAYOUT_KEY] = layout.sharded(cp_size, cp_rank)
    return out


def _token_count(thd: Mapping[str, Any]) -> int:
    """``T`` of an unsharded converted batch, from its ``input_ids`` ``[T]`` / ``[T, H]``."""
    input_ids = thd.get("input_ids") if isinstance(thd, Mapping) else None
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
            fast = _checked_rank_indices_np(cu_np, total, cp_size, cp_rank)
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
