"""te_thd.cp strategies: each equals a loop transcription of TE's own rule; conversions invert."""

from __future__ import annotations

import enum

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp import te_partition_oracle

from te_thd.cp import (
    STRATEGIES,
    cp_rank_to_sequence_order,
    partition_indices,
    sequence_to_cp_rank_order,
    shard_thd_batch_for_cp,
    validate_cp_layout,
)
from te_thd.layout import ThdLayout
from te_thd.packing import PackingCollator
from te_thd.thd_utils import process_input_for_thd


class CPLoadBalancingStrategy(enum.Enum):
    """TE's enum, as ``transformer_engine/pytorch/constants.py`` defines it (TE is not
    installed here; te_thd accepts a member by its class name and value)."""

    DUAL_CHUNK_SWAP = "dual_chunk_swap"
    NO_LOAD_BALANCE = "no_load_balance"


def te_no_load_balance_oracle(cu: list[int], total_tokens: int, cp_size: int, rank: int):
    """Loop transcription of TE's ``get_thd_partitioned_indices`` for ``NO_LOAD_BALANCE``.

    TE (``dot_product_attention/context_parallel.py``): first
    ``validate_no_load_balance_thd_metadata(cu, cu, total_tokens, cp_size)`` -- every
    ``assert`` below -- then ``torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)``
    with ``chunk = total_tokens // cp_size``.
    """
    assert total_tokens % cp_size == 0
    assert cu[0] == 0
    assert cu[-1] == total_tokens
    for i in range(len(cu) - 1):
        assert cu[i + 1] >= cu[i]
    chunk = total_tokens // cp_size
    out = []
    for token in range(cp_rank_start := rank * chunk, cp_rank_start + chunk):
        out.append(token)
    return out


ORACLES = {"dual_chunk_swap": te_partition_oracle, "no_load_balance": te_no_load_balance_oracle}


@st.composite
def free_layouts(draw, cps=(1, 2, 3, 4, 8)):
    """(cu, total, cp): any lengths (zero, not multiples of cp), the stream a multiple of cp.

    The last sequence takes the tail pad that rounds the stream up (TE's boundaries
    must end at the stream's end).
    """
    cp = draw(st.sampled_from(cps))
    lengths = draw(st.lists(st.integers(0, 13), min_size=1, max_size=8))
    total = sum(lengths)
    lengths[-1] += -total % cp  # a trailing pad grown into the last slot
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, cu[-1], cp


@st.composite
def dcs_layouts(draw, cps=(1, 2, 4, 8)):
    """(cu, total, cp) with every padded length a multiple of 2cp (zero lengths included)."""
    cp = draw(st.sampled_from(cps))
    units = draw(st.lists(st.integers(0, 5), min_size=1, max_size=8))
    cu = [0]
    for u in units:
        cu.append(cu[-1] + u * 2 * cp)
    return cu, cu[-1], cp


def spelled(strategy: str) -> list:
    return [strategy, CPLoadBalancingStrategy(strategy)]


# --------------------------------------------------------------------------- partition


def test_te_unit_test_examples():
    # TE's own tests of the two strategies, same inputs and expected indices
    nlb = partition_indices(torch.tensor([0, 5, 12]), 12, 4, 2, strategy="no_load_balance")
    assert nlb.tolist() == [6, 7, 8]
    dcs = partition_indices(torch.tensor([0, 8, 16]), 16, 2, 0, strategy="dual_chunk_swap")
    assert dcs.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]


@settings(max_examples=120)
@given(free_layouts(), st.sampled_from([torch.int32, torch.int64]), st.booleans())
def test_no_load_balance_matches_te_oracle(layout, dtype, enum_member):
    cu, total, cp = layout
    strategy = CPLoadBalancingStrategy.NO_LOAD_BALANCE if enum_member else "no_load_balance"
    seen = []
    for rank in range(cp):
        got = partition_indices(torch.tensor(cu, dtype=dtype), total, cp, rank, strategy=strategy)
        assert got.dtype == torch.int64 and got.shape == (total // cp,)
        assert got.tolist() == te_no_load_balance_oracle(cu, total, cp, rank)
        seen.extend(got.tolist())
    assert seen == list(range(total))  # contiguous pieces, in rank order


@settings(max_examples=80)
@given(free_layouts(cps=(2, 3, 4)), st.integers(0, 4), st.sampled_from([-1000, -1]))
def test_no_load_balance_sentinel_padded(layout, n_sentinel, sentinel):
    cu, total, cp = layout
    padded = torch.tensor(cu + [sentinel] * n_sentinel, dtype=torch.int32)
    for rank in range(cp):
        want = te_no_load_balance_oracle(cu, total, cp, rank)
        kw = {"strategy": "no_load_balance"}
        assert partition_indices(padded, total, cp, rank, len(cu) - 1, **kw).tolist() == want
        assert partition_indices(padded, total, cp, rank, **kw).tolist() == want
        assert partition_indices(padded, total, cp, rank, check=False, **kw).tolist() == want


@settings(max_examples=60)
@given(dcs_layouts(), st.integers(0, 3))
def test_dual_chunk_swap_default_is_unchanged(layout, n_sentinel):
    cu, total, cp = layout
    padded = torch.tensor(cu + [-1000] * n_sentinel, dtype=torch.int32)
    for rank in range(cp):
        want = partition_indices(padded, total, cp, rank)
        assert want.tolist() == te_partition_oracle(cu, total, cp, rank)
        for strategy in spelled("dual_chunk_swap"):
            got = partition_indices(padded, total, cp, rank, strategy=strategy)
            assert torch.equal(got, want) and got.dtype == want.dtype


def test_no_load_balance_accepts_what_dual_chunk_swap_refuses():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # lengths 5, 7: no multiple of 2*cp
    with pytest.raises(ValueError, match="multiple of 2"):
        validate_cp_layout(cu, 12, 2)
    validate_cp_layout(cu, 12, 2, strategy="no_load_balance")
    validate_cp_layout(cu, 12, 3, strategy=CPLoadBalancingStrategy.NO_LOAD_BALANCE)


@pytest.mark.parametrize(
    ("cu", "total", "cp", "match"),
    [
        ([0, 5, 13], 13, 4, "total_tokens=13 is not divisible by cp_size=4"),
        ([0, 5, 10], 12, 2, "ends at 10 but the global stream has 12"),
        ([0, 7, 5, 12], 12, 2, "cu_seqlens_padded"),
        ([1, 5, 12], 12, 2, "cu_seqlens_padded"),
    ],
)
def test_no_load_balance_refuses_what_te_asserts(cu, total, cp, match):
    with pytest.raises(AssertionError):
        te_no_load_balance_oracle(cu, total, cp, 0)
    with pytest.raises(ValueError, match=match):
        partition_indices(torch.tensor(cu), total, cp, 0, strategy="no_load_balance")


@pytest.mark.parametrize("bad", ["zigzag", "DUAL_CHUNK_SWAP", None, 1, "striped"])
def test_unknown_strategy_is_one_line_listing_the_values(bad):
    cu = torch.tensor([0, 8])
    for call in (
        lambda: partition_indices(cu, 8, 2, 0, strategy=bad),
        lambda: sequence_to_cp_rank_order(torch.arange(8), cu, 2, strategy=bad),
        lambda: validate_cp_layout(cu, 8, 2, strategy=bad),
    ):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and f"strategy={bad!r}" in msg
        assert all(f"'{s}'" in msg for s in STRATEGIES)


# --------------------------------------------------------------------------- conversion


@settings(max_examples=80)
@given(st.data(), st.sampled_from(STRATEGIES), st.integers(0, 2))
def test_conversions_invert_each_other(data, strategy, dim):
    layout = free_layouts() if strategy == "no_load_balance" else dcs_layouts()
    cu, total, cp = data.draw(layout)
    shape = [3, 2, 4]
    shape[dim] = total
    x = torch.randn(shape)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    oracle = ORACLES[strategy]
    for kind in spelled(strategy):
        ranked = sequence_to_cp_rank_order(x, cu_t, cp, dim, strategy=kind)
        order = [i for r in range(cp) for i in oracle(cu, total, cp, r)]
        assert torch.equal(ranked, x.index_select(dim, torch.tensor(order, dtype=torch.long)))
        assert torch.equal(cp_rank_to_sequence_order(ranked, cu_t, cp, dim, strategy=kind), x)
        back = cp_rank_to_sequence_order(x, cu_t, cp, dim, strategy=kind)
        assert torch.equal(sequence_to_cp_rank_order(back, cu_t, cp, dim, strategy=kind), x)


@settings(max_examples=40)
@given(dcs_layouts(cps=(2, 4)))
def test_contiguous_to_load_balanced_and_back(layout):
    """Megatron's contiguous shards (rank r: r-th piece of the stream) all-gathered are the
    sequence order; the load-balanced ranks' order is one conversion away, and back."""
    cu, total, cp = layout
    cu_t = torch.tensor(cu)
    x = torch.arange(total) * 10
    gathered = torch.cat(
        [x[partition_indices(cu_t, total, cp, r, strategy="no_load_balance")] for r in range(cp)]
    )
    seq = cp_rank_to_sequence_order(gathered, cu_t, cp, strategy="no_load_balance")
    balanced = sequence_to_cp_rank_order(seq, cu_t, cp)
    for r in range(cp):
        local = total // cp
        assert torch.equal(
            balanced[r * local : (r + 1) * local], x[partition_indices(cu_t, total, cp, r)]
        )
    assert torch.equal(cp_rank_to_sequence_order(balanced, cu_t, cp), x)


# --------------------------------------------------------------------------- batches


def _batch(lengths: list[int], pad_to: int, seq_len: int) -> dict:
    """A converted THD batch: one packed row of ``lengths``, each padded to ``pad_to``."""
    samples = [{"input_ids": torch.arange(1, n + 1)} for n in lengths]
    collate = PackingCollator(seq_len, pad_to_multiple_of=pad_to, rows=1)
    return process_input_for_thd(collate(samples))


@pytest.mark.parametrize("strategy", spelled("no_load_balance"))
def test_shard_batch_no_load_balance(strategy):
    thd = _batch([5, 7, 3], pad_to=1, seq_len=18)  # lengths no multiple of 2*cp
    total = thd["input_ids"].shape[0]
    pieces = []
    for rank in range(3):
        out = shard_thd_batch_for_cp(thd, 3, rank, strategy=strategy)
        local = total // 3
        assert torch.equal(out["input_ids"], thd["input_ids"][rank * local : (rank + 1) * local])
        assert out["cp_strategy"] == "no_load_balance"
        layout = ThdLayout.from_thd(out)
        assert (layout.cp_size, layout.cp_rank, layout.cp_strategy) == (3, rank, "no_load_balance")
        pieces.append(out["labels"])
    assert torch.equal(torch.cat(pieces), thd["labels"])


def test_shard_batch_default_output_is_unchanged():
    thd = _batch([5, 7, 3], pad_to=4, seq_len=20)
    plain = shard_thd_batch_for_cp(thd, 2, 1)
    named = shard_thd_batch_for_cp(thd, 2, 1, strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP)
    assert "cp_strategy" not in plain and set(plain) == set(named)
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, named[key])
    assert ThdLayout.from_thd(plain).cp_strategy == "dual_chunk_swap"


def test_layout_sharded_by_strategy():
    layout = ThdLayout.from_thd(_batch([5, 7], pad_to=1, seq_len=14))
    with pytest.raises(ValueError, match="multiple of 2"):
        layout.sharded(2, 0)
    view = shard_thd_batch_for_cp(layout, 2, 1, strategy="no_load_balance")
    assert (view.cp_size, view.cp_rank, view.cp_strategy) == (2, 1, "no_load_balance")


def test_docs_strategy_table_is_current():
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "cp_figure", repo / "scripts" / "cp_strategy_figure.py"
    )
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    text = (repo / "docs" / "cp.md").read_text()
    block = text.split(figure.BEGIN, 1)[1].split(figure.END, 1)[0].strip("\n")
    assert block == figure.render(), "run .venv/bin/python scripts/cp_strategy_figure.py --write"
    assert (repo / "docs" / "cp-strategies.png").is_file()


def test_pad_to_multiple_for_follows_the_strategy() -> None:
    """Dual chunk swap pads every document to ``2*cp``; no load balance pads none (the stream is
    cut into contiguous shares), sequence parallelism's TP multiple aside."""
    from te_thd.packing import pad_to_multiple_for

    assert pad_to_multiple_for(4) == pad_to_multiple_for(4, strategy="dual_chunk_swap") == 8
    assert pad_to_multiple_for(4, strategy="no_load_balance") == 1
    assert pad_to_multiple_for(4, 2, True, strategy="no_load_balance") == 2
    assert pad_to_multiple_for(4, 2, True) == 16
    with pytest.raises(ValueError, match="strategy"):
        pad_to_multiple_for(2, strategy="striped")
