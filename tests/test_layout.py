"""te_thd.ThdLayout: built once from the converted batch, trusted by every consumer.

Property tests over random pack layouts (sequences padded to a multiple for CP, rows
not filled, rows without sequences, absorption on or off): ``from_thd`` reads what
the dict carries, ``.to`` keeps TE's same-object rule, and every consumer gives the
same output for the dict and for its ``ThdLayout``. Exact-value and error tests pin
the documented example and each check of the constructor.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd import ThdLayout
from te_thd.attention import (
    ThdAttention,
    ThdContractError,
    VarlenLayoutError,
    flash_attn_varlen_kwargs,
    packed_seq_params,
    te_attention_kwargs,
    torch_varlen_kwargs,
)
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.thd_utils import process_input_for_thd

I32 = torch.int32
EXAMPLES = 60


@st.composite
def packed_batches(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], int, bool]:
    """A packed BSHD batch whose sequences are padded to ``2*cp`` (cp in 1, 2, 4)."""
    cp = draw(st.sampled_from([1, 2, 4]))
    mult = 2 * cp if cp > 1 else 1
    rows = draw(st.integers(1, 3))
    seq_len = mult * draw(st.integers(1, 6))
    seq_lens, seq_lens_padded = [], []
    for b in range(rows):
        free = seq_len
        real_row, pad_row = [], []
        for _ in range(draw(st.integers(1 if b == 0 else 0, 3))):
            if free < mult:
                break
            padded = mult * draw(st.integers(1, free // mult))
            real_row.append(draw(st.integers(1, padded)))
            pad_row.append(padded)
            free -= padded
        if b == 0 and not real_row:
            real_row, pad_row = [1], [mult]
        seq_lens.append(real_row)
        seq_lens_padded.append(pad_row)
    slots = max(len(r) for r in seq_lens)

    def table(rows_: list[list[int]]) -> torch.Tensor:
        return torch.tensor([r + [-1000] * (slots - len(r)) for r in rows_], dtype=torch.long)

    tokens = torch.arange(rows * seq_len).view(rows, seq_len)
    batch = {
        "input_ids": tokens,
        "labels": tokens + 1,
        "position_ids": tokens % seq_len,
        "seq_lens": table(seq_lens),
        "seq_lens_padded": table(seq_lens_padded),
    }
    # A partition needs the stream to end on a sequence multiple: the last row's
    # unused tail is padding of its last sequence, so the stream length must divide.
    return batch, cp, draw(st.booleans())


def _convert(batch: dict[str, torch.Tensor], absorb: bool) -> dict:
    return process_input_for_thd(batch, absorb_trailing_pad=absorb)


def _same(a: object, b: object) -> None:
    """Equal outputs: same keys, equal tensors (and the same-object pattern), equal values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
        ids_a = {k: id(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
        ids_b = {k: id(v) for k, v in b.items() if isinstance(v, torch.Tensor)}
        groups_a = sorted(sorted(k for k in ids_a if ids_a[k] == i) for i in set(ids_a.values()))
        groups_b = sorted(sorted(k for k in ids_b if ids_b[k] == i) for i in set(ids_b.values()))
        assert groups_a == groups_b
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device
        assert a.shape == b.shape and (a.device.type == "meta" or torch.equal(a, b))
    else:
        assert type(a) is type(b) and a == b


def _outcome(fn, *args, **kwargs):
    """``("ok", result)`` or ``("error", type, message)``: consumers must agree on either."""
    try:
        return ("ok", fn(*args, **kwargs))
    except ValueError as exc:
        return ("error", type(exc), str(exc).split("(")[0])


def _same_outcome(a, b) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "ok":
        _same(a[1], b[1])
    else:
        assert a[1:] == b[1:]


# --------------------------------------------------------------------------- from_thd


@settings(max_examples=EXAMPLES)
@given(packed_batches())
def test_from_thd_reads_what_the_dict_carries(case):
    batch, _, absorb = case
    out = _convert(batch, absorb)
    layout = ThdLayout.from_thd(out)
    assert layout.cu_seqlens is out["cu_seqlens"]  # read, not recomputed or copied
    assert torch.equal(layout.cu_seqlens_padded, out["cu_seqlens_padded"])
    assert layout.num_seqs == out["num_seqs"] == out["cu_seqlens"].numel() - 1
    assert layout.total_tokens == out["input_ids"].shape[0]
    assert layout.pad_between_seqs is out["pad_between_seqs"]
    assert (layout.cp_size, layout.cp_rank) == (1, 0)
    lengths = out["cu_seqlens_padded"].diff()
    assert layout.max_seqlen == max(out["max_seqlen_int"], int(lengths.max()))
    if not out["pad_between_seqs"]:
        assert layout.cu_seqlens_padded is layout.cu_seqlens
        assert layout.max_seqlen == out["max_seqlen_int"]
    # absorption is recorded exactly when a padding slot lies inside a sequence
    pm = out["padding_mask"][: int(out["cu_seqlens"][-1])]
    assert layout.absorbed_trailing_pad == (not out["pad_between_seqs"] and bool(pm.any()))
    # round trip: a dict that carries the layout gives it back; rebuilding gives an equal one
    assert ThdLayout.from_thd({**out, "thd_layout": layout}) is layout
    assert (
        ThdLayout(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}) == layout
    )


@settings(max_examples=EXAMPLES)
@given(packed_batches())
def test_to_keeps_the_same_object_rule(case):
    batch, _, absorb = case
    layout = ThdLayout.from_thd(_convert(batch, absorb))
    assert layout.to("cpu") is layout  # nothing to move
    moved = layout.to("meta", non_blocking=True)
    assert moved.cu_seqlens.device.type == "meta" and moved.cu_seqlens_padded.device.type == "meta"
    assert (moved.cu_seqlens_padded is moved.cu_seqlens) == (not layout.pad_between_seqs)
    host = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    assert {k: getattr(moved, k) for k in host if not k.startswith("cu_")} == {
        k: v for k, v in host.items() if not k.startswith("cu_")
    }
    assert moved.cu_seqlens.dtype == I32


# --------------------------------------------------------------------------- consumers


@settings(max_examples=EXAMPLES)
@given(
    packed_batches(), st.sampled_from(["padding_causal", "padding", "padding_causal_bottom_right"])
)
def test_attention_adapters_give_the_same_for_dict_and_layout(case, mask):
    batch, _, absorb = case
    out = _convert(batch, absorb)
    layout = ThdLayout.from_thd(out)
    for thd in (layout, {**out, "thd_layout": layout}):
        _same_outcome(
            _outcome(te_attention_kwargs, out, mask), _outcome(te_attention_kwargs, thd, mask)
        )
        for device in (None, "meta"):
            _same_outcome(
                _outcome(te_attention_kwargs, out, "padding_causal", device=device),
                _outcome(te_attention_kwargs, thd, "padding_causal", device=device),
            )
        for fn in (flash_attn_varlen_kwargs, torch_varlen_kwargs):
            _same_outcome(_outcome(fn, out), _outcome(fn, thd))
        causal = mask != "padding"
        a, b = (
            _outcome(packed_seq_params, out, causal=causal),
            _outcome(packed_seq_params, thd, causal=causal),
        )
        assert a[0] == b[0]
        if a[0] == "ok":
            _same(vars(a[1]), vars(b[1]))


@settings(max_examples=EXAMPLES)
@given(packed_batches(), st.data())
def test_cp_shard_gives_the_same_for_dict_and_layout(case, data):
    batch, cp, absorb = case
    out = _convert(batch, absorb)
    layout = ThdLayout.from_thd(out)
    rank = data.draw(st.integers(0, cp - 1))
    plain = _outcome(shard_thd_batch_for_cp, out, cp, rank)
    with_layout = _outcome(shard_thd_batch_for_cp, out, cp, rank, layout=layout)
    carried = _outcome(shard_thd_batch_for_cp, {**out, "thd_layout": layout}, cp, rank)
    assert plain[0] == with_layout[0] == carried[0]
    if plain[0] == "error":
        return
    local = with_layout[1]
    sharded = local.pop("thd_layout") if cp > 1 else layout
    _same(plain[1], local)
    _same(carried[1]["thd_layout"] if cp > 1 else layout, sharded)
    assert (sharded.cp_size, sharded.cp_rank) == (cp, rank) if cp > 1 else sharded is layout
    # the sharded batch's kwargs: identical for the sharded dict and its layout
    _same_outcome(_outcome(te_attention_kwargs, plain[1]), _outcome(te_attention_kwargs, sharded))


def test_thd_attention_gives_the_same_for_dict_and_layout():
    batch = {
        "input_ids": torch.arange(16).view(2, 8),
        "position_ids": torch.arange(16).view(2, 8) % 8,
        "seq_lens": torch.tensor([[3, 2], [5, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 4], [8, -1000]]),
    }
    out = process_input_for_thd(batch)
    layout = ThdLayout.from_thd(out)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for mask in ("padding_causal", "padding"):
        attn = ThdAttention(4, 8, attn_mask_type=mask, backend="reference")
        torch.testing.assert_close(attn(q, k, v, layout), attn(q, k, v, out), rtol=0, atol=0)


# --------------------------------------------------------------------------- exact values


def test_reference_example():
    # The reference page's example: B=2, S=6.
    out = process_input_for_thd({
        "input_ids": torch.arange(12).view(2, 6),
        "position_ids": torch.arange(12).view(2, 6),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
    })  # fmt: skip
    layout = ThdLayout.from_thd(out)
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 11]
    assert layout.cu_seqlens_padded.tolist() == [0, 4, 6, 12]
    assert (layout.num_seqs, layout.max_seqlen, layout.total_tokens) == (3, 6, 12)
    assert layout.pad_between_seqs is True and layout.absorbed_trailing_pad is False
    assert te_attention_kwargs(layout)["max_seqlen_q"] == 6


def test_sharded_layout_and_override():
    cu = torch.tensor([0, 4, 8], dtype=I32)
    layout = ThdLayout(cu, cu, num_seqs=2, max_seqlen=4, total_tokens=8, pad_between_seqs=False)
    assert layout.sharded(1, 0) is layout
    two = layout.sharded(2, 1)
    assert (two.cp_size, two.cp_rank, two.local_tokens) == (2, 1, 4) and two.cu_seqlens is cu
    with pytest.raises(ValueError, match=r"not a multiple of 2\*cp_size=8"):
        layout.sharded(4, 0)
    assert te_attention_kwargs(layout, max_seqlen=7)["max_seqlen_q"] == 7
    with pytest.raises(ValueError, match="max_seqlen=3 is smaller than sequence 0's length 4"):
        te_attention_kwargs(layout, max_seqlen=3)
    with pytest.raises(VarlenLayoutError, match="has no context parallelism"):
        flash_attn_varlen_kwargs(two)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.max_seqlen = 5  # type: ignore[misc]


# --------------------------------------------------------------------------- errors


def _fields(**over):
    cu = torch.tensor([0, 3, 5], dtype=I32)
    cup = torch.tensor([0, 4, 8], dtype=I32)
    fields = dict(cu_seqlens=cu, cu_seqlens_padded=cup, num_seqs=2, max_seqlen=4,
                  total_tokens=8, pad_between_seqs=True)  # fmt: skip
    fields.update(over)
    return fields


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"cu_seqlens": [0, 3, 5]}, "cu_seqlens must be an int32 .* got list"),
        ({"cu_seqlens": torch.tensor([0, 3, 5])}, "cu_seqlens must have dtype torch.int32, got torch.int64"),
        ({"cu_seqlens_padded": torch.tensor([[0, 4, 8]], dtype=I32)}, r"cu_seqlens_padded must be 1-D"),
        ({"cu_seqlens_padded": torch.tensor([0, 8], dtype=I32)}, r"cu_seqlens_padded has shape \(2,\)"),
        ({"num_seqs": 3}, r"num_seqs=3 but cu_seqlens holds 3 boundaries \(2 sequences\)"),
        ({"max_seqlen": torch.tensor(4)}, r"max_seqlen=tensor\(4\) must be an int >= 0"),
        ({"total_tokens": -1}, "total_tokens=-1 must be an int >= 0"),
        ({"pad_between_seqs": 1}, "pad_between_seqs must be a Python bool, got int 1"),
        ({"pad_between_seqs": False}, r"pad_between_seqs=False but cu_seqlens \[0, 3, 5\] differs"),
        ({"max_seqlen": 2}, "max_seqlen=2 is smaller than sequence 0's length 3"),
        ({"total_tokens": 6}, "cu_seqlens_padded ends at 8, beyond the 6 tokens"),
        ({"cu_seqlens": torch.tensor([0, 5, 6], dtype=I32)}, "sequence 0 has real length 5"),
        ({"cp_size": 0}, "cp_size=0 must be an int >= 1"),
        ({"cp_size": 2, "cp_rank": 2}, r"cp_rank=2 must be an int in \[0, cp_size=2\)"),
        ({"cp_size": 4, "cp_rank": 0}, r"padded length 4 .*not a multiple of 2\*cp_size=8"),
        ({"cp_size": 2, "total_tokens": 16}, "ends at 8 but the global stream has 16 tokens"),
    ],
)  # fmt: skip
def test_constructor_errors(over, match):
    ThdLayout(**_fields())  # the unmodified layout is valid
    with pytest.raises(ThdContractError, match=match):
        ThdLayout(**_fields(**over))


def test_device_boundaries_are_not_read():
    # "meta" tensors hold no data: building succeeds only because nothing is read.
    cu = torch.tensor([0, 3, 5], dtype=I32).to("meta")
    layout = ThdLayout(cu, cu, num_seqs=2, max_seqlen=3, total_tokens=None, pad_between_seqs=False)
    assert te_attention_kwargs(layout)["cu_seqlens_q_padded"] is cu


def test_import_te_thd_stays_light():
    code = (
        "import sys, te_thd; assert 'torch' not in sys.modules, 'import te_thd pulled torch'; "
        "from te_thd import ThdLayout; assert ThdLayout.__module__ == 'te_thd.layout'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
