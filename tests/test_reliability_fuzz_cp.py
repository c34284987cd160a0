"""Fuzz of te_thd.cp with arbitrary -- also malformed -- layouts.

Every call either returns exactly what a plain loop transcription of Transformer
Engine's THD context-parallel rule produces, or raises ``ValueError``; nothing else
(no IndexError / RuntimeError / silently wrong partition). The oracle below is
written from TE's rule (``tex.thd_get_partitioned_indices``), not from te_thd's code:

    sequence i, padded length L_i, start s_i, chunk c_i = L_i / (2 * cp):
    rank r receives [s_i + r*c_i, s_i + (r+1)*c_i) then [s_i + (2cp-1-r)*c_i, s_i + (2cp-r)*c_i)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _fuzz_support import EITHER, FUZZ, INVALID, VALID, expect
from hypothesis import given
from hypothesis import strategies as st

from te_thd import cp as tcp

INT64 = st.integers(-(2**63), 2**63 - 1)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_BAD_DTYPES = (torch.float32, torch.float64, torch.bool)


# --------------------------------------------------------------------------- oracle


LAYOUT_ONLY = object()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def cp_verdict(
    cu: Any, total: Any, cp: Any, rank: Any, num_seqs: Any
) -> tuple[str, str, list[int]]:
    """(verdict, reason, boundaries) for partition_indices(cu, total, cp, rank, num_seqs).

    ``rank=LAYOUT_ONLY`` judges only the layout (as validate_cp_layout / reorder do).
    Values of narrow integer dtypes are judged after the cast the caller made.
    """
    if not _is_int(cp) or cp < 1:
        return INVALID, f"cp_size={cp!r}", []
    if rank is not LAYOUT_ONLY and (not _is_int(rank) or not 0 <= rank < cp):
        return INVALID, f"cp_rank={rank!r}", []
    if not isinstance(cu, torch.Tensor):
        return INVALID, "boundaries not a tensor", []
    if cu.dim() != 1:
        return INVALID, f"boundaries {cu.dim()}-D", []
    if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dtype.is_complex:
        return INVALID, f"boundaries dtype {cu.dtype}", []
    if cu.numel() < 1:
        return INVALID, "no boundaries", []
    if num_seqs is not None and (not _is_int(num_seqs) or not 0 <= num_seqs <= cu.numel() - 1):
        return INVALID, f"num_seqs={num_seqs!r}", []
    if not _is_int(total) or total < 0:
        return INVALID, f"total_tokens={total!r}", []
    if cp > 1 and total % (2 * cp):
        return INVALID, f"total {total} % {2 * cp}", []
    vals = [int(v) for v in cu.tolist()]
    if num_seqs is not None:
        vals = vals[: num_seqs + 1]
    else:
        neg = [i for i, v in enumerate(vals) if v < 0]
        if neg:
            first = neg[0]
            if any(v >= 0 for v in vals[first:]):
                return INVALID, "non-negative after sentinel", []
            vals = vals[:first]
        if not vals:
            return INVALID, "only sentinels", []
    if vals[0] != 0:
        return INVALID, "first boundary != 0", []
    for a, b in zip(vals, vals[1:], strict=False):
        if b < a:
            return INVALID, "decreasing boundaries", []
        if cp > 1 and (b - a) % (2 * cp):
            return INVALID, f"length {b - a} % {2 * cp}", []
    if vals[-1] != total:
        return INVALID, f"last boundary {vals[-1]} != total {total}", []
    return VALID, "well-formed", vals


def loop_partition(vals: list[int], total: int, cp: int, rank: int) -> list[int]:
    """TE's rule, one sequence and one token at a time."""
    if cp == 1:
        return list(range(total))
    out: list[int] = []
    for i in range(len(vals) - 1):
        s, length = vals[i], vals[i + 1] - vals[i]
        c = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            for t in range(s + chunk * c, s + (chunk + 1) * c):
                out.append(t)
    return out


# --------------------------------------------------------------------------- strategies


@st.composite
def cp_args(draw) -> dict[str, Any]:
    """A mostly well-formed partition request, then zero or more corruptions."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n = draw(st.integers(0, 6))
    lens = [2 * cp * draw(st.integers(0, 4)) for _ in range(n)]
    vals = [0]
    for length in lens:
        vals.append(vals[-1] + length)
    total = vals[-1]
    sentinel = draw(st.sampled_from([-1000, -1, -(2**31)]))
    n_sentinel = draw(st.integers(0, 3))
    num_seqs = draw(st.sampled_from(["none", "exact"]))
    num_seqs = None if num_seqs == "none" else len(vals) - 1
    rank = draw(st.integers(0, cp - 1))
    dtype = draw(st.sampled_from(_INT_DTYPES[:2]))
    muts = draw(st.lists(st.sampled_from(MUTATIONS), max_size=2))
    for m in muts:
        if m == "boundary" and vals:
            i = draw(st.integers(0, len(vals) - 1))
            vals[i] = draw(st.one_of(st.integers(-3, 3).map(lambda d, v=vals[i]: v + d), INT64))
        elif m == "total":
            total = draw(
                st.one_of(st.integers(-3, 3).map(lambda d, t=total: t + d), INT64, st.just(True))
            )
        elif m == "cp_size":
            cp = draw(st.sampled_from([0, -1, True, 2.0, 3, 16]))
        elif m == "cp_rank":
            rank = draw(st.sampled_from([-1, cp if _is_int(cp) else 1, 99, True, None, 0.0]))
        elif m == "dtype":
            dtype = draw(st.sampled_from(_INT_DTYPES + _BAD_DTYPES))
        elif m == "num_seqs":
            num_seqs = draw(st.one_of(st.integers(-2, len(vals) + n_sentinel + 2), st.just(True)))
        elif m == "sentinel_then_value":
            n_sentinel = max(n_sentinel, 1)
        elif m == "empty":
            vals, n_sentinel = [], 0
    raw = vals + [sentinel] * n_sentinel
    if "sentinel_then_value" in muts:
        raw = raw + [draw(st.integers(0, 64))]
    shape = draw(st.sampled_from(["1d", "1d", "1d", "2d", "list"])) if "shape" in muts else "1d"
    return {
        "raw": raw,
        "dtype": dtype,
        "shape": shape,
        "total": total,
        "cp": cp,
        "rank": rank,
        "num_seqs": num_seqs,
    }


MUTATIONS = (
    "boundary",
    "total",
    "cp_size",
    "cp_rank",
    "dtype",
    "num_seqs",
    "sentinel_then_value",
    "empty",
    "shape",
)


def _tensor(args: dict[str, Any]) -> Any:
    raw, dtype = args["raw"], args["dtype"]
    if args["shape"] == "list":
        return list(raw)
    # garbage past int64 cannot be a tensor at all: clamp it (it never reaches te_thd otherwise)
    raw = [min(max(v, -(2**63)), 2**63 - 1) for v in raw]
    t = torch.tensor(raw, dtype=torch.int64).to(dtype)
    if args["shape"] == "2d":
        t = t.reshape(1, -1)
    return t


# --------------------------------------------------------------------------- tests


@FUZZ
@given(cp_args())
def test_fuzz_partition_indices(args: dict[str, Any]) -> None:
    cu = _tensor(args)
    verdict, why, vals = cp_verdict(cu, args["total"], args["cp"], args["rank"], args["num_seqs"])
    out = expect(
        "cp.partition_indices",
        verdict,
        lambda: tcp.partition_indices(
            cu, args["total"], args["cp"], args["rank"], args["num_seqs"]
        ),
        why,
    )
    if out is None:
        return
    assert out.dtype == torch.int64 and out.dim() == 1
    assert out.tolist() == loop_partition(vals, args["total"], args["cp"], args["rank"])


@FUZZ
@given(cp_args())
def test_fuzz_validate_cp_layout(args: dict[str, Any]) -> None:
    cu = _tensor(args)
    verdict, why, _ = cp_verdict(cu, args["total"], args["cp"], LAYOUT_ONLY, args["num_seqs"])
    out = expect(
        "cp.validate_cp_layout",
        verdict,
        lambda: tcp.validate_cp_layout(cu, args["total"], args["cp"], args["num_seqs"]),
        why,
    )
    assert out is None


@FUZZ
@given(cp_args(), st.integers(1, 3), st.booleans())
def test_fuzz_rank_order_reorder(args: dict[str, Any], hidden: int, two_d: bool) -> None:
    """sequence -> cp-rank order equals the concatenated loop partitions; the inverse undoes it."""
    cu = _tensor(args)
    total = args["total"]
    size = total if _is_int(total) and 0 <= total <= 4096 else 8
    x = torch.arange(size * hidden, dtype=torch.float32).reshape(size, hidden)
    if not two_d:
        x = x[:, 0].contiguous()
    verdict, why, vals = cp_verdict(cu, size, args["cp"], LAYOUT_ONLY, args["num_seqs"])
    fwd = expect(
        "cp.sequence_to_cp_rank_order",
        verdict,
        lambda: tcp.sequence_to_cp_rank_order(x, cu, args["cp"], 0, args["num_seqs"]),
        why,
    )
    inv = expect(
        "cp.cp_rank_to_sequence_order",
        verdict,
        lambda: tcp.cp_rank_to_sequence_order(x, cu, args["cp"], 0, args["num_seqs"]),
        why,
    )
    if fwd is None:
        assert inv is None
        return
    order = [t for r in range(args["cp"]) for t in loop_partition(vals, size, args["cp"], r)]
    assert sorted(order) == list(range(size))
    assert torch.equal(fwd, x[torch.tensor(order, dtype=torch.long)])
    # inverse: position order[j] of the restored tensor holds x[j]
    expected_inv = torch.empty_like(x)
    expected_inv[torch.tensor(order, dtype=torch.long)] = x
    assert torch.equal(inv, expected_inv)
    assert torch.equal(tcp.cp_rank_to_sequence_order(fwd, cu, args["cp"], 0, args["num_seqs"]), x)


# ------------------------------------------------------------------ batch sharding

_TOKEN_KEYS = ("input_ids", "labels", "padding_mask")


@st.composite
def thd_batches(draw) -> tuple[dict[str, Any], int, Any, Any, Any]:
    args = draw(cp_args())
    cu = _tensor(args)
    total = args["total"] if _is_int(args["total"]) and 0 <= args["total"] <= 4096 else 8
    hidden = draw(st.sampled_from([None, 3]))
    batch: dict[str, Any] = {
        "input_ids": torch.arange(total * (hidden or 1)).reshape(
            (total, hidden) if hidden else (total,)
        ),
        "labels": torch.arange(total) + 1000,
        "padding_mask": torch.arange(total) % 3 == 0,
        "qkv_format": "thd",
        "max_seqlen": torch.tensor(7, dtype=torch.int32),
        "pad_between_seqs": True,
    }
    pos = draw(st.sampled_from(["1d", "mrope", "absent"]))
    if pos == "1d":
        batch["position_ids"] = torch.arange(total) % 5
    elif pos == "mrope":
        batch["position_ids"] = torch.arange(3 * total).reshape(3, 1, total)
    which = draw(st.sampled_from(["padded", "padded", "plain", "padded_none"]))
    if which == "padded":
        batch["cu_seqlens_padded"] = cu
        batch["cu_seqlens"] = torch.tensor([0, 1], dtype=torch.int32)  # must NOT be used
    elif which == "plain":
        batch["cu_seqlens"] = cu
    else:
        batch["cu_seqlens_padded"] = None
        batch["cu_seqlens"] = cu
    extra: Any = ()
    if draw(st.booleans()):
        batch["hidden_states"] = torch.randn(total, 2)
        extra = ("hidden_states",)
    for m in draw(st.lists(st.sampled_from(BATCH_MUTATIONS), max_size=2)):
        if m == "drop_input_ids":
            batch.pop("input_ids", None)
        elif m == "input_ids_3d":
            batch["input_ids"] = torch.zeros(total, 2, 2)
        elif m == "labels_len":
            batch["labels"] = torch.zeros(
                max(0, total + draw(st.sampled_from([-1, 1, 2]))), dtype=torch.long
            )
        elif m == "labels_list":
            batch["labels"] = list(range(total))
        elif m == "labels_none":
            batch["labels"] = None
        elif m == "position_bad":
            batch["position_ids"] = draw(
                st.sampled_from([torch.zeros(total + 1), torch.zeros(2, 2, total), torch.tensor(0)])
            )
        elif m == "extra_missing":
            extra = (*extra, "no_such_key")
        elif m == "extra_str":
            extra = "hidden_states"
        elif m == "extra_scalar":
            batch["scalar"] = torch.tensor(1.0)
            extra = (*extra, "scalar")
        elif m == "boundaries_missing":
            batch.pop("cu_seqlens", None)
            batch.pop("cu_seqlens_padded", None)
    return batch, total, args["cp"], args["rank"], (extra, args["num_seqs"])


BATCH_MUTATIONS = (
    "drop_input_ids",
    "input_ids_3d",
    "labels_len",
    "labels_list",
    "labels_none",
    "position_bad",
    "extra_missing",
    "extra_str",
    "extra_scalar",
    "boundaries_missing",
)


def shard_verdict(
    batch: dict[str, Any], cp: Any, rank: Any, extra: Any, num_seqs: Any
) -> tuple[str, str, list[int]]:
    if not _is_int(cp) or cp < 1:
        return INVALID, f"cp_size={cp!r}", []
    if not _is_int(rank) or not 0 <= rank < cp:
        return INVALID, f"cp_rank={rank!r}", []
    if isinstance(extra, str):
        return INVALID, "extra_keys is a str", []
    if cp == 1:
        return EITHER, "cp_size 1 returns the batch unchanged", []
    x = batch.get("input_ids")
    if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2):
        return INVALID, "input_ids", []
    total = x.shape[0]
    cu = batch.get("cu_seqlens_padded")
    if cu is None:
        cu = batch.get("cu_seqlens")
    if not isinstance(cu, torch.Tensor):
        return INVALID, "no boundaries", []
    verdict, why, vals = cp_verdict(cu, total, cp, rank, num_seqs)
    if verdict != VALID:
        return verdict, why, vals
    for k in (*_TOKEN_KEYS, *extra):
        v = batch.get(k)
        if v is None and k in _TOKEN_KEYS:
            continue
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != total:
            return INVALID, f"{k} not [T, ...]", []
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor):
        mrope = pos.dim() == 3 and pos.shape[1] == 1 and pos.shape[2] == total
        if not mrope and not (pos.dim() >= 1 and pos.shape[0] == total):
            return INVALID, "position_ids shape", []
    return VALID, "well-formed", vals


@FUZZ
@given(thd_batches())
def test_fuzz_shard_thd_batch_for_cp(drawn) -> None:
    batch, total, cp, rank, (extra, num_seqs) = drawn
    verdict, why, vals = shard_verdict(batch, cp, rank, extra, num_seqs)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = expect(
        "cp.shard_thd_batch_for_cp",
        verdict,
        lambda: tcp.shard_thd_batch_for_cp(batch, cp, rank, extra, num_seqs=num_seqs),
        why,
    )
    # the input batch is never modified, whatever happened
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(batch[k], v), k
    if out is None:
        return
    if cp == 1:
        assert out is batch
        return
    idx = torch.tensor(loop_partition(vals, total, cp, rank), dtype=torch.long)
    for k in (*_TOKEN_KEYS, *extra):
        if batch.get(k) is None:
            continue
        assert torch.equal(out[k], batch[k][idx]), k
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor):
        if pos.dim() == 3 and pos.shape[1] == 1 and pos.shape[2] == total:
            assert torch.equal(out["position_ids"], pos[:, :, idx])
        else:
            assert torch.equal(out["position_ids"], pos[idx])
    for k, v in batch.items():  # everything else stays global, untouched
        if k not in (*_TOKEN_KEYS, *extra, "position_ids"):
            assert out[k] is v, k
    assert out["cp_size"] == cp and out["cp_rank"] == rank


def test_two_d_boundaries_with_no_tokens_are_refused() -> None:
    """Found by the fuzzer: ``[[0]]`` padded boundaries and an empty batch passed the host
    fast path (its end checks read the flattened array) and were sharded silently."""
    batch = {
        "input_ids": torch.tensor([], dtype=torch.int64),
        "qkv_format": "thd",
        "cu_seqlens_padded": torch.tensor([[0]]),
        "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32),
    }
    with pytest.raises(
        ValueError, match=r"cu_seqlens_padded must be 1-D \[N\+1\], got shape \(1, 1\)"
    ):
        tcp.shard_thd_batch_for_cp(batch, 2, 0)
