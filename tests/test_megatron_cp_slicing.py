"""te_thd's CP shard == Megatron-Core's per-document CP slicing, transcribed.

Megatron-Core (``megatron/core/utils.py``, ``_get_batch_on_this_cp_rank_per_document_balancing``)
slices a packed micro-batch for one CP rank with TE's ``tex.thd_get_partitioned_indices``
on ``cu_seqlens_padded``, falling back to ``cu_seqlens`` when the batch has no padded
array. Below, that function is transcribed with the process group replaced by
``(cp_size, cp_rank)`` and TE's extension replaced by a transcription of its host checks,
its kernel's device assert and its arithmetic. te_thd must give the same tokens for
every layout Megatron accepts (both boundary arrays), and refuse -- naming the padding
multiple and the te_thd call that produces it -- every layout TE's kernel asserts on.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp import te_partition_oracle

from te_thd.attention import te_attention_kwargs
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.packing import PackingCollator, pad_to_multiple_for
from te_thd.thd_utils import process_input_for_thd


def tex_thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """TE ``thd_get_partitioned_indices`` (pytorch/csrc/extensions/attention.cpp + the kernel)."""
    assert cu_seqlens.dtype == torch.int32  # NVTE_CHECK(scalar_type == Int)
    assert cu_seqlens.dim() == 1 and cu_seqlens.size(0) >= 2
    assert 0 <= rank < world_size and world_size > 0
    assert total_tokens > 0 and total_tokens % (world_size * 2) == 0
    cu = cu_seqlens.tolist()
    for seqlen in cu:  # thd_partition_indices_kernel: assert(seqlen % (world_size * 2) == 0)
        assert seqlen % (world_size * 2) == 0, "device-side assert triggered"
    return torch.tensor(te_partition_oracle(cu, total_tokens, world_size, rank), dtype=torch.int32)


def megatron_per_document_cp_slice(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """Megatron's ``_get_batch_on_this_cp_rank_per_document_balancing`` (cp group -> ints)."""
    if cp_size > 1:
        cu_seqlens_for_te = (
            batch["cu_seqlens_padded"]
            if batch["cu_seqlens_padded"] is not None
            else batch["cu_seqlens"]
        )[0]
        index = tex_thd_get_partitioned_indices(
            cu_seqlens_for_te,
            batch["tokens"].size(1) if batch["tokens"] is not None else batch["labels"].size(1),
            cp_size,
            cp_rank,
        )
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            if batch.get(key) is not None:
                batch[key] = batch[key].index_select(1, index)
    return batch


def _megatron_batch(thd: dict, with_padded: bool) -> dict:
    """A Megatron-style micro-batch (``[1, T]`` tensors, ``[1, N+1]`` boundaries) of ``thd``."""
    return {
        "tokens": thd["input_ids"].view(1, -1),
        "labels": thd["labels"].view(1, -1),
        "position_ids": thd["position_ids"].view(1, -1),
        "loss_mask": (~thd["padding_mask"]).float().view(1, -1),
        "cu_seqlens": thd["cu_seqlens"].view(1, -1),
        "cu_seqlens_padded": thd["cu_seqlens_padded"].view(1, -1) if with_padded else None,
    }


def _packed(lengths: list[int], seq_len: int, multiple: int) -> dict:
    samples = [{"input_ids": torch.arange(1, n + 1) + 100 * i} for i, n in enumerate(lengths)]
    return process_input_for_thd(PackingCollator(seq_len, pad_to_multiple_of=multiple)(samples))


@settings(max_examples=40, deadline=None)
@given(
    cp=st.sampled_from([2, 4]),
    units=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    data=st.data(),
)
def test_shard_equals_megatron_per_document_slicing_with_padded_boundaries(cp, units, data):
    multiple = pad_to_multiple_for(cp)
    # real lengths anywhere inside their padded slot of a multiple of 2*cp
    lengths = [data.draw(st.integers(u * multiple - multiple + 1, u * multiple)) for u in units]
    thd = _packed(lengths, seq_len=sum(units) * multiple, multiple=multiple)
    for rank in range(cp):
        ours = shard_thd_batch_for_cp(thd, cp, rank)
        theirs = megatron_per_document_cp_slice(_megatron_batch(thd, True), cp, rank)
        assert torch.equal(ours["input_ids"], theirs["tokens"][0])
        assert torch.equal(ours["labels"], theirs["labels"][0])
        assert torch.equal(ours["position_ids"], theirs["position_ids"][0])


@settings(max_examples=30, deadline=None)
@given(cp=st.sampled_from([2, 4]), units=st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_shard_equals_megatron_fallback_to_cu_seqlens(cp, units):
    """Documents exactly a multiple of 2*cp long: no padded array, both slice on cu_seqlens."""
    multiple = pad_to_multiple_for(cp)
    thd = _packed([u * multiple for u in units], seq_len=sum(units) * multiple, multiple=1)
    assert thd["pad_between_seqs"] is False
    unpadded = {k: v for k, v in thd.items() if k != "cu_seqlens_padded"}
    for rank in range(cp):
        ours = shard_thd_batch_for_cp(unpadded, cp, rank)
        theirs = megatron_per_document_cp_slice(_megatron_batch(thd, False), cp, rank)
        assert torch.equal(ours["input_ids"], theirs["tokens"][0])


def test_documents_not_padded_to_2cp_are_refused_like_tes_kernel_with_the_fix():
    # three documents of 5, 3 and 8 tokens packed without per-document padding (the
    # trailing pad of the row is absorbed into the last one): Megatron falls back to
    # cu_seqlens and TE's kernel asserts on the device
    thd = _packed([5, 3, 8], seq_len=16, multiple=1)
    batch = _megatron_batch(thd, with_padded=False)
    with pytest.raises(AssertionError, match="device-side assert"):
        megatron_per_document_cp_slice(batch, 2, 0)
    with pytest.raises(ValueError) as err:
        shard_thd_batch_for_cp(thd, 2, 0)
    fix = (
        "pad every document to a multiple of 4: te_thd.packing.PackingCollator(seq_len, "
        "pad_to_multiple_of=pad_to_multiple_for(cp_size=2)) does"
    )
    assert "not a multiple of 2*cp_size=4" in str(err.value) and fix in str(err.value)
    # the attention side (the layout's check) names the same fix
    with pytest.raises(ValueError) as err:
        te_attention_kwargs(thd, cp_size=2)
    assert "not a multiple of 2*cp_size=4" in str(err.value) and fix in str(err.value)
    # and the call the message names produces a layout both accept
    fixed = _packed([5, 3, 8], seq_len=24, multiple=pad_to_multiple_for(cp_size=2))
    for rank in range(2):
        ours = shard_thd_batch_for_cp(fixed, 2, rank)
        theirs = megatron_per_document_cp_slice(_megatron_batch(fixed, True), 2, rank)
        assert torch.equal(ours["input_ids"], theirs["tokens"][0])
