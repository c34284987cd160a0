"""CP reference attention over real gloo processes == the single-process reference.

One spawn per CP size (2 and 4), several layouts each: padding between sequences,
real lengths shorter than a CP chunk, no padding at all, GQA, causal and
bidirectional. Every rank's local output and q/k/v gradients, put back at their
global slots, must equal the cp=1 reference's within float32 tolerance; the K/V
gradients prove the all-gather's backward sums contributions from every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from _attention_cp_worker import run

from te_thd.attention import te_attention_kwargs, thd_attention_reference

I32 = torch.int32


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)


def _cases(cp: int, seed: int) -> list[dict]:
    m = 2 * cp
    g = torch.Generator().manual_seed(seed)
    layouts = [
        # (real lengths, padded lengths): padding between sequences, incl. a sequence
        # shorter than one CP chunk and one that is pure padding on some ranks.
        ([m + 1, 1, 3 * m], [2 * m, m, 3 * m]),
        # no padding anywhere (pad_between_seqs False)
        ([m, 2 * m], [m, 2 * m]),
        # random real lengths, each padded up to a multiple of 2*cp
        (lens := torch.randint(1, 4 * m, (4,), generator=g).tolist(),
         [-(-n // m) * m for n in lens]),
    ]  # fmt: skip
    cases = []
    for j, (lens, padded) in enumerate(layouts):
        for mask, (h, hkv) in (("padding_causal", (4, 2)), ("padding", (2, 2))):
            t = sum(padded)
            cases.append(
                {
                    "cu_seqlens": _cu(lens),
                    "cu_seqlens_padded": _cu(padded),
                    "mask": mask,
                    "chunk": 3 if j == 0 else 256,
                    "q": torch.randn(t, h, 8, generator=g),
                    "k": torch.randn(t, hkv, 8, generator=g),
                    "v": torch.randn(t, hkv, 8, generator=g),
                    "grad": torch.randn(t, h, 8, generator=g),
                }
            )
    return cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_reference_matches_single_process(cp, tmp_path):
    cases = _cases(cp, seed=cp)
    init_file = str(tmp_path / "store")
    mp.spawn(run, args=(cp, init_file, str(tmp_path), cases), nprocs=cp, join=True)

    for i, case in enumerate(cases):
        q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
        thd = {
            "cu_seqlens": case["cu_seqlens"],
            "cu_seqlens_padded": case["cu_seqlens_padded"],
            "pad_between_seqs": not torch.equal(case["cu_seqlens"], case["cu_seqlens_padded"]),
        }
        want = thd_attention_reference(q, k, v, **te_attention_kwargs(thd, case["mask"]))
        (want * case["grad"]).sum().backward()

        got = {n: torch.zeros_like(x) for n, x in (("out", want), ("dq", q), ("dk", k), ("dv", v))}
        seen = torch.zeros(q.shape[0], dtype=torch.int64)
        for r in range(cp):
            res = torch.load(os.path.join(tmp_path, f"case{i}_rank{r}.pt"))
            idx = res["idx"]
            seen[idx] += 1
            for n in got:
                got[n][idx] = res[n]
            assert res["module_backend"] == "reference"
            torch.testing.assert_close(res["module_out"], res["out"].reshape(len(idx), -1))
        assert torch.equal(seen, torch.ones_like(seen)), "ranks must own every slot once"
        tol = {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got["out"], want.detach(), **tol)
        torch.testing.assert_close(got["dq"], q.grad, **tol)
        torch.testing.assert_close(got["dk"], k.grad, **tol)
        torch.testing.assert_close(got["dv"], v.grad, **tol)
        assert k.grad.abs().sum() > 0  # the comparison is not vacuous
