"""te_thd's cache beside the caches users would pick instead: the same samples, one run, one table.

Readers (every one reads one shuffled epoch, batch 8, ``num_workers=0``):

- te_thd (``CachedTensorDataset`` + ``build_cached_dataloader``) over its ``ragged``,
  ``ragged_fp8`` (``aux_hidden_states`` as fp8_e4m3 with a float32 scale per token) and
  ``padded`` layouts, each verified (the default) and ``_unverified`` (``verify=False``);
- ``deepspec`` and ``specforge``: the readers of ``perf/peers.py`` (a DataLoader over
  their map-style dataset, shuffled by torch's ``RandomSampler``);
- ``reference``: NeMo Automodel's ``offline_cache`` (the pinned version, when installed)
  over te_thd's padded cache, which it reads as its own.

Workload, EAGLE-3 shaped: ``input_ids`` int32, ``loss_mask`` uint8 and
``aux_hidden_states`` bf16 ``[n, 3H]`` (three captured layers of hidden size ``H``, the
reference's EAGLE-3 key), plus ``seq_len`` for te_thd's length key. Lengths lognormal
(median 1500, sigma 0.8) cut to [16, 8192]; te_thd's cache width ``L`` = 8192. Hidden
states: unit-scale tokens whose norms spread lognormally, and a few tokens with
massive activations past fp8's 448 (each sample's first token and about one in a
thousand others carry 4 channels per layer at 500-3000), as real models have.
Full run: ``H`` = 1024, 128 samples (about 1.25 GB ragged); the padded cache (te_thd
``padded`` and ``reference``) holds the first 16 samples only (padded to 8192 the
whole set would be four times the ragged cache; real tokens/s is what compares).
``--quick``: ``H`` = 512, 64 samples (8 batches a delivery: with fewer, a reader's open and
first batch weigh more than its reads), padded 8, and of te_thd's readers only those the goals
name (``ragged``, ``ragged_unverified``).

Two deliveries of each batch on the host:

- ``padded``: ``[B, L, ...]`` as the reader's collator gives it: te_thd's
  ``collate_cached`` pads to the cache's ``L``, the reference's stacks its padded rows,
  the peers pad to the batch's longest sample (:func:`peers.pad_batch`);
- ``thd``: the batch's real tokens ``[T, ...]`` with ``cu_seqlens``: te_thd's
  ``CachedThdCollator(8192, length_key="seq_len")``; the peers and the reference
  concatenate their samples' real tokens (:func:`peers.concat_batch`).

Each repetition reads every reader once per delivery cold (every file of its cache
dropped from the page cache first, ``os.sync`` + ``POSIX_FADV_DONTNEED``), then at
once warm (the cold epoch left it in the page cache); a fresh reader each epoch (a
mapped page cannot be dropped). The readers' order rotates each repetition. The
figures are medians over repetitions; a ratio is the median of the per-repetition
ratios. In a record a baseline's figure is te_thd's median over that median ratio, so
``Record.ratios`` is it; the readers' own medians are in ``extra``.

Records (goals in ``perf/thresholds.json``):

- ``<delivery>_<warm|cold>_<te_thd layout>``: real tokens/s against ``deepspec``,
  ``specforge`` and ``reference``; ``extra``: every reader's median real tokens/s and
  samples/s, per-repetition figures, bytes read from storage in the cold epoch
  (``/proc/self/io`` ``read_bytes``).
- ``ragged_disk`` / ``padded_disk`` / ``ragged_fp8_disk``: bytes on disk per real
  token (lower is better) against each peer's cache (``deepspec_fp8``: the plain
  cast).
- ``fp8_error_max`` / ``fp8_error_mean``: te_thd's fp8 (read back from the cache)
  against a plain ``float8_e4m3fn`` cast, the largest and the mean per-token relative
  error ``||x' - x|| / ||x||`` over every token of the workload.

Run: ``.venv/bin/python perf/run.py --only peers``; ``.venv/bin/python
perf/bench_peers.py --docs`` (a full run) also rewrites the table in ``docs/peers.md``
and the picture ``docs/peers.png``.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from harness import Record, print_records, reference_offline_cache
from peers import (
    HIDDEN_KEY,
    DeepSpecDataset,
    Sample,
    SpecForgeDataset,
    concat_batch,
    pad_batch,
    write_deepspec,
    write_specforge,
)
from torch.utils.data import DataLoader

BENCH = "peers"
KEYS = ("input_ids", "seq_len", "loss_mask", HIDDEN_KEY)
TOKEN_KEYS = ("input_ids", "loss_mask", HIDDEN_KEY)
WIDTH = 8192
BATCH = 8
SHARD_SIZE = 16
LAYERS = 3
TETHD = (
    "ragged",
    "ragged_unverified",
    "ragged_fp8",
    "ragged_fp8_unverified",
    "padded",
    "padded_unverified",
)
PEERS = ("deepspec", "specforge", "reference")
DELIVERIES = ("padded", "thd")


@dataclass(frozen=True)
class Config:
    hidden: int  # H: one captured layer's width
    samples: int
    padded_samples: int  # the padded cache holds the first this many
    reps: int
    deepspec_shard_bytes: int
    tethd: tuple[str, ...]  # te_thd's readers measured


FULL = Config(
    hidden=1024, samples=128, padded_samples=16, reps=3, deepspec_shard_bytes=256 << 20, tethd=TETHD
)
#: --quick reads only the layouts the goals name
QUICK = Config(
    hidden=512,
    samples=64,
    padded_samples=8,
    reps=5,
    deepspec_shard_bytes=4 << 20,
    tethd=("ragged", "ragged_unverified"),
)


# --------------------------------------------------------------------------- workload


def lengths_for(n: int, seed: int = 7) -> np.ndarray:
    """``n`` lognormal lengths (median 1500, sigma 0.8) cut to [16, 8192], int64 ``[n]``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(np.exp(rng.normal(math.log(1500), 0.8, n))), 16, WIDTH).astype(np.int64)


def make_sample(i: int, n: int, hidden: int) -> Sample:
    """Sample ``i`` of length ``n``: ids int32 ``[n]``, mask uint8 ``[n]``, hidden bf16 ``[n, 3H]``.

    Token norms spread lognormally; the first token and about one in a thousand others
    carry 4 channels per layer at 500-3000 in magnitude (massive activations).
    """
    g = torch.Generator().manual_seed(1000 + i)
    width = LAYERS * hidden
    scale = torch.exp(0.5 * torch.randn(n, 1, generator=g))
    x = torch.randn(n, width, generator=g) * scale
    big = torch.rand(n, generator=g) < 1e-3
    big[0] = True
    rows = big.nonzero().flatten()
    for layer in range(LAYERS):
        cols = layer * hidden + torch.randint(0, hidden, (rows.numel(), 4), generator=g)
        mag = 500 + 2500 * torch.rand(rows.numel(), 4, generator=g)
        sign = torch.randint(0, 2, (rows.numel(), 4), generator=g) * 2 - 1
        x[rows.unsqueeze(1), cols] = mag * sign
    return {
        "input_ids": torch.randint(1, 128_000, (n,), generator=g, dtype=torch.int32),
        "loss_mask": (torch.rand(n, generator=g) < 0.7).to(torch.uint8),
        HIDDEN_KEY: x.to(torch.bfloat16),
    }


def write_tethd(out: str, samples: list[Sample], lengths: np.ndarray, **kw: Any) -> None:
    """te_thd's cache of ``samples`` through ``produce_cache`` (``kw``: ``token_keys``, ``codecs``)."""
    from te_thd.offline_cache import produce_cache

    hidden = int(samples[0][HIDDEN_KEY].shape[1])

    def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx = batch["i"].tolist()
        out = {
            "input_ids": torch.zeros(len(idx), WIDTH, dtype=torch.int32),
            "seq_len": torch.tensor([int(lengths[i]) for i in idx], dtype=torch.int64),
            "loss_mask": torch.zeros(len(idx), WIDTH, dtype=torch.uint8),
            HIDDEN_KEY: torch.zeros(len(idx), WIDTH, hidden, dtype=torch.bfloat16),
        }
        for b, i in enumerate(idx):
            for key in TOKEN_KEYS:
                out[key][b, : int(lengths[i])] = samples[i][key]
        return out

    index = [{"i": torch.tensor(i)} for i in range(len(samples))]
    produce_cache(
        DataLoader(index, batch_size=BATCH),
        out,
        SHARD_SIZE,
        compute,
        KEYS,
        cache_name="bench",
        progress=False,
        length_key="seq_len",
        **kw,
    )


def cache_files(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))


def disk_bytes(d: str) -> int:
    """Bytes of every file of the cache in ``d`` (shards, index, manifest)."""
    return sum(os.path.getsize(p) for p in cache_files(d))


def drop_page_cache(d: str) -> None:
    """Evict the files of ``d`` from the page cache (clean pages: ``run`` syncs once after writing)."""
    for p in cache_files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes() -> int:
    """``read_bytes`` of ``/proc/self/io``: what this process fetched from the block device."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


# --------------------------------------------------------------------------- readers


def _tethd_loader(d: str, delivery: str, verify: bool, seed: int) -> Any:
    from te_thd.offline_cache import (
        CachedTensorDataset,
        CachedThdCollator,
        UnverifiedCacheWarning,
        build_cached_dataloader,
        collate_cached,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedCacheWarning)  # measured on purpose
        ds = CachedTensorDataset(d, "bench", 1, KEYS, verify=verify)
    collate = (
        functools.partial(collate_cached, keys=KEYS)
        if delivery == "padded"
        else CachedThdCollator(WIDTH, length_key="seq_len")
    )
    return build_cached_dataloader(ds, BATCH, True, collate, seed=seed)


def _reference_loader(ref: Any, d: str, delivery: str, seed: int) -> Any:
    ds = ref.CachedTensorDataset(cache_dir=d, cache_name="bench", format_version=1, disk_keys=KEYS)
    if delivery == "padded":
        collate = functools.partial(ref.collate_cached, keys=KEYS)  # its own: [B, L, ...]
    else:
        collate = functools.partial(_concat_padded, ref=ref)
    torch.manual_seed(seed)  # its RandomSampler draws from torch's global generator
    return ref.build_cached_dataloader(
        dataset=ds, batch_size=BATCH, shuffle=True, collate_fn=collate
    )


def _concat_padded(features: list[dict[str, torch.Tensor]], ref: Any) -> dict[str, torch.Tensor]:
    """THD from the reference's padded samples: each sample's first ``seq_len`` tokens, concatenated."""
    return concat_batch([{k: f[k][: int(f["seq_len"])] for k in TOKEN_KEYS} for f in features])


def _peer_loader(ds: Any, delivery: str, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    collate = pad_batch if delivery == "padded" else concat_batch
    return DataLoader(ds, batch_size=BATCH, shuffle=True, collate_fn=collate, generator=g)


@dataclass
class Reader:
    name: str
    cache_dir: str
    samples: int
    tokens: int
    open: Callable[[str, int], Any]  # (delivery, seed) -> loader


def _batch_samples(batch: dict[str, Any]) -> int:
    """Samples in a delivered batch: te_thd's THD ``num_samples``, else ``cu_seqlens`` or the rows."""
    if "num_samples" in batch:
        return int(batch["num_samples"])
    if "cu_seqlens" in batch:
        return int(batch["cu_seqlens"].numel()) - 1
    return int(batch["input_ids"].shape[0])


def _epoch(reader: Reader, delivery: str, seed: int, cold: bool) -> tuple[float, int]:
    """(seconds, bytes read from storage) of one epoch; asserts every sample was delivered."""
    gc.collect()  # the last epoch's mappings must be gone before its pages can be dropped
    if cold:
        drop_page_cache(reader.cache_dir)
    before = read_bytes()
    t0 = time.perf_counter()
    loader = reader.open(delivery, seed)
    n = 0
    for batch in loader:
        n += _batch_samples(batch)
    seconds = time.perf_counter() - t0
    fetched = read_bytes() - before
    ds = getattr(loader, "dataset", None)
    if hasattr(ds, "close"):
        ds.close()
    del loader, ds
    assert n == reader.samples, f"{reader.name} {delivery}: {n} samples, expected {reader.samples}"
    return seconds, fetched


def measure(readers: list[Reader], reps: int) -> dict[tuple[str, str, str], dict[str, list[float]]]:
    """``{(reader, delivery, warm|cold): {"tokens_s", "samples_s", "read_bytes": [per rep]}}``."""
    out: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    gc.collect()
    gc.freeze()  # each epoch's collection then walks only what that epoch allocated
    try:
        _measure(readers, reps, out)
    finally:
        gc.unfreeze()
    return out


def _measure(readers: list[Reader], reps: int, out: dict) -> None:
    for r in readers:  # one untimed warm epoch each: imports, first calls
        for delivery in DELIVERIES:
            _epoch(r, delivery, 0, cold=False)
    for rep in range(reps):
        order = readers[rep % len(readers) :] + readers[: rep % len(readers)]
        for r in order:
            for delivery in DELIVERIES:
                for temp in ("cold", "warm"):
                    seconds, fetched = _epoch(r, delivery, rep + 1, cold=temp == "cold")
                    fig = out.setdefault(
                        (r.name, delivery, temp),
                        {"tokens_s": [], "samples_s": [], "read_bytes": []},
                    )
                    fig["tokens_s"].append(r.tokens / seconds)
                    fig["samples_s"].append(r.samples / seconds)
                    fig["read_bytes"].append(fetched)


# --------------------------------------------------------------------------- fp8


def fp8_errors(samples: list[Sample], fp8_dir: str) -> dict[str, float]:
    """Per-token relative error of te_thd's fp8 (read back from ``fp8_dir``) and of a plain cast.

    Returns the max and mean over every token of both, and their hidden bytes per token.
    """
    from te_thd.offline_cache import CachedTensorDataset

    ds = CachedTensorDataset(fp8_dir, "bench", 1, ("seq_len", HIDDEN_KEY))
    errs: dict[str, list[torch.Tensor]] = {"te_thd": [], "plain": []}
    for i, s in enumerate(samples):
        x = s[HIDDEN_KEY].float()
        n = x.shape[0]
        norm = x.norm(dim=1).clamp_min(1e-30)
        ours = ds[i][HIDDEN_KEY][:n].float()
        plain = s[HIDDEN_KEY].to(torch.float8_e4m3fn).float()
        errs["te_thd"].append((ours - x).norm(dim=1) / norm)
        errs["plain"].append((plain - x).norm(dim=1) / norm)
    cat = {k: torch.cat(v) for k, v in errs.items()}
    width = int(samples[0][HIDDEN_KEY].shape[1])
    return {
        "te_thd_max": float(cat["te_thd"].max()),
        "te_thd_mean": float(cat["te_thd"].mean()),
        "plain_max": float(cat["plain"].max()),
        "plain_mean": float(cat["plain"].mean()),
        "te_thd_bytes_per_token": width + 4,
        "plain_bytes_per_token": width,
        "tokens": int(cat["te_thd"].numel()),
        "tokens_over_448": int(sum(int((s[HIDDEN_KEY].abs() > 448).any(1).sum()) for s in samples)),
    }


# --------------------------------------------------------------------------- records


def _ratio_record(case: str, ours: str, figs: dict, delivery: str, temp: str) -> Record:
    """te_thd layout ``ours`` against every peer measured: median of per-repetition ratios."""
    mine = figs[(ours, delivery, temp)]["tokens_s"]
    med = statistics.median(mine)
    baselines, medians, per_rep = {}, {}, {}
    for peer in PEERS:
        theirs = figs.get((peer, delivery, temp))
        if theirs is None:
            continue
        ratio = statistics.median(a / b for a, b in zip(mine, theirs["tokens_s"], strict=True))
        baselines[peer] = med / ratio
        medians[peer] = statistics.median(theirs["tokens_s"])
        per_rep[peer] = [a / b for a, b in zip(mine, theirs["tokens_s"], strict=True)]
    readers = {
        name: {
            "tokens_s": statistics.median(f["tokens_s"]),
            "samples_s": statistics.median(f["samples_s"]),
            "read_bytes": statistics.median(f["read_bytes"]),
        }
        for (name, d, t), f in figs.items()
        if d == delivery and t == temp
    }
    return Record(
        bench=BENCH,
        case=case,
        metric="throughput",
        unit="real tokens/s",
        ours=med,
        baselines=baselines,
        extra={
            "peer_medians": medians,
            "ratios_per_rep": per_rep,
            "readers": readers,
            "delivery": delivery,
            "temperature": temp,
        },
    )


def run(quick: bool) -> list[Record]:
    if not os.path.exists("/proc/self/io"):
        return []
    cfg = QUICK if quick else FULL
    ref = reference_offline_cache()
    lengths = lengths_for(cfg.samples)
    samples = [make_sample(i, int(n), cfg.hidden) for i, n in enumerate(lengths)]
    tokens = int(lengths.sum())
    npad = cfg.padded_samples
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="te_thd_bench_peers_") as tmp:
        dirs = {
            k: os.path.join(tmp, k)
            for k in ("ragged", "ragged_fp8", "padded", "deepspec", "deepspec_fp8", "specforge")
        }
        write_tethd(dirs["ragged"], samples, lengths, token_keys=TOKEN_KEYS)
        write_tethd(
            dirs["ragged_fp8"],
            samples,
            lengths,
            token_keys=TOKEN_KEYS,
            codecs={HIDDEN_KEY: "fp8_e4m3"},
        )
        write_tethd(dirs["padded"], samples[:npad], lengths[:npad])
        write_deepspec(dirs["deepspec"], samples, cfg.deepspec_shard_bytes)
        write_deepspec(dirs["deepspec_fp8"], samples, cfg.deepspec_shard_bytes, fp8=True)
        write_specforge(dirs["specforge"], samples)
        os.sync()  # every cache written back, so dropping its pages later evicts them
        fp8 = fp8_errors(samples, dirs["ragged_fp8"])
        del samples
        gc.collect()

        per_token = {
            k: disk_bytes(d) / (tokens if k != "padded" else int(lengths[:npad].sum()))
            for k, d in dirs.items()
        }
        for case, ours, base in (
            ("ragged_disk", "ragged", ("deepspec", "specforge", "padded")),
            ("ragged_fp8_disk", "ragged_fp8", ("deepspec_fp8",)),
            ("padded_disk", "padded", ("deepspec",)),
        ):
            records.append(
                Record(
                    bench=BENCH,
                    case=case,
                    metric="time",
                    unit="B/real token",
                    ours=per_token[ours],
                    baselines={b: per_token[b] for b in base},
                    extra={
                        "bytes": {k: disk_bytes(d) for k, d in dirs.items()},
                        "real_tokens": tokens,
                        "hidden": cfg.hidden,
                    },
                )
            )
        for stat in ("max", "mean"):
            records.append(
                Record(
                    bench=BENCH,
                    case=f"fp8_error_{stat}",
                    metric="time",
                    unit="per-token relative error",
                    ours=fp8[f"te_thd_{stat}"],
                    baselines={"plain_cast": fp8[f"plain_{stat}"]},
                    extra=fp8,
                )
            )

        def tethd(name: str) -> Reader:
            layout = name.removesuffix("_unverified")
            verify = not name.endswith("_unverified")
            n = npad if layout == "padded" else cfg.samples
            return Reader(
                name,
                dirs[layout],
                n,
                int(lengths[:n].sum()),
                lambda delivery, seed: _tethd_loader(dirs[layout], delivery, verify, seed),
            )

        readers = [tethd(name) for name in cfg.tethd]
        readers.append(
            Reader(
                "deepspec",
                dirs["deepspec"],
                cfg.samples,
                tokens,
                lambda dl, seed: _peer_loader(DeepSpecDataset(dirs["deepspec"]), dl, seed),
            )
        )
        readers.append(
            Reader(
                "specforge",
                dirs["specforge"],
                cfg.samples,
                tokens,
                lambda dl, seed: _peer_loader(SpecForgeDataset(dirs["specforge"]), dl, seed),
            )
        )
        if ref is not None:
            readers.append(
                Reader(
                    "reference",
                    dirs["padded"],
                    npad,
                    int(lengths[:npad].sum()),
                    lambda dl, seed: _reference_loader(ref, dirs["padded"], dl, seed),
                )
            )
        figs = measure(readers, cfg.reps)
        for delivery in DELIVERIES:
            for temp in ("warm", "cold"):
                for name in cfg.tethd:
                    records.append(
                        _ratio_record(f"{delivery}_{temp}_{name}", name, figs, delivery, temp)
                    )
    return records


def records_from_run(path: str) -> tuple[list[Record], bool]:
    """This bench's records and whether they came from ``--quick``, out of a ``perf/run.py`` JSON."""
    import json

    with open(path) as f:
        doc = json.load(f)
    (entry,) = [b for b in doc["benches"] if b["name"] == BENCH]
    return [Record.from_json(r) for r in entry["records"]], doc["mode"] == "quick"


def main(argv: list[str]) -> None:
    """``[--quick] [--docs] [--from-json RUN.json]``: run (or load a perf/run.py result), print,
    and with ``--docs`` rewrite docs/peers.md's table and docs/peers.png."""
    torch.set_num_threads(1)
    if "--from-json" in argv:
        recs, quick = records_from_run(argv[argv.index("--from-json") + 1])
    else:
        quick = "--quick" in argv
        recs = run(quick)
    print_records(recs)
    if "--docs" in argv:
        from peers_docs import write_docs

        write_docs(recs, quick)


if __name__ == "__main__":
    main(sys.argv[1:])
