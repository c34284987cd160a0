"""One rank of the distributed producer test: ``python _offline_cache_dist_worker.py RANK WORLD PORT BASE OUT``.

Joins a real gloo process group and runs every scenario of :data:`SCENARIOS` for
its world size with :func:`te_thd.offline_cache.produce_cache`, writing into
``BASE/<scenario>``. ``compute_batch`` performs a real all-reduce, so ranks that
were not in lockstep would deadlock (the group's 60 s timeout turns that into a
failure). Per scenario it records the number of ``compute_batch`` calls, the
returned manifest or the error, into ``OUT`` (JSON).
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

KEYS = ("h", "ids", "n")
#: the key each sample's length is recorded from
LENGTH_KEY = "n"
OPTIONS = {"cp_size": 2, "mask_prompt": False}

#: name -> (num_samples, shard_size, batch_size); per world size
SCENARIOS: dict[int, dict[str, tuple[int, int, int]]] = {
    # 13 samples / shard 2 -> 7 shards: ranks own 4+3 shards (8 and 5 samples: 4 vs 3 steps)
    2: {"uneven": (13, 2, 2), "two_shards": (7, 4, 2), "ragged": (13, 2, 2)},
    # 7 shards over 3 ranks: 3+2+2 shards (6, 4, 3 samples); 2 shards over 3 ranks: rank 2 owns none
    3: {
        "uneven": (13, 2, 2),
        "zero_rank": (7, 4, 2),
        "resume": (13, 2, 2),
        "subgroup": (7, 2, 2),
        "schema_error": (9, 2, 2),
    },
}


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        {"x": torch.randn(4, generator=g), "i": torch.tensor([i, 2 * i, 3 * i])} for i in range(n)
    ]


#: scenarios whose name starts with "ragged" store "tok" ragged, fp8-encoded (the token layout)
RAGGED = {"token_keys": ("tok",), "codecs": {"tok": "fp8_e4m3"}}


def produce_kwargs(name: str) -> dict:
    """The keys and layout arguments of scenario ``name``."""
    return {"keys": KEYS + ("tok",), **RAGGED} if name.startswith("ragged") else {"keys": KEYS}


def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    n = batch["i"][:, 0] % 5 + 1
    real = (torch.arange(5).unsqueeze(0) < n.unsqueeze(1)).unsqueeze(-1)  # [b, 5, 1]: tokens < n
    tok = (batch["x"][:, None, :] * torch.arange(1, 6).view(1, 5, 1) * real).to(
        torch.bfloat16
    )  # [b, 5, 4]
    return {"h": (batch["x"] * 0.5).to(torch.bfloat16), "ids": batch["i"] + 1, "n": n, "tok": tok}


def loader(n: int, batch_size: int) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size)


def main() -> None:
    rank, world, port, base, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    from te_thd.offline_cache import produce_cache

    results: dict[str, dict] = {}
    subgroup = dist.new_group([1, 2]) if world == 3 else None  # collective: every rank creates it
    for name, (n, shard_size, bs) in SCENARIOS[world].items():
        group = subgroup if name == "subgroup" else None
        if name == "subgroup" and rank not in (1, 2):
            dist.barrier()
            continue
        calls = {"n": 0}
        group_size = dist.get_world_size(group)

        def compute_collective(batch, calls=calls, group=group, group_size=group_size, name=name):
            calls["n"] += 1
            t = torch.ones(1)
            dist.all_reduce(t, group=group)  # a sharded model's forward is a collective
            assert int(t.item()) == group_size
            outp = compute(batch)
            if name == "schema_error" and rank == 1 and calls["n"] == 2:
                outp["h"] = outp["h"].float()  # rank 1 drifts in dtype on its 2nd batch
            return outp

        try:
            kw = produce_kwargs(name)
            m = produce_cache(
                loader(n, bs),
                f"{base}/{name}",
                shard_size,
                compute_collective,
                kw.pop("keys"),
                OPTIONS,
                group=group,
                progress=False,
                length_key=LENGTH_KEY,
                **kw,
            )
            results[name] = {"calls": calls["n"], "manifest": m}
        except Exception as exc:  # recorded, the test asserts on it
            results[name] = {
                "calls": calls["n"],
                "error": f"{type(exc).__name__}: {exc}",
                "tb": traceback.format_exc(),
            }
        dist.barrier()
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
