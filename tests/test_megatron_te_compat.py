"""Current Megatron-Core and TE: PackedSeqParams fields by release, fixed (CUDA-graph) shapes.

``packed_seq_params`` is run against the real megatron-core 0.16.1 class and against
stand-in dataclasses that transcribe later releases' fields (``total_tokens`` from 0.17,
``pad_between_seqs`` from 0.19, with the current ``__post_init__``), installed in place
of ``megatron.core.packed_seq_params.PackedSeqParams``. The fixed-shape form
(``max_num_seqs``: ``cu_seqlens*`` padded to ``N + 1`` by repeating the last offset,
``max_seqlen`` fixed) must give the reference attention's outputs and gradients
unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import megatron.core.packed_seq_params as mcore_psp
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from te_thd import ThdLayout
from te_thd.attention import (
    check_te_thd_args,
    packed_seq_params,
    te_attention_kwargs,
    thd_attention_reference,
)
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.offline_cache import CachedThdCollator
from te_thd.packing import PackingCollator, pad_to_multiple_for
from te_thd.thd_utils import process_input_for_thd


@dataclass
class PackedSeqParams0_16:
    """megatron-core 0.16.1's fields (what this machine has installed)."""

    qkv_format: str = None
    cu_seqlens_q: Tensor = None
    cu_seqlens_kv: Tensor = None
    cu_seqlens_q_padded: Tensor = None
    cu_seqlens_kv_padded: Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None


@dataclass
class PackedSeqParams0_17(PackedSeqParams0_16):
    """0.17 / 0.18: ``total_tokens`` (no ``__post_init__`` here: only the field matters)."""

    total_tokens: int = None


@dataclass
class PackedSeqParamsCurrent(PackedSeqParams0_16):
    """Megatron-LM main (0.19 / 0.20): the current fields and ``__post_init__``, transcribed."""

    total_tokens: int = None
    seq_idx: Tensor = None
    tokens_per_sample: int = None
    pad_between_seqs: bool = None
    cp_scatter_cache: object = None
    post_init_devices: tuple = ()  # test bookkeeping, not Megatron's

    def __post_init__(self):
        cu_seqlens = (
            self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
        )
        if isinstance(cu_seqlens, Tensor) and self.total_tokens is not None:
            self.post_init_devices = (cu_seqlens.device.type,)
            total = torch.tensor(
                [self.total_tokens], dtype=cu_seqlens.dtype, device=cu_seqlens.device
            )
            lengths = (
                torch.cat([cu_seqlens, total])[1:] - torch.cat([cu_seqlens, total])[:-1]
            ).clamp(min=0)
            self.seq_idx = (
                torch.repeat_interleave(
                    torch.arange(lengths.numel(), device=cu_seqlens.device), lengths
                )
                .to(torch.int32)
                .unsqueeze(0)
            )


def _thd(lengths: list[int], seq_len: int, multiple: int = 1, absorb: bool = True) -> dict:
    samples = [{"input_ids": torch.arange(1, n + 1) + 50 * i} for i, n in enumerate(lengths)]
    packed = PackingCollator(seq_len, pad_to_multiple_of=multiple)(samples)
    return process_input_for_thd(packed, absorb_trailing_pad=absorb)


# --------------------------------------------------------------------------- PackedSeqParams


def test_real_megatron_class_gets_its_fields_only():
    thd = _thd([5, 3, 7], 8, multiple=2)
    p = packed_seq_params(thd)
    assert type(p) is mcore_psp.PackedSeqParams
    names = {f.name for f in dataclasses.fields(p)}
    if "pad_between_seqs" in names:  # a newer megatron-core than this machine's
        assert p.pad_between_seqs is True
    assert p.cu_seqlens_q_padded is not p.cu_seqlens_q  # padding between sequences


@pytest.mark.parametrize(
    ("cls", "has_total", "has_pad"),
    [(PackedSeqParams0_16, False, False), (PackedSeqParams0_17, True, False),
     (PackedSeqParamsCurrent, True, True)],
)  # fmt: skip
@pytest.mark.parametrize("pad_between", [True, False])
def test_every_known_field_the_installed_class_has_is_set(
    monkeypatch, cls, has_total, has_pad, pad_between
):
    monkeypatch.setattr(mcore_psp, "PackedSeqParams", cls)
    # pad_between: documents padded to 2 slots inside rows of 8; else one tail-padded row
    thd = _thd([5, 3, 7], 8, multiple=2) if pad_between else _thd([3, 2], 8)
    layout = ThdLayout.from_thd(thd)
    p = packed_seq_params(thd)
    assert type(p) is cls
    kw = te_attention_kwargs(thd)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(p, name), kw[name])
    assert (p.cu_seqlens_q_padded is p.cu_seqlens_q) is (not pad_between)
    assert p.max_seqlen_q == p.max_seqlen_kv == layout.max_seqlen
    assert p.qkv_format == "thd"
    if has_total:
        assert p.total_tokens == layout.total_tokens == thd["input_ids"].shape[0]
    if has_pad:
        assert p.pad_between_seqs is pad_between  # TE then never guesses it
        # Megatron's __post_init__ ran on the host boundaries: seq_idx covers the stream
        assert p.seq_idx.shape == (1, layout.total_tokens)
    else:
        assert not hasattr(p, "pad_between_seqs")


def test_device_move_after_megatrons_post_init_ran_on_the_host(monkeypatch):
    monkeypatch.setattr(mcore_psp, "PackedSeqParams", PackedSeqParamsCurrent)
    thd = _thd([5, 3, 7], 8, multiple=2)
    p = packed_seq_params(thd, device="meta")  # a device that is not the CPU, on any machine
    assert p.post_init_devices == ("cpu",)  # seq_idx computed without a device sync
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded", "seq_idx"):
        assert getattr(p, name).device.type == "meta", name
    assert p.cu_seqlens_kv is p.cu_seqlens_q and p.cu_seqlens_kv_padded is p.cu_seqlens_q_padded
    tail = packed_seq_params(_thd([3, 2], 8), device="meta")
    assert tail.cu_seqlens_q_padded is tail.cu_seqlens_q  # TE's same-object rule survives the move


def test_sharded_batch_total_tokens_is_the_global_stream(monkeypatch):
    monkeypatch.setattr(mcore_psp, "PackedSeqParams", PackedSeqParamsCurrent)
    thd = _thd([5, 3, 7, 9], 32, multiple=pad_to_multiple_for(2))
    p = packed_seq_params(shard_thd_batch_for_cp(thd, 2, 1))
    assert p.total_tokens == thd["input_ids"].shape[0] == 32
    assert p.pad_between_seqs is True


# --------------------------------------------------------------------------- fixed shapes


@settings(max_examples=40, deadline=None)
@given(
    multiple=st.sampled_from([1, 2, 4]),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    extra=st.integers(0, 5),
    causal=st.booleans(),
)
def test_padded_form_gives_identical_outputs_and_gradients(multiple, lengths, extra, causal):
    # a bidirectional mask needs the row's trailing pad kept outside the last sequence
    thd = _thd(lengths, seq_len=16, multiple=multiple, absorb=causal)
    mask = "padding_causal" if causal else "padding"
    layout = ThdLayout.from_thd(thd)
    n, total = layout.num_seqs, layout.total_tokens
    kw = te_attention_kwargs(thd, mask)
    fixed = te_attention_kwargs(thd, mask, max_num_seqs=n + extra, max_seqlen=total)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        t, f = kw[name], fixed[name]
        assert f.shape == (n + extra + 1,) and f.dtype == torch.int32
        assert torch.equal(f[: n + 1], t) and bool((f[n:] == t[-1]).all())  # zero-length tail
    assert (fixed["cu_seqlens_q_padded"] is fixed["cu_seqlens_q"]) is (not kw["pad_between_seqs"])
    assert fixed["max_seqlen_q"] == fixed["max_seqlen_kv"] == total
    assert fixed["pad_between_seqs"] is kw["pad_between_seqs"]

    gen = torch.Generator().manual_seed(n)
    q, k, v, w = (torch.randn(total, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    check_te_thd_args(q, k, v, **fixed)
    outs, grads = [], []
    for args in (kw, fixed):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = thd_attention_reference(*qkv, **args)
        (out * w).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in qkv])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_more_sequences_than_max_num_seqs_is_a_clear_error():
    thd = _thd([2, 2, 2, 2, 2], 16)
    with pytest.raises(ValueError) as err:
        te_attention_kwargs(thd, max_num_seqs=4)
    msg = str(err.value)
    assert "the batch has 5 sequences, more than max_num_seqs=4" in msg
    assert "max_num_seqs=16 always suffices for these 16 tokens" in msg


def test_max_seqlen_bound_below_the_longest_sequence_is_refused():
    thd = _thd([9, 3], 16)
    with pytest.raises(ValueError, match=r"max_seqlen=8 is below the batch's longest sequence \(9"):
        te_attention_kwargs(thd, max_num_seqs=4, max_seqlen=8)


def test_fixed_shape_defaults_the_bound_to_the_stream_length():
    thd = _thd([9, 3], 16)
    kw = te_attention_kwargs(thd, max_num_seqs=4)
    assert kw["max_seqlen_q"] == 16 and kw["cu_seqlens_q"].shape == (5,)


def test_packed_seq_params_takes_the_same_option(monkeypatch):
    monkeypatch.setattr(mcore_psp, "PackedSeqParams", PackedSeqParamsCurrent)
    p = packed_seq_params(_thd([5, 3, 7], 8, multiple=2), max_num_seqs=6, max_seqlen=8)
    assert p.cu_seqlens_q.shape == (7,) and p.max_seqlen_q == 8
    assert p.seq_idx.shape == (1, 24)


def test_collator_gives_every_step_the_same_shapes():
    def sample(n: int, i: int) -> dict:
        return {"input_ids": torch.arange(n) + i, "seq_len": torch.tensor(n)}

    collate = CachedThdCollator(
        32, length_key="seq_len", cp_size=2, cp_rank=1, rows=2, max_num_seqs=12
    )
    shapes = set()
    for lengths in ([20, 3, 9], [5, 5, 5, 5, 5, 5, 2], [31]):
        rows = [sample(n, i) for i, n in enumerate(lengths)]
        width = max(lengths)
        rows = [{"input_ids": torch.nn.functional.pad(r["input_ids"], (0, width - r["input_ids"].numel())),
                 "seq_len": r["seq_len"]} for r in rows]  # fmt: skip
        batch = collate(rows)
        kw = te_attention_kwargs(batch)
        shapes.add((tuple(batch["input_ids"].shape), tuple(kw["cu_seqlens_q"].shape),
                    tuple(kw["cu_seqlens_q_padded"].shape), kw["max_seqlen_q"]))  # fmt: skip
        # the unpadded layout's real sequences are the leading ones
        assert int(kw["cu_seqlens_q_padded"][-1]) == 64
    assert shapes == {((32,), (13,), (13,), 64)}  # max_seqlen: the 2 x 32-slot stream
