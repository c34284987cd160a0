"""CP communication types (TE's ``cp_comm_type``) over real gloo process groups.

Four processes; the CP reference attention with ``"p2p"``, ``"all_gather"``, ``"a2a"``
(one group of 4) and ``"a2a+p2p"`` (a2a groups ``[0, 1] [2, 3]``, p2p groups
``[0, 2] [1, 3]``, as TE's own CP tests build them) must give every rank's shard of
the single-device output, and the single-device gradients, whatever the type.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from _example_support import run_gloo

from te_thd.attention import ThdAttention, te_attention_kwargs, thd_attention_reference
from te_thd.attention.cp_comm import check_cp_comm_type, resolve_cp_groups
from te_thd.attention.cp_reference import thd_attention_cp_reference
from te_thd.cp import partition_indices
from te_thd.packing import PackingCollator, pad_to_multiple_for
from te_thd.thd_utils import process_input_for_thd

WORLD = 4
TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _batch(cp: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    lengths = [int(n) for n in torch.randint(3, 30, (6,), generator=gen)]
    samples = [{"input_ids": torch.arange(1, n + 1)} for n in lengths]
    return process_input_for_thd(
        PackingCollator(64, pad_to_multiple_of=pad_to_multiple_for(cp))(samples)
    )


def _groups(rank: int) -> dict:
    """Every group of the test, created in the same order on every rank."""
    whole = dist.new_group(list(range(WORLD)))
    a2a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    p2p = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {
        "p2p": whole,
        "all_gather": whole,
        "a2a": whole,
        "a2a+p2p": [a2a[rank // 2], p2p[rank % 2]],
    }


def _worker(rank: int, world: int, heads: int, heads_kv: int) -> dict:
    torch.manual_seed(0)  # the same global tensors on every rank
    thd = _batch(world)
    kw = te_attention_kwargs(thd)
    total = thd["input_ids"].shape[0]
    q = torch.randn(total, heads, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, heads_kv, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, heads_kv, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(total, heads, 8, dtype=torch.float64)
    ref = thd_attention_reference(q, k, v, **kw)
    (ref * w).sum().backward()

    groups = _groups(rank)
    result = {}
    for comm_type in TYPES:
        cp = resolve_cp_groups(groups[comm_type], comm_type)
        idx = partition_indices(kw["cu_seqlens_q_padded"], total, cp.size, cp.rank)
        ql, kl, vl = (t.detach()[idx].clone().requires_grad_() for t in (q, k, v))
        out = thd_attention_cp_reference(
            ql, kl, vl, cp_group=groups[comm_type], cp_comm_type=comm_type, **kw
        )
        (out * w[idx]).sum().backward()
        result[comm_type] = {
            "cp": (cp.size, cp.rank, cp.global_ranks),
            "out": (out - ref.detach()[idx]).abs().max().item(),
            "dq": (ql.grad - q.grad[idx]).abs().max().item(),
            "dk": (kl.grad - k.grad[idx]).abs().max().item(),
            "dv": (vl.grad - v.grad[idx]).abs().max().item(),
        }
    return result


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_gloo(WORLD, _worker, 4, 4)


@pytest.mark.parametrize("comm_type", TYPES)
def test_cp_reference_gives_the_same_numbers_whatever_the_comm_type(per_rank, comm_type):
    for rank, res in enumerate(per_rank):
        r = res[comm_type]
        assert r["out"] < 1e-12 and r["dq"] < 1e-12, (rank, r)
        assert r["dk"] < 1e-12 and r["dv"] < 1e-12, (rank, r)


def test_hierarchical_cp_index_is_p2p_rank_times_a2a_size_plus_a2a_rank(per_rank):
    # a2a groups [0,1] [2,3], p2p groups [0,2] [1,3]: rank g has a2a rank g % 2 and p2p
    # rank g // 2, so its CP index is (g // 2) * 2 + g % 2 = g, and TE's cp_global_ranks
    # (CP index order) is the world
    for rank, res in enumerate(per_rank):
        assert res["a2a+p2p"]["cp"] == (4, rank, (0, 1, 2, 3))
        assert res["p2p"]["cp"] == (4, rank, (0, 1, 2, 3))


def _gqa_worker(rank: int, world: int) -> list[str]:
    groups = _groups(rank)
    errors = []
    for comm_type in ("a2a", "a2a+p2p", "p2p"):
        cp = resolve_cp_groups(groups[comm_type], comm_type)
        try:
            check_cp_comm_type(
                cp, num_attention_heads=8, num_gqa_groups=2, attn_mask_type="padding_causal"
            )
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    try:  # the module checks at construction, before any TE object exists
        ThdAttention(8, 8, num_gqa_groups=2, cp_group=groups["a2a"], cp_comm_type="a2a")
        errors.append("")
    except ValueError as e:
        errors.append(str(e))
    for bad, comm_type in ((groups["a2a+p2p"], "p2p"), (groups["p2p"], "a2a+p2p")):
        try:
            resolve_cp_groups(bad, comm_type)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_combinations_te_rejects_fail_before_te_sees_them():
    a2a4, a2a2, p2p, module, list_for_p2p, group_for_hier = run_gloo(WORLD, _gqa_worker)[0]
    assert module == a2a4
    # 2 kv heads cannot be scattered over 4 CP ranks; over an a2a group of 2 they can
    assert "cp_comm_type='a2a' scatters attention heads over the CP size (4), but " in a2a4
    assert "num_gqa_groups=2 is not divisible by it" in a2a4 and "use cp_comm_type='p2p'" in a2a4
    assert a2a2 == "" and p2p == ""
    assert (
        "cp_comm_type='p2p' needs one torch.distributed ProcessGroup as cp_group, got list"
        in list_for_p2p
    )
    assert "cp_comm_type='a2a+p2p' needs cp_group=[a2a_group, p2p_group]" in group_for_hier


@pytest.mark.parametrize(
    ("comm_type", "version", "ok"),
    [("p2p", (2, 2), True), ("a2a", (2, 9), False), ("a2a", (2, 10), True),
     ("all_gather", (2, 17), False), ("all_gather", (2, 18), True),
     ("a2a+p2p", (2, 18), False), ("a2a+p2p", (2, 19), True)],
)  # fmt: skip
def test_te_version_rule_per_comm_type(comm_type, version, ok):
    from te_thd.attention.cp_comm import CpGroups

    groups = CpGroups(comm_type, None, None, None, 1, 2, 2, 0, (0, 1))
    call = lambda: check_cp_comm_type(  # noqa: E731
        groups, num_attention_heads=4, num_gqa_groups=4, attn_mask_type="padding_causal",
        te_version=version,
    )  # fmt: skip
    if ok:
        call()
    else:
        with pytest.raises(
            ValueError,
            match=rf"cp_comm_type='{re.escape(comm_type)}' with qkv_format='thd' needs "
            rf"Transformer Engine >= \d+\.\d+, installed: {version[0]}\.{version[1]}",
        ):
            call()


def test_unknown_comm_type():
    with pytest.raises(ValueError, match=r"cp_comm_type='ring' is not one of TE's"):
        resolve_cp_groups(None, "ring")
