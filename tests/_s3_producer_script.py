"""A producer into object storage for the tests: ``python _s3_producer_script.py URL CRASH``.

Builds the cache of :func:`dataset` at ``URL`` (``s3://...``; endpoint and credentials from
the environment; ``msc://...``: the profile of ``MSC_CONFIG``) with
:func:`te_thd.offline_cache.produce_cache`. ``CRASH``:

- ``none``          run to completion
- ``mid_upload:K``  shard K's upload is started as a streamed (multipart) upload, half its bytes written,
                    then the process SIGKILLs itself (an upload that never completes)
- ``after_upload:K`` SIGKILL right after shard K's object is complete
- ``hold:K``        after shard K's object is complete, wait (holding the producer lock) until killed

Run under torchrun (``WORLD_SIZE`` set) every rank joins a gloo group first, produces
its block and then reads the whole cache back, writing ``<OUT>.<rank>.json`` (``OUT``:
the third argument) with a digest of every tensor it read through the dataset and the
THD collator at cp = 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader

KEYS = ("input_ids", "hidden", "length")
TOKEN_KEYS = ("input_ids", "hidden")
L, H = 12, 8


def dataset(n: int = 22) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, L + 1, (1,), generator=g))
        ids = torch.zeros(L, dtype=torch.int64)
        ids[:length] = torch.randint(1, 500, (length,), generator=g)
        out.append({"input_ids": ids, "length": torch.tensor(length)})
    return out


def compute_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids, length = batch["input_ids"], batch["length"]
    real = (torch.arange(L).unsqueeze(0) < length.unsqueeze(1)).unsqueeze(-1)
    hidden = torch.stack(
        [torch.randn(L, H, generator=torch.Generator().manual_seed(int(r.sum()))) for r in ids]
    )
    return {"input_ids": ids, "hidden": (hidden * real).to(torch.bfloat16), "length": length}


def produce(url: str, **kw) -> dict:
    from te_thd.offline_cache import produce_cache

    return produce_cache(DataLoader(dataset(), batch_size=2), url, 4, compute_batch, KEYS, {"cp_size": 2},
                         progress=False, length_key="length", token_keys=TOKEN_KEYS, **kw)  # fmt: skip


def _install_crash(spec: str, url: str) -> None:
    from te_thd.offline_cache.storage.schemes import open_storage
    from te_thd.offline_cache.storage.s3 import client

    kind, _, k = spec.partition(":")
    target = f"shard-{int(k):06d}.safetensors"
    cls = type(
        open_storage(url)
    )  # S3Prefix, or MSCPrefix for msc:// (after_upload only: mid_upload writes with obstore)
    real_commit = cls.commit

    def commit(store, name, path):
        if name == target and kind == "mid_upload":
            import obstore

            data = open(path, "rb").read()
            writer = obstore.open_writer(client(store.bucket, store.config), store.key(name))
            writer.write(data[: len(data) // 2])
            writer.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        shown = real_commit(store, name, path)
        if name == target and kind == "after_upload":
            os.kill(os.getpid(), signal.SIGKILL)
        while name == target and kind == "hold":
            signal.pause()
        return shown

    cls.commit = commit


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()[:16]


def main() -> None:
    url, crash = sys.argv[1], sys.argv[2]
    if crash != "none":
        _install_crash(crash, url)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    produce(url)
    if world > 1:
        from te_thd.offline_cache import CachedTensorDataset, CachedThdCollator

        rank = int(os.environ["RANK"])
        ds = CachedTensorDataset(url, "test", 1, KEYS)
        out = {"items": [_digest(ds[i]["hidden"]) for i in range(len(ds))]}
        thd = CachedThdCollator(128, length_key="length", cp_size=2, cp_rank=rank % 2)(
            ds.__getitems__(list(range(len(ds))))
        )
        out["thd"] = {k: _digest(v) for k, v in thd.items() if isinstance(v, torch.Tensor)}
        with open(f"{sys.argv[3]}.{rank}.json", "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
