"""te_thd.cp: partition == a loop transcription of TE's kernel, reorders, sharding, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd import _partition as cp_module
from te_thd.cp import (
    cp_rank_to_sequence_order,
    partition_indices,
    sequence_to_cp_rank_order,
    shard_thd_batch_for_cp,
    validate_cp_layout,
)

# --------------------------------------------------------------------------- oracle


def te_partition_oracle(cu_seqlens: list[int], total_tokens: int, world_size: int, rank: int):
    """Per-token loop transcription of TE's ``thd_partition_indices_kernel``.

    TE (transformer_engine/common/fused_attn/thd_utils.cu): boundaries are divided by
    world_size into shared memory; each output token binary-searches its sequence
    (first index in [1, len-1] whose boundary exceeds it, minus one), then
    ``offset = rank`` in the first half of the sequence's local share and
    ``(world_size - 1) * 2 - rank`` in the second, and the source index is
    ``index + cu_s[seq] * world_size + seq_len / 2 * offset``.
    """
    batch = len(cu_seqlens) - 1
    cu_s = [c // world_size for c in cu_seqlens]

    def binary_search(target: int, array: list[int], length: int) -> int:
        left, right = 1, length - 1
        while left < right:
            mid = (left + right) // 2
            if array[mid] <= target:
                left = mid + 1
            else:
                right = mid
        return left - 1

    out = []
    for token_id in range(total_tokens // world_size):
        seq_id = binary_search(token_id, cu_s, batch + 1)
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += cu_s[seq_id] * world_size + seq_len // 2 * offset
        out.append(index)
    return out


@st.composite
def layouts(draw, cps=(1, 2, 4, 8)):
    """(cu_seqlens_padded list, total_tokens, cp_size): every padded length a multiple of 2cp."""
    cp = draw(st.sampled_from(cps))
    units = draw(st.lists(st.integers(0, 6), min_size=1, max_size=10))
    if sum(units) == 0:
        units[0] = 1
    lengths = [u * 2 * cp for u in units]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, cu[-1], cp


# --------------------------------------------------------------------------- partition


def test_documented_example_two_ranks():
    # sequences of 8, 8, 24 tokens; cp=2 -> chunks of 2, 2, 6
    cu = torch.tensor([0, 8, 16, 40], dtype=torch.int32)
    r0 = [0, 1, 6, 7, 8, 9, 14, 15, *range(16, 22), *range(34, 40)]
    r1 = [2, 3, 4, 5, 10, 11, 12, 13, *range(22, 34)]
    assert partition_indices(cu, 40, 2, 0).tolist() == r0
    assert partition_indices(cu, 40, 2, 1).tolist() == r1
    assert partition_indices(cu, 40, 2, 0).dtype == torch.int64
    assert sequence_to_cp_rank_order(torch.arange(40), cu, 2).tolist() == r0 + r1


@settings(max_examples=150)
@given(layouts(), st.sampled_from([torch.int32, torch.int64]))
def test_partition_matches_te_loop_oracle(layout, dtype):
    cu, total, cp = layout
    cu_t = torch.tensor(cu, dtype=dtype)
    seen = []
    for rank in range(cp):
        got = partition_indices(cu_t, total, cp, rank)
        assert got.shape == (total // cp,)
        assert got.tolist() == te_partition_oracle(cu, total, cp, rank)
        seen.extend(got.tolist())
    assert sorted(seen) == list(range(total))  # the ranks tile the stream exactly once


@settings(max_examples=80)
@given(layouts(), st.integers(0, 5), st.sampled_from([-1000, -1]))
def test_sentinel_padded_boundaries(layout, n_sentinel, sentinel):
    cu, total, cp = layout
    padded = torch.tensor(cu + [sentinel] * n_sentinel, dtype=torch.int32)
    for rank in range(cp):
        want = te_partition_oracle(cu, total, cp, rank)
        # host-side valid count: sliced, no argmin
        assert partition_indices(padded, total, cp, rank, num_seqs=len(cu) - 1).tolist() == want
        # no count: sentinels neutralised sync-free
        assert partition_indices(padded, total, cp, rank).tolist() == want
        # and the unchecked path used on a device gives the same values
        assert partition_indices(padded, total, cp, rank, check=False).tolist() == want


@settings(max_examples=50)
@given(layouts(cps=(2, 4, 8)), st.integers(0, 3))
def test_device_path_matches_oracle(layout, n_sentinel):
    """The pure-torch path used for boundaries on a GPU (run here on CPU tensors)."""
    cu, total, cp = layout
    padded = torch.tensor(cu + [-1000] * n_sentinel, dtype=torch.int32)
    n = len(cu) - 1
    for rank in range(cp):
        want = te_partition_oracle(cu, total, cp, rank)
        assert cp_module.partition_torch(padded, cp, (rank,), None, total).tolist() == want
        assert cp_module.partition_torch(padded, cp, (rank,), n, total).tolist() == want
    every = [i for r in range(cp) for i in te_partition_oracle(cu, total, cp, r)]
    assert cp_module.partition_torch(padded, cp, tuple(range(cp)), None, total).tolist() == every


def test_fast_path_declines_invalid_layouts():
    # the hot path proves validity or returns None so the full check can name the error
    import numpy as np

    fast = cp_module.partition_np
    assert fast(np.array([0, 8, 16]), 16, 2, (0,)) is not None
    assert fast(np.array([0, 16, 8, 16]), 16, 2, (0,)) is None  # decreasing (negative chunk)
    assert fast(np.array([0, 6, 16]), 16, 2, (0,)) is None  # not a multiple of 4
    assert fast(np.array([4, 8, 16]), 16, 2, (0,)) is None  # does not start at 0
    assert fast(np.array([0, 8]), 16, 2, (0,)) is None  # does not cover the stream
    assert fast(np.array([0, 8, -1000]), 8, 2, (0,)) is None  # sentinel left in
    assert fast(np.array([0, 8, 16]), 16, 2, (0, 1)) is not None  # several ranks: same rule


def test_cp1_is_identity_for_any_layout():
    cu = torch.tensor([0, 3, 10, 11])
    assert partition_indices(cu, 11, 1, 0).tolist() == list(range(11))
    assert partition_indices(cu, 11, 1, 0).tolist() == te_partition_oracle([0, 3, 10, 11], 11, 1, 0)
    x = torch.randn(11, 2)
    assert torch.equal(sequence_to_cp_rank_order(x, cu, 1), x)
    assert torch.equal(cp_rank_to_sequence_order(x, cu, 1), x)


# --------------------------------------------------------------------------- reorder


@settings(max_examples=80)
@given(layouts(), st.integers(0, 2))
def test_reorder_is_rank_concat_and_inverse(layout, dim):
    cu, total, cp = layout
    cu_t = torch.tensor(cu, dtype=torch.int32)
    shape = [2, 3, 2]
    shape[dim] = total
    x = torch.randn(*shape)
    y = sequence_to_cp_rank_order(x, cu_t, cp, dim=dim)
    want = torch.cat(
        [x.index_select(dim, partition_indices(cu_t, total, cp, r)) for r in range(cp)], dim=dim
    )
    assert torch.equal(y, want)
    assert torch.equal(cp_rank_to_sequence_order(y, cu_t, cp, dim=dim), x)
    assert torch.equal(
        sequence_to_cp_rank_order(cp_rank_to_sequence_order(x, cu_t, cp, dim), cu_t, cp, dim), x
    )


def test_reorder_negative_dim_and_autograd():
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    x = torch.randn(3, 24, requires_grad=True)
    w = torch.randn(3, 24)
    y = cp_rank_to_sequence_order(sequence_to_cp_rank_order(x, cu, 4, dim=-1), cu, 4, dim=-1)
    (y * w).sum().backward()
    assert torch.equal(y.detach(), x.detach())
    assert torch.equal(x.grad, w)


# --------------------------------------------------------------------------- sharding


def _thd_batch(
    cu: list[int], mrope: bool = False, hidden: int | None = None, dtype=torch.int32
) -> dict:
    total = cu[-1]
    g = torch.Generator().manual_seed(total)
    ids = torch.randint(0, 1000, (total,), generator=g)
    if hidden is not None:
        ids = torch.randn(total, hidden, generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:], strict=True)])
    cu_t = torch.tensor(cu, dtype=dtype)
    return {
        "input_ids": ids,
        "labels": torch.randint(-100, 1000, (total,), generator=g),
        "position_ids": pos.view(1, 1, -1).expand(3, 1, -1).clone() if mrope else pos,
        "cu_seqlens": cu_t.clone(),
        "cu_seqlens_padded": cu_t,
        "pad_between_seqs": True,
        "max_seqlen": torch.tensor(
            max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), dtype=torch.int32
        ),
        "max_seqlen_int": max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)),
        "padding_mask": torch.rand(total, generator=g) < 0.2,
        "hidden_target": torch.randn(total, 4, generator=g),
        "qkv_format": "thd",
    }


@settings(max_examples=40)
@given(
    layouts(cps=(2, 4, 8)),
    st.booleans(),
    st.sampled_from([None, 5]),
    st.sampled_from([torch.int32, torch.int64, torch.int16]),
)
def test_shard_slices_token_keys_and_keeps_boundaries_global(layout, mrope, hidden, dtype):
    cu, total, cp = layout
    if dtype == torch.int16 and total >= 2**15:
        return
    batch = _thd_batch(cu, mrope=mrope, hidden=hidden, dtype=dtype)
    shards = [
        shard_thd_batch_for_cp(batch, cp, r, extra_keys=("hidden_target",)) for r in range(cp)
    ]
    for r, sh in enumerate(shards):
        idx = te_partition_oracle(cu, total, cp, r)
        for k in ("input_ids", "labels", "padding_mask", "hidden_target"):
            assert torch.equal(sh[k], batch[k][idx]), k
        if mrope:
            assert sh["position_ids"].shape == (3, 1, total // cp)
            assert torch.equal(sh["position_ids"], batch["position_ids"][..., idx])
        else:
            assert torch.equal(sh["position_ids"], batch["position_ids"][idx])
        for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
            assert sh[k] is batch[k]
        assert sh["max_seqlen_int"] == batch["max_seqlen_int"]
        assert sh["pad_between_seqs"] is True and sh["qkv_format"] == "thd"
        assert (sh["cp_size"], sh["cp_rank"]) == (cp, r)
    # all-gathered shards in rank order, restored to sequence order, are the batch again
    gathered = torch.cat([sh["input_ids"] for sh in shards])
    assert torch.equal(
        cp_rank_to_sequence_order(gathered, batch["cu_seqlens_padded"], cp), batch["input_ids"]
    )
    assert "cp_size" not in batch  # the input dict is not mutated


def test_shard_cp1_returns_batch_unchanged():
    batch = _thd_batch([0, 4, 10])
    assert shard_thd_batch_for_cp(batch, 1, 0) is batch


def test_shard_falls_back_to_cu_seqlens_and_uses_num_seqs():
    batch = _thd_batch([0, 8, 16])
    del batch["cu_seqlens_padded"]
    sh = shard_thd_batch_for_cp(batch, 2, 1)
    assert torch.equal(sh["input_ids"], batch["input_ids"][[2, 3, 4, 5, 10, 11, 12, 13]])
    batch["cu_seqlens_padded"] = torch.tensor([0, 8, 16, -1000], dtype=torch.int32)
    sh = shard_thd_batch_for_cp(batch, 2, 1, num_seqs=2)
    assert torch.equal(sh["labels"], batch["labels"][[2, 3, 4, 5, 10, 11, 12, 13]])


# --------------------------------------------------------------------------- errors


def test_error_names_sequence_length_and_multiple():
    cu = torch.tensor([0, 8, 14, 24], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"sequence 1 has padded length 6 .*multiple of 2\*cp_size=4"
    ):
        partition_indices(cu, 24, 2, 0)
    with pytest.raises(ValueError, match=r"sequence 1 has padded length 6.*2\*cp_size=4"):
        validate_cp_layout(cu, 24, 2)
    with pytest.raises(ValueError, match=r"sequence 0 has padded length 8.*2\*cp_size=16"):
        validate_cp_layout(torch.tensor([0, 8, 32]), 32, 8)


def test_error_total_tokens_not_divisible():
    with pytest.raises(ValueError, match=r"total_tokens=18 is not divisible by 2\*cp_size=4"):
        partition_indices(torch.tensor([0, 8, 18]), 18, 2, 1)


def test_error_boundaries_do_not_cover_stream():
    with pytest.raises(
        ValueError, match=r"cu_seqlens_padded ends at 8 but the global stream has 16 tokens"
    ):
        partition_indices(torch.tensor([0, 8]), 16, 2, 0)


def test_error_bad_boundaries():
    with pytest.raises(ValueError, match=r"cu_seqlens_padded\[0\] must be 0, got 4"):
        validate_cp_layout(torch.tensor([4, 8]), 8, 2)
    with pytest.raises(ValueError, match=r"non-decreasing: sequence 1 has length -4"):
        validate_cp_layout(torch.tensor([0, 8, 4, 8]), 8, 2)
    with pytest.raises(
        ValueError, match=r"non-negative entry 8 at index 3 after the sentinel at index 2"
    ):
        validate_cp_layout(torch.tensor([0, 8, -1000, 8]), 8, 2)
    with pytest.raises(ValueError, match=r"must be 1-D \[N\+1\].*one row per chunk"):
        partition_indices(torch.zeros(2, 3, dtype=torch.int32), 8, 2, 0)
    with pytest.raises(ValueError, match=r"integer dtype"):
        partition_indices(torch.tensor([0.0, 8.0]), 8, 2, 0)
    with pytest.raises(ValueError, match=r"num_seqs=3 is out of range"):
        partition_indices(torch.tensor([0, 8, 16]), 16, 2, 0, num_seqs=3)
    with pytest.raises(ValueError, match=r"must be a torch.Tensor, got list"):
        partition_indices([0, 8], 8, 2, 0)


def test_error_cp_args():
    cu = torch.tensor([0, 8])
    with pytest.raises(ValueError, match=r"cp_size=0 must be an int >= 1"):
        partition_indices(cu, 8, 0, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 must be an int in \[0, cp_size=2\)"):
        partition_indices(cu, 8, 2, 2)
    with pytest.raises(ValueError, match=r"dim=2 is out of range for x of shape \(8,\)"):
        sequence_to_cp_rank_order(torch.zeros(8), cu, 2, dim=2)


def test_error_shard_bad_batch():
    batch = _thd_batch([0, 8, 16])
    with pytest.raises(ValueError, match=r"thd\['nope'\] must be a \[T, \.\.\.\] tensor with T=16"):
        shard_thd_batch_for_cp(batch, 2, 0, extra_keys=("nope",))
    with pytest.raises(
        ValueError,
        match=r"extra_keys='hidden_target' must be a tuple of key names, e.g. \('hidden_target',\)",
    ):
        shard_thd_batch_for_cp(batch, 2, 0, extra_keys="hidden_target")
    with pytest.raises(ValueError, match=r"must hold the flattened token tensor 'input_ids'"):
        shard_thd_batch_for_cp({"cu_seqlens": batch["cu_seqlens"]}, 2, 0)
    bad = dict(batch, position_ids=torch.zeros(3, 16))
    with pytest.raises(
        ValueError, match=r"position_ids'\] must be \[T\] or \[n_rope, 1, T\] with T=16"
    ):
        shard_thd_batch_for_cp(bad, 2, 0)
    with pytest.raises(ValueError, match=r"num_seqs='2' must be an int or None"):
        shard_thd_batch_for_cp(batch, 2, 0, num_seqs="2")
    with pytest.raises(ValueError, match=r"num_seqs=5 is out of range"):
        shard_thd_batch_for_cp(batch, 2, 0, num_seqs=5)
    with pytest.raises(ValueError, match=r"must hold 'cu_seqlens_padded' \(or 'cu_seqlens'\)"):
        shard_thd_batch_for_cp({"input_ids": batch["input_ids"]}, 2, 0)


def test_shard_a_bare_layout_gives_the_ranks_layout():
    """A ThdLayout alone (no tokens) shards to ``layout.sharded(cp_size, cp_rank)``, the layout the
    dict form carries for the same boundaries."""
    from te_thd.layout import LAYOUT_KEY, ThdLayout, as_layout

    batch = _thd_batch([0, 8, 16])
    layout = as_layout(batch)
    for rank in (0, 1):
        got = shard_thd_batch_for_cp(layout, 2, rank)
        assert isinstance(got, ThdLayout) and (got.cp_size, got.cp_rank) == (2, rank)
        via_dict = shard_thd_batch_for_cp({**batch, LAYOUT_KEY: layout}, 2, rank)[LAYOUT_KEY]
        assert (
            torch.equal(got.cu_seqlens_padded, via_dict.cu_seqlens_padded)
            and got.cp_rank == via_dict.cp_rank
        )
    with pytest.raises(ValueError, match=r"cp_rank=2 must be an int in \[0, cp_size=2\)"):
        shard_thd_batch_for_cp(layout, 2, 2)
