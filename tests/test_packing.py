"""te_thd.packing: FFD vs a loop oracle, packer invariants (hypothesis), round trips, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd.cp import cp_rank_to_sequence_order, shard_thd_batch_for_cp
from te_thd.packing import (
    PackingCollator,
    assign_bins,
    pad_to_multiple_for,
    seq_lens_from_position_ids,
    unflatten_from_position_ids,
)
from te_thd.thd_utils import process_input_for_thd

PAD = -7  # a pad id no sample token uses, so placement is checkable by value


def naive_first_fit(sizes: list[int], capacity: int, decreasing: bool) -> list[int]:
    """O(n^2) first fit (decreasing: visit by size desc, ties in arrival order)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i]) if decreasing else range(len(sizes))
    residual: list[int] = []
    out = [0] * len(sizes)
    for i in order:
        for b, room in enumerate(residual):
            if room >= sizes[i]:
                residual[b] -= sizes[i]
                out[i] = b
                break
        else:
            residual.append(capacity - sizes[i])
            out[i] = len(residual) - 1
    return out


@settings(max_examples=150)
@given(st.integers(1, 64), st.data(), st.booleans())
def test_assign_bins_is_first_fit(capacity, data, decreasing):
    sizes = data.draw(st.lists(st.integers(0, capacity), max_size=60))
    got = assign_bins(sizes, capacity, decreasing=decreasing)
    assert got.tolist() == naive_first_fit(sizes, capacity, decreasing)


def test_ffd_beats_arrival_order_first_fit():
    sizes = [2, 2, 2, 2, 8, 8, 8, 8]  # arrival FF: 5 bins of 10; FFD: 4
    assert int(assign_bins(sizes, 10, decreasing=False).max()) + 1 == 5
    assert int(assign_bins(sizes, 10).max()) + 1 == 4


def test_pad_to_multiple_for():
    assert pad_to_multiple_for(1) == 1
    assert pad_to_multiple_for(2) == 4
    assert pad_to_multiple_for(8) == 16
    assert pad_to_multiple_for(4, tp_size=2) == 8  # TP without SP adds nothing
    assert pad_to_multiple_for(4, tp_size=2, sequence_parallel=True) == 16
    assert pad_to_multiple_for(1, tp_size=4, sequence_parallel=True) == 4


# --------------------------------------------------------------------------- invariants


@st.composite
def packing_cases(draw):
    m = draw(st.sampled_from([1, 2, 4, 8]))
    S = m * draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, S + S // 2 + 1), min_size=1, max_size=24))
    with_labels = draw(st.booleans())
    extra = draw(st.booleans())
    samples, nxt = [], 0
    for n in lengths:
        ids = torch.arange(nxt, nxt + n)  # globally unique token values
        nxt += n
        s = {"input_ids": ids}
        if with_labels:
            lab = ids.clone() + 100_000
            lab[: n // 3] = -100  # a masked "prompt"
            s["labels"] = lab
        if extra:
            s["loss_weight"] = torch.rand(n) + 1.0
        samples.append(s)
    return samples, S, m


def _documents(out, S):
    """(row, start, real, padded) of every document, read from seq_lens[_padded]."""
    docs = []
    for b, (reals, pads) in enumerate(
        zip(out["seq_lens"].tolist(), out["seq_lens_padded"].tolist(), strict=True)
    ):
        off = 0
        for r, p in zip(reals, pads, strict=True):
            if p == -1000:
                assert r == -1000
                continue
            docs.append((b, off, r, p))
            off += p
        assert off == S, f"row {b}: padded lengths sum to {off}, not S={S}"
    return docs


@settings(max_examples=120)
@given(packing_cases())
def test_packer_invariants(case):
    samples, S, m = case
    out = PackingCollator(S, pad_to_multiple_of=m, overlong="truncate", pad_token_id=PAD)(samples)
    B = out["input_ids"].shape[0]
    for k in ("input_ids", "labels", "position_ids"):
        assert out[k].shape == (B, S)
    assert out["seq_lens"].shape == out["seq_lens_padded"].shape and out["seq_lens"].shape[0] == B
    ids = out["input_ids"].reshape(-1)
    labels = out["labels"].reshape(-1)
    pos = out["position_ids"].reshape(-1)
    docs = _documents(out, S)
    assert len(docs) == len(samples)
    by_first = {int(s["input_ids"][0]): s for s in samples}
    placed = torch.zeros(ids.numel(), dtype=torch.bool)
    kept_total = 0
    for b, off, real, padded in docs:
        assert padded % m == 0 and real <= padded and real >= 1
        base = b * S + off
        sample = by_first[int(ids[base])]
        full = sample["input_ids"]
        assert real == min(full.numel(), S)  # overlong documents truncated to S
        assert torch.equal(ids[base : base + real], full[:real])  # contiguous, in order
        assert (ids[base + real : base + padded] == PAD).all()
        assert pos[base : base + padded].tolist() == list(range(padded))
        src = sample.get("labels", full)
        want = torch.full((real,), -100, dtype=labels.dtype)
        nxt = src[1 : real + 1]  # shifted inside the document (real target when truncated)
        want[: nxt.numel()] = nxt
        assert torch.equal(labels[base : base + real], want)
        assert (labels[base + real : base + padded] == -100).all()
        if "loss_weight" in sample:
            lw = out["loss_weight"].reshape(-1)
            assert torch.equal(lw[base : base + real], sample["loss_weight"][:real])
            assert (lw[base + real : base + padded] == 0).all()
        placed[base : base + real] = True
        kept_total += real
    # every kept token exactly once, nothing else
    assert int(placed.sum()) == kept_total
    assert (ids[~placed] == PAD).all()
    assert sorted(ids[placed].tolist()) == sorted(
        t for s in samples for t in s["input_ids"][:S].tolist()
    )
    assert out["packing_efficiency"] == pytest.approx(kept_total / (B * S))
    # at least as good as first-fit-decreasing: exactly FFD's row count
    padded_lens = [-(-min(s["input_ids"].numel(), S) // m) * m for s in samples]
    assert B == max(naive_first_fit(padded_lens, S, True)) + 1


@settings(max_examples=60)
@given(packing_cases(), st.sampled_from([1, 2, 4]))
def test_round_trip_through_thd_and_cp(case, cp):
    samples, S, _ = case
    m = pad_to_multiple_for(cp)
    S = -(-S // m) * m
    out = PackingCollator(S, pad_to_multiple_of=m, overlong="truncate", pad_token_id=PAD)(samples)
    reals = out["seq_lens"][out["seq_lens"] != -1000].tolist()
    thd = process_input_for_thd(out, padding_token_id=PAD)
    ids, cu_pad = thd["input_ids"], thd["cu_seqlens_padded"].tolist()
    assert len(cu_pad) == len(samples) + 1 and cu_pad[-1] == ids.numel()
    recovered = sorted(tuple(ids[cu_pad[i] : cu_pad[i] + r].tolist()) for i, r in enumerate(reals))
    assert recovered == sorted(tuple(s["input_ids"][:S].tolist()) for s in samples)
    assert int((~thd["padding_mask"]).sum()) == sum(reals)
    assert (ids[thd["padding_mask"]] == PAD).all()
    shards = [shard_thd_batch_for_cp(thd, cp, r) for r in range(cp)]
    gathered = torch.cat([sh["input_ids"] for sh in shards]) if cp > 1 else shards[0]["input_ids"]
    assert torch.equal(cp_rank_to_sequence_order(gathered, thd["cu_seqlens_padded"], cp), ids)


def test_documented_example():
    samples = [
        {"input_ids": torch.tensor(x)}
        for x in ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17])
    ]
    out = PackingCollator(8, pad_to_multiple_of=2)(samples)
    assert out["input_ids"].tolist() == [
        [11, 12, 13, 14, 15, 16, 17, 0],
        [4, 5, 6, 7, 8, 0, 9, 10],
        [1, 2, 3, 0, 0, 0, 0, 0],
    ]
    assert out["labels"].tolist() == [
        [12, 13, 14, 15, 16, 17, -100, -100],
        [5, 6, 7, 8, -100, -100, 10, -100],
        [2, 3, -100, -100, -100, -100, -100, -100],
    ]
    assert out["position_ids"].tolist() == [
        list(range(8)),
        [0, 1, 2, 3, 4, 5, 0, 1],
        list(range(8)),
    ]
    assert out["seq_lens"].tolist() == [[7, -1000], [5, 2], [3, -1000]]
    assert out["seq_lens_padded"].tolist() == [[8, -1000], [6, 2], [8, -1000]]
    assert out["packing_efficiency"] == pytest.approx(17 / 24)


def test_labels_already_shifted_are_kept():
    s = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, 8])}
    out = PackingCollator(4, labels_shifted=True)([s])
    assert out["labels"].tolist() == [[6, 7, 8, -100]]
    out = PackingCollator(4)([s])
    assert out["labels"].tolist() == [[7, 8, -100, -100]]
    out = PackingCollator(4, label_key=None)([{"input_ids": s["input_ids"]}])  # from the ids
    assert out["labels"].tolist() == [[6, 7, -100, -100]]
    assert "labels" in out and out["input_ids"].tolist() == [[5, 6, 7, 0]]


def test_fixed_rows_leave_exact_empty_rows():
    out = PackingCollator(4, rows=3)([{"input_ids": torch.tensor([1, 2, 3])}])
    assert out["seq_lens"].tolist() == [[3], [-1000], [-1000]]
    assert out["seq_lens_padded"].tolist() == [[4], [-1000], [-1000]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]] * 3
    assert out["labels"].tolist() == [[2, 3, -100, -100]] + [[-100] * 4] * 2
    assert out["packing_efficiency"] == pytest.approx(3 / 12)
    thd = process_input_for_thd(out)  # empty rows become the last document's padding
    assert thd["cu_seqlens_padded"].tolist() == [0, 12]
    assert thd["padding_mask"].tolist() == [False] * 3 + [True] * 9


# --------------------------------------------------------------------------- flattened input


def test_flattened_batch_matches_sample_list():
    docs = [torch.tensor([3, 4, 5]), torch.tensor([6, 7]), torch.tensor([8, 9, 10, 11])]
    flat_ids = torch.cat(docs).view(1, -1)
    flat_labels = flat_ids.clone()
    starts = [0, 3, 5]
    flat_labels[0, starts] = -100  # HF DataCollatorWithFlattening's separator
    flat = {
        "input_ids": flat_ids,
        "labels": flat_labels,
        "position_ids": torch.cat([torch.arange(d.numel()) for d in docs]).view(1, -1),
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 9]),  # dropped: describes the old layout
        "max_length_q": 4,
    }
    assert seq_lens_from_position_ids(flat["position_ids"]).tolist() == [3, 2, 4]
    split = unflatten_from_position_ids(flat)
    assert [s["input_ids"].tolist() for s in split] == [d.tolist() for d in docs]
    assert set(split[0]) == {"input_ids", "labels"}
    coll = PackingCollator(6, pad_to_multiple_of=2)
    a = coll(flat)
    b = coll([{"input_ids": d} for d in docs])
    for k in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"):
        assert torch.equal(a[k], b[k]), k


@settings(max_examples=60)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_seq_lens_from_position_ids_property(lengths):
    pos = torch.cat([torch.arange(n) for n in lengths])
    assert seq_lens_from_position_ids(pos).tolist() == lengths


# --------------------------------------------------------------------------- errors


def test_errors():
    one = [{"input_ids": torch.tensor([1, 2, 3, 4, 5])}]
    with pytest.raises(
        ValueError, match=r"seq_len=10 must be a multiple of pad_to_multiple_of=4.*seq_len=12"
    ):
        PackingCollator(10, pad_to_multiple_of=4)
    with pytest.raises(
        ValueError, match=r"sample 0 has 5 tokens > seq_len=4; pass overlong='truncate'"
    ):
        PackingCollator(4)(one)
    with pytest.raises(ValueError, match=r"overlong must be 'truncate' or 'raise', got 'drop'"):
        PackingCollator(4, overlong="drop")
    with pytest.raises(ValueError, match=r"seq_lens_padding_value must be a negative int.*got 0"):
        PackingCollator(4, seq_lens_padding_value=0)
    with pytest.raises(ValueError, match=r"seq_len=0 must be an int >= 1"):
        PackingCollator(0)
    with pytest.raises(ValueError, match=r"rows=0 must be an int >= 1"):
        PackingCollator(4, rows=0)
    with pytest.raises(ValueError, match=r"samples is empty"):
        PackingCollator(8)([])
    with pytest.raises(ValueError, match=r"sample 1 is empty \(0 tokens\)"):
        PackingCollator(8)([one[0], {"input_ids": torch.tensor([], dtype=torch.long)}])
    with pytest.raises(
        ValueError, match=r"sample 1 has keys \['ids'\], sample 0 has \['input_ids'\]"
    ):
        PackingCollator(8)([one[0], {"ids": torch.tensor([1])}])
    with pytest.raises(
        ValueError,
        match=r"sample 0\['labels'\] must be a 1-D tensor of the sample's length 5, got \(4,\)",
    ):
        PackingCollator(8)([{"input_ids": torch.arange(5), "labels": torch.arange(4)}])
    with pytest.raises(
        ValueError, match=r"sample 0\['input_ids'\] must be a 1-D tensor, got \(1, 5\)"
    ):
        PackingCollator(8)([{"input_ids": torch.arange(5).view(1, 5)}])
    with pytest.raises(ValueError, match=r"sample 0 must be a dict holding 'input_ids'"):
        PackingCollator(8)([{"tokens": torch.arange(5)}])
    with pytest.raises(ValueError, match=r"need 2 rows of seq_len=4 but rows=1"):
        PackingCollator(4, rows=1)([{"input_ids": torch.arange(3)}] * 2)
    with pytest.raises(ValueError, match=r"item 1 has length 9 > capacity=8"):
        assign_bins([3, 9], 8)
    with pytest.raises(ValueError, match=r"item 0 has length -1"):
        assign_bins([-1], 8)
    with pytest.raises(ValueError, match=r"cp_size=0 must be an int >= 1"):
        pad_to_multiple_for(0)


def test_flattened_errors():
    with pytest.raises(ValueError, match=r"position_ids\[3\]=5 follows 2"):
        seq_lens_from_position_ids(torch.tensor([0, 1, 2, 5, 0]))
    with pytest.raises(ValueError, match=r"must start a document with 0 at index 0, got 1"):
        seq_lens_from_position_ids(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"row 1 starts at 3, not 0"):
        seq_lens_from_position_ids(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(ValueError, match=r"integer dtype"):
        seq_lens_from_position_ids(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"must be a mapping holding 'position_ids'"):
        unflatten_from_position_ids({"input_ids": torch.arange(3)})


def test_non_numpy_dtype_key_and_first_fit_option():
    samples = [
        {
            "input_ids": torch.tensor([1, 2, 3]),
            "w": torch.tensor([0.5, 1.0, 2.0], dtype=torch.bfloat16),
        },
        {"input_ids": torch.tensor([4, 5]), "w": torch.tensor([3.0, 4.0], dtype=torch.bfloat16)},
    ]
    out = PackingCollator(4, pad_values={"w": -1.0})(samples)
    assert out["w"].dtype == torch.bfloat16
    assert out["w"].tolist() == [[0.5, 1.0, 2.0, -1.0], [3.0, 4.0, -1.0, -1.0]]
    sizes = [2, 2, 2, 2, 8, 8, 8, 8]
    samples = [{"input_ids": torch.arange(n)} for n in sizes]
    assert PackingCollator(10, bin_packing="first_fit")(samples)["input_ids"].shape[0] == 5
    assert PackingCollator(10)(samples)["input_ids"].shape[0] == 4
    with pytest.raises(ValueError, match=r"bin_packing must be 'ffd' or 'first_fit', got 'bfd'"):
        PackingCollator(10, bin_packing="bfd")


def test_sample_keys_colliding_with_outputs_are_rejected():
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"sample key 'input_ids' collides.*input_key='tokens'"):
        PackingCollator(8, input_key="tokens")([{"tokens": ids, "input_ids": ids + 6}])
    with pytest.raises(ValueError, match=r"sample key 'labels' collides.*label_key=None"):
        PackingCollator(8, label_key=None)([{"input_ids": ids, "labels": ids}])
    with pytest.raises(ValueError, match=r"sample key 'seq_lens' collides"):
        PackingCollator(8)([{"input_ids": ids, "seq_lens": ids}])
    out = PackingCollator(8, input_key="tokens")([{"tokens": ids}])
    assert out["input_ids"][0, :3].tolist() == [1, 2, 3]
