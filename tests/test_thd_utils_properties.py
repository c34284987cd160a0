"""Hypothesis property tests of te_thd.thd_utils over random pack layouts.

Layouts vary B, S, slots per row, sentinels (trailing and in the middle of a
row), padding between sequences, unfilled rows, rows without sequences, 2-D ids
vs 3-D embeddings, 2-D vs mRoPE positions, labels present or not, absorption on
or off. Every property is checked against ``oracle`` below: a slot-by-slot loop
over the length tables with Python ints, written from the layout rules of docs/thd_utils.md alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_thd.thd_utils import (
    _thd_padding_mask,
    process_input_for_thd,
    split_batch_into_thd_chunks,
    thd_padding_mask_from_token_ids,
)

EXAMPLES = 300


@dataclass
class Layout:
    rows: list[list[tuple[int, int] | None]]  # per row, per slot: (real, padded) or sentinel
    seq_len: int
    sentinel: int


@dataclass
class Expected:
    cu_seqlens: list[int]
    cu_seqlens_padded: list[int]
    pad_between_seqs: bool
    max_seqlen: int
    padding_mask: list[bool]
    real_spans: list[tuple[int, int]]  # (physical start, real length) per sequence


def oracle(layout: Layout, absorb: bool, row_range: range | None = None) -> Expected:
    """The layout rules by hand: walk the rows of ``row_range`` slot by slot."""
    rows = range(len(layout.rows)) if row_range is None else row_range
    s = layout.seq_len
    total = len(rows) * s
    starts: list[int] = []
    reals: list[int] = []
    for local, b in enumerate(rows):
        offset = local * s  # row b starts at b*S, whatever the previous row used
        for slot in layout.rows[b]:
            if slot is None:
                continue
            real, padded = slot
            starts.append(offset)
            reals.append(real)
            offset += padded
    cu = [0]
    for r in reals:
        cu.append(cu[-1] + r)
    cu_padded = starts + [total]
    if absorb and cu[:-1] == cu_padded[:-1]:
        cu[-1] = total
    mask = [True] * total
    for start, real in zip(starts, reals, strict=True):
        for t in range(start, start + real):
            mask[t] = False
    return Expected(
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        pad_between_seqs=cu != cu_padded,
        max_seqlen=max(b - a for a, b in zip(cu, cu[1:], strict=False)),
        padding_mask=mask,
        real_spans=list(zip(starts, reals, strict=True)),
    )


@st.composite
def row_strategy(draw, seq_len: int, slots: int, must_hold_sequence: bool):
    """One row: up to ``slots`` sequences whose padded lengths fit in ``seq_len``."""
    lo = 1 if must_hold_sequence else 0
    k = draw(st.integers(lo, min(slots, seq_len)))
    budget = seq_len
    seqs: list[tuple[int, int]] = []
    for i in range(k):
        left = k - i - 1  # keep >= 1 slot for each later sequence
        padded = draw(st.integers(1, budget - left))
        real = draw(st.integers(1, padded))
        seqs.append((real, padded))
        budget -= padded
    row: list[tuple[int, int] | None] = list(seqs)
    # sentinels fill the remaining pack slots, anywhere in the row
    for _ in range(slots - k):
        row.insert(draw(st.integers(0, len(row))), None)
    return row


@st.composite
def layouts(draw, num_chunks: int = 1):
    chunks = num_chunks
    rows_per_chunk = draw(st.integers(1, 3))
    bsz = chunks * rows_per_chunk
    seq_len = draw(st.integers(1, 16))
    slots = draw(st.integers(1, 4))
    sentinel = draw(st.sampled_from([-1000, -1, 0]))
    rows = [
        draw(row_strategy(seq_len, slots, must_hold_sequence=(b % rows_per_chunk == 0)))
        for b in range(bsz)
    ]
    return Layout(rows=rows, seq_len=seq_len, sentinel=sentinel)


@st.composite
def batches(draw, num_chunks: int = 1):
    layout = draw(layouts(num_chunks))
    bsz, s = len(layout.rows), layout.seq_len
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    embeddings = draw(st.booleans())
    mrope = draw(st.booleans())
    with_labels = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    real = [[layout.sentinel if x is None else x[0] for x in row] for row in layout.rows]
    padded = [[layout.sentinel if x is None else x[1] for x in row] for row in layout.rows]
    batch = {
        "input_ids": torch.randn(bsz, s, 3, generator=gen)
        if embeddings
        else torch.randint(1, 1000, (bsz, s), generator=gen),
        "position_ids": torch.randint(0, 99, (3, bsz, s) if mrope else (bsz, s), generator=gen),
        "seq_lens": torch.tensor(real, dtype=dtype),
        "seq_lens_padded": torch.tensor(padded, dtype=dtype),
        "extra": "passed through",
    }
    if with_labels:
        batch["labels"] = torch.randint(0, 1000, (bsz, s), generator=gen)
    return layout, batch


def check_against_oracle(out: dict, exp: Expected, total: int) -> None:
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        t = out[key]
        assert t.dtype == torch.int32 and t.dim() == 1, key
        values = t.tolist()
        assert values == sorted(values), f"{key} not monotone: {values}"
        assert values[0] == 0
    assert out["cu_seqlens"].tolist() == exp.cu_seqlens
    assert out["cu_seqlens_padded"].tolist() == exp.cu_seqlens_padded
    assert out["cu_seqlens_padded"][-1].item() == total  # every token accounted for
    assert out["pad_between_seqs"] is exp.pad_between_seqs
    # max_seqlen contract: int32 scalar >= every segment, equal to the largest
    assert out["max_seqlen"].dtype == torch.int32 and out["max_seqlen"].dim() == 0
    assert out["max_seqlen"].item() == exp.max_seqlen == out["max_seqlen_int"]
    assert out["padding_mask"].dtype == torch.bool
    assert out["padding_mask"].tolist() == exp.padding_mask


@settings(max_examples=EXAMPLES)
@given(batches(), st.booleans())
def test_conversion_matches_loop_oracle(case, absorb) -> None:
    layout, batch = case
    bsz, s = len(layout.rows), layout.seq_len
    out = process_input_for_thd(
        batch, seq_lens_padding_value=layout.sentinel, absorb_trailing_pad=absorb
    )
    exp = oracle(layout, absorb)
    check_against_oracle(out, exp, bsz * s)
    assert out["num_seqs"] == len(exp.real_spans)
    assert out["extra"] == "passed through"
    assert ("labels" in out) == ("labels" in batch)
    if batch["position_ids"].dim() == 3:
        assert out["position_ids"].shape == (3, 1, bsz * s)
    else:
        assert out["position_ids"].shape == (bsz * s,)


@settings(max_examples=EXAMPLES)
@given(batches())
def test_thd_to_bshd_round_trip_recovers_every_real_token(case) -> None:
    layout, batch = case
    bsz, s = len(layout.rows), layout.seq_len
    out = process_input_for_thd(batch, seq_lens_padding_value=layout.sentinel)
    thd = out["input_ids"]
    assert thd.data_ptr() == batch["input_ids"].data_ptr()  # a view, not a copy
    # Scatter each sequence's real tokens back to its physical slots.
    rebuilt = torch.zeros_like(thd)
    cu_padded = out["cu_seqlens_padded"].tolist()
    reals = [r for row in layout.rows for r in ([x[0] for x in row if x is not None])]
    for i, real in enumerate(reals):
        start = cu_padded[i]
        rebuilt[start : start + real] = thd[start : start + real]
    real_slots = ~out["padding_mask"]
    assert torch.equal(
        rebuilt.reshape(batch["input_ids"].shape)[real_slots.view(bsz, s)],
        batch["input_ids"][real_slots.view(bsz, s)],
    )
    # and nothing but real tokens is covered: the scattered spans are the real slots
    covered = torch.zeros(bsz * s, dtype=torch.bool)
    for i, real in enumerate(reals):
        covered[cu_padded[i] : cu_padded[i] + real] = True
    assert torch.equal(covered, real_slots)
    # labels ride along with the same layout
    if "labels" in batch:
        assert torch.equal(out["labels"].view(bsz, s), batch["labels"])


@settings(max_examples=EXAMPLES)
@given(
    st.integers(2, 3).flatmap(lambda c: st.tuples(st.just(c), batches(num_chunks=c))), st.booleans()
)
def test_chunked_equals_per_chunk_conversion(case, absorb) -> None:
    chunks, (layout, batch) = case
    bsz, s = len(layout.rows), layout.seq_len
    rows = bsz // chunks
    out = split_batch_into_thd_chunks(
        batch, chunks, seq_lens_padding_value=layout.sentinel, absorb_trailing_pad=absorb
    )
    width = out["cu_seqlens"].shape[1]
    assert out["cu_seqlens"].shape == out["cu_seqlens_padded"].shape == (chunks, width)
    assert out["max_seqlen"].shape == (chunks,)
    assert out["padding_mask"].shape == (chunks, rows * s)
    any_pad_between = False
    for c in range(chunks):
        part = {
            k: (
                v[:, c * rows : (c + 1) * rows]
                if k == "position_ids" and v.dim() == 3
                else v[c * rows : (c + 1) * rows]
                if isinstance(v, torch.Tensor)
                else v
            )
            for k, v in batch.items()
        }
        single = process_input_for_thd(
            part, seq_lens_padding_value=layout.sentinel, absorb_trailing_pad=absorb
        )
        exp = oracle(layout, absorb, range(c * rows, (c + 1) * rows))
        check_against_oracle(single, exp, rows * s)
        n = out["num_seqs"][c]
        assert n == single["num_seqs"]
        for key in ("cu_seqlens", "cu_seqlens_padded"):
            row = out[key][c].tolist()
            assert row[: n + 1] == single[key].tolist()
            assert row[n + 1 :] == [layout.sentinel] * (width - n - 1)
        assert out["max_seqlen"][c].item() == single["max_seqlen_int"] == out["max_seqlen_int"][c]
        assert torch.equal(out["padding_mask"][c], single["padding_mask"])
        for key in ("input_ids", "labels", "position_ids"):
            if key in single:
                assert torch.equal(out[key][c], single[key]), key  # mRoPE: [3, 1, T_c] both
        any_pad_between |= single["pad_between_seqs"]
    assert out["pad_between_seqs"] is any_pad_between
    assert max(out["num_seqs"]) + 1 == width


@settings(max_examples=EXAMPLES)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=0, max_size=6),
    st.integers(0, 5),
    st.booleans(),
)
def test_layout_padding_mask_matches_loop(pairs, extra, with_padded) -> None:
    real = [r for r, _ in pairs]
    padded = [r + p for r, p in pairs] if with_padded else real
    total = sum(padded) + extra
    mask = _thd_padding_mask(
        total,
        torch.tensor(real, dtype=torch.long),
        torch.tensor(padded, dtype=torch.long) if with_padded else None,
        torch.device("cpu"),
    )
    expected = [True] * total
    offset = 0
    for r, p in zip(real, padded, strict=True):
        for t in range(offset, offset + r):
            expected[t] = False
        offset += p
    assert mask.tolist() == expected


@settings(max_examples=EXAMPLES)
@given(st.lists(st.integers(0, 3), max_size=12), st.integers(0, 3))
def test_token_mask_accepts_exactly_right_padded_streams(ids, pad) -> None:
    t = torch.tensor(ids, dtype=torch.long)
    first_pad = next((i for i, v in enumerate(ids) if v == pad), len(ids))
    right_padded = all(v == pad for v in ids[first_pad:])
    if right_padded:
        assert thd_padding_mask_from_token_ids(t, pad).tolist() == [v == pad for v in ids]
    else:
        try:
            thd_padding_mask_from_token_ids(t, pad)
        except ValueError as e:
            assert f"padding_token_id={pad} also occurs as content" in str(e)
        else:
            raise AssertionError(f"{ids} with pad {pad} accepted")
