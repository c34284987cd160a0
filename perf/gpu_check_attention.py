"""Attention numerics of ``perf/gpu_check.py``: random THD layouts, kernels vs references.

For every random layout (built by te_thd's own packers and converted with
``process_input_for_thd``), q/k/v and an output gradient are drawn in float32,
rounded once to the low precision under test (bf16 or fp16), and run through:

- ``gold``: ``thd_attention_reference`` in float64 on the rounded inputs (the oracle);
- ``ref_fp32`` / ``ref_lowp``: the same reference in float32 / in the low precision
  (it accumulates in float32 and rounds its result: the floor any kernel is held to);
- ``naive_lowp``: a per-sequence implementation doing every matmul and the softmax in
  the low precision (the kind of reference flash-attn's own tests measure kernels
  against -- and the CPU stand-in for a kernel in the dry run);
- the kernels: ``torch.nn.attention.varlen.varlen_attn`` with
  ``torch_varlen_kwargs(thd)`` (layouts without padding between sequences) and TE
  ``DotProductAttention`` through ``ThdAttention(backend="te")`` with
  ``te_attention_kwargs(thd)`` (every layout, incl. padding between sequences).

Errors are measured against ``gold`` over the real token slots (``~padding_mask``;
the output gradient is zero on padding slots, as a loss mask makes it) for the
output and the q/k/v gradients. A case passes when every element satisfies
``|x - gold| <= atol + rtol * |gold|`` (:data:`TOLERANCES`); the reported ``ratio``
is the largest ``|x - gold| / (atol + rtol * |gold|)``, so ``ratio <= 1`` passes.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from te_thd.attention import (
    ThdAttention,
    VarlenLayoutError,
    te_attention_kwargs,
    thd_attention_reference,
    torch_varlen_kwargs,
)
from te_thd.packing import PackingCollator
from te_thd.thd_utils import process_input_for_thd

#: ``dtype -> {"fwd": (atol, rtol), "bwd": (atol, rtol)}`` for ``|x - gold| <= atol + rtol*|gold|``.
#: Inputs are N(0, 1), so outputs and gradients are O(1). bf16 keeps 8 significant
#: bits (unit roundoff 2**-9 ~ 2e-3), fp16 11 bits (2**-12 ~ 2.4e-4): a fused kernel
#: rounds the softmax probabilities to that precision before the P @ V matmul and
#: the backward rounds dS once more, so the bounds are ~10x (forward) and ~25x
#: (gradients) the unit roundoff. The dry run checks they hold with headroom for an
#: implementation that does *every* step in low precision (``naive_lowp``), and a
#: negative control (a non-causal kernel on causal data) must fail them.
TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    "bfloat16": {"fwd": (2e-2, 2e-2), "bwd": (5e-2, 5e-2)},
    "float16": {"fwd": (1e-2, 1e-2), "bwd": (2e-2, 2e-2)},
}

#: What TE's ``DotProductAttention.forward`` accepts (TransformerEngine main,
#: ``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``),
#: checked against ``te_attention_kwargs`` when TE cannot be imported; with TE the real
#: signature is bound instead.
TE_FORWARD_PARAMS = (
    "query_layer",
    "key_layer",
    "value_layer",
    "attention_mask",
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "attn_mask_type",
    "window_size",
    "checkpoint_core_attention",
    "core_attention_bias_type",
    "core_attention_bias",
    "alibi_slopes",
    "fast_zero_fill",
    "inference_params",
    "pad_between_seqs",
)

TENSORS = ("out", "dq", "dk", "dv")


# -- layouts --------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutSpec:
    """Sizes the layout generator draws from."""

    row_lens: tuple[int, ...]  # S candidates
    max_tokens: int  # B * S cap
    max_docs_per_row: int
    heads: tuple[tuple[int, int, int], ...]  # (H, H_kv, D) candidates, GQA among them
    pad_multiples: tuple[int, ...]  # per-document pad multiples of the padded layouts


def _sentinel_rows(rows: list[list[int]], pad: int = -1000) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def _composition(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """``parts`` positive ints summing to ``total`` (uniform cut points)."""
    parts = max(1, min(parts, total))
    cuts = (
        np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else []
    )
    edges = [0, *(int(c) for c in cuts), total]
    return [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]


def layout_without_padding(rng: np.random.Generator, spec: LayoutSpec) -> dict[str, Any]:
    """A packed BSHD batch whose THD form has no padding between sequences.

    Every row but the last is filled exactly by its documents; the last row may end in
    a tail pad, which ``process_input_for_thd`` absorbs into the last sequence (the
    causal fast path). Sequence lengths range from 1 token to a whole row.
    """
    s = int(rng.choice(spec.row_lens))
    b = int(rng.integers(1, max(1, spec.max_tokens // s) + 1))
    rows = []
    for i in range(b):
        fill = s if i < b - 1 else int(rng.integers(1, s + 1))
        mode = rng.random()
        # a whole-row sequence, a few long ones, or many short ones
        parts = 1 if mode < 0.15 else int(rng.integers(1, spec.max_docs_per_row + 1))
        rows.append(_composition(rng, fill, parts))
    lens = _sentinel_rows(rows)
    return {
        "input_ids": torch.zeros(b, s, dtype=torch.int64),
        "position_ids": torch.zeros(b, s, dtype=torch.int64),
        "seq_lens": lens,
        "seq_lens_padded": lens.clone(),
    }


def layout_with_padding(rng: np.random.Generator, spec: LayoutSpec) -> dict[str, Any]:
    """A batch packed by ``te_thd.packing.PackingCollator`` with per-document padding.

    Documents of random length are padded to a multiple of ``m`` (as for CP) and packed
    first-fit-decreasing into rows whose unused tails stay padding, so the THD layout
    has padding between sequences (``pad_between_seqs`` True).
    """
    for _ in range(20):  # a draw whose padding all ends up in the absorbed tail is redrawn
        m = int(rng.choice(spec.pad_multiples))
        s = int(rng.choice([r for r in spec.row_lens if r % m == 0] or [m * 8]))
        budget = int(rng.integers(s // 2, spec.max_tokens + 1))
        docs: list[int] = []
        while sum(docs) < budget * 0.8:
            docs.append(int(rng.integers(1, s - m + 2)))
        packer = PackingCollator(s, pad_to_multiple_of=m, label_key=None)
        # A document whose padded span exceeds S is impossible here: len <= S - m + 1.
        packed = packer([{"input_ids": torch.ones(n, dtype=torch.int64)} for n in docs])
        batch = {k: packed[k] for k in ("input_ids", "position_ids", "seq_lens", "seq_lens_padded")}
        if process_input_for_thd(batch)["pad_between_seqs"]:
            break
    return batch


def draw_heads(rng: np.random.Generator, spec: LayoutSpec, gqa: bool) -> tuple[int, int, int]:
    pool = [h for h in spec.heads if (h[0] != h[1]) == gqa] or list(spec.heads)
    return pool[int(rng.integers(len(pool)))]


# -- implementations -----------------------------------------------------------------


AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
) -> torch.Tensor:
    """``thd_attention_reference(q, k, v, **te_attention_kwargs(thd))`` -> ``[T, H, D]``."""
    kw = te_attention_kwargs(thd, device=q.device)
    return thd_attention_reference(q, k, v, **kw)


def naive_lowp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
) -> torch.Tensor:
    """Per-sequence causal attention with every matmul and the softmax in ``q.dtype``.

    Follows TE's THD semantics (sequence ``i`` starts at ``cu_seqlens_padded[i]``, its
    first ``cu_seqlens[i+1]-cu_seqlens[i]`` slots are real, everything else outputs
    zero). A loop over sequences: a test oracle, not a hot path.
    """
    cu = thd["cu_seqlens"].tolist()
    cup = thd["cu_seqlens_padded"].tolist()
    h, hkv = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    pieces = []
    for i in range(len(cu) - 1):
        n, s = cu[i + 1] - cu[i], cup[i]
        if n == 0:
            continue
        qi = q[s : s + n].transpose(0, 1)  # [H, n, D]
        ki = k[s : s + n].transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        vi = v[s : s + n].transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        scores = (qi @ ki.transpose(1, 2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        p = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        pieces.append((s, n, (p @ vi).transpose(0, 1)))
    if pieces:
        idx = torch.cat([torch.arange(s, s + n, device=q.device) for s, n, _ in pieces])
        out = out.index_copy(0, idx, torch.cat([o for _, _, o in pieces]))
    return out


def _varlen_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any], causal: bool
) -> torch.Tensor:
    """``varlen_attn(q, k, v, **torch_varlen_kwargs(thd))``; where the installed
    ``varlen_attn`` has no ``enable_gqa`` (torch 2.11), GQA runs on repeated k/v heads,
    as ``torch_varlen_kwargs``'s refusal tells a user to."""
    from torch.nn.attention.varlen import varlen_attn

    gqa = q.shape[1] != k.shape[1]
    if gqa and "enable_gqa" not in inspect.signature(varlen_attn).parameters:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        gqa = False
    kw = torch_varlen_kwargs(thd, enable_gqa=gqa, device=q.device)
    if not causal:  # the layout's own boundaries, attended both ways
        kw["window_size"] = (-1, -1)
    return varlen_attn(q, k, v, **kw)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
) -> torch.Tensor:
    """torch's FlashAttention varlen kernel fed by ``torch_varlen_kwargs(thd)`` (CUDA only)."""
    return _varlen_call(q, k, v, thd, causal=True)


def varlen_attention_noncausal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
) -> torch.Tensor:
    """Negative control: the varlen kernel without the causal mask (must fail the tolerance)."""
    return _varlen_call(q, k, v, thd, causal=False)


def naive_lowp_noncausal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
) -> torch.Tensor:
    """Negative control on the CPU: bidirectional attention inside each sequence."""
    cu = thd["cu_seqlens"].tolist()
    cup = thd["cu_seqlens_padded"].tolist()
    h, hkv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    for i in range(len(cu) - 1):
        n, s = cu[i + 1] - cu[i], cup[i]
        if n == 0:
            continue
        qi = q[s : s + n].transpose(0, 1)
        ki = k[s : s + n].transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        vi = v[s : s + n].transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi)
        out = out.index_copy(0, torch.arange(s, s + n, device=q.device), o.transpose(0, 1))
    return out


#: Extra zero-length sequences the fixed-shape (CUDA-graph) form appends to a layout.
FIXED_SHAPE_EXTRA_SEQS = 4


def fixed_shape_kwargs(thd: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``te_attention_kwargs`` in the fixed-shape form: boundaries padded with
    :data:`FIXED_SHAPE_EXTRA_SEQS` zero-length sequences, ``max_seqlen`` = the stream."""
    return dict(
        te_attention_kwargs(
            thd, device=device, max_num_seqs=thd["num_seqs"] + FIXED_SHAPE_EXTRA_SEQS
        )
    )


def reference_fixed_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
) -> torch.Tensor:
    """The reference on the fixed-shape kwargs (the dry run's stand-in for TE on them)."""
    return thd_attention_reference(q, k, v, **fixed_shape_kwargs(thd, q.device))


class TeKernel:
    """TE ``DotProductAttention`` via ``ThdAttention(backend="te")``, one module per head shape.

    ``fixed_shape``: call it with :func:`fixed_shape_kwargs` (zero-length trailing
    sequences; TE >= 2.18 takes them) instead of the plain kwargs.
    """

    def __init__(self, fixed_shape: bool = False) -> None:
        self._mods: dict[tuple[int, int, int], ThdAttention] = {}
        self.fixed_shape = fixed_shape

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: dict[str, Any]
    ) -> torch.Tensor:
        key = (q.shape[1], k.shape[1], q.shape[2])
        if key not in self._mods:
            self._mods[key] = ThdAttention(
                q.shape[1], q.shape[2], num_gqa_groups=k.shape[1], backend="te"
            )
        mod = self._mods[key]
        kw = (
            fixed_shape_kwargs(thd, q.device)
            if self.fixed_shape
            else te_attention_kwargs(thd, device=q.device)
        )
        out = mod(q, k, v, kw)  # [T, H*D]
        if mod.last_backend != "te":
            raise RuntimeError(
                f"ThdAttention ran {mod.last_backend!r}, not TE, on {q.device} input"
            )
        return out.reshape(q.shape[0], q.shape[1], v.shape[2])


def te_import_status() -> dict[str, Any]:
    """Whether ``transformer_engine.pytorch`` imports here, and its version."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a broken CUDA/cuDNN install
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    return {"available": True, "version": getattr(transformer_engine, "__version__", "?")}


def check_kwarg_signatures(thd: dict[str, Any], te_status: dict[str, Any]) -> dict[str, Any]:
    """Bind the adapters' kwargs to the kernels' real signatures (no kernel launch).

    ``torch_varlen_kwargs`` against ``varlen_attn`` of the installed torch; and
    ``te_attention_kwargs`` against TE's ``DotProductAttention.forward`` when TE
    imports, else against :data:`TE_FORWARD_PARAMS`.
    """
    from torch.nn.attention.varlen import varlen_attn

    q = torch.zeros(thd["input_ids"].shape[0], 2, 8)
    out: dict[str, Any] = {}
    vkw = torch_varlen_kwargs(thd)
    inspect.signature(varlen_attn).bind(q, q, q, **vkw)  # raises TypeError on a mismatch
    out["varlen_attn"] = {"bound": sorted(vkw), "signature": str(inspect.signature(varlen_attn))}
    tkw = dict(te_attention_kwargs(thd))
    if te_status.get("available"):
        import transformer_engine.pytorch as te

        sig = inspect.signature(te.DotProductAttention.forward)
        sig.bind(None, q, q, q, **tkw)
        out["te_forward"] = {"bound": sorted(tkw), "against": "installed TE signature"}
    else:
        unknown = sorted(set(tkw) - set(TE_FORWARD_PARAMS))
        if unknown:
            raise TypeError(f"te_attention_kwargs produced {unknown}, not parameters of TE forward")
        out["te_forward"] = {
            "bound": sorted(tkw),
            "against": "TE_FORWARD_PARAMS (TE not importable)",
        }
    return out


# -- measurement --------------------------------------------------------------------------


def fwd_bwd(
    fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    thd: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """Output and q/k/v gradients of ``fn`` for the output gradient ``dout``."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v, thd)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def error_stats(
    x: torch.Tensor, gold: torch.Tensor, real: torch.Tensor, atol: float, rtol: float
) -> dict[str, float]:
    """Max abs error, max error relative to ``max|gold|``, and the allclose ratio, over real slots."""
    xs, gs = x[real].double(), gold[real].double()
    if gs.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "ratio": 0.0}
    err = (xs - gs).abs()
    if not bool(torch.isfinite(xs).all()):
        return {"max_abs": math.inf, "max_rel": math.inf, "ratio": math.inf}
    scale = float(gs.abs().max())
    return {
        "max_abs": float(err.max()),
        "max_rel": float(err.max()) / max(scale, 1e-30),
        "ratio": float((err / (atol + rtol * gs.abs())).max()),
    }


def compare(
    results: dict[str, dict[str, torch.Tensor]],
    gold: dict[str, torch.Tensor],
    real: torch.Tensor,
    dtype_name: str,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{impl: {tensor: error_stats}}`` against the float64 gold."""
    tol = TOLERANCES.get(dtype_name, TOLERANCES["bfloat16"])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for impl, res in results.items():
        out[impl] = {}
        for t in TENSORS:
            atol, rtol = tol["fwd"] if t == "out" else tol["bwd"]
            out[impl][t] = error_stats(res[t], gold[t], real, atol, rtol)
    return out


def worst_ratio(errs: dict[str, dict[str, float]]) -> float:
    return max(e["ratio"] for e in errs.values())


@dataclass
class NumericsPlan:
    """How many cases of each kind, and their sizes."""

    layouts_without_padding: int
    layouts_with_padding: int
    dtypes: tuple[str, ...]
    spec: LayoutSpec
    seed: int
    time_budget_s: float


def _draw_inputs(
    seed: int,
    t: int,
    h: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    padding: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """q ``[T,H,D]``, k/v ``[T,H_kv,D]``, dout ``[T,H,D]`` (zero on padding): N(0,1) rounded to ``dtype``."""
    # Drawn on the device: a CUDA case needs up to ~10^8 values.
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    q, k, v, dout = randn(t, h, d), randn(t, hkv, d), randn(t, hkv, d), randn(t, h, d)
    dout = dout.masked_fill(padding.to(device)[:, None, None], 0.0)
    return tuple(x.to(dtype) for x in (q, k, v, dout))


def run_case(
    thd: dict[str, Any],
    heads: tuple[int, int, int],
    dtype_name: str,
    kernels: dict[str, AttnFn],
    device: torch.device,
    seed: int,
) -> dict[str, Any]:
    """One layout x dtype: gold, references, naive low precision and each kernel."""
    h, hkv, d = heads
    dtype = getattr(torch, dtype_name)
    t = thd["input_ids"].shape[0]
    padding = thd["padding_mask"]
    q, k, v, dout = _draw_inputs(seed, t, h, hkv, d, dtype, device, padding)
    real = ~padding.to(device)

    def run(fn: AttnFn, cast: torch.dtype) -> dict[str, torch.Tensor]:
        return fwd_bwd(fn, q.to(cast), k.to(cast), v.to(cast), dout.to(cast), thd)

    gold = run(reference_attention, torch.float64)
    results: dict[str, dict[str, torch.Tensor]] = {
        "ref_fp32": run(reference_attention, torch.float32),
        "ref_lowp": run(reference_attention, dtype),
        "naive_lowp": run(naive_lowp_attention, dtype),
    }
    errors: dict[str, str] = {}
    pad_slot_out: dict[str, float] = {}
    for name, fn in kernels.items():
        try:
            res = run(fn, dtype)
        except Exception as exc:  # a kernel refusing a layout is a finding, not a crash
            errors[name] = f"{type(exc).__name__}: {exc}"[:400]
            continue
        results[name] = res
        if bool(padding.any()):
            pad_slot_out[name] = float(res["out"][~real].double().abs().max())
    cmp = compare(results, gold, real, dtype_name)
    return {
        "tokens": t,
        "real_tokens": int(real.sum()),
        "num_seqs": thd["num_seqs"],
        "max_seqlen": thd["max_seqlen_int"],
        "pad_between_seqs": thd["pad_between_seqs"],
        "heads": {"H": h, "H_kv": hkv, "D": d},
        "dtype": dtype_name,
        "errors": cmp,
        "kernel_errors": errors,
        "pad_slot_max_abs_out": pad_slot_out,
    }


def _summarise(cases: list[dict[str, Any]], impls: list[str]) -> dict[str, Any]:
    """Worst error per dtype x impl x tensor, and how many cases each kernel passed."""
    out: dict[str, Any] = {}
    for dt in sorted({c["dtype"] for c in cases}):
        sel = [c for c in cases if c["dtype"] == dt]
        per: dict[str, Any] = {}
        for impl in impls:
            have = [c for c in sel if impl in c["errors"]]
            if not have:
                continue
            per[impl] = {
                t: {
                    k: max(c["errors"][impl][t][k] for c in have)
                    for k in ("max_abs", "max_rel", "ratio")
                }
                for t in TENSORS
            }
            per[impl]["cases"] = len(have)
            per[impl]["passed"] = sum(worst_ratio(c["errors"][impl]) <= 1.0 for c in have)
        out[dt] = per
    return out


def run_numerics(
    plan: NumericsPlan,
    device: torch.device,
    kernels_nopad: dict[str, AttnFn],
    kernels_pad: dict[str, AttnFn],
    negative_control: tuple[str, AttnFn],
    log: Callable[[str], None],
    te_status: dict[str, Any],
) -> dict[str, Any]:
    """All layouts x dtypes; returns the JSON section (cases, summary, failures)."""
    rng = np.random.default_rng(plan.seed)
    t0 = time.perf_counter()
    cases: list[dict[str, Any]] = []
    failures: list[str] = []
    layout_errors: list[str] = []
    varlen_refusals = {"checked": 0, "refused": 0}
    skipped = 0
    n_kind = {"nopad": plan.layouts_without_padding, "pad": plan.layouts_with_padding}
    # Interleaved in proportion, so a spent time budget leaves both kinds covered.
    kinds = sorted(
        [(kind, i) for kind, n in n_kind.items() for i in range(n)],
        key=lambda item: ((item[1] + 0.5) / n_kind[item[0]], item[0]),
    )
    sig: dict[str, Any] | None = None
    for idx, (kind, i) in enumerate(kinds):
        if time.perf_counter() - t0 > plan.time_budget_s:
            skipped = len(kinds) - idx
            failures.append(
                f"numerics: time budget {plan.time_budget_s:.0f} s spent, {skipped} layouts skipped"
            )
            break
        batch = (
            layout_without_padding(rng, plan.spec)
            if kind == "nopad"
            else layout_with_padding(rng, plan.spec)
        )
        thd = dict(process_input_for_thd(batch))
        if kind == "nopad" and thd["pad_between_seqs"]:
            layout_errors.append(f"layout {idx}: generator produced padding between sequences")
            continue
        if kind == "pad" and thd["pad_between_seqs"]:
            # Bidirectional attention cannot be expressed over padding between
            # sequences with one boundary array; causal attention can (and runs below).
            varlen_refusals["checked"] += 1
            try:
                torch_varlen_kwargs(thd, causal=False)
            except VarlenLayoutError:
                varlen_refusals["refused"] += 1
            else:
                failures.append(
                    f"layout {idx}: torch_varlen_kwargs(causal=False) accepted padding between sequences"
                )
        if sig is None:
            try:
                sig = check_kwarg_signatures(thd, te_status)
            except Exception as exc:  # a signature mismatch is a finding, not a crash
                sig = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                failures.append(f"signatures: {sig['error']}")
        heads = draw_heads(rng, plan.spec, gqa=bool(i % 2))
        kernels = kernels_nopad if (kind == "nopad" or not thd["pad_between_seqs"]) else kernels_pad
        for dt in plan.dtypes:
            case = run_case(thd, heads, dt, kernels, device, seed=plan.seed * 100_003 + idx)
            case["layout"] = {
                "index": idx,
                "kind": kind,
                "B": int(batch["input_ids"].shape[0]),
                "S": int(batch["input_ids"].shape[1]),
            }
            for name in kernels:
                if name in case["kernel_errors"]:
                    failures.append(f"layout {idx} {dt} {name}: {case['kernel_errors'][name]}")
                elif worst_ratio(case["errors"][name]) > 1.0:
                    worst = max(TENSORS, key=lambda t, n=name: case["errors"][n][t]["ratio"])
                    e = case["errors"][name][worst]
                    failures.append(
                        f"layout {idx} {dt} {name}: {worst} max abs {e['max_abs']:.3g} exceeds tolerance "
                        f"(ratio {e['ratio']:.2f}; ref_lowp ratio {case['errors']['ref_lowp'][worst]['ratio']:.2f})"
                    )
            cases.append(case)
        if (idx + 1) % 20 == 0:
            log(f"  numerics: {idx + 1}/{len(kinds)} layouts, {time.perf_counter() - t0:.1f} s")

    # Negative control: a kernel without the causal mask must fail the same tolerance,
    # or the comparison cannot catch a wrong mask.
    neg_name, neg_fn = negative_control
    nb = layout_without_padding(np.random.default_rng(plan.seed + 1), plan.spec)
    nb["seq_lens"] = nb["seq_lens_padded"] = _sentinel_rows(
        [[int(nb["input_ids"].shape[1])]] * int(nb["input_ids"].shape[0])
    )
    neg = run_case(
        dict(process_input_for_thd(nb)),
        plan.spec.heads[0],
        plan.dtypes[0],
        {neg_name: neg_fn},
        device,
        plan.seed,
    )
    neg_error = neg["kernel_errors"].get(neg_name)
    neg_detected = neg_error is None and worst_ratio(neg["errors"][neg_name]) > 1.0
    if neg_error is not None:
        failures.append(f"negative control {neg_name} could not run: {neg_error}")
    elif not neg_detected:
        failures.append(
            f"negative control {neg_name} passed the tolerance: the check cannot see a wrong mask"
        )

    impls = ["ref_fp32", "ref_lowp", "naive_lowp", *sorted(set(kernels_nopad) | set(kernels_pad))]
    counts = {
        "layouts_without_padding": sum(1 for c in cases if c["layout"]["kind"] == "nopad")
        // max(1, len(plan.dtypes)),
        "layouts_with_padding": sum(1 for c in cases if c["layout"]["kind"] == "pad")
        // max(1, len(plan.dtypes)),
        "gqa_cases": sum(1 for c in cases if c["heads"]["H"] != c["heads"]["H_kv"]),
        "cases": len(cases),
    }
    return {
        "ok": not failures and not layout_errors,
        "plan": {**asdict(plan), "spec": asdict(plan.spec)},
        "kernels": {"without_padding": sorted(kernels_nopad), "with_padding": sorted(kernels_pad)},
        "counts": counts,
        "summary": _summarise(cases, impls),
        "signatures": sig,
        "varlen_refuses_bidirectional_padding": varlen_refusals,
        "negative_control": {
            "kernel": neg_name,
            "detected": neg_detected,
            "worst_ratio": None if neg_error else worst_ratio(neg["errors"][neg_name]),
            "error": neg_error,
        },
        "layout_errors": layout_errors,
        "skipped_layouts": skipped,
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 2),
        "cases": cases,
    }
