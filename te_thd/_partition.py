"""TE's THD context-parallel partition rule: checks and the index math, nothing else.

Rank ``r`` of ``cp_size`` owns, for every sequence ``i`` (padded length ``L_i``,
start ``s_i``, chunk ``c_i = L_i / (2 * cp_size)``), the tokens
``[s_i + r*c_i, s_i + (r+1)*c_i)`` then ``[s_i + (2cp-1-r)*c_i, s_i + (2cp-r)*c_i)``.

The rule is written twice, once per place it must run: :func:`partition_np` on the
host (the DataLoader worker; numpy's per-call cost is a fraction of torch's on these
tiny ``[N]`` arrays) and :func:`partition_torch` on a device (no host-device sync).
Both use TE's own arithmetic: rank ``r``'s local stream holds sequence ``i``'s chunk
``r`` at local offset ``s_i / cp`` and its chunk ``2cp-1-r`` right after, so local
token ``j`` of those two runs comes from ``j + shift`` with

    shift_first  = s_i - s_i / cp + r * c_i
    shift_second = s_i - s_i / cp + (2cp - 2 - r) * c_i

(TE: ``index += cu_s[seq] * world_size + seq_len / 2 * offset``): one repeat of the
``2N`` shifts over the run lengths plus an arange gives every index.
``tests/test_cp.py`` checks both against a per-token loop oracle of TE's kernel.
The public API over this module is :mod:`te_thd.cp`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from te_thd._cp_strategy import DUAL_CHUNK_SWAP, NO_LOAD_BALANCE
from te_thd.args import check_int
from te_thd.boundaries import (
    check_covers,
    check_cp_multiple,
    check_non_decreasing,
    check_pieces,
    check_starts_at_zero,
    check_stream_divisible,
    host_int64,
)


def check_total_tokens(total_tokens: Any) -> None:
    check_int("total_tokens", total_tokens, 0)


def check_boundaries_tensor(cu_seqlens_padded: Any, num_seqs: int | None) -> torch.Tensor:
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
            "cu_seqlens_padded must have an integer dtype (int32/int64), got "
            f"{cu_seqlens_padded.dtype}"
        )
    if cu_seqlens_padded.numel() < 1:
        raise ValueError("cu_seqlens_padded must hold at least one boundary (the leading 0), got 0")
    if num_seqs is not None:
        check_int("num_seqs", num_seqs, optional=True)
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


def validated_np(
    cu: np.ndarray, total_tokens: int, cp_size: int, num_seqs: int | None, balanced: bool = True
) -> np.ndarray:
    """Check a host boundary array (see :func:`validate_cp_layout`); return its valid ``[N+1]``.

    The rules are :mod:`te_thd.boundaries`'; what is the partition's own is the sentinel
    handling. The common, valid case costs a handful of numpy calls (this runs on every
    shard); the error paths take their time to name the offending entry. ``balanced=False``:
    TE's rules for ``no_load_balance`` (``validate_no_load_balance_thd_metadata``):
    ``total_tokens % cp_size == 0`` and boundaries from 0, never decreasing, to
    ``total_tokens``; the padded lengths need no multiple of ``2 * cp_size``.
    """
    if balanced:
        check_stream_divisible(total_tokens, cp_size)
    else:
        check_pieces(total_tokens, cp_size)
    if num_seqs is not None:
        cu = cu[: num_seqs + 1]
    elif cu[-1] < 0:  # sentinels trail; one in the middle shows up as a decrease below
        cu = _strip_sentinels(cu)
    check_starts_at_zero("cu_seqlens_padded", cu)
    if num_seqs is None and np.count_nonzero(cu < 0):
        _strip_sentinels(cu)  # raises, naming the misplaced sentinel
    lengths = check_non_decreasing(
        "cu_seqlens_padded",
        cu,
        "pass num_seqs to say how many sequences are valid, or trim the array",
    )
    if balanced:
        check_cp_multiple("cu_seqlens_padded", lengths, cp_size)
    check_covers("cu_seqlens_padded", int(cu[-1]), total_tokens, exact=True)
    return cu


def contiguous_indices(
    total_tokens: int, cp_size: int, ranks: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """int64 indices of ``ranks`` (rank-major) under ``no_load_balance``: rank ``r`` owns
    ``[r*T/cp, (r+1)*T/cp)`` (TE: ``torch.arange(cp_rank * chunk_size, ...)``)."""
    local = total_tokens // cp_size
    if ranks == tuple(range(cp_size)):
        return torch.arange(total_tokens, dtype=torch.int64, device=device)
    starts = torch.tensor([r * local for r in ranks], dtype=torch.int64, device=device)
    return (starts.view(-1, 1) + torch.arange(local, device=device)).reshape(-1)


@functools.lru_cache(maxsize=8)
def _arange_np(n: int, dtype: type = np.int64) -> np.ndarray:
    """Read-only ``arange(n)``, cached: the partition length repeats batch after batch."""
    out = np.arange(n, dtype=dtype)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _rank_matrices(
    cp_size: int, ranks: tuple[int, ...], dtype: type
) -> tuple[np.ndarray, np.ndarray]:
    """``(2*cp_size as a 0-d array, M)`` in ``dtype``, ``M`` ``[R+1, 2, 2]`` for ``R`` ranks.

    For sequence ``i`` with boundaries ``q_i, q_{i+1}`` in chunk units (chunk
    ``c_i = q_{i+1} - q_i``), ``(q_i, q_{i+1}) @ M[k]`` is rank ``ranks[k]``'s two
    shifts and ``@ M[R]`` its two run lengths (both ``c_i``). With ``a = 2cp-2-r`` and
    ``b = r``:

        shift_first  = s_i - s_i/cp + r*c_i         = a*q_i + b*q_{i+1}
        shift_second = s_i - s_i/cp + (2cp-2-r)*c_i = b*q_i + a*q_{i+1}

    Every term is at most ``total_tokens``: no overflow in the boundaries' dtype.
    (The 0-d divisor skips numpy's Python-int scalar promotion on every call.)
    """
    rows = [[[2 * cp_size - 2 - r, r], [r, 2 * cp_size - 2 - r]] for r in ranks]
    mats = np.array([*rows, [[-1, -1], [1, 1]]], dtype=dtype)
    divisor = np.array(2 * cp_size, dtype=dtype)
    mats.flags.writeable = divisor.flags.writeable = False
    return divisor, mats


def partition_np(
    cu: np.ndarray, total_tokens: int, cp_size: int, ranks: tuple[int, ...]
) -> np.ndarray | None:
    """Host indices of ``ranks`` (concatenated, rank-major) for a *valid* layout, else None.

    Args:
        cu: int32/int64 ``[N+1]`` padded boundaries (sentinels already removed).
        total_tokens: ``T``; ``cp_size``: CP size; ``ranks``: the ranks wanted.

    Returns:
        ``[len(ranks) * T / cp_size]`` in ``cu``'s dtype (int32 boundaries -- what
        ``process_input_for_thd`` emits -- give int32 indices: half the memory traffic
        of int64 for the gathers that follow), or None when the layout is not valid;
        the caller's :func:`validated_np` then names the problem.

    Checks and index math share their arrays, since this runs on every batch (a
    sharded 32k-token batch is ~4 gathers of ~4 us, so each numpy call of ~0.3-1 us on
    these ``[N]`` arrays counts): the ends must be 0 and ``T``, the divmod remainder
    proves every boundary (so every padded length) a multiple of ``2*cp``, and
    ``ndarray.repeat`` rejects the negative run of a decreasing array.
    """
    if cu.ndim != 1:  # [[0]] would pass the checks below: .item(0) / .item(-1) read flat
        return None
    n = cu.shape[0] - 1  # sequences
    # (.item: Python ints, cheaper than numpy scalars)
    if total_tokens % (2 * cp_size) or n < 0 or cu.item(0) != 0 or cu.item(-1) != total_tokens:
        return None
    dtype = cu.dtype.type
    divisor, mats = _rank_matrices(cp_size, ranks, dtype)
    q, rem = np.divmod(cu, divisor)  # chunk units; the remainder proves the multiples
    if np.count_nonzero(rem):
        return None
    # [N, 2] overlapping view (q_i, q_{i+1}) of the fresh, contiguous q (no copy)
    step = q.itemsize
    pairs = np.ndarray((n, 2), dtype, q, 0, (step, step))  # positional: kwargs cost
    # [R+1, N, 2] -> rows: each rank's flat [2N] shifts, then the [2N] run lengths
    r = len(ranks)
    rows = (pairs @ mats).reshape(r + 1, 2 * n)
    local = total_tokens // cp_size
    if r == 1:  # the hot path: one rank's shard
        shifts, runs = rows[0], rows[1]
    else:  # rank k's block starts at local offset k * T / cp in the concatenation
        shifts = (rows[:r] - (np.arange(r, dtype=dtype) * local)[:, None]).reshape(-1)
        runs = np.tile(rows[r], r)
    try:  # ndarray.repeat, not np.repeat: the same kernel without the dispatch wrapper
        index = shifts.repeat(runs)
    except ValueError:  # a negative run: the boundaries decrease somewhere
        return None
    # the runs sum to 2 * (q_N - q_0) = T / cp per rank: cu starts at 0 and ends at T
    index += _arange_np(local * r, dtype)
    return index


def partition_torch(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    ranks: tuple[int, ...],
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


def _host_indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    ranks: tuple[int, ...],
    num_seqs: int | None,
    check: bool,
) -> np.ndarray:
    """Host path of :func:`indices` (``cu_seqlens_padded`` on the CPU): int64 numpy."""
    cu = host_int64(cu_seqlens_padded)
    if check:
        if cp_size > 1:  # a valid layout needs no separate check: the rule proves it
            index = partition_np(
                cu if num_seqs is None else cu[: num_seqs + 1], total_tokens, cp_size, ranks
            )
            if index is not None:
                return index
        cu = validated_np(cu, total_tokens, cp_size, num_seqs)  # raises, or strips sentinels
    elif num_seqs is not None:
        cu = cu[: num_seqs + 1]
    else:
        cu = np.maximum.accumulate(cu)  # neutralise trailing sentinels, as on the device
    if cp_size == 1:
        return np.arange(total_tokens, dtype=np.int64)
    index = partition_np(cu, total_tokens, cp_size, ranks)
    if index is None:  # only reachable with check=False
        raise ValueError(
            f"cu_seqlens_padded cannot be partitioned for cp_size={cp_size} over "
            f"total_tokens={total_tokens} (check=False skipped the checks); run "
            "validate_cp_layout on it"
        )
    return index


def indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    ranks: tuple[int, ...],
    num_seqs: int | None,
    check: bool | None,
    strategy: str = DUAL_CHUNK_SWAP,
) -> torch.Tensor:
    """Concatenated partition indices of ``ranks`` (int64, on the boundaries' device).

    ``check`` (default: when the boundaries are on the CPU) validates the layout
    first; a check on a device tensor would sync, so it is skipped there by default.
    ``strategy`` is a name from :data:`te_thd._cp_strategy.STRATEGIES`.
    """
    check_boundaries_tensor(cu_seqlens_padded, num_seqs)
    check_total_tokens(total_tokens)
    if strategy == NO_LOAD_BALANCE:
        device = cu_seqlens_padded.device
        if check or (check is None and device.type == "cpu"):
            cu = host_int64(cu_seqlens_padded)
            validated_np(cu, total_tokens, cp_size, num_seqs, balanced=False)
        else:  # a host int: checked even without the layout checks
            check_pieces(total_tokens, cp_size)
        return contiguous_indices(total_tokens, cp_size, ranks, device)
    if cu_seqlens_padded.device.type == "cpu":
        check = True if check is None else check
        return torch.from_numpy(
            _host_indices(cu_seqlens_padded, total_tokens, cp_size, ranks, num_seqs, check)
        )
    if check:
        validated_np(host_int64(cu_seqlens_padded), total_tokens, cp_size, num_seqs)
    if cp_size == 1:
        return torch.arange(total_tokens, device=cu_seqlens_padded.device, dtype=torch.int64)
    return partition_torch(cu_seqlens_padded, cp_size, ranks, num_seqs, total_tokens)
