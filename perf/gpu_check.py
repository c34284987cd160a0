"""GPU validation of te_thd's CUDA path, in one command (CI runs its ``--dry-run``).

    python perf/gpu_check.py              # on a CUDA machine, < 5 min on one GPU
    python perf/gpu_check.py --dry-run    # anywhere: the same plumbing, CPU-sized

What the CUDA run checks, and writes to ``perf/results/gpu_check-cuda.json``:

1. **numerics** (:mod:`gpu_check_attention`): te_thd's reference THD attention vs
   ``torch.nn.attention.varlen.varlen_attn`` fed by ``torch_varlen_kwargs`` on >= 100
   random layouts without padding between sequences, and vs TE ``DotProductAttention``
   fed by ``te_attention_kwargs`` (when ``transformer_engine`` imports) on those and on
   layouts with padding between sequences -- bf16 and fp16, causal, MHA and GQA,
   output and q/k/v gradients, each against a float64 reference on the same inputs,
   next to the reference's own low-precision error. Tolerances:
   :data:`gpu_check_attention.TOLERANCES` (bf16 out 2e-2 / grads 5e-2, fp16 out 1e-2 /
   grads 2e-2, as ``atol = rtol``). A non-causal kernel must fail them (negative control).
2. **sync-freedom** (:mod:`gpu_check_step`): after warm-up, a whole training step of
   the example's student (cached loader batch -> THD -> CP shard at cp=1 -> forward /
   backward / clip / AdamW) under ``torch.cuda.set_sync_debug_mode``: the list of
   synchronising calls with their source lines (``"warn"``) and the first one
   (``"error"``); and the te_thd path alone (loader -> kwargs -> device -> attention
   forward + backward), which must have none.
3. **speed**: THD collate and host-to-device time per batch as a fraction of the step
   time; cached-loader throughput into pinned memory for 0 and 4 workers.

The dry run builds the same random layouts, runs the reference in float64 / float32 /
bf16 / fp16 and a low-precision stand-in kernel against the same tolerance table (and
the negative control), binds the adapters' kwargs to the installed ``varlen_attn``
signature and to TE's forward parameters, produces a small cache, runs the training
step at cp=1 on the CPU (float32) with a prediction of its CUDA syncs, measures the
same speed fractions, writes ``perf/results/gpu_check-dry-run.json`` and prints the
CUDA plan. Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA without
``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from gpu_check_attention import (
    TOLERANCES,
    LayoutSpec,
    NumericsPlan,
    TeKernel,
    naive_lowp_attention,
    naive_lowp_noncausal,
    reference_fixed_shape,
    run_numerics,
    te_import_status,
    varlen_attention,
    varlen_attention_noncausal,
)
from gpu_check_step import StepPlan, run_step_checks

PERF = Path(__file__).resolve().parent
REPO = PERF.parent

FORMAT_VERSION = 1


def numerics_plan(dry_run: bool, seed: int, te: bool) -> NumericsPlan:
    if dry_run:
        spec = LayoutSpec(
            row_lens=(16, 32, 64),
            max_tokens=128,
            max_docs_per_row=6,
            heads=((2, 2, 8), (4, 2, 8), (4, 1, 16)),
            pad_multiples=(2, 4),
        )
        return NumericsPlan(6, 3, ("bfloat16", "float16"), spec, seed, time_budget_s=60.0)
    spec = LayoutSpec(
        row_lens=(128, 256, 512, 1024, 2048, 4096),
        max_tokens=8192,
        max_docs_per_row=24,
        heads=((8, 8, 64), (16, 16, 128), (8, 2, 64), (16, 4, 128), (32, 8, 64), (4, 1, 128)),
        pad_multiples=(2, 4, 8, 16),
    )
    return NumericsPlan(
        120, 60 if te else 40, ("bfloat16", "float16"), spec, seed, time_budget_s=200.0
    )


def step_plan(dry_run: bool, seed: int) -> StepPlan:
    if dry_run:
        return StepPlan(
            num_samples=48,
            min_len=4,
            max_len=40,
            shard_size=16,
            pack_seq_len=64,
            batch_size=8,
            topk=4,
            target={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64},
            student={
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "num_experts": 4,
                "router_topk": 2,
                "expert_ffn_size": 32,
                "target_hidden_size": 32,
            },
            warmup_steps=1,
            timed_steps=2,
            loader_workers=(0, 1),
            step_workers=0,
            loader_batches=3,
            mp_context="forkserver",
            bf16_autocast=False,
            seed=seed,
        )
    return StepPlan(
        num_samples=1024,
        min_len=64,
        max_len=1024,
        shard_size=128,
        pack_seq_len=4096,
        batch_size=32,
        topk=8,
        target={"hidden_size": 256, "num_layers": 2, "num_heads": 4, "ffn_size": 512},
        student={
            "hidden_size": 1024,
            "num_layers": 4,
            "num_heads": 8,
            "num_experts": 8,
            "router_topk": 2,
            "expert_ffn_size": 2048,
            "target_hidden_size": 256,
        },
        warmup_steps=3,
        timed_steps=10,
        loader_workers=(0, 4),
        step_workers=4,
        loader_batches=24,
        # The parent holds a CUDA context: workers must not be forked from it.
        mp_context="forkserver",
        bf16_autocast=True,
        seed=seed,
    )


def describe(
    nplan: NumericsPlan, splan: StepPlan, kernels: dict[str, list[str]], backend: str
) -> list[str]:
    """Human-readable lines of what a run does."""
    s = nplan.spec
    n_nopad, n_pad = nplan.layouts_without_padding, nplan.layouts_with_padding
    return [
        f"numerics: {n_nopad} layouts without padding between sequences x {len(nplan.dtypes)} dtypes "
        f"{list(nplan.dtypes)} -> kernels {kernels['without_padding']}",
        f"          {n_pad} layouts with padding between sequences (PackingCollator, pad multiples "
        f"{list(s.pad_multiples)}) -> kernels {kernels['with_padding']} (causal; the varlen adapter "
        "must refuse them bidirectional)",
        f"          rows S in {list(s.row_lens)}, <= {s.max_tokens} tokens, heads (H, H_kv, D) in "
        f"{[list(h) for h in s.heads]}, causal, fwd + bwd vs float64 reference; tolerances "
        + ", ".join(
            f"{k}: out {v['fwd'][0]:g} grads {v['bwd'][0]:g}" for k, v in TOLERANCES.items()
        ),
        "          negative control: non-causal kernel on causal data must fail the tolerance",
        f"step:     cache of {splan.num_samples} samples ({splan.min_len}..{splan.max_len} tokens, "
        f"target {splan.target}), rows of {splan.pack_seq_len}, {splan.batch_size} samples/step",
        f"          student {splan.student}, attention backend '{backend}', "
        f"{'bf16 autocast' if splan.bf16_autocast else 'float32'}, {splan.warmup_steps} warm-up steps",
        "          sync: whole step + te_thd path (loader -> kwargs -> device -> attention fwd/bwd) "
        'under torch.cuda.set_sync_debug_mode("warn") then ("error")',
        f"          speed: {splan.timed_steps} steps (collate, H2D of a pinned batch, step), loader "
        f"throughput with {list(splan.loader_workers)} workers ({splan.mp_context}), pin_memory",
    ]


def machine_info(device: torch.device, te_status: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "transformer_engine": te_status,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_GiB=round(props.total_memory / 2**30, 1),
        )
    return info


def git_info() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "te_thd", "perf", "examples"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except Exception:  # not a git checkout (e.g. a copied tree on the GPU machine)
        return {"commit": None, "dirty": None}


def _strict(obj: Any) -> Any:
    """JSON-safe copy: floats to 4 significant digits, non-finite ones as strings ("inf")."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}") if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


def _atomic_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_strict(obj), indent=1, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    """The printed summary: everything but the per-case arrays."""
    out = {k: v for k, v in report.items() if k not in ("numerics", "step")}
    if isinstance(report.get("numerics"), dict):
        out["numerics"] = {
            k: v for k, v in report["numerics"].items() if k not in ("cases", "plan")
        }
    if isinstance(report.get("step"), dict):
        out["step"] = {k: v for k, v in report["step"].items() if k != "plan"}
    return out


def run(
    dry_run: bool,
    out_path: Path | None,
    seed: int,
    overrides: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], int]:
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    te_status = te_import_status()
    te = bool(te_status.get("available")) and cuda
    mode = "cuda" if cuda else "dry-run"
    backend = ("te" if te else "varlen") if cuda else "reference"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    nplan, splan = numerics_plan(not cuda, seed, te), step_plan(not cuda, seed)
    for key, value in (overrides or {}).items():
        if value is not None:
            setattr(nplan, key, value)
    if cuda:
        te_kernels = {"te": TeKernel(), "te_fixed_shape": TeKernel(fixed_shape=True)} if te else {}
        kernels_nopad = {"varlen_attn": varlen_attention, **te_kernels}
        # Causal varlen over padding between sequences runs on cu_seqlens_padded.
        kernels_pad = {"varlen_attn": varlen_attention, **te_kernels}
        negative = ("varlen_attn_noncausal", varlen_attention_noncausal)
    else:
        stand_ins = {
            "stand_in_naive_lowp": naive_lowp_attention,
            "stand_in_fixed_shape": reference_fixed_shape,
        }
        kernels_nopad = dict(stand_ins)
        kernels_pad = dict(stand_ins)
        negative = ("stand_in_noncausal", naive_lowp_noncausal)

    report: dict[str, Any] = {
        "tool": "perf/gpu_check.py",
        "format_version": FORMAT_VERSION,
        "mode": mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_info(),
        "machine": machine_info(device, te_status),
        "tolerances": {
            "gate": "|x - gold| <= atol + rtol*|gold| at every real token slot, gold = float64 reference on the same (rounded) inputs",
            "values": {
                k: {p: {"atol": a, "rtol": r} for p, (a, r) in v.items()}
                for k, v in TOLERANCES.items()
            },
            "justification": "reported next to the reference's own low-precision error (ref_lowp) and an "
            "all-low-precision per-sequence implementation (naive_lowp); a non-causal kernel must fail",
        },
    }
    lines = describe(
        nplan,
        splan,
        {"without_padding": sorted(kernels_nopad), "with_padding": sorted(kernels_pad)},
        backend,
    )
    if not cuda:
        cuda_te = True
        cplan_n, cplan_s = numerics_plan(False, seed, cuda_te), step_plan(False, seed)
        cuda_lines = describe(
            cplan_n,
            cplan_s,
            {
                "without_padding": ["te (if it imports)", "varlen_attn"],
                "with_padding": ["te (if it imports)", "varlen_attn"],
            },
            "te, or varlen_attn when TE does not import",
        )
        print("On a CUDA machine `python perf/gpu_check.py` runs:")
        for ln in cuda_lines:
            print("  " + ln)
        print("This dry run (CPU, stand-in kernels, same plumbing):")
        report["cuda_plan"] = {
            "numerics": {**asdict(cplan_n), "spec": asdict(cplan_n.spec)},
            "step": asdict(cplan_s),
            "description": cuda_lines,
        }
    else:
        print(f"GPU check on {report['machine'].get('gpu')} (TE: {te_status}):")
    for ln in lines:
        print("  " + ln)
    sys.stdout.flush()

    failures: list[str] = []
    t0 = time.perf_counter()
    try:
        log("numerics ...")
        num = run_numerics(nplan, device, kernels_nopad, kernels_pad, negative, log, te_status)
        report["numerics"] = num
        failures += num["failures"] + num["layout_errors"]
        if cuda and num["counts"]["layouts_without_padding"] < 100:
            failures.append(
                f"numerics: only {num['counts']['layouts_without_padding']} layouts without padding ran (need >= 100)"
            )
    except Exception:
        failures.append("numerics crashed: " + traceback.format_exc(limit=8))
    try:
        log("training step ...")
        with tempfile.TemporaryDirectory(prefix="te_thd_gpu_check_") as work:
            step = run_step_checks(splan, device, backend, work, log)
        report["step"] = step
        if not step["losses_finite"]:
            failures.append(f"step: non-finite loss (final {step['final_loss']})")
        if cuda:
            if not step["sync"]["ok"]:
                failures.append(
                    "sync: the te_thd path synchronises or the warn/error modes disagree: "
                    + json.dumps(
                        step["sync"]["te_thd_offenders"] or step["sync"]["attention_path"]
                    )[:2000]
                )
            if not step["pinned_ok"]:
                failures.append("loader: batches were not in pinned memory")
    except Exception:
        failures.append("step crashed: " + traceback.format_exc(limit=8))

    report["failures"] = failures
    report["ok"] = not failures
    report["seconds"] = round(time.perf_counter() - t0, 1)
    path = out_path or PERF / "results" / f"gpu_check-{mode}.json"
    _atomic_json(path, report)
    report["json"] = str(path)
    print(json.dumps(_strict(summary_of(report)), indent=1, default=str))
    print(
        f"{'OK' if report['ok'] else 'FAILED'}: {mode} check in {report['seconds']} s; JSON at {path}"
    )
    return report, 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU-sized plumbing run with stand-in kernels (no CUDA needed)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: perf/results/gpu_check-<mode>.json)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", type=int, default=None, help="layouts without padding (CUDA: 120)")
    ap.add_argument(
        "--padded-layouts", type=int, default=None, help="layouts with padding (CUDA: 60 with TE)"
    )
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds for the numerics (CUDA: 200)"
    )
    args = ap.parse_args(argv)
    for name in ("layouts", "padded_layouts", "time_budget"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}={v} must be >= 1")
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "error: no CUDA device (torch.cuda.is_available() is False); run on a GPU machine, "
            "or pass --dry-run to exercise the script on the CPU",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        # Tiny tensors: one thread avoids oversubscribing a shared CI runner (10x here).
        torch.set_num_threads(1)
    overrides = {
        "layouts_without_padding": args.layouts,
        "layouts_with_padding": args.padded_layouts,
        "time_budget_s": args.time_budget,
    }
    _, code = run(args.dry_run, args.out, args.seed, overrides)
    return code


if __name__ == "__main__":
    sys.exit(main())
