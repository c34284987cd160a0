"""CP attention under ``no_load_balance`` over a real gloo group: the single-device numbers.

Three processes; documents of lengths that are no multiples of ``2*cp`` (none padded), the
stream cut into three contiguous pieces (TE's ``NO_LOAD_BALANCE``). The CP reference with
``cp_comm_type="all_gather"`` and ``ThdAttention(strategy="no_load_balance")`` must give
every rank its piece of the single-device output and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _example_support import run_gloo

from te_thd.attention import (
    ThdAttention,
    ThdContractError,
    te_attention_kwargs,
    thd_attention_cp_reference,
    thd_attention_reference,
)
from te_thd.cp import shard_thd_batch_for_cp
from te_thd.packing import PackingCollator
from te_thd.thd_utils import process_input_for_thd

WORLD = 3


def _batch() -> dict:
    lengths = (7, 13, 2, 9, 5)  # 36 real tokens in a 39-slot stream: a trailing pad
    samples = [{"input_ids": torch.arange(1, n + 1)} for n in lengths]
    return process_input_for_thd(PackingCollator(39, rows=1)(samples), absorb_trailing_pad=False)


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)  # the same global tensors on every rank
    thd = _batch()
    total = thd["input_ids"].shape[0]
    q, k, v, w = (torch.randn(total, 2, 8, dtype=torch.float64) for _ in range(4))
    q_all, k_all, v_all = (t.clone().requires_grad_() for t in (q, k, v))
    ref = thd_attention_reference(q_all, k_all, v_all, **te_attention_kwargs(thd))
    (ref * w).sum().backward()

    shard = shard_thd_batch_for_cp(thd, world, rank, strategy="no_load_balance")
    piece = slice(rank * total // world, (rank + 1) * total // world)
    ql, kl, vl = (t[piece].clone().requires_grad_() for t in (q, k, v))
    kw = te_attention_kwargs(shard)
    group = dist.group.WORLD
    out = thd_attention_cp_reference(
        ql, kl, vl, cp_group=group, cp_comm_type="all_gather", strategy="no_load_balance", **kw
    )
    (out * w[piece]).sum().backward()
    module = ThdAttention(
        2, 8, cp_group=group, cp_comm_type="all_gather", strategy="no_load_balance"
    )
    mod_out = module(ql.detach(), kl.detach(), vl.detach(), shard)
    try:
        thd_attention_cp_reference(
            ql, kl, vl, cp_group=group, cp_comm_type="p2p", strategy="no_load_balance", **kw
        )
        refused = ""
    except ThdContractError as exc:
        refused = str(exc)
    return {
        "out": out.detach(),
        "want": ref.detach()[piece],
        "module": mod_out,
        "grads": [t.grad for t in (ql, kl, vl)],
        "want_grads": [t.grad[piece] for t in (q_all, k_all, v_all)],
        "refused": refused,
    }


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_gloo(WORLD, _worker)


def test_cp_reference_under_no_load_balance_matches_single_process(per_rank):
    for got in per_rank:
        torch.testing.assert_close(got["out"], got["want"], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["module"], got["want"].reshape(got["want"].shape[0], -1))
        for grad, want in zip(got["grads"], got["want_grads"], strict=True):
            # K/V gradients reach every rank's keys through the all-gather's backward
            torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


def test_no_load_balance_needs_all_gather(per_rank):
    for got in per_rank:
        assert "TE runs it with cp_comm_type='all_gather' and a causal mask only" in got["refused"]
