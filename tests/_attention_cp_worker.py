"""Worker for tests/test_attention_cp.py: one process per CP rank, real gloo group.

Each rank receives the *global* q/k/v/grad of every case, keeps only its dual-chunk
shard (te_thd.cp.partition_indices), runs the CP reference attention forward and
backward, and saves its local output and gradients for the parent to reassemble.
Kept separate from the test module so spawned children import nothing but this.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run(rank: int, world: int, init_file: str, out_dir: str, cases: list[dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from te_thd.attention import ThdAttention, te_attention_kwargs, thd_attention_cp_reference
        from te_thd.cp import partition_indices

        group = dist.group.WORLD
        for i, case in enumerate(cases):
            cu, cup = case["cu_seqlens"], case["cu_seqlens_padded"]
            t = case["q"].shape[0]
            idx = partition_indices(cup, t, world, rank)
            q, k, v = (case[n][idx].clone().requires_grad_() for n in ("q", "k", "v"))
            thd = {
                "cu_seqlens": cu,
                "cu_seqlens_padded": cup,
                "pad_between_seqs": not torch.equal(cu, cup),
                "cp_size": world,
            }
            kw = te_attention_kwargs(thd, case["mask"])
            out = thd_attention_cp_reference(
                q, k, v, cp_group=group, query_chunk_size=case["chunk"], **kw
            )
            (out * case["grad"][idx]).sum().backward()
            # The module (reference backend on CPU) must give the same result.
            module = ThdAttention(q.shape[1], q.shape[2], k.shape[1],
                                  attn_mask_type=case["mask"], cp_group=group)  # fmt: skip
            mod_out = module(q.detach(), k.detach(), v.detach(), thd)
            torch.save(
                {
                    "idx": idx,
                    "out": out.detach(),
                    "dq": q.grad,
                    "dk": k.grad,
                    "dv": v.grad,
                    "module_out": mod_out,
                    "module_backend": module.last_backend,
                },
                os.path.join(out_dir, f"case{i}_rank{rank}.pt"),
            )
    finally:
        dist.destroy_process_group()
