"""Corruption test of the offline cache: flip bytes, truncate files, and check nothing slips through.

``python scripts/corruption_test.py [--quick] [--seed S] [--json OUT]``

The same small clean cache (24 samples, 3 shards) is written by every writer path
a user takes (:data:`WRITERS`): ``produce_cache``; the reference API the reference
implementation's own producers use (``write_tensor_shard`` once per shard, then
``write_manifest``); ``DurableShardWriter``; the reference loops
``write_cache_shards`` and ``write_cache_shards_distributed``; and, for comparison,
the reference implementation's own writer (plain ``save_file`` shards and a manifest
without integrity fields), which te_thd still reads but cannot verify. Each trial
copies one clean cache, damages ONE file, and then looks at it every way a user does:

* ``verify_cache(dir, deep=True)`` (= ``te-thd cache verify``);
* open + read every sample through the batched path (``__getitems__``) and, on a
  fresh dataset, through the per-item path (``__getitem__``);
* the training read path: ``CachedTensorDataset`` -> ``build_cached_dataloader``
  (its ``CacheShardSampler``, shard-block shuffled) -> ``CachedThdCollator`` for one
  epoch, compared batch by batch with the same epoch of the clean cache.

Damage kinds: one byte XOR-flipped at a random position of a shard (stratified:
40% in the 8-byte length prefix + JSON header, 60% in the tensor data), a shard
truncated to a random length, one byte flipped in ``manifest.json``, the manifest
truncated.

Rules (a trial that breaks one is a violation, exit status 1):

1. only ``ValueError`` (te_thd's ``CacheError`` family) may be raised -- never
   another exception type from any path;
2. every error that is raised names the damaged file (its base name), except
   that an error caused by a damaged manifest may instead name the shard the
   manifest no longer describes -- that is counted separately ("blames a shard");
3. never wrong tensors from a te_thd-written cache: no read path (batched, per-item,
   training) returns a tensor that differs from the clean cache without raising.
   Every shard te_thd writes carries per-row checksums, so this holds with no
   deep verify first;
4. with a manifest that records whole-file checksums (``produce_cache``), every
   damaged shard is also caught by deep verify; a truncated shard fails at open.

For the reference implementation's writer, rules 2 and 3 cannot hold (its shards and
manifest carry no checksums, so a damaged file cannot be told from the ones it
contradicts): the figures count its wrong tensors and its errors naming another file.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _run_info import git_commit

NUM_SAMPLES = 24
SHARD_SIZE = 8
KEYS = ("hidden", "input_ids", "loss_mask")


def expected_sample(i: int) -> dict[str, Any]:
    import torch

    return {
        "hidden": torch.sin(torch.arange(32, dtype=torch.float32) * 0.1 * (i + 1)),
        "input_ids": torch.arange(16, dtype=torch.int64) * 7 + i,
        "loss_mask": (torch.arange(16) + i) % 4 != 0,
    }


class _Index:
    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"idx": i}


def _compute(batch: Any) -> dict[str, Any]:
    import torch

    samples = [expected_sample(i) for i in batch["idx"].tolist()]
    return {k: torch.stack([s[k] for s in samples]) for k in KEYS}


def _shard_tensors(shard: int) -> dict[str, Any]:
    import torch

    rows = [
        expected_sample(i)
        for i in range(shard * SHARD_SIZE, min(NUM_SAMPLES, (shard + 1) * SHARD_SIZE))
    ]
    return {k: torch.stack([r[k] for r in rows]) for k in KEYS}


def _loader() -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(_Index(), batch_size=4, shuffle=False)


def _reference_manifest(path: Path) -> None:
    from te_thd.offline_cache import write_manifest

    write_manifest(str(path), {"num_samples": NUM_SAMPLES, "shard_size": SHARD_SIZE}, 1)


def make_clean_cache(path: Path) -> None:
    """``produce_cache``: lock, resume, manifest with schema and whole-file checksums."""
    from te_thd.offline_cache import produce_cache

    produce_cache(
        _loader(),
        str(path),
        SHARD_SIZE,
        _compute,
        KEYS,
        {"scenario": "corruption_test"},
        progress=False,
    )


def _write_tensor_shard(path: Path) -> None:
    """The reference API as the reference implementation's producers call it."""
    from te_thd.offline_cache import write_tensor_shard

    for s in range(-(-NUM_SAMPLES // SHARD_SIZE)):
        write_tensor_shard(str(path), s, _shard_tensors(s), KEYS, "offline")
    _reference_manifest(path)


def _durable_writer(path: Path) -> None:
    from te_thd.offline_cache import DurableShardWriter

    with DurableShardWriter(KEYS) as w:
        for s in range(-(-NUM_SAMPLES // SHARD_SIZE)):
            w(str(path), s, _shard_tensors(s))
    _reference_manifest(path)


def _loop_writer(distributed: bool) -> Any:
    def write(path: Path) -> None:
        import logging

        from te_thd.offline_cache import (
            write_cache_shards,
            write_cache_shards_distributed,
            write_tensor_shard,
        )

        def fn(d: str, i: int, t: dict[str, Any]) -> str:
            return write_tensor_shard(d, i, t, KEYS, "offline")

        log = logging.getLogger("corruption_test")
        if distributed:
            write_cache_shards_distributed(
                _loader(), str(path), SHARD_SIZE, 1, 0, _compute, fn, log
            )
        else:
            write_cache_shards(_loader(), str(path), SHARD_SIZE, 0, _compute, fn, log)
        _reference_manifest(path)

    return write


def _reference_writer(path: Path) -> None:
    """What the reference implementation writes: plain save_file shards, a manifest without integrity fields."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for s in range(-(-NUM_SAMPLES // SHARD_SIZE)):
        save_file(_shard_tensors(s), str(path / f"shard-{s:06d}.safetensors"))
    manifest = {"format_version": 1, "num_samples": NUM_SAMPLES, "shard_size": SHARD_SIZE}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


#: writer path -> function writing the clean cache into a directory
WRITERS = {
    "produce_cache": make_clean_cache,
    "write_tensor_shard": _write_tensor_shard,
    "DurableShardWriter": _durable_writer,
    "write_cache_shards": _loop_writer(False),
    "write_cache_shards_distributed": _loop_writer(True),
    "reference_writer": _reference_writer,
}
#: writer paths whose shards carry no checksums (rule 3 cannot hold; counted instead)
UNVERIFIABLE = frozenset({"reference_writer"})


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def _attempt(fn) -> tuple[str, BaseException | None]:
    try:
        fn()
    except ValueError as e:
        return "ValueError", e
    except Exception as e:  # noqa: BLE001 - any other kind is what we are looking for
        return "other", e
    return "ok", None


def _train_epoch(cache_dir: str) -> list[dict[str, Any]]:
    """One epoch through the training read path: dataset -> sampler + loader -> THD collator."""
    import warnings

    from te_thd.offline_cache import (
        CachedTensorDataset,
        CachedThdCollator,
        UnverifiedCacheWarning,
        build_cached_dataloader,
    )

    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UnverifiedCacheWarning
        )  # the reference writer's cache: counted
        ds = CachedTensorDataset(cache_dir, "offline", 1, KEYS)
        collate = CachedThdCollator(64, keys=("input_ids", "loss_mask"), token_keys=("loss_mask",))
        loader = build_cached_dataloader(ds, 4, True, collate, seed=3)
        return [{k: b[k] for k in ("input_ids", "loss_mask", "cu_seqlens")} for b in loader]


def _read_everything(
    cache_dir: str, path: str, clean_epoch: list[dict[str, Any]]
) -> tuple[str, BaseException | None, bool]:
    """Open the cache and read every sample through one read path.

    ``path`` is ``"batched"`` (``__getitems__``, what DataLoader calls), ``"item"``
    (``__getitem__``, the reference API) or ``"train"`` (:func:`_train_epoch`,
    compared with ``clean_epoch``). Returns (outcome, exception, tensors_equal_clean).
    """
    import warnings

    import torch

    from te_thd.offline_cache import CachedTensorDataset, UnverifiedCacheWarning

    state = {"same": True}

    def check(i: int, got: dict[str, Any]) -> None:
        want = expected_sample(i)
        for k in KEYS:
            t = got[k]
            if t.dtype != want[k].dtype or t.shape != want[k].shape or not torch.equal(t, want[k]):
                state["same"] = False

    def run() -> None:
        if path == "train":
            got = _train_epoch(cache_dir)
            state["same"] = len(got) == len(clean_epoch) and all(
                g[k].dtype == c[k].dtype and g[k].shape == c[k].shape and torch.equal(g[k], c[k])
                for g, c in zip(got, clean_epoch, strict=True) for k in c
            )  # fmt: skip
            return
        ds = CachedTensorDataset(cache_dir, "offline", 1, KEYS)
        if len(ds) != NUM_SAMPLES:
            state["same"] = False
            return
        if path == "batched":
            batch = ds.__getitems__(list(range(NUM_SAMPLES)))
            for i in range(NUM_SAMPLES):
                check(i, {k: batch.tensors[k][i] for k in KEYS})
        else:
            for i in range(NUM_SAMPLES):
                check(i, ds[i])

    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UnverifiedCacheWarning
        )  # the reference writer's cache: counted
        outcome, exc = _attempt(run)
    return outcome, exc, state["same"]


def _names(exc: BaseException | None, name: str) -> bool:
    return exc is not None and name in str(exc)


READ_PATHS = ("batched", "item", "train")


def _damage(work: Path, kind: str, rng: random.Random) -> tuple[str, str, dict[str, int]]:
    """Damage one file of ``work``; returns (file name, region, {"pos" or "cut": int})."""
    shards = sorted(p.name for p in work.iterdir() if p.name.startswith("shard-"))
    target = "manifest.json" if kind.startswith("manifest") else rng.choice(shards)
    path = work / target
    data = bytearray(path.read_bytes())
    region = ""
    if kind.endswith("flip"):
        if kind == "shard-flip":
            hdr = _header_end(data)
            region = "header" if rng.random() < 0.4 else "data"
            pos = rng.randrange(0, hdr) if region == "header" else rng.randrange(hdr, len(data))
        else:
            pos = rng.randrange(len(data))
        data[pos] ^= rng.randrange(1, 256)
        detail = {"pos": pos}
    else:
        cut = rng.randrange(0, len(data))
        data = data[:cut]
        detail = {"cut": cut}
    path.write_bytes(bytes(data))
    return target, region, detail


def trial(
    clean: Path,
    work: Path,
    kind: str,
    rng: random.Random,
    writer: str = "produce_cache",
    clean_epoch: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Damage one copy of the clean cache; return what verify and every read path made of it."""
    from te_thd.offline_cache import verify_cache

    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(clean, work)
    shards = sorted(p.name for p in work.iterdir() if p.name.startswith("shard-"))
    target, region, detail = _damage(work, kind, rng)
    v_out, v_exc = _attempt(lambda: verify_cache(str(work), deep=True))
    reads = {p: _read_everything(str(work), p, clean_epoch or []) for p in READ_PATHS}
    res: dict[str, Any] = {"writer": writer, "kind": kind, "file": target, "region": region, **detail,
                           "verify": v_out, **{p: r[0] for p, r in reads.items()},
                           "read": "ok" if all(r[0] == "ok" for r in reads.values()) else "error",
                           "read_correct": all(r[2] for r in reads.values()),
                           "msgs": {n: str(e)[:300] for n, e in [("verify", v_exc)] + [(p, r[1]) for p, r in reads.items()]
                                    if e is not None}}  # fmt: skip
    problems = []
    for what, out, exc in [("verify", v_out, v_exc)] + [
        (f"{p} read", r[0], r[1]) for p, r in reads.items()
    ]:
        if out == "other":
            problems.append(f"{what} raised {type(exc).__name__}: {exc}")
        elif out == "ValueError" and not _names(exc, target):
            if target == "manifest.json" and any(_names(exc, s) for s in shards):
                res.setdefault("blames_shard", []).append(what)
            elif writer in UNVERIFIABLE:
                # no checksums to tell a damaged file from the ones it contradicts: counted
                res.setdefault("misattributed", []).append(what)
            else:
                problems.append(f"{what} error does not name {target}: {exc}")
    wrong = [p for p, (out, _, same) in reads.items() if out == "ok" and not same]
    res["wrong_tensors"] = bool(wrong)
    if wrong and writer not in UNVERIFIABLE:
        problems.append(
            f"WRONG TENSORS: the {', '.join(wrong)} read path(s) returned tensors that differ from clean"
        )
    if writer == "produce_cache" and target != "manifest.json" and v_out == "ok":
        problems.append("deep verify passed a damaged shard")
    if kind == "shard-truncate" and reads["batched"][0] == "ok" and reads["item"][0] == "ok":
        problems.append("a truncated shard opened and read without error")
    res["detected"] = v_out != "ok" or res["read"] != "ok"
    res["problems"] = problems
    return res


PLAN_QUICK = {"shard-flip": 120, "shard-truncate": 30, "manifest-flip": 60, "manifest-truncate": 20}
PLAN_FULL = {
    "shard-flip": 1000,
    "shard-truncate": 200,
    "manifest-flip": 400,
    "manifest-truncate": 100,
}
#: the other writer paths share the format; fewer trials each
PLAN_OTHER_QUICK = {"shard-flip": 12, "shard-truncate": 2, "manifest-flip": 2}
PLAN_OTHER_FULL = {
    "shard-flip": 200,
    "shard-truncate": 40,
    "manifest-flip": 60,
    "manifest-truncate": 20,
}


def _summary(trials: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for kind in kinds:
        ts = [t for t in trials if t["kind"] == kind]
        s = {
            "tried": len(ts),
            "detected": sum(t["detected"] for t in ts),
            "detected_by_verify": sum(t["verify"] != "ok" for t in ts),
            "detected_at_open_or_read": sum(t["read"] != "ok" for t in ts),
            **{f"detected_by_{p}_read": sum(t[p] != "ok" for t in ts) for p in READ_PATHS},
            "wrong_tensors_returned": sum(t["wrong_tensors"] for t in ts),
            "benign_undetected_reads_correct": sum(
                not t["detected"] and t["read_correct"] for t in ts
            ),
            "violations": sum(bool(t["problems"]) for t in ts),
        }
        if kind == "shard-flip":
            for region in ("header", "data"):
                rs = [t for t in ts if t["region"] == region]
                s[f"{region}_flips"] = len(rs)
                s[f"{region}_flips_caught_by_reader_alone"] = sum(
                    t["batched"] != "ok" and t["item"] != "ok" for t in rs
                )
                s[f"{region}_flips_caught_by_training_path"] = sum(t["train"] != "ok" for t in rs)
                s[f"{region}_flips_caught_by_some_read_path"] = sum(t["read"] != "ok" for t in rs)
        if kind.startswith("manifest"):
            s["errors_blaming_a_shard"] = sum(bool(t.get("blames_shard")) for t in ts)
        summary[kind] = s
    return summary


def run(
    quick: bool,
    seed: int | None = None,
    workdir: str | None = None,
    plan: dict[str, int] | None = None,
    other_plan: dict[str, int] | None = None,
) -> dict[str, Any]:
    plan = plan or (PLAN_QUICK if quick else PLAN_FULL)
    other_plan = (
        other_plan if other_plan is not None else (PLAN_OTHER_QUICK if quick else PLAN_OTHER_FULL)
    )
    seed = seed if seed is not None else time.time_ns() % 2**31
    rng = random.Random(seed)
    t0 = time.perf_counter()
    own = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix="te_thd_corrupt_"))
    trials: list[dict[str, Any]] = []
    try:
        for writer, write in WRITERS.items():
            clean = wd / f"clean-{writer}"
            write(clean)
            clean_epoch = _train_epoch(str(clean))
            p = plan if writer == "produce_cache" else other_plan
            trials += [trial(clean, wd / "trial", kind, rng, writer, clean_epoch)
                       for kind, n in p.items() for _ in range(n)]  # fmt: skip
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    main_trials = [t for t in trials if t["writer"] == "produce_cache"]
    violations = [
        f"{t['writer']} {t['kind']} {t['file']} {t.get('pos', t.get('cut'))}: {p}"
        for t in trials
        for p in t["problems"]
    ]
    kinds: dict[str, int] = {}
    for t in trials:
        for p in t["problems"]:
            k = re.sub(r"(raised \w+).*", r"\1", p)
            k = re.sub(r"(does not name \S+).*", r"\1", k)
            kinds[k] = kinds.get(k, 0) + 1
    damaged_shards = [t for t in main_trials if t["file"] != "manifest.json"]
    by_writer = {}
    for writer in WRITERS:
        ts = [t for t in trials if t["writer"] == writer]
        flips = [t for t in ts if t["kind"] == "shard-flip"]
        by_writer[writer] = {
            "tried": len(ts),
            "detected": sum(t["detected"] for t in ts),
            "shard_flips_detected_by_reading": f"{sum(t['read'] != 'ok' for t in flips)}/{len(flips)}",
            "shard_flips_detected_by_training_path": f"{sum(t['train'] != 'ok' for t in flips)}/{len(flips)}",
            "shard_flips_detected_by_verify": f"{sum(t['verify'] != 'ok' for t in flips)}/{len(flips)}",
            "wrong_tensors_returned_undetected": sum(
                t["wrong_tensors"] and not t["detected"] for t in ts
            ),
            "wrong_tensors_returned": sum(t["wrong_tensors"] for t in ts),
            "errors_naming_another_file": sum(bool(t.get("misattributed")) for t in ts),
            "by_kind": _summary(ts, list(dict.fromkeys(t["kind"] for t in ts))),
        }
    return {
        "ok": not violations,
        "seed": seed,
        "mode": "quick" if quick else "full",
        "commit": git_commit(),
        "tried": len(main_trials),
        "detected": sum(t["detected"] for t in main_trials),
        "shard_corruptions_detected_by_deep_verify": f"{sum(t['verify'] != 'ok' for t in damaged_shards)}/{len(damaged_shards)}",
        "wrong_tensors_returned_undetected": sum(
            not t["detected"] and not t["read_correct"] for t in main_trials
        ),
        "by_kind": _summary(main_trials, list(plan)),
        "by_writer": by_writer,
        "tried_all_writers": len(trials),
        "violation_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "violations": violations[:100],
        "n_violations": len(violations),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help=f"CI mode: {PLAN_QUICK}")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = run(args.quick, args.seed)
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
