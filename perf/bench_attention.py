"""Reference THD attention (the CPU stand-in for TE) vs the two obvious plain-torch ways.

``thd_attention_reference`` (segment ids from one ``searchsorted``, query rows in
chunks against the key window they can see) is timed, forward + backward, against

- ``sdpa_loop``: a Python loop of ``scaled_dot_product_attention`` over each
  sequence (CPU flash kernel per sequence, no padding support);
- ``dense_mask_sdpa``: one SDPA over the whole stream with a ``[T, T]`` block-causal
  boolean mask (O(T^2) memory and work).

Packs of lognormal-length documents (median ~150 tokens, long tail), causal, GQA
(8 query heads, 2 kv heads, head dim 64), float32. No goal is attached: the ratios
say whether the reference is fast enough to drive the CPU example, nothing more.
``ratios[name] = baseline_time / ours_time`` (> 1: the reference is faster).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from harness import Record, print_records, time_interleaved

BENCH = "attention"
H, H_KV, D = 8, 2, 64


def _layout(total: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(torch.empty(1).log_normal_(5.0, 1.0, generator=g).clamp(8, 1024))
        lengths.append(min(n, total - sum(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu, lengths


def _case(total: int, trials: int) -> Record:
    from te_thd.attention import thd_attention_reference

    cu, lengths = _layout(total, seed=total)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, H, D, generator=g).requires_grad_()
    k = torch.randn(total, H_KV, D, generator=g).requires_grad_()
    v = torch.randn(total, H_KV, D, generator=g).requires_grad_()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(total) - cu[:-1].long()[seg]

    def ours() -> None:
        out = thd_attention_reference(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        out.sum().backward()

    def sdpa_loop() -> None:
        outs = []
        for i in range(len(lengths)):
            s, e = int(cu[i]), int(cu[i + 1])
            qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        torch.cat(outs).sum().backward()

    def dense_mask_sdpa() -> None:
        mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
        o.sum().backward()

    t = time_interleaved(
        {"ours": ours, "sdpa_loop": sdpa_loop, "dense_mask_sdpa": dense_mask_sdpa}, trials=trials
    )
    return Record(
        bench=BENCH,
        case=f"T={total},seqs={len(lengths)},fwd+bwd",
        metric="time",
        unit="s",
        ours=t["ours"],
        baselines={"sdpa_loop": t["sdpa_loop"], "dense_mask_sdpa": t["dense_mask_sdpa"]},
        extra={"heads": H, "kv_heads": H_KV, "head_dim": D, "max_len": max(lengths)},
    )


def run(quick: bool) -> list[Record]:
    if quick:
        return [_case(1024, trials=3)]
    return [_case(total, trials=5) for total in (2048, 4096)]


if __name__ == "__main__":
    print_records(run(quick="--quick" in sys.argv))
