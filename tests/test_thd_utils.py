"""Exact-value, behaviour and error tests of te_thd.thd_utils.

The worked examples are the reference implementation's documented ones; the
values are written out by hand here, not computed by the code under test.
Property tests over random layouts live in test_thd_utils_properties.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from te_thd import thd_utils as tu
from te_thd._thd_layout import pack_layout, stream_layout, validate_pack_lengths
from te_thd.thd_utils import (
    _thd_padding_mask,
    process_input_for_thd,
    split_batch_into_thd_chunks,
    thd_padding_mask_from_token_ids,
)

S = -1000  # the default sentinel


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def reference_2x6() -> dict:
    """The 2x6 example of process_input_for_thd's reference docstring."""
    return {
        "input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, S]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, S]]),
    }


def reference_4x6() -> dict:
    """The 4x6 example of split_batch_into_thd_chunks' reference docstring."""
    return {
        "input_ids": torch.arange(1, 25).view(4, 6),
        "labels": torch.arange(2, 26).view(4, 6),
        "position_ids": torch.arange(6).repeat(4, 1),
        "seq_lens": torch.tensor([[6], [6], [6], [6]]),
        "seq_lens_padded": torch.tensor([[6], [6], [6], [6]]),
    }


def assert_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), (actual, expected)


# ---------------------------------------------------------------- worked examples


def test_reference_worked_example_2x6_exact() -> None:
    batch = reference_2x6()
    batch["qkv_format"] = "thd"
    out = process_input_for_thd(batch)
    assert_equal(out["input_ids"], torch.tensor([1, 2, 3, 99, 4, 5, 6, 7, 8, 9, 10, 11]))
    assert_equal(out["labels"], torch.tensor([2, 3, 99, 4, 5, 6, 7, 8, 9, 10, 11, 12]))
    assert_equal(out["position_ids"], torch.tensor([0, 1, 2, 0, 0, 1, 0, 1, 2, 3, 4, 5]))
    assert_equal(out["cu_seqlens"], i32(0, 3, 5, 11))
    assert_equal(out["cu_seqlens_padded"], i32(0, 4, 6, 12))
    assert out["pad_between_seqs"] is True
    assert_equal(out["max_seqlen"], torch.tensor(6, dtype=torch.int32))
    assert out["max_seqlen_int"] == 6 and type(out["max_seqlen_int"]) is int
    assert out["num_seqs"] == 3
    # slot 3 is sequence 0's padding (3 real in 4 slots); everything else is real
    assert_equal(out["padding_mask"], torch.tensor([0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]).bool())
    assert out["qkv_format"] == "thd"
    assert "seq_lens" not in out and "seq_lens_padded" not in out


def test_flattened_tokens_are_views() -> None:
    batch = reference_2x6()
    out = process_input_for_thd(batch)
    for key in ("input_ids", "labels", "position_ids"):
        assert out[key].data_ptr() == batch[key].data_ptr(), key
        assert out[key].untyped_storage().data_ptr() == batch[key].untyped_storage().data_ptr()


def test_reference_worked_example_4x6_chunked_exact() -> None:
    out = split_batch_into_thd_chunks(reference_4x6(), num_chunks=2)
    assert_equal(out["input_ids"], torch.arange(1, 25).view(2, 12))
    assert_equal(out["labels"], torch.arange(2, 26).view(2, 12))
    assert_equal(out["position_ids"], torch.arange(6).repeat(2, 2))
    assert_equal(out["cu_seqlens"], torch.tensor([[0, 6, 12], [0, 6, 12]], dtype=torch.int32))
    assert_equal(
        out["cu_seqlens_padded"], torch.tensor([[0, 6, 12], [0, 6, 12]], dtype=torch.int32)
    )
    assert_equal(out["max_seqlen"], i32(6, 6))
    assert out["max_seqlen_int"] == [6, 6] and out["num_seqs"] == [2, 2]
    assert out["pad_between_seqs"] is False
    assert_equal(out["padding_mask"], torch.zeros(2, 12, dtype=torch.bool))


def test_num_chunks_at_most_one_is_the_unchunked_result() -> None:
    for c in (0, 1):
        out = split_batch_into_thd_chunks(reference_2x6(), c)
        assert_equal(out["cu_seqlens"], i32(0, 3, 5, 11))
        assert out["num_seqs"] == 3 and out["max_seqlen_int"] == 6


def test_a_negative_num_chunks_is_refused_not_ignored() -> None:
    """-1 is not "no split": it is a mistake (the reference returned the batch unsplit)."""
    with err(r"^num_chunks=-1 must be an int >= 0; pass the number of chunks \(e\.g\. the pipeline's micro-batch "
             r"count; 0 or 1: no split\)$"):  # fmt: skip
        split_batch_into_thd_chunks(reference_2x6(), -1)


# -------------------------------------------------------- layout decisions


def unfilled_row_batch() -> dict:
    """A row that is not full: row 0 holds [3] in [4] slots of S=6; row 1 is full."""
    return {
        "input_ids": torch.arange(12).view(2, 6),
        "position_ids": torch.arange(6).repeat(2, 1),
        "seq_lens": torch.tensor([[3], [6]]),
        "seq_lens_padded": torch.tensor([[4], [6]]),
    }


def test_unfilled_row_offsets_point_into_the_right_row() -> None:
    out = process_input_for_thd(unfilled_row_batch())
    # The second sequence starts at row 1 = offset 6 (the reference says 4). Row
    # 0's unused slots 4..5 are padding of sequence 0, so its physical segment
    # ends at 6.
    assert_equal(out["cu_seqlens_padded"], i32(0, 6, 12))
    assert_equal(out["cu_seqlens"], i32(0, 3, 9))
    assert out["pad_between_seqs"] is True
    assert_equal(out["padding_mask"], torch.tensor([0, 0, 0, 1, 1, 1] + [0] * 6).bool())
    assert out["max_seqlen_int"] == 6


def test_trailing_pad_is_absorbed_by_default() -> None:
    # One row, sequences [3, 2] back to back, 3 pad slots at the end of S=8.
    batch = {
        "input_ids": torch.arange(8).view(1, 8),
        "position_ids": torch.arange(8).view(1, 8),
        "seq_lens": torch.tensor([[3, 2]]),
        "seq_lens_padded": torch.tensor([[3, 2]]),
    }
    out = process_input_for_thd(batch)
    assert_equal(out["cu_seqlens"], i32(0, 3, 8))
    assert_equal(out["cu_seqlens_padded"], i32(0, 3, 8))
    assert out["pad_between_seqs"] is False
    assert out["max_seqlen_int"] == 5  # the grown last segment
    # absorption changes the boundaries TE sees, never which slots are padding
    assert_equal(out["padding_mask"], torch.tensor([0] * 5 + [1] * 3).bool())


def test_absorption_off_for_bidirectional_attention() -> None:
    batch = {
        "input_ids": torch.arange(8).view(1, 8),
        "position_ids": torch.arange(8).view(1, 8),
        "seq_lens": torch.tensor([[3, 2]]),
        "seq_lens_padded": torch.tensor([[3, 2]]),
    }
    out = process_input_for_thd(batch, absorb_trailing_pad=False)
    assert_equal(out["cu_seqlens"], i32(0, 3, 5))
    assert_equal(out["cu_seqlens_padded"], i32(0, 3, 8))
    assert out["pad_between_seqs"] is True
    assert out["max_seqlen_int"] == 3


def test_no_absorption_when_padding_sits_between_sequences() -> None:
    # Reference example: the arrays differ before the last entry -> untouched.
    out = process_input_for_thd(reference_2x6())
    assert out["cu_seqlens"][-1].item() == 11


def test_nothing_to_absorb_keeps_arrays_equal() -> None:
    out = process_input_for_thd(reference_4x6())
    assert_equal(out["cu_seqlens"], i32(0, 6, 12, 18, 24))
    assert_equal(out["cu_seqlens_padded"], i32(0, 6, 12, 18, 24))
    assert out["pad_between_seqs"] is False


def test_rows_without_sequences_are_padding_of_the_preceding_sequence() -> None:
    batch = {
        "input_ids": torch.arange(12).view(3, 4),
        "position_ids": torch.zeros(3, 4, dtype=torch.long),
        "seq_lens": torch.tensor([[2, S], [S, S], [3, S]]),
        "seq_lens_padded": torch.tensor([[2, S], [S, S], [4, S]]),
    }
    out = process_input_for_thd(batch, absorb_trailing_pad=False)
    assert_equal(out["cu_seqlens_padded"], i32(0, 8, 12))  # seq 0 owns slots 2..7
    assert_equal(out["cu_seqlens"], i32(0, 2, 5))
    assert_equal(out["padding_mask"], torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1]).bool())


def test_sentinel_in_the_middle_of_a_row_is_dropped() -> None:
    batch = {
        "input_ids": torch.arange(6).view(1, 6),
        "position_ids": torch.arange(6).view(1, 6),
        "seq_lens": torch.tensor([[2, S, 3]]),
        "seq_lens_padded": torch.tensor([[3, S, 3]]),
    }
    out = process_input_for_thd(batch)
    assert_equal(out["cu_seqlens"], i32(0, 2, 5))
    assert_equal(out["cu_seqlens_padded"], i32(0, 3, 6))


def test_custom_sentinel_value() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = torch.tensor([[3, 2], [6, 0]])
    batch["seq_lens_padded"] = torch.tensor([[4, 2], [6, 0]])
    out = process_input_for_thd(batch, seq_lens_padding_value=0)
    assert_equal(out["cu_seqlens"], i32(0, 3, 5, 11))


def test_equal_tables_still_emit_cu_seqlens_padded_as_a_distinct_tensor() -> None:
    out = process_input_for_thd(reference_4x6())
    assert "cu_seqlens_padded" in out
    # distinct objects: TE's identity-based auto-detect must not be relied on
    # (NVIDIA/TransformerEngine#3487), hence the explicit pad_between_seqs
    assert out["cu_seqlens_padded"] is not out["cu_seqlens"]


def test_missing_seq_lens_padded_means_no_per_sequence_padding() -> None:
    batch = reference_2x6()
    del batch["seq_lens_padded"]
    out = process_input_for_thd(batch, absorb_trailing_pad=False)
    assert_equal(out["cu_seqlens"], i32(0, 3, 5, 11))
    # row 0's 6th slot (after 3 + 2 tokens) belongs to sequence 1
    assert_equal(out["cu_seqlens_padded"], i32(0, 3, 6, 12))
    batch["seq_lens_padded"] = None
    assert_equal(process_input_for_thd(batch)["cu_seqlens"], i32(0, 3, 5, 11))


def test_labels_are_optional() -> None:
    batch = reference_2x6()
    del batch["labels"]
    out = process_input_for_thd(batch)
    assert "labels" not in out
    assert_equal(out["cu_seqlens"], i32(0, 3, 5, 11))


def test_every_other_key_passes_through_untouched() -> None:
    batch = reference_2x6()
    pixels = torch.randn(3, 4)
    batch.update(pixel_values=pixels, qkv_format="thd", meta={"a": 1}, nothing=None)
    out = process_input_for_thd(batch)
    assert out["pixel_values"] is pixels and out["meta"] is batch["meta"]
    assert out["qkv_format"] == "thd" and out["nothing"] is None
    chunked = split_batch_into_thd_chunks(reference_4x6() | {"pixel_values": pixels}, 2)
    assert chunked["pixel_values"] is pixels


def test_embeddings_and_mrope() -> None:
    batch = reference_2x6()
    emb = torch.randn(2, 6, 5)
    mrope = torch.arange(3 * 12).view(3, 2, 6)
    batch.update(input_ids=emb, position_ids=mrope)
    out = process_input_for_thd(batch)
    assert_equal(out["input_ids"], emb.reshape(12, 5))
    assert out["input_ids"].data_ptr() == emb.data_ptr()
    assert_equal(out["position_ids"], mrope.reshape(3, 1, 12))
    assert_equal(out["cu_seqlens"], i32(0, 3, 5, 11))


def test_chunked_embeddings_and_mrope_split_along_the_batch_axis() -> None:
    batch = reference_4x6()
    emb = torch.randn(4, 6, 5)
    mrope = torch.arange(3 * 24).view(3, 4, 6)
    batch.update(input_ids=emb, position_ids=mrope)
    out = split_batch_into_thd_chunks(batch, 2)
    assert_equal(out["input_ids"], emb.reshape(2, 12, 5))
    assert out["position_ids"].shape == (2, 3, 1, 12)
    for c in range(2):
        # chunk c's mRoPE positions are rows 2c, 2c+1 of every rope axis
        assert_equal(out["position_ids"][c], mrope[:, 2 * c : 2 * c + 2].reshape(3, 1, 12))


def test_chunked_pads_boundaries_with_the_sentinel_and_reports_valid_counts() -> None:
    batch = {
        "input_ids": torch.arange(16).view(4, 4),
        "position_ids": torch.zeros(4, 4, dtype=torch.long),
        "seq_lens": torch.tensor([[1, 2], [4, S], [3, S], [S, S]]),
        "seq_lens_padded": torch.tensor([[2, 2], [4, S], [3, S], [S, S]]),
    }
    out = split_batch_into_thd_chunks(batch, 2, seq_lens_padding_value=S)
    assert_equal(out["cu_seqlens"], torch.tensor([[0, 1, 3, 7], [0, 8, S, S]], dtype=torch.int32))
    assert_equal(
        out["cu_seqlens_padded"], torch.tensor([[0, 2, 4, 8], [0, 8, S, S]], dtype=torch.int32)
    )
    assert out["num_seqs"] == [3, 1]
    assert_equal(out["max_seqlen"], i32(4, 8))  # chunk 1 absorbed its tail (3 -> 8)
    assert out["pad_between_seqs"] is True  # chunk 0 needs it
    assert_equal(
        out["padding_mask"],
        torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1]]).bool(),
    )


def test_chunked_absorb_switch_applies_per_chunk() -> None:
    batch = reference_4x6()
    batch["seq_lens"] = torch.tensor([[6], [5], [6], [6]])
    out = split_batch_into_thd_chunks(batch, 2, absorb_trailing_pad=False)
    assert_equal(out["cu_seqlens"], torch.tensor([[0, 6, 11], [0, 6, 12]], dtype=torch.int32))
    assert out["pad_between_seqs"] is True
    out = split_batch_into_thd_chunks(batch, 2)
    assert_equal(out["cu_seqlens"], torch.tensor([[0, 6, 12], [0, 6, 12]], dtype=torch.int32))
    assert out["pad_between_seqs"] is False


def test_narrow_integer_length_dtypes() -> None:
    for dtype in (torch.int32, torch.int16, torch.uint8):
        batch = reference_2x6()
        batch["seq_lens"] = torch.tensor([[3, 2], [6, 255]], dtype=dtype)
        batch["seq_lens_padded"] = torch.tensor([[4, 2], [6, 255]], dtype=dtype)
        out = process_input_for_thd(batch, seq_lens_padding_value=255)
        assert_equal(out["cu_seqlens_padded"], i32(0, 4, 6, 12))


def test_tokens_off_the_cpu_never_read_and_metadata_stays_with_the_lengths() -> None:
    # Tokens on the "meta" device hold no data: any read of their values (a
    # .item(), a comparison pulled to the host) would raise. The layout comes
    # from the CPU length tables alone, and the boundaries stay on the CPU.
    batch = {
        "input_ids": torch.empty(2, 6, dtype=torch.long, device="meta"),
        "labels": torch.empty(2, 6, dtype=torch.long, device="meta"),
        "position_ids": torch.empty(2, 6, dtype=torch.long, device="meta"),
        "seq_lens": torch.tensor([[3, 2], [6, S]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, S]]),
    }
    out = process_input_for_thd(batch)
    assert out["input_ids"].device.type == "meta"
    assert out["padding_mask"].device.type == "meta"
    for key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        assert out[key].device.type == "cpu", key
    assert_equal(out["cu_seqlens_padded"], i32(0, 4, 6, 12))
    chunked = split_batch_into_thd_chunks({k: torch.cat([v, v]) for k, v in batch.items()}, 2)
    assert chunked["cu_seqlens"].device.type == "cpu"


def test_typed_contract_names_every_key() -> None:
    out = process_input_for_thd(reference_2x6())
    assert set(tu.ThdBatch.__annotations__) <= set(out)
    chunked = split_batch_into_thd_chunks(reference_4x6(), 2)
    assert set(tu.ThdChunkedBatch.__annotations__) - {"labels"} <= set(chunked)


# ----------------------------------------------------------- token-id fallback


def test_token_id_fallback_one_sequence_per_row() -> None:
    batch = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 0, 0], [0, 0, 0]]),
        "position_ids": torch.zeros(3, 3, dtype=torch.long),
        "seq_lens": None,
    }
    out = process_input_for_thd(batch, padding_token_id=0, absorb_trailing_pad=False)
    assert_equal(out["cu_seqlens"], i32(0, 3, 4))
    assert_equal(out["cu_seqlens_padded"], i32(0, 3, 9))
    assert_equal(out["padding_mask"], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1]).bool())
    out = process_input_for_thd(batch, padding_token_id=0)
    assert_equal(out["cu_seqlens"], i32(0, 3, 9))
    assert out["pad_between_seqs"] is False


def test_token_id_fallback_chunked_validates_each_chunk() -> None:
    batch = {
        "input_ids": torch.tensor([[5, 0], [0, 0], [7, 8], [9, 0]]),
        "position_ids": torch.zeros(4, 2, dtype=torch.long),
        "seq_lens": None,
    }
    out = split_batch_into_thd_chunks(batch, 2, absorb_trailing_pad=False)
    assert_equal(out["cu_seqlens"], torch.tensor([[0, 1, S], [0, 2, 3]], dtype=torch.int32))
    assert out["num_seqs"] == [1, 2]


def test_thd_padding_mask_from_token_ids() -> None:
    ids = torch.tensor([4, 5, 6, 0, 0])
    assert_equal(thd_padding_mask_from_token_ids(ids, 0), torch.tensor([0, 0, 0, 1, 1]).bool())
    assert_equal(thd_padding_mask_from_token_ids(ids, 9), torch.zeros(5, dtype=torch.bool))
    assert_equal(
        thd_padding_mask_from_token_ids(torch.zeros(3, dtype=torch.long), 0),
        torch.ones(3, dtype=torch.bool),
    )
    assert thd_padding_mask_from_token_ids(torch.zeros(0, dtype=torch.long), 0).shape == (0,)


def test_thd_padding_mask_from_layout() -> None:
    real = torch.tensor([3, 2])
    padded = torch.tensor([4, 2])
    expected = torch.tensor([0, 0, 0, 1, 0, 0, 1, 1]).bool()
    assert_equal(_thd_padding_mask(8, real, padded, torch.device("cpu")), expected)
    kw = _thd_padding_mask(
        total_tokens=8, valid_seq_lens=real, valid_seq_lens_padded=padded, device="cpu"
    )
    assert_equal(kw, expected)
    assert_equal(
        _thd_padding_mask(6, real, None, torch.device("cpu")),
        torch.tensor([0, 0, 0, 0, 0, 1]).bool(),
    )


# ------------------------------------------------------------------------ errors
# One test per message: each asserts the argument, the offending value and the fix.


def err(match: str):
    return pytest.raises(ValueError, match=match)


def test_error_batch_not_a_mapping() -> None:
    with err(r"batch must be a dict of tensors, got list; pass the collate's output dict"):
        process_input_for_thd([1, 2])  # type: ignore[arg-type]


def test_error_missing_required_keys() -> None:
    batch = reference_2x6()
    del batch["position_ids"], batch["seq_lens"]
    with err(r"missing required key\(s\) \['position_ids', 'seq_lens'\].*seq_lens=None"):
        process_input_for_thd(batch)


def test_error_value_not_a_tensor() -> None:
    batch = reference_2x6()
    batch["labels"] = [[1, 2]]
    with err(
        r"batch\['labels'\] must be a torch.Tensor, got list; convert it with torch.as_tensor"
    ):
        process_input_for_thd(batch)


def test_error_input_ids_rank() -> None:
    batch = reference_2x6()
    batch["input_ids"] = torch.zeros(12, dtype=torch.long)
    with err(r"input_ids must be \[B, S\] token ids or \[B, S, H\] embeddings, got shape \(12,\)"):
        process_input_for_thd(batch)


def test_error_num_chunks_does_not_divide_batch() -> None:
    with err(r"num_chunks=3 does not divide the batch size B=4.*pick a divisor of 4"):
        split_batch_into_thd_chunks(reference_4x6(), 3)


def test_error_num_chunks_not_an_int() -> None:
    with err(r"num_chunks=2.0 must be an int"):
        split_batch_into_thd_chunks(reference_4x6(), 2.0)  # type: ignore[arg-type]


def test_error_stream_too_long_for_int32() -> None:
    big = torch.zeros(1, 1, dtype=torch.long).expand(2**16, 2**16)  # a view, no memory
    batch = {"input_ids": big, "position_ids": big, "seq_lens": torch.ones(2**16, 1).long()}
    with err(r"input_ids holds 4294967296 tokens per converted stream.*more chunks"):
        process_input_for_thd(batch)


def test_error_position_ids_shape() -> None:
    batch = reference_2x6()
    batch["position_ids"] = torch.zeros(2, 5, dtype=torch.long)
    with err(r"position_ids shape \(2, 5\) does not match the batch \[B, S\]=\[2, 6\].*mRoPE"):
        process_input_for_thd(batch)


def test_error_labels_shape() -> None:
    batch = reference_2x6()
    batch["labels"] = torch.zeros(2, 7, dtype=torch.long)
    with err(r"labels shape \(2, 7\) does not match the batch \[B, S\]=\[2, 6\]"):
        process_input_for_thd(batch)


def test_error_seq_lens_padded_without_seq_lens() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = None
    with err(r"seq_lens is None but seq_lens_padded is given; pass both length tables"):
        process_input_for_thd(batch)


def test_error_non_integer_lengths() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = batch["seq_lens"].float()
    with err(r"seq_lens must have an integer dtype, got torch.float32.*seq_lens.long\(\)"):
        process_input_for_thd(batch)
    batch = reference_2x6()
    batch["seq_lens_padded"] = batch["seq_lens_padded"].bool()
    with err(r"seq_lens_padded must have an integer dtype, got torch.bool"):
        process_input_for_thd(batch)


def test_error_seq_lens_shape_vs_batch() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = torch.tensor([3, 2, 6])
    with err(
        r"seq_lens must be \[B, P\] with B=2 \(input_ids.shape\[0\]\), got shape \(3,\).*unsqueeze"
    ):
        process_input_for_thd(batch)
    batch["seq_lens"] = torch.tensor([[3, 2], [6, S], [1, S]])
    with err(r"seq_lens must be \[B, P\] with B=2 .*got shape \(3, 2\)"):
        process_input_for_thd(batch)


def test_error_seq_lens_padded_shape_vs_seq_lens() -> None:
    batch = reference_2x6()
    batch["seq_lens_padded"] = torch.tensor([[4, 2, S], [6, S, S]])
    with err(r"seq_lens_padded shape \(2, 3\) does not match seq_lens shape \(2, 2\)"):
        process_input_for_thd(batch)


def test_error_sentinel_in_only_one_table() -> None:
    batch = reference_2x6()
    batch["seq_lens_padded"] = torch.tensor([[4, 2], [6, 0]])
    with err(r"disagree on unused pack slots: at \[1, 1\] seq_lens=-1000 but seq_lens_padded=0"):
        process_input_for_thd(batch)


def test_error_non_positive_length() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = torch.tensor([[3, 0], [6, S]])
    with err(r"seq_lens\[0, 1\]=0 is not a positive length and not the sentinel .*=-1000"):
        process_input_for_thd(batch)


def test_error_real_exceeds_padded() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = torch.tensor([[5, 2], [6, S]])
    with err(r"seq_lens\[0, 0\]=5 exceeds seq_lens_padded\[0, 0\]=4.*must be >= seq_lens"):
        process_input_for_thd(batch)


def test_error_padded_slot_exceeds_row() -> None:
    batch = reference_2x6()
    batch["seq_lens_padded"] = torch.tensor([[4, 2], [7, S]])
    with err(r"seq_lens_padded\[1, 0\]=7 exceeds the row length S=6"):
        process_input_for_thd(batch)


def test_error_row_padded_lengths_exceed_row() -> None:
    batch = reference_2x6()
    batch["seq_lens_padded"] = torch.tensor([[4, 3], [6, S]])
    with err(r"seq_lens_padded row 0 occupies 7 slots but the batch rows hold S=6.*repack"):
        process_input_for_thd(batch)


def test_error_stream_starts_without_a_sequence() -> None:
    batch = reference_2x6()
    batch["seq_lens"] = torch.tensor([[S, S], [6, S]])
    batch["seq_lens_padded"] = torch.tensor([[S, S], [6, S]])
    with err(r"seq_lens row 0 holds no sequence .*Put rows without sequences after rows"):
        process_input_for_thd(batch)


def test_error_chunk_starts_without_a_sequence() -> None:
    batch = reference_4x6()
    batch["seq_lens"] = torch.tensor([[6], [6], [S], [6]])
    batch["seq_lens_padded"] = torch.tensor([[6], [6], [S], [6]])
    with err(r"seq_lens chunk 1 \(batch row 2\) holds no sequence"):
        split_batch_into_thd_chunks(batch, 2)
    process_input_for_thd(batch)  # fine unchunked: row 2 pads row 1's sequence


def test_error_fallback_needs_token_ids() -> None:
    batch = reference_2x6()
    batch.update(input_ids=torch.randn(2, 6, 4), seq_lens=None, seq_lens_padded=None)
    with err(r"padding can only be inferred from integer token ids \[B, S\]. Supply seq_lens"):
        process_input_for_thd(batch)


def test_error_fallback_pad_id_collision() -> None:
    batch = reference_2x6()
    batch.update(seq_lens=None, seq_lens_padded=None)
    batch["input_ids"] = torch.tensor([[1, 2, 0, 3, 4, 5], [6, 7, 8, 9, 0, 0]])
    with err(r"padding_token_id=0 also occurs as content \(input_ids\[2\] is the pad id"):
        process_input_for_thd(batch)


def test_error_fallback_stream_starts_with_padding() -> None:
    batch = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "position_ids": torch.zeros(2, 3, dtype=torch.long),
        "seq_lens": None,
    }
    with err(r"input_ids row 0 is entirely padding_token_id=0, so the batch holds no sequence"):
        process_input_for_thd(batch)


def test_error_token_mask_collision_eos_equals_pad() -> None:
    # e.g. a model whose pad id is also its EOS id: EOS inside content
    with err(r"padding_token_id=2 also occurs as content \(input_ids\[1\] is the pad id"):
        thd_padding_mask_from_token_ids(torch.tensor([5, 2, 7, 2]), 2)


def test_error_token_mask_not_1d() -> None:
    with err(r"input_ids must be 1-D \[total_tokens\], got shape \(2, 2\); flatten it first"):
        thd_padding_mask_from_token_ids(torch.zeros(2, 2, dtype=torch.long), 0)


@pytest.mark.parametrize(
    ("real", "padded", "total", "match"),
    [
        (torch.tensor([[3]]), None, 4, r"valid_seq_lens must be 1-D \[N\], got shape \(1, 1\)"),
        (
            torch.tensor([3]),
            torch.tensor([3, 1]),
            4,
            r"valid_seq_lens_padded shape \(2,\) != valid_seq_lens shape \(1,\)",
        ),
        (
            torch.tensor([3]),
            torch.tensor([2]),
            4,
            r"valid_seq_lens\[0\]=3 exceeds valid_seq_lens_padded\[0\]=2",
        ),
        (torch.tensor([-1]), None, 4, r"valid_seq_lens\[0\]=-1 is negative; drop sentinel entries"),
        (torch.tensor([3, 2]), None, 4, r"the sequences occupy 5 slots but total_tokens=4"),
        (
            torch.tensor([3.0]),
            None,
            4,
            r"valid_seq_lens must have an integer dtype, got torch.float32",
        ),
    ],
)
def test_error_layout_mask_arguments(real, padded, total, match) -> None:
    with err(match):
        _thd_padding_mask(total, real, padded, torch.device("cpu"))


# ---------------------------------------------- the host layout module directly


def test_validate_pack_lengths_returns_valid_slots() -> None:
    sl = np.array([[3, 2], [6, S]])
    sp = np.array([[4, 2], [6, S]])
    assert validate_pack_lengths(sl, sp, 6, S, 2).tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize(
    ("sl", "sp", "match"),
    [
        ([[3, 2], [6, S]], [[4, 2], [6, 1]], "disagree on unused pack slots"),
        ([[3, -2], [6, S]], [[4, 2], [6, S]], "not a positive length"),
        ([[3, 3], [6, S]], [[4, 2], [6, S]], "exceeds seq_lens_padded"),
        ([[3, 2], [6, S]], [[4, 2], [9, S]], "exceeds the row length"),
        ([[3, 2], [6, S]], [[4, 3], [6, S]], "occupies 7 slots"),
        ([[S, S], [6, S]], [[S, S], [6, S]], "holds no sequence"),
        ([[2**62, 2**62], [6, S]], [[2**62, 2**62], [6, S]], "exceeds the row length"),
    ],
)
def test_fast_check_and_diagnosis_agree(sl, sp, match) -> None:
    # pack_layout's combined fast check must reject exactly what the per-check
    # diagnosis rejects, and surface the diagnosis' message.
    a, b = np.array(sl, dtype=np.int64), np.array(sp, dtype=np.int64)
    with err(match):
        validate_pack_lengths(a, b, 6, S, 2)
    with err(match):
        pack_layout(a, b, 6, S)
    with err(match):
        stream_layout(a, b, 6, S)


@pytest.mark.parametrize(
    ("sl", "sp", "match"),
    [
        ([[0, 2], [6, 99]], [[4, 2], [6, 99]], "not a positive length"),
        ([[3, 2], [6, 99]], [[4, 2], [7, 99]], "exceeds the row length"),
        ([[3, 3], [6, 99]], [[4, 2], [6, 99]], "exceeds seq_lens_padded"),
        ([[3, 99], [6, 99]], [[4, 2], [6, 99]], "disagree on unused pack slots"),
    ],
)
def test_fast_check_with_a_positive_sentinel(sl, sp, match) -> None:
    # A sentinel above S (e.g. 99 in uint8 tables) is counted by the "> S"
    # comparison on every unused slot; the fast check must still see bad slots.
    a, b = np.array(sl, dtype=np.int64), np.array(sp, dtype=np.int64)
    with err(match):
        stream_layout(a, b, 6, 99)
    ok = stream_layout(np.array([[3, 2], [6, 99]]), np.array([[4, 2], [6, 99]]), 6, 99)
    assert ok.cu_seqlens_padded.tolist() == [0, 4, 6, 12]


def test_non_contiguous_inputs_are_copied_not_misread() -> None:
    batch = reference_2x6()
    ids_t = batch["input_ids"].t().contiguous().t()  # same values, column-major strides
    assert not ids_t.is_contiguous()
    batch["input_ids"] = ids_t
    out = process_input_for_thd(batch)
    assert_equal(out["input_ids"], torch.tensor([1, 2, 3, 99, 4, 5, 6, 7, 8, 9, 10, 11]))


# -- drop-in details: position_ids None, per-token keys, integer 3-D ids -----------------------


def _token_batch(position_ids=True):
    b = {
        "input_ids": torch.arange(1, 25).reshape(4, 6),
        "position_ids": torch.arange(6).repeat(4, 1) if position_ids else None,
        "seq_lens": torch.tensor([[3, 3], [6, -1000], [2, 4], [5, -1000]]),
        "loss_mask": (torch.arange(24).reshape(4, 6) % 3 > 0),
        "weights": torch.rand(4, 6, 2),
    }
    return b


def test_position_ids_none_is_returned_as_none() -> None:
    with_pos = process_input_for_thd(_token_batch())
    out = process_input_for_thd(_token_batch(position_ids=False))
    assert out["position_ids"] is None
    for k in ("input_ids", "cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(out[k], with_pos[k])
    chunked = split_batch_into_thd_chunks(_token_batch(position_ids=False), 2)
    assert chunked["position_ids"] is None and chunked["input_ids"].shape == (2, 12)


@pytest.mark.parametrize("num_chunks", [1, 2, 4])
def test_token_keys_are_flattened_and_split_like_the_ids(num_chunks: int) -> None:
    batch = _token_batch()
    out = split_batch_into_thd_chunks(batch, num_chunks, token_keys=("loss_mask", "weights"))
    lead = (24,) if num_chunks == 1 else (num_chunks, 24 // num_chunks)
    assert torch.equal(out["loss_mask"], batch["loss_mask"].reshape(lead))
    assert torch.equal(out["weights"], batch["weights"].reshape(*lead, 2))
    # each chunk's token keys line up with that chunk's ids, as a per-chunk conversion gives them
    if num_chunks > 1:
        rows = 4 // num_chunks
        for c in range(num_chunks):
            part = {
                k: (v[c * rows : (c + 1) * rows] if isinstance(v, torch.Tensor) else v)
                for k, v in batch.items()
            }
            one = process_input_for_thd(part, token_keys=("loss_mask",))
            assert torch.equal(out["loss_mask"][c], one["loss_mask"]) and torch.equal(
                out["input_ids"][c], one["input_ids"]
            )
    # the default stays the reference's pass-through
    plain = split_batch_into_thd_chunks(batch, num_chunks)
    assert plain["loss_mask"] is batch["loss_mask"]


@pytest.mark.parametrize(
    ("token_keys", "match"),
    [
        (("nope",), r"token_keys names 'nope', which the batch does not hold"),
        (("labels",), r"token_keys names 'labels', which the conversion handles itself"),
        (
            "loss_mask",
            r"token_keys='loss_mask' must be a tuple of key names, e.g. \('loss_mask',\)",
        ),
        (
            ("bad",),
            r"token key 'bad' is \[4\], not \[B, S, \.\.\.\]=\[4, 6, \.\.\.\] like input_ids",
        ),
    ],
)
def test_token_keys_bad_input(token_keys, match) -> None:
    batch = {**_token_batch(), "bad": torch.zeros(4)}
    with pytest.raises(ValueError, match=match):
        process_input_for_thd(batch, token_keys=token_keys)


@pytest.mark.parametrize(
    ("shape", "fix"), [((1, 4, 6), r"input_ids\[0\]"), ((4, 6, 1), r"input_ids\.squeeze\(-1\)")]
)
def test_integer_3d_input_ids_are_refused_naming_the_fix(shape, fix) -> None:
    batch = {**_token_batch(), "input_ids": torch.arange(24).reshape(shape)}
    with pytest.raises(
        ValueError,
        match=re.escape(f"input_ids has shape {list(shape)}")
        + rf".*a 3-D input_ids is read as embeddings.*pass {fix}",
    ):
        process_input_for_thd(batch)
    emb = {
        **_token_batch(),
        "input_ids": torch.rand(4, 6, 1),
    }  # float [B, S, 1] embeddings stay valid
    assert process_input_for_thd(emb)["input_ids"].shape == (24, 1)
