"""The loaders ``bench_cache_read.py`` times, and timing one of them in a process of its own.

``python perf/cache_readers.py --own-process JSON`` (JSON: the object that
:func:`epoch_seconds_here` takes) times one reader's epochs in a fresh interpreter and
prints ``{"seconds": median}``: :func:`own_process_seconds` runs it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import torch
from harness import reference_offline_cache, time_interleaved

FORMAT_VERSION = 1


def epoch_samples(loader: Any) -> int:
    """Read one epoch of ``loader``; the number of samples it yielded."""
    n = 0
    for batch in loader:
        n += next(iter(batch.values())).shape[0]
    return n


def reader_loader(
    name: str, cache_dir: str, keys: tuple[str, ...], batch: int, shuffle: bool, ref: Any
) -> Any:
    """The loader of reader ``name``: ``"ours"`` (te_thd, verified), ``"unverified"``
    (te_thd, ``verify=False``) or ``"reference"`` (the module ``ref``)."""
    if name == "reference":
        return ref.build_cached_dataloader(
            dataset=ref.CachedTensorDataset(
                cache_dir=cache_dir,
                cache_name="bench",
                format_version=FORMAT_VERSION,
                disk_keys=keys,
            ),
            batch_size=batch,
            shuffle=shuffle,
            collate_fn=functools.partial(ref.collate_cached, keys=keys),
        )
    from te_thd.offline_cache import (
        CachedTensorDataset,
        UnverifiedCacheWarning,
        build_cached_dataloader,
        collate_cached,
    )

    with warnings.catch_warnings():
        # verify=False says so; measured on purpose
        warnings.simplefilter("ignore", UnverifiedCacheWarning)
        return build_cached_dataloader(
            CachedTensorDataset(cache_dir, "bench", FORMAT_VERSION, keys, verify=name == "ours"),
            batch,
            shuffle,
            functools.partial(collate_cached, keys=keys),
        )


def run_epoch(loader: Any, n: int, epoch_no: Any) -> None:
    """Read one epoch of ``loader`` (the next number of ``epoch_no`` as its sampler's epoch,
    where the sampler has one) and check that it yields ``n`` samples."""
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(next(epoch_no))
    assert epoch_samples(loader) == n


#: the first argument that makes this file time one reader in its own process
#: (:func:`epoch_seconds_here`) instead of running the bench
OWN_PROCESS_FLAG = "--own-process"


def epoch_seconds_here(spec: dict[str, Any]) -> float:
    """Median seconds of one epoch of reader ``spec["reader"]``, timed in this process.

    Meant for a fresh process that has read nothing before: the same timing as the
    interleaved candidates (:func:`time_interleaved` of whole epochs: ``spec["warmup"]``
    untimed, then ``spec["trials"]`` timed), of the loader :func:`reader_loader` builds
    for the reader over ``spec["cache_dir"]`` (keys, batch size, order and sample count
    in ``spec``), with ``spec["threads"]`` torch threads.
    """
    torch.set_num_threads(int(spec["threads"]))
    # the reference's RandomSampler draws each epoch's order from torch's global generator:
    # seeded, every process of it reads the same orders
    torch.manual_seed(0)
    reader = str(spec["reader"])
    ref = reference_offline_cache() if reader == "reference" else None
    if reader == "reference" and ref is None:
        raise RuntimeError("the reference implementation is not importable in this process")
    keys = tuple(spec["keys"])
    loader = reader_loader(
        reader, spec["cache_dir"], keys, int(spec["batch"]), spec["shuffle"], ref
    )
    one = functools.partial(run_epoch, loader, int(spec["num_samples"]), iter(range(10**9)))
    trials, warmup = int(spec["trials"]), int(spec["warmup"])
    return time_interleaved({reader: one}, trials=trials, warmup=warmup)[reader]


def own_process_seconds(spec: dict[str, Any]) -> float:
    """Run :func:`epoch_seconds_here` for ``spec`` in a fresh interpreter; its result."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), OWN_PROCESS_FLAG, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"timing {spec['reader']} in its own process failed: {last}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])


if __name__ == "__main__":
    if sys.argv[1:2] != [OWN_PROCESS_FLAG] or len(sys.argv) != 3:
        sys.exit(f"usage: python {sys.argv[0]} {OWN_PROCESS_FLAG} JSON")
    print(json.dumps({"seconds": epoch_seconds_here(json.loads(sys.argv[2]))}))
