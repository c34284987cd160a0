"""Expert-parallel MoE of the example (examples/ep_cp/moe.py) over real gloo processes.

EP=2 (experts split over two ranks, tokens dispatched with all-to-all) must equal
EP=1 (every rank holds all experts) for the same routing: outputs, gradients of the
tokens (the return all-to-all's backward) and of the experts (the dispatch
all-to-all's backward, summed over the ranks that hold a replica under EP=1).
A bad expert count is a clear error.
"""

from __future__ import annotations

import pytest
import torch
from _example_support import run_gloo

H, F, E, K, T = 16, 24, 4, 2, 37


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T + rank * 5, H, generator=g)  # uneven token counts per rank
    pad = torch.zeros(x.shape[0], dtype=torch.bool)
    pad[-3:] = True  # padding tokens: routed nowhere, zero output
    return x, pad


def _run(layer, x: torch.Tensor, pad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y, stats = layer(x, pad)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(y.shape, generator=g)
    ((y * w).sum() + 3.0 * stats.aux_loss).backward()
    return {
        "y": y.detach(),
        "dx": x.grad,
        "d_router": layer.router.weight.grad,
        "d_w_in": layer.w_in.grad,
        "d_w_out": layer.w_out.grad,
        "aux": stats.aux_loss.detach(),
    }


def _worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist
    from ep_cp.moe import MoELayer

    x, pad = _inputs(rank)
    ep_group = dist.new_group([0, 1])
    torch.manual_seed(0)
    ep2 = MoELayer(H, F, E, K, layer_index=1, seed=5, ep_group=ep_group)
    ep1 = MoELayer(H, F, E, K, layer_index=1, seed=5, ep_group=None)
    ep1.router.load_state_dict(ep2.router.state_dict())  # same routing (dense params replicated)
    out = {"ep2": _run(ep2, x, pad), "ep1": _run(ep1, x, pad)}
    try:  # 3 experts cannot be split over 2 ranks
        MoELayer(H, F, 3, 1, layer_index=0, seed=0, ep_group=ep_group)
        out["error"] = ""
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_ep2_equals_ep1_outputs_and_gradients():
    res = run_gloo(2, _worker)
    nl = E // 2
    for rank in range(2):
        a, b = res[rank]["ep2"], res[rank]["ep1"]
        x, pad = _inputs(rank)
        assert torch.equal(a["y"][pad], torch.zeros_like(a["y"][pad]))
        for key in ("y", "dx", "d_router", "aux"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
        # Expert shard of this rank == the EP=1 gradients of those experts summed over
        # the two ranks' tokens (what the expert-data-parallel reduction would add up).
        for key in ("d_w_in", "d_w_out"):
            full = res[0]["ep1"][key] + res[1]["ep1"][key]
            torch.testing.assert_close(
                a[key], full[rank * nl : (rank + 1) * nl], rtol=1e-5, atol=1e-6
            )
    # the test must be able to fail: gradients are not trivially zero
    assert res[0]["ep2"]["d_w_in"].abs().sum() > 0 and res[1]["ep2"]["d_w_out"].abs().sum() > 0
    for r in res:
        assert "num_experts=3 must be divisible by the expert-parallel size ep=2" in r["error"]


@pytest.mark.parametrize("k", [1, 3])
def test_single_rank_moe_matches_dense_loop_oracle(k: int):
    """EP=1 dispatch vs. a per-token loop over the chosen experts (no sorting tricks)."""
    import torch.nn.functional as Fn
    from ep_cp.moe import MoELayer

    layer = MoELayer(H, F, E, k, layer_index=0, seed=3)
    x, pad = _inputs(0)
    y, _ = layer(x, pad)
    probs = torch.softmax(layer.router(x), -1)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        if pad[t]:
            continue
        p, e = probs[t].topk(k)
        p = p / p.sum()
        for j in range(k):
            h = Fn.gelu(x[t] @ layer.w_in[e[j]]) @ layer.w_out[e[j]]
            ref[t] += p[j] * h
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
