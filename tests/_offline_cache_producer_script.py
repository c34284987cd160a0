"""A tiny real producer for the crash tests: ``python _offline_cache_producer_script.py OUT CRASH``.

Builds the cache of :func:`dataset` with :func:`te_thd.offline_cache.produce_cache`
(resume=True). ``CRASH`` picks the instant at which the process SIGKILLs itself
(nothing is cleaned up, exactly as a killed job):

- ``none``            run to completion
- ``mid_write:K``     inside shard K's file write: the temp file holds part of the
                      shard (a whole-shard write: the header and part of the tensors;
                      a streamed one: its first rows, the header comes last), the
                      shard name does not exist yet
- ``between:K``       right after shard K is fsynced and renamed into place
- ``mid_manifest``    inside the manifest write: its temp file exists, manifest.json not
- ``before_manifest`` after every shard exists, before the manifest write starts
- ``pause:K``         right after shard K is committed, print ``PAUSED`` and sleep: a live
                      producer holding its lock, for a test to observe (then kill it)

``--named`` (a third argument): pass ``producer_name``, the command that resumes this run
(``python <this script> OUT none``), as the example producer does, so hints name it.

The hooks wrap real library functions; only the moment of death is chosen here.
The test imports :func:`dataset`, :func:`compute_batch` and :data:`PARAMS` to build
the uninterrupted reference in-process.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

NUM_SAMPLES = 11
PARAMS = {
    "shard_size": 4,
    "batch_size": 2,
    "keys": ("hidden", "ids"),
    "options": {"cp_size": 2, "mask_prompt": True},
}


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [
        {"x": torch.randn(6, 8, generator=g), "i": torch.tensor([i] * 5)}
        for i in range(NUM_SAMPLES)
    ]


def compute_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Per-sample deterministic "frozen model": bf16 hidden states and int ids.
    return {
        "hidden": (batch["x"] * 3 + 1).to(torch.bfloat16),
        "ids": batch["i"] * 7,
        "unused": batch["x"].sum((1, 2)),
    }


def loader() -> DataLoader:
    return DataLoader(dataset(), batch_size=PARAMS["batch_size"])


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install(crash: str) -> None:
    import te_thd.offline_cache.storage.base as storage
    import te_thd.offline_cache.write.producer as producer
    import te_thd.offline_cache.write.shardfile as shardfile

    kind, _, arg = crash.partition(":")
    if kind == "mid_write":
        target = f".shard-{int(arg):06d}.safetensors."  # the prefix of that shard's temp file
        # every writer serialises through ShardStream, whose rows go out through pwrite_all
        real_pwrite_all = shardfile.pwrite_all
        streamed = {"runs": 0}

        def pwrite_all(fd, buf, offset):
            real_pwrite_all(fd, buf, offset)
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(target):
                streamed["runs"] += 1
                if streamed["runs"] == 2:
                    os.fsync(fd)  # two runs of rows reached the disk, no header yet: die mid-file
                    _die()

        shardfile.pwrite_all = pwrite_all
    elif kind == "between":
        target = os.path.basename(f"shard-{int(arg):06d}.safetensors")
        real_commit = storage.commit_temp

        def commit(tmp_path, path, *a, **k):
            out = real_commit(tmp_path, path, *a, **k)
            if os.path.basename(path) == target:
                storage.fsync(os.path.dirname(path))
                _die()  # shard K is durable under its name; K+1 not started committing
            return out

        storage.commit_temp = commit
    elif kind == "pause":
        target = os.path.basename(f"shard-{int(arg):06d}.safetensors")
        real_commit_pause = storage.commit_temp

        def commit_then_pause(tmp_path, path, *a, **k):
            out = real_commit_pause(tmp_path, path, *a, **k)
            if os.path.basename(path) == target:
                storage.fsync(os.path.dirname(path))
                print("PAUSED", flush=True)
                time.sleep(600)  # alive, holding the lock, until the test kills it
            return out

        storage.commit_temp = commit_then_pause
    elif kind == "before_manifest":
        producer.write_manifest = lambda *a, **k: _die()
    elif kind == "mid_manifest":
        real_atomic = storage.atomic_write_bytes

        def atomic(path, data):
            if path.endswith("manifest.json"):
                with open(storage.temp_path_for(path), "wb") as f:
                    f.write(data[: len(data) // 2])
                _die()
            return real_atomic(path, data)

        storage.atomic_write_bytes = atomic
    elif kind != "none":
        raise SystemExit(f"unknown crash point {crash!r}")


def main() -> None:
    out, crash = sys.argv[1], sys.argv[2]
    named = sys.argv[3:] == ["--named"]
    _install(crash)
    from te_thd.offline_cache import produce_cache

    resume = f"`{shlex.join([sys.executable, os.path.abspath(__file__), out, 'none'])}`"
    produce_cache(
        loader(),
        out,
        PARAMS["shard_size"],
        compute_batch,
        PARAMS["keys"],
        PARAMS["options"],
        progress=False,
        producer_name=resume if named else None,
    )
    print("FINISHED")


if __name__ == "__main__":
    main()
