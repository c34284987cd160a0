"""Balanced steps of the EP + CP example: the same gradient, and the run reports compute spread.

* Numerics: balancing only moves documents between replicas and rows inside one global
  batch. The example normalises the distillation loss by the global batch's supervised
  tokens, so with dp = 2 (real gloo processes, real Megatron groups, the real cache and
  collate) the summed gradient of a balanced step equals the unbalanced step's to
  float32 tolerance. The load-balancing (aux) loss is left out (``aux_weight=0``): it
  is a statistic of each replica's own tokens, so it is not invariant to any re-split
  of the global batch, balanced or not.
* The training script with ``--balance`` runs under torchrun and its summary line and
  ``summary.json`` give the fastest and slowest rank's compute time per step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _example_support import EXAMPLES, run_gloo, small_cache_argv

PER_REPLICA = 6


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    import precompute_cache

    out = str(tmp_path_factory.mktemp("balance_cache") / "cache")
    argv = small_cache_argv(out, 48)
    argv[argv.index("--cp") + 1] = "1"  # dp = 2 on the two processes
    torch.set_num_threads(1)
    assert precompute_cache.main(argv) == 0
    return out


def _grad_worker(rank: int, world: int, cache_dir: str) -> dict:
    from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION, KEYS
    from ep_cp.parallel import init_parallel, reduce_gradients
    from ep_cp.step import forward_backward
    from megatron.core import parallel_state as ps
    from train_ep_cp import build_collate, build_parser, build_student

    from te_thd.attention import te_attention_kwargs
    from te_thd.offline_cache import CachedTensorDataset, build_cached_dataloader, read_manifest
    from te_thd.offline_cache.train.sampler import scan_lengths

    manifest = read_manifest(cache_dir, CACHE_NAME, FORMAT_VERSION)
    dataset = CachedTensorDataset(cache_dir, CACHE_NAME, FORMAT_VERSION, KEYS)
    lengths = scan_lengths(dataset, length_key="seq_len")
    ctx = init_parallel(1, 1, "cpu", num_experts=4)
    args = build_parser().parse_args(["--cache-dir", cache_dir])
    out = {}
    try:
        for name, balance in (
            ("unbalanced", {}),
            ("balanced", dict(balance=True, lengths=lengths, attn_scale=64.0)),
        ):
            torch.manual_seed(0)  # the same initial weights for both
            model = build_student(args, manifest, ctx)
            collate = build_collate(128, 1, 0)
            loader = build_cached_dataloader(
                dataset, PER_REPLICA, True, collate, distributed=True, seed=3, **balance
            )
            batch = next(iter(loader))
            kw = te_attention_kwargs(batch, cp_size=1)
            forward_backward(model, batch, kw, ctx, hidden_weight=1.0, aux_weight=0.0)
            dense, expert = model.dense_parameters(), model.expert_parameters()
            reduce_gradients(dense, expert, ctx)
            out[name] = {
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "tokens": sorted(batch["input_ids"][~batch["padding_mask"]].tolist()),
                "rows": int(batch["input_ids"].numel()) // 128,
                "num_seqs": batch["num_seqs"],
            }
    finally:
        ps.destroy_model_parallel()
    return out


def test_balanced_step_has_the_unbalanced_gradient(cache_dir):
    res = run_gloo(2, _grad_worker, cache_dir)
    seqs = {name: sum(r[name]["num_seqs"] for r in res) for name in ("unbalanced", "balanced")}
    assert seqs["unbalanced"] == seqs["balanced"] == 2 * PER_REPLICA  # one global batch
    assert res[0]["balanced"]["rows"] == res[1]["balanced"]["rows"]  # equal rows per replica
    # the same documents overall, but not the same split: the test compares two real splits
    both = {
        name: sorted(x for r in res for x in r[name]["tokens"])
        for name in ("unbalanced", "balanced")
    }
    assert both["unbalanced"] == both["balanced"]
    assert res[0]["unbalanced"]["tokens"] != res[0]["balanced"]["tokens"]
    for rank in res:
        a, b = rank["unbalanced"]["grads"], rank["balanced"]["grads"]
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(b[n], a[n], rtol=2e-5, atol=2e-6, msg=n)


def test_training_with_balance_reports_the_compute_spread(cache_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "train_ep_cp.py"), "--cache-dir", cache_dir, "--out", str(out),
        "--cp", "1", "--ep", "1", "--steps", "4", "--batch-size", "4", "--balance",
        "--log-every", "2", "--save-every", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["balance"] is True
    assert 0 < summary["compute_min_s"] <= summary["compute_max_s"]
    assert "compute per step" in run.stdout and "balanced" in run.stdout
