"""check_te_thd_kwargs: each known TE / Megatron THD pitfall, and our own kwargs never hit one."""

from __future__ import annotations

import enum

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import te_thd
from te_thd.attention import (
    ThdContractError,
    check_te_thd_kwargs,
    te_attention_kwargs,
    te_cp_group_kwargs,
    thd_attention_reference,
)
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.packing import PackingCollator
from te_thd.thd_utils import process_input_for_thd

#: TE releases and branches the rules name (2.20: the one expected to carry the enum).
VERSIONS = (None, "2.16.0", "2.17.1", "2.18", "2.19.0", "2.20.0.dev0+d0067d0")


class CPLoadBalancingStrategy(enum.Enum):
    """TE's enum as ``transformer_engine/pytorch/constants.py`` (TE #3221) defines it."""

    DUAL_CHUNK_SWAP = "dual_chunk_swap"
    NO_LOAD_BALANCE = "no_load_balance"


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _kwargs(cu: list[int], cup: list[int] | None, pad: bool | None, same: bool = False) -> dict:
    c = _i32(cu)
    p = c if same else _i32(cup if cup is not None else cu)
    return {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": c,
        "cu_seqlens_kv": c,
        "cu_seqlens_q_padded": p,
        "cu_seqlens_kv_padded": p,
        "max_seqlen_q": 8,
        "max_seqlen_kv": 8,
        "pad_between_seqs": pad,
    }


def _one_line(problems: list[str], *needles: str) -> None:
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    assert "fix:" in problems[0]
    for needle in needles:
        assert needle in problems[0], (needle, problems[0])


# --------------------------------------------------------------------------- each pitfall


@pytest.mark.parametrize("version", VERSIONS)
def test_pad_false_over_padding_3331(version):
    kw = _kwargs([0, 5, 12], [0, 8, 12], pad=False)
    name = "every TE version" if version is None else "TE 2."
    _one_line(
        check_te_thd_kwargs(kw, te_version=version),
        "pad_between_seqs=False",
        "cu_seqlens_q_padded [0, 8, 12]",
        name,
        "TransformerEngine#3331",
    )


def test_autodetect_blind_to_tail_pad_3331_only_up_to_2_17_1():
    kw = _kwargs([0, 5, 12], [0, 5, 16], pad=None)  # padding after the last sequence only
    _one_line(check_te_thd_kwargs(kw, "2.17.1"), "pad_between_seqs=None", "TE 2.17.1", "#3331")
    _one_line(check_te_thd_kwargs(kw, "2.16.0"), "TE 2.16.0")
    assert check_te_thd_kwargs(kw, "2.18.0") == []  # identity: distinct tensors -> True
    _one_line(check_te_thd_kwargs(kw), "TE <= 2.17.1")  # no TE here: every version


def test_equal_but_distinct_tensors_3487_from_2_18():
    kw = _kwargs([0, 5, 12], [0, 5, 12], pad=None)
    for version in ("2.18", "2.19.0", "2.20.0.dev0"):
        _one_line(check_te_thd_kwargs(kw, version), "distinct tensor", f"TE {version[:4]}", "#3487")
    assert check_te_thd_kwargs(kw, "2.17.1") == []
    _one_line(check_te_thd_kwargs(kw), "TE >= 2.18")
    assert check_te_thd_kwargs(_kwargs([0, 5, 12], None, pad=None, same=True), "2.18") == []
    assert check_te_thd_kwargs(_kwargs([0, 5, 12], [0, 5, 12], pad=False), "2.18") == []


@pytest.mark.parametrize(
    ("head_dim", "where"), [(256, "only sm90"), (192, "only sm90"), (512, "on any GPU")]
)
def test_padding_leaves_no_backend_for_wide_heads_7417(head_dim, where):
    padded = _kwargs([0, 5, 12], [0, 8, 16], pad=True)
    _one_line(
        check_te_thd_kwargs(padded, "2.19.0", head_dim=head_dim),
        f"head_dim={head_dim}",
        where,
        "Megatron-LM#7417",
        "remove the padding",
    )
    # Megatron's hard-coded True over equal arrays: the fix is the flag itself
    equal = _kwargs([0, 5, 12], [0, 5, 12], pad=True)
    _one_line(
        check_te_thd_kwargs(equal, "2.19.0", head_dim=head_dim), "pass pad_between_seqs=False"
    )
    assert check_te_thd_kwargs(padded, "2.19.0", head_dim=128) == []
    assert check_te_thd_kwargs(padded, "2.19.0") == []  # head_dim unknown: rule skipped
    assert check_te_thd_kwargs(_kwargs([0, 5, 12], None, False, True), "2.19", head_dim) == []


def test_strategy_the_te_does_not_know():
    kw = {**_kwargs([0, 8, 16], None, False, True), "load_balancing_strategy": "no_load_balance"}
    _one_line(check_te_thd_kwargs(kw, "2.19.0"), "load_balancing_strategy='no_load_balance'")
    assert check_te_thd_kwargs(kw, "2.20.0") == []
    member = {**kw, "load_balancing_strategy": CPLoadBalancingStrategy.NO_LOAD_BALANCE}
    assert check_te_thd_kwargs(member, "2.20.1") == []
    _one_line(check_te_thd_kwargs(member, "2.18.0"), "TE 2.18.0", "expected in TE 2.20")
    bad = {**kw, "load_balancing_strategy": "striped"}
    _one_line(check_te_thd_kwargs(bad, "2.20.0"), "'striped'", "'no_load_balance'")
    default = {**kw, "load_balancing_strategy": "dual_chunk_swap"}
    assert check_te_thd_kwargs(default, "2.16.0") == []


@pytest.mark.parametrize("bad", ["two", "v2", 2.18])
def test_bad_te_version_is_one_line(bad):
    with pytest.raises(ValueError, match=r"te_version=.* is not a TE version"):
        check_te_thd_kwargs(_kwargs([0, 8], None, False, True), te_version=bad)


def test_exported_at_top_level():
    assert te_thd.check_te_thd_kwargs is check_te_thd_kwargs
    assert "check_te_thd_kwargs" in te_thd.__all__


# --------------------------------------------------------------------------- our kwargs


@st.composite
def batches(draw):
    cp = draw(st.sampled_from([1, 2, 3, 4]))
    pad_to = draw(st.sampled_from([1, 2 * cp]))
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    padded = sum((n + pad_to - 1) // pad_to * pad_to for n in lengths)
    slack = draw(st.integers(0, 2))
    unit = 2 * cp
    seq_len = (padded + slack * pad_to + unit - 1) // unit * unit
    seq_len = (seq_len + pad_to - 1) // pad_to * pad_to
    samples = [{"input_ids": torch.arange(1, n + 1)} for n in lengths]
    batch = PackingCollator(seq_len, pad_to_multiple_of=pad_to, rows=1)(samples)
    absorb = draw(st.booleans())
    return process_input_for_thd(batch, absorb_trailing_pad=absorb), cp, pad_to


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(VERSIONS), st.sampled_from([None, 64, 128]))
def test_our_kwargs_never_trip_the_check(batch, version, head_dim):
    thd, cp, pad_to = batch
    # dual chunk swap needs every sequence padded to 2*cp; no load balance only the stream
    strategies = ["no_load_balance"] + (["dual_chunk_swap"] if pad_to % (2 * cp) == 0 else [])
    for strategy in strategies:
        shard = thd if cp == 1 else shard_thd_batch_for_cp(thd, cp, cp - 1, strategy=strategy)
        kwargs = te_attention_kwargs(shard)  # check=True already ran the check
        assert check_te_thd_kwargs(kwargs, version, head_dim) == []
        full = {**kwargs, **te_cp_group_kwargs()}
        assert check_te_thd_kwargs(full, version, head_dim) == []


def test_check_true_raises_what_the_check_finds():
    thd = process_input_for_thd(
        PackingCollator(16, pad_to_multiple_of=4, rows=1)(
            [{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(1, 4)}]
        )
    )
    kwargs = te_attention_kwargs(thd)
    assert kwargs["pad_between_seqs"] is True and check_te_thd_kwargs(kwargs) == []
    # the same batch with the flag forced off: TE #3331's silently wrong call
    with pytest.raises(ThdContractError, match="#3331"):
        te_attention_kwargs({**thd, "pad_between_seqs": False})


# --------------------------------------------------------------------------- strategies


def _nlb_batch() -> dict:
    samples = [{"input_ids": torch.arange(1, n + 1)} for n in (5, 7, 3)]
    return process_input_for_thd(PackingCollator(18, rows=1)(samples))  # T = 18, cp = 3


def test_kwargs_follow_the_sharded_strategy():
    thd = _nlb_batch()
    for rank in range(3):
        shard = shard_thd_batch_for_cp(thd, 3, rank, strategy="no_load_balance")
        kwargs = te_attention_kwargs(shard)
        assert kwargs["cu_seqlens_q"].tolist() == thd["cu_seqlens"].tolist()  # global
        assert kwargs == te_attention_kwargs(shard, strategy="no_load_balance")
    # the dual chunk swap rules refuse this batch: its lengths are no multiples of 6
    with pytest.raises(ValueError, match="multiple of 2"):
        te_attention_kwargs({**thd, "cp_size": 3, "input_ids": thd["input_ids"][:6]})
    member = CPLoadBalancingStrategy.NO_LOAD_BALANCE
    te_attention_kwargs({**thd, "cp_size": 3, "input_ids": thd["input_ids"][:6]}, strategy=member)


def test_no_load_balance_needs_a_causal_mask():
    shard = shard_thd_batch_for_cp(_nlb_batch(), 3, 0, strategy="no_load_balance")
    with pytest.raises(ThdContractError, match="requires causal attention"):
        te_attention_kwargs(shard, "padding")


def test_kwargs_drive_the_reference_under_no_load_balance():
    """cp=1 view of the same stream: the strategy changes who holds which tokens, not
    the attention the boundaries describe."""
    thd = _nlb_batch()
    torch.manual_seed(0)
    q, k, v = (torch.randn(18, 2, 8, dtype=torch.float64) for _ in range(3))
    kwargs = te_attention_kwargs(thd, strategy="no_load_balance")
    out = thd_attention_reference(q, k, v, **kwargs)
    assert out.shape == (18, 2, 8)


def test_cp_group_kwargs_carry_the_strategy():
    assert te_cp_group_kwargs() == {}
    assert te_cp_group_kwargs(CPLoadBalancingStrategy.DUAL_CHUNK_SWAP) == {}
    with pytest.raises(ValueError) as err:  # TE is not installed here
        te_cp_group_kwargs("no_load_balance")
    msg = str(err.value)
    assert "\n" not in msg and "TE 2.20" in msg and "no Transformer Engine is installed" in msg
    with pytest.raises(ValueError, match="'dual_chunk_swap' .the default., 'no_load_balance'"):
        te_cp_group_kwargs("zigzag")
