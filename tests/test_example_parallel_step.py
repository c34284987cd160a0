"""One training step of the EP + CP example is independent of the parallel layout.

Real gloo processes, real Megatron parallel groups, the real cache, collate, THD
attention (reference CP attention over the CP group) and MoE all-to-all:

* CP=2 (each rank holds half of every sequence, dual-chunk layout, documents
  padded to 2*cp) gives the loss and the reduced gradients of CP=1 on the same
  samples (documents not padded), within float32 tolerance -- also with EP=2 on top;
* EP=2 (experts split over the ranks, tokens dispatched with all-to-all) gives the
  loss and gradients of EP=1 for the same data and routing.
"""

from __future__ import annotations

import os

import pytest
import torch
from _example_support import EXAMPLES, run_gloo, small_cache_argv

N_SAMPLES = 6  # samples per data-parallel replica in the step


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    import precompute_cache

    out = str(tmp_path_factory.mktemp("ep_cp_cache") / "cache")
    argv = small_cache_argv(out, 32)
    torch.set_num_threads(1)
    assert precompute_cache.main(argv) == 0
    return out


def _step_worker(rank: int, world: int, cache_dir: str, configs: list) -> dict:
    from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION, KEYS
    from ep_cp.parallel import clip_grad_norm, init_parallel, reduce_gradients
    from ep_cp.step import forward_backward, global_stats
    from megatron.core import parallel_state as ps
    from train_ep_cp import build_collate, build_parser, build_student

    from te_thd.attention import te_attention_kwargs
    from te_thd.offline_cache import CachedTensorDataset, read_manifest

    manifest = read_manifest(cache_dir, CACHE_NAME, FORMAT_VERSION)
    dataset = CachedTensorDataset(cache_dir, CACHE_NAME, FORMAT_VERSION, KEYS)
    out = {}
    for name, cp, ep, same_samples, *extra in configs:
        ctx = init_parallel(cp, ep, "cpu", num_experts=4)
        args = build_parser().parse_args(
            ["--cache-dir", cache_dir, "--cp", str(cp), "--ep", str(ep), *extra]
        )
        model = build_student(args, manifest, ctx)
        first = 0 if same_samples else ctx.dp_rank * N_SAMPLES
        collate = build_collate(128, cp, ctx.cp_rank, args.rows, args.max_num_seqs)
        batch = collate(dataset.__getitems__(list(range(first, first + N_SAMPLES))))
        kw = te_attention_kwargs(batch, cp_size=cp)
        local = forward_backward(model, batch, kw, ctx, hidden_weight=1.0, aux_weight=0.1)
        dense, expert = model.dense_parameters(), model.expert_parameters()
        reduce_gradients(dense, expert, ctx)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = clip_grad_norm(dense, expert, 1e9, ctx)  # huge max: only the global norm
        out[name] = {
            "stats": global_stats(local, norm, ctx),
            "grads": grads,
            "grad_norm": float(norm),
            "ep": ep,
            "dp": ctx.dp_size,
            "ep_rank": ctx.ep_rank,
            "backend": model.blocks[0].attn.last_backend,
            "local_tokens": int(batch["input_ids"].shape[0]),
            "global_tokens": int(batch["cu_seqlens_padded"][-1]),
            "boundaries": tuple(kw["cu_seqlens_q"].shape),
            "max_seqlen": kw["max_seqlen_q"],
        }
        ps.destroy_model_parallel()
    return out


def _assert_same_step(a: dict, ref: dict, num_experts: int = 4) -> None:
    for key in ("loss", "kl", "mse", "aux"):
        assert a["stats"][key] == pytest.approx(ref["stats"][key], rel=1e-5, abs=1e-6), key
    for key in ("supervised_tokens", "tokens"):  # per data-parallel replica
        assert a["stats"][key] / a["dp"] == ref["stats"][key] / ref["dp"], key
    nl = num_experts // a["ep"]
    for name, g in a["grads"].items():
        r = ref["grads"][name]
        if ".moe.w_" in name:  # this rank's expert shard of the full expert stack
            r = r[a["ep_rank"] * nl : (a["ep_rank"] + 1) * nl]
        torch.testing.assert_close(g, r, rtol=2e-4, atol=2e-6, msg=name)
    assert a["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


# cp1_same: CP=1 on both ranks with the SAME samples (2 data-parallel replicas of one
# batch: the gradient sum over DP of loss/(2N) is the single-batch gradient).
# ep1 / ep2: CP=1, each data-parallel replica its own samples.
# cp2_fixed: CP=2 with identical shapes every step (3 packed rows, cu_seqlens padded to
# 9 entries with zero-length sequences); cp2_a2a / cp2_all_gather: TE's other CP
# communication types (the reference moves data the same way).
CONFIGS = [
    ("cp1_same", 1, 1, True),
    ("cp2", 2, 1, True),
    ("cp2_ep2", 2, 2, True),
    ("ep1", 1, 1, False),
    ("ep2", 1, 2, False),
    ("cp2_fixed", 2, 1, True, "--rows", "3", "--max-num-seqs", "8"),
    ("cp2_a2a", 2, 1, True, "--cp-comm-type", "a2a"),
    ("cp2_all_gather", 2, 2, True, "--cp-comm-type", "all_gather"),
]


@pytest.fixture(scope="module")
def steps(cache_dir: str) -> list[dict]:
    """One spawn of 2 gloo ranks runs every layout (Megatron groups rebuilt per layout)."""
    return run_gloo(2, _step_worker, cache_dir, CONFIGS)


def test_cp2_and_cp2_ep2_steps_equal_the_cp1_step(steps: list[dict]):
    for rank in range(2):
        ref = steps[rank]["cp1_same"]
        assert ref["stats"]["supervised_tokens"] > 0 and ref["grad_norm"] > 0
        for name in ("cp2", "cp2_ep2"):
            got = steps[rank][name]
            assert got["backend"] == "reference"
            # really sharded: each CP rank holds half of the (global) packed stream
            assert got["local_tokens"] * 2 == got["global_tokens"]
            _assert_same_step(got, ref)


def test_fixed_shapes_and_other_cp_comm_types_give_the_cp1_step(steps: list[dict]):
    for rank in range(2):
        ref = steps[rank]["cp1_same"]
        fixed = steps[rank]["cp2_fixed"]
        assert fixed["boundaries"] == (9,) and fixed["max_seqlen"] == 3 * 128
        assert fixed["local_tokens"] * 2 == fixed["global_tokens"] == 3 * 128
        for name in ("cp2_fixed", "cp2_a2a", "cp2_all_gather"):
            _assert_same_step(steps[rank][name], ref)


def test_ep2_step_equals_ep1_step(steps: list[dict]):
    for rank in range(2):
        _assert_same_step(steps[rank]["ep2"], steps[rank]["ep1"])
    # different samples per data-parallel replica, yet one reduced gradient
    torch.testing.assert_close(
        steps[0]["ep2"]["grads"]["embed.weight"], steps[1]["ep2"]["grads"]["embed.weight"]
    )
    assert steps[0]["ep2"]["stats"]["loss"] != steps[0]["cp1_same"]["stats"]["loss"]


def test_training_refuses_a_cache_packed_for_another_cp_size(cache_dir: str):
    from train_ep_cp import build_parser, open_cache

    from te_thd.offline_cache import ManifestError

    args = build_parser().parse_args(["--cache-dir", cache_dir, "--cp", "1"])
    with pytest.raises(ManifestError, match=r"was built with cp_size=2.*the run sets cp_size=1"):
        open_cache(args, 1)
    manifest, seq_len = open_cache(args, 2)
    assert seq_len == 128 and manifest["pad_to_multiple_of"] == 4


def test_examples_dir_is_importable():
    assert os.path.isdir(EXAMPLES / "ep_cp")
