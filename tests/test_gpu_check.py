"""``perf/gpu_check.py --dry-run`` keeps the GPU validation script runnable without a GPU.

The dry run is a real subprocess (the same command CI runs): it builds the random
layouts, runs the reference attention in float64 / float32 / bf16 / fp16, gates a
low-precision stand-in kernel with the tolerance table (and a non-causal negative
control that must fail it), binds the adapters' kwargs to the installed
``varlen_attn`` signature, produces a cache, trains one step of the example's student
at cp=1 and writes the JSON this test reads. The smaller tests pin the pieces whose
CUDA use cannot run here: the tolerance gate, the sync-warning collector and the CPU
sync prediction.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

import gpu_check_attention as gca  # noqa: E402
import gpu_check_step as gcs  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "dry.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "perf" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "On a CUDA machine" in proc.stdout  # the CUDA plan is printed
    return json.loads(out.read_text())


def test_dry_run_json(dry_run: dict) -> None:
    r = dry_run
    assert r["mode"] == "dry-run" and r["ok"] is True and r["failures"] == []
    assert r["tolerances"]["values"]["bfloat16"]["fwd"] == {"atol": 2e-2, "rtol": 2e-2}
    assert set(r["tolerances"]["values"]) == {"bfloat16", "float16"}

    # What the GPU run would do: >= 100 layouts without padding, both dtypes, TE padded layouts.
    cp = r["cuda_plan"]["numerics"]
    assert cp["layouts_without_padding"] >= 100 and cp["layouts_with_padding"] > 0
    assert set(cp["dtypes"]) == {"bfloat16", "float16"}

    n = r["numerics"]
    assert n["ok"] and n["counts"]["layouts_without_padding"] == 6
    assert n["counts"]["layouts_with_padding"] == 3 and n["counts"]["gqa_cases"] > 0
    # every padded layout really has padding between sequences, and the varlen adapter refuses it
    assert n["varlen_refuses_bidirectional_padding"] == {"checked": 3, "refused": 3}
    assert n["negative_control"]["detected"] and n["negative_control"]["worst_ratio"] > 1.0
    assert set(n["signatures"]["varlen_attn"]["bound"]) == {
        "cu_seq_q",
        "cu_seq_k",
        "max_q",
        "max_k",
        "window_size",
        "scale",
        "enable_gqa",
    }
    assert {"pad_between_seqs", "max_seqlen_q", "cu_seqlens_q_padded"} <= set(
        n["signatures"]["te_forward"]["bound"]
    )
    assert {c["layout"]["kind"] for c in n["cases"]} == {"nopad", "pad"}
    assert all(c["pad_between_seqs"] == (c["layout"]["kind"] == "pad") for c in n["cases"])
    for case in n["cases"]:
        e = case["errors"]
        for impl in ("ref_lowp", "naive_lowp", "stand_in_naive_lowp"):
            assert gca.worst_ratio(e[impl]) <= 1.0, (impl, case["layout"])
        # low precision really was low, float32 really was float32
        assert e["ref_lowp"]["out"]["max_abs"] > 1e-5 > e["ref_fp32"]["out"]["max_abs"]
    summ = n["summary"]["bfloat16"]
    assert summ["stand_in_naive_lowp"]["passed"] == summ["stand_in_naive_lowp"]["cases"] == 9

    s = r["step"]
    assert s["losses_finite"] and s["backend"] == "reference"
    found = s["sync"]["whole_step"]["predicted_offenders"]
    assert found, "the reference attention reads its windows on the host: the scan must see it"
    for o in found:
        assert o["category"] in ("cpu_stand_in", "model", "model_step", "other"), o
        if o["where"].startswith("te_thd/attention/reference.py"):
            assert o["category"] == "cpu_stand_in"
    sp = s["speed"]
    assert sp["step_s"] > 0 and sp["thd_collate_s"] > 0 and 0 < sp["thd_collate_fraction_of_step"]
    assert [x["workers"] for x in s["loader"]] == [0, 1]
    assert all(x["samples_per_s"] > 0 for x in s["loader"])


def test_tolerance_gate_can_fail() -> None:
    gold = torch.tensor([[1.0, -2.0], [0.5, 0.0]], dtype=torch.float64)
    real = torch.tensor([True, True])
    atol, rtol = gca.TOLERANCES["bfloat16"]["fwd"]
    inside = gold + 0.9 * (atol + rtol * gold.abs())
    outside = gold.clone()
    outside[1, 1] += 1.1 * atol  # one element just outside
    assert gca.error_stats(inside, gold, real, atol, rtol)["ratio"] <= 1.0
    assert gca.error_stats(outside, gold, real, atol, rtol)["ratio"] > 1.0
    # padding slots are not compared
    assert gca.error_stats(outside, gold, torch.tensor([True, False]), atol, rtol)["ratio"] <= 1.0
    assert gca.error_stats(gold * float("nan"), gold, real, atol, rtol)["ratio"] == float("inf")


def _emits_sync_warning() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    warnings.warn("an unrelated warning", UserWarning, stacklevel=1)


def test_sync_warning_collector_locates_the_caller() -> None:
    found: list[dict[str, str]] = []
    with gcs.collect_sync_warnings(found):
        _emits_sync_warning()
        _emits_sync_warning()
    assert len(found) == 2  # "always": repeated syncs at one line all count; others ignored
    assert found[0]["where"].startswith("tests/test_gpu_check.py:")
    assert "_emits_sync_warning" in found[0]["where"]


def _host_reads() -> None:
    x = torch.arange(6)
    x.tolist()
    int(x[0])
    x.nonzero()
    torch.bincount(x)
    x.repeat_interleave(x, output_size=15)  # with output_size: no sync


def test_cpu_sync_prediction_lists_host_reads() -> None:
    original = torch.Tensor.tolist
    found = gcs.predicted_sync_offenders(_host_reads)
    ops = {o["op"] for o in found}
    assert ops == {
        ".tolist()",
        ".item() / int() / bool() of a tensor",
        "nonzero",
        "bincount (reads max)",
    }
    assert all(o["where"].startswith("tests/test_gpu_check.py:") for o in found)
    assert torch.Tensor.tolist is original  # the instrumentation is undone
    assert torch.arange(2).tolist() == [0, 1]
