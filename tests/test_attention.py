"""te_thd.attention: reference == per-sequence SDPA, adapters, TE contract errors, module.

The oracle is torch's ``scaled_dot_product_attention`` run on each sequence's real
tokens separately (a Python loop, deliberately the simplest possible transcription);
padding slots must come out zero with zero gradient.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.packed_seq_params import PackedSeqParams

from te_thd.attention import (
    ThdAttention,
    ThdContractError,
    VarlenLayoutError,
    check_te_thd_args,
    flash_attn_varlen_kwargs,
    packed_seq_params,
    te_attention_kwargs,
    te_available,
    thd_attention_reference,
    torch_varlen_kwargs,
)
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.thd_utils import process_input_for_thd

I32 = torch.int32


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: intra-op threads only add contention on a shared 2-core runner.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=I32
    )


def _stream(lens: list[int], pads: list[int], tail: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``cu_seqlens``, ``cu_seqlens_padded`` (int32 ``[N+1]``) and the stream length ``T``."""
    cup = _cu([a + b for a, b in zip(lens, pads, strict=True)])
    return _cu(lens), cup, int(cup[-1]) + tail


def _real_slots(lens: list[int], cup: torch.Tensor, t: int) -> torch.Tensor:
    """bool ``[T]``: the slots holding a sequence's real tokens."""
    real = torch.zeros(t, dtype=torch.bool)
    for i, n in enumerate(lens):
        real[int(cup[i]) : int(cup[i]) + n] = True
    return real


def sdpa_oracle(q, k, v, cu, cup, causal, scale):
    """Per-sequence SDPA over real tokens; zeros everywhere else. q/k/v [T, H, D]."""
    t = q.shape[0]
    pieces = []
    cursor = 0
    n = cu.numel() - 1
    for i in range(n):
        s, e = int(cup[i]), int(cup[i + 1])
        length = int(cu[i + 1] - cu[i])
        pieces.append(q.new_zeros(s - cursor, q.shape[1], v.shape[2]))
        if length:
            qi, ki, vi = (x[s : s + length].transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=causal, scale=scale, enable_gqa=True
            )
            pieces.append(o[0].transpose(0, 1))
        pieces.append(q.new_zeros(e - s - length, q.shape[1], v.shape[2]))
        cursor = e
    pieces.append(q.new_zeros(t - cursor, q.shape[1], v.shape[2]))
    # Keep the result in the autograd graph even when no token is real.
    return torch.cat(pieces, 0) + 0 * (q.sum() + k.sum() + v.sum())


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    pads = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    tail = draw(st.integers(0, 3))
    hkv = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8]))
    dv = draw(st.sampled_from([d, 6]))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    chunk = draw(st.sampled_from([1, 3, 16, 256]))
    seed = draw(st.integers(0, 2**16))
    return lens, pads, tail, hkv, groups, d, dv, causal, scale, chunk, seed


def _qkv(t, h, hkv, d, dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(t, hkv, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(t, hkv, dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v, g


@settings(max_examples=100)
@given(layouts())
def test_reference_matches_per_sequence_sdpa(layout):
    lens, pads, tail, hkv, groups, d, dv, causal, scale, chunk, seed = layout
    cu, cup, t = _stream(lens, pads, tail)
    q, k, v, g = _qkv(t, hkv * groups, hkv, d, dv, seed)
    mask = "padding_causal" if causal else "padding"
    out = thd_attention_reference(
        q, k, v,
        cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup,
        attn_mask_type=mask, softmax_scale=scale, query_chunk_size=chunk,
        pad_between_seqs=not torch.equal(cu, cup),
    )  # fmt: skip
    ref = sdpa_oracle(q, k, v, cu, cup, causal, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
    want = torch.autograd.grad((ref * grad_out).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    # Padding slots: zero output, zero gradient.
    real = _real_slots(lens, cup, t)
    assert not out.detach()[~real].any()
    for grad in got:
        assert not grad[~real].any()


@pytest.mark.parametrize("bottom_right", [False, True])
def test_reference_cross_attention_causal_alignment(bottom_right):
    # q and kv streams with different lengths per sequence: the causal diagonal is
    # top-left (TE "padding_causal") or bottom-right ("padding_causal_bottom_right").
    lq, lk, pq, pk = [2, 3], [4, 5], [1, 0], [0, 2]
    cu_q, cu_k = _cu(lq), _cu(lk)
    cup_q = _cu([a + b for a, b in zip(lq, pq, strict=True)])
    cup_k = _cu([a + b for a, b in zip(lk, pk, strict=True)])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(int(cup_q[-1]), 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(int(cup_k[-1]), 1, 4, generator=g, dtype=torch.float64)
    v = torch.randn(int(cup_k[-1]), 1, 4, generator=g, dtype=torch.float64)
    mask = "padding_causal_bottom_right" if bottom_right else "padding,causal"
    out = thd_attention_reference(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cup_q,
        cu_seqlens_kv_padded=cup_k, attn_mask_type=mask,
    )  # fmt: skip
    for i in range(2):
        sq, sk = int(cup_q[i]), int(cup_k[i])
        i_idx = torch.arange(lq[i])[:, None]
        j_idx = torch.arange(lk[i])[None, :]
        allowed = j_idx <= i_idx + ((lk[i] - lq[i]) if bottom_right else 0)
        o = F.scaled_dot_product_attention(
            q[sq : sq + lq[i]].transpose(0, 1),
            k[sk : sk + lk[i]].transpose(0, 1).expand(2, -1, -1),
            v[sk : sk + lk[i]].transpose(0, 1).expand(2, -1, -1),
            attn_mask=allowed,
        ).transpose(0, 1)
        torch.testing.assert_close(out[sq : sq + lq[i]], o)
        assert not out[sq + lq[i] : int(cup_q[i + 1])].any()


def test_reference_bf16_accumulates_in_float32():
    cu, cup = _cu([5, 9]), _cu([8, 12])
    q, k, v, _ = _qkv(20, 4, 2, 16, 16, seed=1, dtype=torch.float32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup)
    out = thd_attention_reference(*(x.detach().bfloat16() for x in (q, k, v)), **kw)
    ref = thd_attention_reference(*(x.detach().bfloat16().float() for x in (q, k, v)), **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- adapters


def _bshd_batch(seq_lens, seq_lens_padded, seq_len):
    """A packed BSHD batch (``process_input_for_thd``'s input) with sentinel-filled length tables."""
    b = len(seq_lens)
    p = max(len(r) for r in seq_lens)
    sl = torch.full((b, p), -1000)
    sp = torch.full((b, p), -1000)
    for i, (r, rp) in enumerate(zip(seq_lens, seq_lens_padded, strict=True)):
        sl[i, : len(r)] = torch.tensor(r)
        sp[i, : len(rp)] = torch.tensor(rp)
    ids = torch.arange(1, b * seq_len + 1).view(b, seq_len)
    return {
        "input_ids": ids,
        "labels": ids + 1,
        "position_ids": torch.zeros(b, seq_len, dtype=torch.long),
        "seq_lens": sl,
        "seq_lens_padded": sp,
    }


PAD_BETWEEN = _bshd_batch([[3, 2], [4]], [[4, 4], [8]], 8)  # padding between sequences
TAIL_ONLY = _bshd_batch([[3, 5], [6]], [[3, 5], [8]], 8)  # only the pack's tail is padding
NO_PAD = _bshd_batch([[3, 5], [8]], [[3, 5], [8]], 8)


@pytest.mark.parametrize("batch", [PAD_BETWEEN, TAIL_ONLY, NO_PAD], ids=["pad", "tail", "none"])
@pytest.mark.parametrize("mask", ["padding_causal", "padding"])
def test_te_kwargs_pass_contract_and_drive_reference(batch, mask):
    absorb = mask == "padding_causal"
    thd = process_input_for_thd(batch, absorb_trailing_pad=absorb)
    kw = te_attention_kwargs(thd, mask)
    assert set(kw) == {
        "qkv_format", "attn_mask_type", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "pad_between_seqs",
    }  # fmt: skip
    assert kw["qkv_format"] == "thd" and kw["attn_mask_type"] == mask
    assert type(kw["max_seqlen_q"]) is int and type(kw["max_seqlen_kv"]) is int
    assert type(kw["pad_between_seqs"]) is bool
    assert kw["pad_between_seqs"] == thd["pad_between_seqs"]
    assert kw["cu_seqlens_q"].dtype == I32 and kw["cu_seqlens_q"].shape == kw["cu_seqlens_kv"].shape
    cup = thd["cu_seqlens_padded"]
    assert kw["max_seqlen_q"] == int((cup[1:] - cup[:-1]).max()) >= thd["max_seqlen_int"]
    if not kw["pad_between_seqs"]:
        # Same object: TE's identity-based auto-detect (NVIDIA/TransformerEngine#3487) agrees with the flag.
        assert kw["cu_seqlens_q_padded"] is kw["cu_seqlens_q"]
    t = thd["input_ids"].shape[0]
    q, k, v, _ = _qkv(t, 4, 2, 8, 8, seed=0)
    assert check_te_thd_args(q, k, v, **kw) == mask
    out = thd_attention_reference(q, k, v, **kw)
    ref = sdpa_oracle(
        q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_q_padded"], "causal" in mask, None
    )
    real = ~thd["padding_mask"]
    torch.testing.assert_close(out[real], ref[real])


def test_te_kwargs_under_cp_read_cp_size_from_sharded_batch():
    thd = process_input_for_thd(PAD_BETWEEN)
    local = shard_thd_batch_for_cp(thd, cp_size=2, cp_rank=1)
    kw = te_attention_kwargs(local)
    assert kw["cu_seqlens_q"] is thd["cu_seqlens"]  # boundaries stay global
    q, k, v, _ = _qkv(local["input_ids"].shape[0], 2, 2, 8, 8, seed=0)
    check_te_thd_args(q, k, v, cp_size=2, **kw)
    with pytest.raises(ThdContractError, match=r"not a multiple of 2\*cp_size=8"):
        te_attention_kwargs(thd, cp_size=4)


def test_packed_seq_params_is_real_megatron_dataclass():
    thd = process_input_for_thd(PAD_BETWEEN)
    p = packed_seq_params(thd)
    assert isinstance(p, PackedSeqParams)
    kw = te_attention_kwargs(thd)
    assert p.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(p, name), kw[name])
    assert p.max_seqlen_q == p.max_seqlen_kv == kw["max_seqlen_q"]
    assert p.cp_group is None and p.local_cp_size is None
    # Megatron forwards these fields to TE as kwargs; they satisfy TE's contract.
    q, k, v, _ = _qkv(thd["input_ids"].shape[0], 2, 2, 8, 8, seed=0)
    fields = {n: getattr(p, n) for n in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv",
              "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv")}  # fmt: skip
    check_te_thd_args(q, k, v, **fields)
    tail = packed_seq_params(process_input_for_thd(TAIL_ONLY))
    assert tail.cu_seqlens_q_padded is tail.cu_seqlens_q
    with pytest.raises(ValueError, match="absorbed into the last sequence"):
        packed_seq_params(process_input_for_thd(TAIL_ONLY), causal=False)


_QUIET_SCRIPT = """
import sys, warnings
import torch
from te_thd.attention import packed_seq_params
from te_thd.thd_utils import process_input_for_thd
ids = torch.arange(1, 9).view(1, 8)
batch = {"input_ids": ids, "labels": ids + 1, "position_ids": torch.zeros(1, 8, dtype=torch.long),
         "seq_lens": torch.tensor([[3, 5]]), "seq_lens_padded": torch.tensor([[3, 5]])}
before = list(warnings.filters)
print(packed_seq_params(process_input_for_thd(batch)).qkv_format)
assert warnings.filters == before, "the process's warning filters changed"
"""


def test_packed_seq_params_keeps_megatrons_import_warnings_out() -> None:
    """Outside pytest (whose config ignores that warning), with every warning shown: megatron-core's
    "Transformer Engine and Apex are not installed" (4 lines on import) does not reach the user, and
    the process's warning filters are as they were."""
    import subprocess
    import sys

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-W", "always", "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
        )

    res = run(_QUIET_SCRIPT)
    assert res.returncode == 0 and res.stdout == "thd\n", res.stderr
    assert "Transformer Engine and Apex are not installed" not in res.stderr, res.stderr
    control = run("import megatron.core.packed_seq_params")  # what the user would otherwise see
    assert "Transformer Engine and Apex are not installed" in control.stderr


@pytest.mark.parametrize("causal", [True, False])
def test_torch_varlen_kwargs_bind_real_signature_and_mean_the_same_attention(causal):
    from torch.nn.attention.varlen import varlen_attn

    thd = process_input_for_thd(NO_PAD)
    kw = torch_varlen_kwargs(thd, causal=causal, enable_gqa=True)
    q, k, v, _ = _qkv(thd["input_ids"].shape[0], 4, 2, 8, 8, seed=0)
    inspect.signature(varlen_attn).bind(q, k, v, **kw)  # every name exists in torch 2.13
    assert kw["window_size"] == ((-1, 0) if causal else (-1, -1))
    assert isinstance(kw["window_size"], tuple)  # varlen_attn tests `== (-1, 0)`
    assert type(kw["max_q"]) is int and kw["max_q"] == 8
    # Interpreting the varlen boundaries as TE's (no padded arrays) gives TE's result.
    out = thd_attention_reference(
        q, k, v, cu_seqlens_q=kw["cu_seq_q"], cu_seqlens_kv=kw["cu_seq_k"],
        max_seqlen_q=kw["max_q"], max_seqlen_kv=kw["max_k"],
        attn_mask_type="padding_causal" if causal else "padding",
    )  # fmt: skip
    te_out = thd_attention_reference(q, k, v, **te_attention_kwargs(thd, kw_mask(causal)))
    torch.testing.assert_close(out, te_out)


def kw_mask(causal: bool) -> str:
    return "padding_causal" if causal else "padding"


def test_flash_attn_varlen_kwargs():
    thd = process_input_for_thd(TAIL_ONLY)
    kw = flash_attn_varlen_kwargs(thd, softmax_scale=0.5)
    assert set(kw) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal",
                       "softmax_scale"}  # fmt: skip
    assert kw["cu_seqlens_q"].dtype == I32 and kw["cu_seqlens_q"].tolist() == [0, 3, 8, 16]
    assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 8 and kw["causal"] is True


@settings(max_examples=100)
@given(layouts())
def test_varlen_kwargs_over_padding_between_sequences_are_exact_at_real_tokens(layout):
    # A varlen kernel reads one boundary array as physical offsets, causally. Stand in
    # for it with the reference over those boundaries alone; TE's own contract (real
    # and padded arrays) is the oracle at every real token, forward and backward.
    lens, pads, tail, hkv, groups, d, dv, _, scale, chunk, seed = layout
    cu, cup, t = _stream(lens, pads, tail)
    thd = {
        "cu_seqlens": cu,
        "cu_seqlens_padded": cup,
        "input_ids": torch.zeros(t, dtype=torch.long),
    }
    q, k, v, g = _qkv(t, hkv * groups, hkv, d, dv, seed)
    for fn, names in (
        (torch_varlen_kwargs, ("cu_seq_q", "cu_seq_k", "max_q", "max_k")),
        (
            flash_attn_varlen_kwargs,
            ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
        ),
    ):
        kw = fn(thd)
        cq, ck, mq, mk = (kw[n] for n in names)
        assert torch.equal(cq, cup) and type(mq) is int
        assert mq == mk >= max([int(x) for x in (cup[1:] - cup[:-1])], default=0)
        out = thd_attention_reference(
            q, k, v, cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=mq, max_seqlen_kv=mk,
            attn_mask_type="padding_causal", softmax_scale=scale, query_chunk_size=chunk,
        )  # fmt: skip
        want = sdpa_oracle(q, k, v, cu, cup, True, scale)
        real = _real_slots(lens, cup, t)
        torch.testing.assert_close(out[real], want[real], rtol=1e-10, atol=1e-10)
        # The loss reads real tokens only: gradients are TE's exactly.
        grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype) * real[:, None, None]
        got = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
        exp = torch.autograd.grad((want * grad_out).sum(), (q, k, v))
        for a, b in zip(got, exp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("fn", [flash_attn_varlen_kwargs, torch_varlen_kwargs])
def test_varlen_kwargs_over_padding_need_host_boundaries(fn):
    # The longest padded segment would take a device sync to read: refused, naming the fix.
    thd = {"cu_seqlens": torch.tensor([0, 3, 5], dtype=I32).to("meta"), "pad_between_seqs": True,
           "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=I32).to("meta"), "max_seqlen_int": 4,
           "input_ids": torch.zeros(8, dtype=torch.long, device="meta")}  # fmt: skip
    with pytest.raises(
        VarlenLayoutError,
        match=r"cu_seqlens_padded is on meta; build the kwargs from the CPU batch",
    ):
        fn(thd)


def test_torch_varlen_kwargs_follow_the_installed_signature(monkeypatch):
    from te_thd.attention import adapters

    thd = process_input_for_thd(NO_PAD)
    assert "enable_gqa" in torch_varlen_kwargs(thd, enable_gqa=True)  # torch 2.13 has it
    # A torch whose varlen_attn lacks enable_gqa (2.11) gets no such key, and GQA there
    # is refused with the way out rather than a TypeError from inside the kernel call.
    monkeypatch.setattr(adapters, "_varlen_accepts", lambda name: name != "enable_gqa")
    assert "enable_gqa" not in torch_varlen_kwargs(thd)
    with pytest.raises(ValueError, match=r"enable_gqa=True.*repeat_interleave"):
        torch_varlen_kwargs(thd, enable_gqa=True)


@pytest.mark.parametrize("fn", [flash_attn_varlen_kwargs, torch_varlen_kwargs])
def test_varlen_kwargs_reject_padding_between_sequences_and_cp(fn):
    thd = process_input_for_thd(PAD_BETWEEN)
    with pytest.raises(VarlenLayoutError, match="cannot express padding between sequences"):
        fn(thd, causal=False)
    cp_ready = _bshd_batch([[4, 4], [8]], [[4, 4], [8]], 8)
    sharded = shard_thd_batch_for_cp(process_input_for_thd(cp_ready), cp_size=2, cp_rank=0)
    with pytest.raises(VarlenLayoutError, match="has no context parallelism.*cp_size=2"):
        fn(sharded)
    with pytest.raises(ValueError, match=r"absorb_trailing_pad=False"):
        fn(process_input_for_thd(TAIL_ONLY), causal=False)


def test_bidirectional_over_absorbed_tail_is_rejected_everywhere():
    absorbed = process_input_for_thd(TAIL_ONLY)
    assert absorbed["pad_between_seqs"] is False
    with pytest.raises(ValueError, match=r"padding slot 14 lies inside a sequence"):
        te_attention_kwargs(absorbed, "padding")
    te_attention_kwargs(absorbed, "padding_causal")  # causal: correct, accepted
    kept = process_input_for_thd(TAIL_ONLY, absorb_trailing_pad=False)
    assert te_attention_kwargs(kept, "padding")["pad_between_seqs"] is True
    # CP-sharded absorbed batch: the local padding mask still reveals it.
    absorbed_cp = process_input_for_thd(_bshd_batch([[4, 4], [5]], [[4, 4], [8]], 8))
    assert absorbed_cp["pad_between_seqs"] is False
    rank1 = shard_thd_batch_for_cp(absorbed_cp, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match=r"rank-local \(cp_size=2\) padding slot"):
        te_attention_kwargs(rank1, "padding")


@pytest.mark.parametrize(
    ("thd", "kwargs", "match"),
    [
        ([1, 2], {}, "thd must be the dict returned by"),
        ({"input_ids": torch.zeros(3)}, {}, r"thd\['cu_seqlens'\] is missing"),
        ({"cu_seqlens": _cu([2]), "cu_seqlens_padded": [0, 2]}, {}, "must be a tensor or absent"),
        ({"cu_seqlens": _cu([2]), "pad_between_seqs": torch.tensor(False)}, {},
         "must be a Python bool, got Tensor"),
        ({"cu_seqlens": _cu([2])}, {"cp_size": 0}, "cp_size=0 must be an int >= 1"),
        ({"cu_seqlens": _cu([2])}, {"max_seqlen": 2.0}, "max_seqlen=2.0 must be an int >= 0"),
        ({"cu_seqlens": _cu([2]).to("meta")}, {}, r"pad_between_seqs'\] is missing .* on meta"),
        ({"cu_seqlens": _cu([2]).to("meta"), "pad_between_seqs": True}, {"cp_size": 2},
         "cannot decide max_seqlen without a device sync"),
    ],
)  # fmt: skip
def test_te_kwargs_bad_input_messages(thd, kwargs, match):
    with pytest.raises(ValueError, match=match):
        te_attention_kwargs(thd, **kwargs)


def test_te_kwargs_on_device_boundaries_use_host_ints_without_reading_them():
    # "meta" tensors cannot be read at all: success proves no host read (no sync).
    thd = {"cu_seqlens": _cu([3, 5]).to("meta"), "pad_between_seqs": False, "max_seqlen_int": 5}
    kw = te_attention_kwargs(thd)
    assert kw["max_seqlen_q"] == 5 and kw["cu_seqlens_q_padded"] is kw["cu_seqlens_q"]
    moved = te_attention_kwargs(process_input_for_thd(PAD_BETWEEN), device="meta")
    assert moved["cu_seqlens_q"].device.type == "meta" and moved["max_seqlen_q"] == 8


# --------------------------------------------------------------------------- contract errors


def _good():
    cu, cup = _cu([3, 2]), _cu([4, 4])
    q, k, v, _ = _qkv(8, 4, 2, 8, 8, seed=0)
    kw = dict(
        qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup, max_seqlen_q=4, max_seqlen_kv=4,
        pad_between_seqs=True,
    )  # fmt: skip
    return [q.detach(), k.detach(), v.detach()], kw


def _cp_good():
    cu, cup = _cu([3, 8]), _cu([4, 8])
    q, k, v, _ = _qkv(6, 2, 2, 8, 8, seed=0)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
              cu_seqlens_kv_padded=cup, pad_between_seqs=True, cp_size=2)  # fmt: skip
    return [q.detach(), k.detach(), v.detach()], kw


def _set(**updates):
    def apply(t, kw):
        kw.update(updates)

    return apply


CONTRACT_CASES = [
    ("format", _good, _set(qkv_format="bshd"), "qkv_format must be 'thd'"),
    ("q4d", _good, lambda t, kw: t.__setitem__(0, t[0][None]), "query must be a 3-D .* got \\(1, 8"),
    ("dtype", _good, lambda t, kw: t.__setitem__(1, t[1].float()), "must share a dtype"),
    ("kv", _good, lambda t, kw: t.__setitem__(2, t[2][:, :1]), "must agree in tokens and heads"),
    ("hdim", _good, lambda t, kw: t.__setitem__(0, t[0][..., :4]), "query head_dim 4 != key head_dim 8"),
    ("gqa", _good, lambda t, kw: t.__setitem__(0, t[0][:, :3]), "3 heads, not a multiple of .* 2"),
    ("mask", _good, _set(attn_mask_type="causal"), "'causal' has no padding mask"),
    ("mask?", _good, _set(attn_mask_type="padding_sliding"), "'padding_sliding' is not supported"),
    ("mask!", _good, _set(attn_mask_type=3), "attn_mask_type must be a string"),
    ("cpmask", _cp_good, _set(attn_mask_type="padding_causal_bottom_right"),
     "Context parallelism is not supported for padding_causal_bottom_right"),
    ("none", _good, _set(cu_seqlens_q=None), "cu_seqlens_q must be an int32 .* got NoneType"),
    ("2d", _good, lambda t, kw: kw.update(cu_seqlens_kv=kw["cu_seqlens_kv"][None]),
     r"cu_seqlens_kv must be 1-D \[N\+1\], got shape \(1, 3\)"),
    ("i64", _good, lambda t, kw: kw.update(cu_seqlens_q_padded=kw["cu_seqlens_q_padded"].long()),
     "cu_seqlens_q_padded must have dtype torch.int32, got torch.int64"),
    ("shape", _good, _set(cu_seqlens_kv=_cu([3, 2, 1])),
     r"cu_seqlens_kv has shape \(4,\) but cu_seqlens_q has shape \(3,\)"),
    ("cp-pad", _cp_good, _set(cu_seqlens_kv_padded=None),
     "cu_seqlens_kv_padded is required with context parallelism"),
    ("maxint", _good, _set(max_seqlen_q=torch.tensor(4)), r"max_seqlen_q=tensor\(4\) must be an int \(a Python int: a tensor"),
    ("padflag", _good, _set(pad_between_seqs=1), "pad_between_seqs must be a Python bool"),
    ("cp-size", _good, _set(cp_size=0), "cp_size=0 must be an int >= 1"),
    ("cp-odd", _cp_good, lambda t, kw: t.__setitem__(0, t[0][:5]),
     "query 5 / key 6 must be even under context parallelism"),
    ("zero", _good, _set(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=I32),
                         cu_seqlens_kv=torch.tensor([1, 3, 5], dtype=I32)), r"cu_seqlens_q\[0\] must be 0, got 1"),
    ("monotone", _good, _set(cu_seqlens_q=torch.tensor([0, 3, 2], dtype=I32)),
     "cu_seqlens_q must be non-decreasing: sequence 1 has length -1"),
    ("fit", _good, _set(cu_seqlens_kv=torch.tensor([0, 5, 7], dtype=I32)),
     "sequence 0 has real length 5 .* but only 4 slots"),
    ("max", _good, _set(max_seqlen_kv=2), "max_seqlen_kv=2 is smaller than sequence 0's length 3"),
    ("beyond", _good, _set(cu_seqlens_q_padded=_cu([4, 6])),
     "cu_seqlens_q_padded ends at 10, beyond the 8 tokens"),
    ("cpdiv", _cp_good, _set(cu_seqlens_q=_cu([3, 5]), cu_seqlens_q_padded=_cu([6, 6])),
     r"sequence 0 has padded length 6 .* not a multiple of 2\*cp_size=4"),
    ("cpcover", _cp_good, lambda t, kw: [t.__setitem__(i, torch.cat((t[i], t[i][:2]))) for i in range(3)],
     "ends at 12 but the global stream has 16 tokens"),
    ("3331", _good, _set(pad_between_seqs=False), "pad_between_seqs=False but .*NVIDIA/TransformerEngine#3331"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "base", "mutate", "match"), CONTRACT_CASES,
                         ids=[c[0] for c in CONTRACT_CASES])  # fmt: skip
def test_check_te_thd_args_error_messages(name, base, mutate, match):
    tensors, kw = base()
    check_te_thd_args(*tensors, **kw)  # the unmutated case passes
    mutate(tensors, kw)
    with pytest.raises(ThdContractError, match=match):
        check_te_thd_args(*tensors, **kw)


def test_check_te_thd_args_skips_value_checks_for_device_boundaries():
    tensors, kw = _good()
    kw["cu_seqlens_kv"] = torch.tensor([0, 5, 7], dtype=I32)  # a value violation...
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        kw[name] = kw[name].to("meta")
    check_te_thd_args(*tensors, **kw)  # ...not read on a device: no sync
    with pytest.raises(NotImplementedError):  # forcing the read on meta cannot succeed
        check_te_thd_args(*tensors, check_values=True, **kw)


# --------------------------------------------------------------------------- module


def test_thd_attention_module_falls_back_to_reference_on_cpu():
    thd = process_input_for_thd(PAD_BETWEEN)
    t = thd["input_ids"].shape[0]
    q, k, v, _ = _qkv(t, 4, 2, 8, 8, seed=5)
    attn = ThdAttention(4, 8, num_gqa_groups=2)
    assert attn.last_backend is None
    out = attn(q, k, v, thd)
    assert attn.last_backend == "reference" and out.shape == (t, 4 * 8)
    want = thd_attention_reference(q, k, v, **te_attention_kwargs(thd))
    torch.testing.assert_close(out, want.reshape(t, -1))
    # Same call site with prebuilt TE kwargs, and a bidirectional module.
    torch.testing.assert_close(attn(q, k, v, te_attention_kwargs(thd)), out)
    bi = ThdAttention(4, 8, 2, attn_mask_type="padding", softmax_scale=0.3, backend="reference")
    want_bi = thd_attention_reference(
        q, k, v, softmax_scale=0.3, **te_attention_kwargs(thd, "padding")
    )
    torch.testing.assert_close(bi(q, k, v, thd), want_bi.reshape(t, -1))
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


def test_thd_attention_module_backend_selection_and_errors():
    if te_available():
        assert ThdAttention(2, 8).preferred_backend == "te"
    else:
        assert ThdAttention(2, 8).preferred_backend == "reference"
        with pytest.raises(ValueError, match=r"backend='te' needs transformer_engine and CUDA"):
            ThdAttention(2, 8, backend="te")
    with pytest.raises(ValueError, match="backend must be 'auto', 'te' or 'reference'"):
        ThdAttention(2, 8, backend="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_attention_heads=3 must be a positive multiple"):
        ThdAttention(3, 8, num_gqa_groups=2)
    attn = ThdAttention(2, 8)
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="neither 'cu_seqlens'"):
        attn(q, q, q, {"input_ids": torch.zeros(4)})
    with pytest.raises(ValueError, match="must be a THD batch"):
        attn(q, q, q, [1])
