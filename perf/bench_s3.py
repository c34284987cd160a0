"""Reading a cache from S3-compatible object storage: requests, bytes fetched per byte used, throughput.

A real SeaweedFS server (``weed server -s3``, ``perf/s3_server.py``) runs on this
machine, so the figures measure the client's overhead, not a network. The same cache is
produced locally and uploaded; then, interleaved, one epoch of
``build_cached_dataloader`` + ``collate_cached`` (shuffled, ``num_workers=0``, verified)
reads it:

- ``local``: from the local directory (the baseline);
- ``s3_cold``: from ``s3://``, a fresh read-through cache directory per trial;
- ``s3_warm``: from ``s3://`` with the read-through cache directory of a previous epoch
  (goal: >= 0.8x local).

The local and warm datasets are opened once, outside the timing (a job opens its
dataset once and reads many epochs); a cold trial opens a fresh one.

Records: ``epoch_<case>`` (samples/s; ours = ``s3_warm``, baselines ``local`` and
``s3_cold``), with ``extra`` holding, for a cold epoch, the requests made per batch and
the bytes fetched per byte the batches hold (``ReadThrough.requests`` /
``fetched_bytes``). Cases: ``large`` (``hidden`` [512, 768] bf16 + ``input_ids``, 256
samples, ``--quick`` 128, batch 8) and ``ragged`` (the long-tailed token cache of ``bench_tokens``, read
through ``CachedThdCollator`` at cp = 2, rank 0: the rank's share only). Skipped (no
records) when the server or the s3 extra is not installed.

``cold_vs_client_<case>``: the cold epoch's rate of bytes fetched (MB/s) against the client
alone making the same ``get_ranges`` calls, recorded from an untimed cold epoch, one after the
other (goal: >= 0.8x): what te_thd adds to the store's own time (local copy, verification,
collate) over the same byte ranges.

``client_batch_ranges``: the client choice -- one batch's 8 ranged reads (768 KiB rows of a
shard object) by obstore's single ``get_ranges`` call against boto3, one request at a
time and on 8 threads (MB/s; reported, not gated).

Run: ``.venv/bin/python perf/run.py --only s3``.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys
import tempfile
import time

import torch
from harness import Record, time_interleaved
from torch.utils.data import DataLoader

BENCH = "s3"


def _server():
    import s3_server as support

    try:
        import boto3  # noqa: F401
        import obstore  # noqa: F401
    except ImportError:
        return None, None
    if support.weed_binary() is None:
        return None, None
    return support, support.start()


def _upload(local: str, url: str) -> None:
    from te_thd.offline_cache.storage.schemes import open_storage

    store = open_storage(url)
    for name in sorted(os.listdir(local)):
        if not name.startswith("."):
            with open(os.path.join(local, name), "rb") as f:
                store.put(name, f.read())


def _large(out: str, n: int) -> tuple[tuple[str, ...], dict]:
    from te_thd.offline_cache import produce_cache

    def compute(batch):
        g = torch.Generator().manual_seed(int(batch["i"][0]))
        b = batch["i"].shape[0]
        return {"hidden": torch.randn(b, 512, 768, generator=g).to(torch.bfloat16),
                "input_ids": torch.randint(0, 32000, (b, 512), generator=g)}  # fmt: skip

    produce_cache(DataLoader([{"i": torch.tensor(i)} for i in range(n)], batch_size=8), out, 16, compute,
                  ("hidden", "input_ids"), progress=False)  # fmt: skip
    return ("hidden", "input_ids"), {}


def _clients(support, server, url: str, quick: bool) -> Record:
    """One batch's ranged reads (8 random 768 KiB rows of a shard object) through obstore's one
    ``get_ranges`` call, against boto3 issuing one ranged GET at a time, and on 8 threads."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    from te_thd.offline_cache.storage.schemes import open_storage

    loc = open_storage(url)
    name = "shard-000000.safetensors"
    size = loc.list()[name]
    row = 512 * 768 * 2
    g = torch.Generator().manual_seed(0)
    starts = [int(v) * row for v in torch.randperm(max(1, (size - 4096) // row), generator=g)[:8]]
    ranges = [(a, a + row) for a in starts]
    c = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=support.ACCESS_KEY,
                     aws_secret_access_key=support.SECRET_KEY, region_name="us-east-1")  # fmt: skip
    key = loc.key(name)

    def one(r):
        return c.get_object(Bucket=loc.bucket, Key=key, Range=f"bytes={r[0]}-{r[1] - 1}")[
            "Body"
        ].read()

    pool = ThreadPoolExecutor(8)
    try:
        times = time_interleaved({
            "obstore_get_ranges": lambda: loc.get_ranges(name, ranges),
            "boto3_sequential": lambda: [one(r) for r in ranges],
            "boto3_8_threads": lambda: list(pool.map(one, ranges)),
        }, trials=5 if quick else 9, inner=3)  # fmt: skip
    finally:
        pool.shutdown()
    mb = len(ranges) * row / 1e6
    rate = {k: mb / v for k, v in times.items()}
    return Record(
        bench=BENCH,
        case="client_batch_ranges",
        metric="throughput",
        unit="MB/s",
        ours=rate.pop("obstore_get_ranges"),
        baselines=rate,
        extra={"ranges": len(ranges), "range_bytes": row},
    )


def _recorded(store) -> list[tuple[str, list[tuple[int, int]]]]:
    """The ``get_ranges`` calls a read-through copy makes of ``store`` from now on (appended as made)."""
    calls: list[tuple[str, list[tuple[int, int]]]] = []
    real = store.get_ranges

    def recording(obj, ranges):
        calls.append((store.key(obj), list(ranges)))
        return real(obj, ranges)

    store.get_ranges = recording
    return calls


def _replay(store, calls: list[tuple[str, list[tuple[int, int]]]]) -> None:
    """The same ``get_ranges`` calls, one after the other as the epoch made them, by the client alone."""
    import obstore

    from te_thd.offline_cache.storage.s3 import client

    c = client(store.bucket, store.config)
    for key, ranges in calls:
        for b in obstore.get_ranges(
            c, key, starts=[a for a, _ in ranges], ends=[b for _, b in ranges]
        ):
            bytes(b)


def run(quick: bool) -> list[Record]:
    support, server = _server()
    if server is None:
        return []
    records: list[Record] = []
    try:
        with server.environment():
            from te_thd.offline_cache import (
                CachedTensorDataset,
                CachedThdCollator,
                build_cached_dataloader,
                collate_cached,
            )

            support.make_bucket(server, "te-thd-bench")
            import bench_tokens

            with tempfile.TemporaryDirectory(prefix="te_thd_bench_s3_") as tmp:
                large = os.path.join(tmp, "large")
                keys, _ = _large(large, 128 if quick else 256)
                ragged = os.path.join(tmp, "ragged")
                lengths = bench_tokens._lengths("long_tail", 48 if quick else 96, 4096)
                bench_tokens._produce(
                    ragged, lengths, 4096, 1024, token_keys=bench_tokens.TOKEN_KEYS
                )
                cases = {
                    "large": (large, keys, 8, functools.partial(collate_cached, keys=keys)),
                    "ragged": (ragged, bench_tokens.KEYS, 8,
                               CachedThdCollator(8192, length_key="seq_len", cp_size=2, cp_rank=0)),
                }  # fmt: skip
                for case, (local, case_keys, batch, collate) in cases.items():
                    url = f"s3://te-thd-bench/{case}"
                    _upload(local, url)
                    warm_dir = os.path.join(tmp, f"warm-{case}")
                    used = {"bytes": 0, "batches": 0}

                    def epoch(ds, collate=collate, batch=batch, used=used):
                        loader = build_cached_dataloader(dataset=ds, batch_size=batch, shuffle=True, collate_fn=collate,
                                                         seed=1)  # fmt: skip
                        n = 0
                        for out in loader:
                            n += 1
                            used["bytes"] += sum(
                                t.numel() * t.element_size()
                                for t in out.values()
                                if isinstance(t, torch.Tensor)
                            )
                        used["batches"] = n
                        return ds

                    # a job opens its dataset once and reads many epochs: the datasets are made outside the timing
                    ds_local = CachedTensorDataset(local, "bench", 1, case_keys)
                    ds_warm = epoch(
                        CachedTensorDataset(url, "bench", 1, case_keys, read_cache_dir=warm_dir)
                    )

                    def cold(url=url, case=case, case_keys=case_keys, epoch=epoch):
                        d = os.path.join(tmp, f"cold-{case}")
                        shutil.rmtree(d, ignore_errors=True)
                        epoch(CachedTensorDataset(url, "bench", 1, case_keys, read_cache_dir=d))

                    # Warm against local is a ratio of two short epochs: enough trials, each
                    # long enough that a scheduler hiccup is not the figure. A cold epoch
                    # is long on its own and only reported, so it is timed apart.
                    t0 = time.perf_counter()
                    epoch(ds_local)
                    inner = max(1, math.ceil(0.05 / max(time.perf_counter() - t0, 1e-6)))
                    times = time_interleaved(
                        {"s3_warm": lambda ds=ds_warm, epoch=epoch: epoch(ds),
                         "local": lambda ds=ds_local, epoch=epoch: epoch(ds)},
                        trials=7 if quick else 9, inner=inner,
                    )  # fmt: skip
                    # one cold epoch untimed, recording the object store calls it makes: the baseline below
                    # makes the same calls with the client alone
                    used["bytes"] = 0
                    shutil.rmtree(os.path.join(tmp, f"cold-{case}"), ignore_errors=True)
                    ds = CachedTensorDataset(
                        url, "bench", 1, case_keys, read_cache_dir=os.path.join(tmp, f"cold-{case}")
                    )
                    calls = _recorded(ds.storage.copy.store)
                    ds = epoch(ds)
                    m = ds.storage.copy
                    n, used_bytes, batches = len(ds), used["bytes"], used["batches"]
                    replay = functools.partial(_replay, ds.storage, calls)
                    times.update(time_interleaved({"s3_cold": cold, "client_get_ranges": replay}, trials=2 if quick else 3,
                                                  warmup=0))  # fmt: skip
                    records.append(Record(
                        bench=BENCH, case=f"cold_vs_client_{case}", metric="throughput", unit="MB/s",
                        ours=m.fetched_bytes / 1e6 / times["s3_cold"],
                        baselines={"client_get_ranges": m.fetched_bytes / 1e6 / times["client_get_ranges"]},
                        extra={"calls": len(calls), "fetched_bytes": m.fetched_bytes, "samples_per_s": n / times["s3_cold"]},
                    ))  # fmt: skip
                    records.append(Record(
                        bench=BENCH, case=f"epoch_{case}", metric="throughput", unit="samples/s",
                        ours=n / times["s3_warm"], baselines={"local": n / times["local"], "s3_cold": n / times["s3_cold"]},
                        extra={"requests_per_batch": m.requests / max(1, batches),
                               "fetched_per_used_byte": m.fetched_bytes / max(1, used_bytes),
                               "fetched_bytes": m.fetched_bytes, "used_bytes": used_bytes, "samples": n},
                    ))  # fmt: skip
            records.append(_clients(support, server, "s3://te-thd-bench/large", quick))
    finally:
        server.stop()
    return records


if __name__ == "__main__":
    from harness import print_records

    print_records(run("--quick" in sys.argv))
