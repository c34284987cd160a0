"""Corruption test of the offline cache: flip bytes, truncate files, and check nothing slips through.

``python scripts/corruption_test.py [--quick] [--seed S] [--json OUT]``

A small clean cache is produced with ``produce_cache`` (3 shards). Each trial
copies it, damages ONE file, and then looks at it the two ways a user does:

* ``verify_cache(dir, deep=True)`` (= ``te-thd cache verify --deep``);
* open + read: ``CachedTensorDataset(...)``, then every sample, once through the
  batched path (``__getitems__``) and, on a fresh dataset, through the per-item
  path (``__getitem__``).

Damage kinds: one byte XOR-flipped at a random position of a shard (stratified:
40% in the 8-byte length prefix + JSON header, 60% in the tensor data), a shard
truncated to a random length, one byte flipped in ``manifest.json``, the manifest
truncated.

Rules (a trial that breaks one is a violation, exit status 1):

1. only ``ValueError`` (te_thd's ``CacheError`` family) may be raised -- never
   another exception type from either path;
2. every error that is raised names the damaged file (its base name), except
   that an error caused by a damaged manifest may instead name the shard the
   manifest no longer describes -- that is counted separately ("blames a shard");
3. detection: every damaged SHARD is caught by deep verify (the CRC-32 covers the
   whole file), a truncated shard already at open (size check), and every
   header flip that changes what the header means at open or first read;
4. never wrong tensors: if neither verify nor the reader objects, every tensor
   read equals the clean cache's (a manifest flip inside JSON whitespace, or in a
   field no reader uses, is "benign").

Without a deep verify, a flipped byte inside tensor DATA is returned as read:
opening a cache only checks sizes (cheap); the figures report how many
such trials the reader alone did not catch.
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


def make_clean_cache(path: Path) -> None:
    from torch.utils.data import DataLoader

    from te_thd.offline_cache import produce_cache

    loader = DataLoader(_Index(), batch_size=4, shuffle=False)
    produce_cache(loader, str(path), SHARD_SIZE, _compute, KEYS, {"scenario": "corruption_test"}, progress=False)


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


def _read_everything(cache_dir: str, path: str) -> tuple[str, BaseException | None, bool]:
    """Open the cache and read every sample through one read path.

    ``path`` is ``"batched"`` (``__getitems__``, what DataLoader calls) or
    ``"item"`` (``__getitem__``, the reference API). Returns (outcome, exception,
    tensors_equal_clean).
    """
    import torch

    from te_thd.offline_cache import CachedTensorDataset

    state = {"same": True}

    def check(i: int, got: dict[str, Any]) -> None:
        want = expected_sample(i)
        for k in KEYS:
            t = got[k]
            if t.dtype != want[k].dtype or t.shape != want[k].shape or not torch.equal(t, want[k]):
                state["same"] = False

    def run() -> None:
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

    outcome, exc = _attempt(run)
    return outcome, exc, state["same"]


def _names(exc: BaseException | None, name: str) -> bool:
    return exc is not None and name in str(exc)


def trial(clean: Path, work: Path, kind: str, rng: random.Random) -> dict[str, Any]:
    """Damage one copy of the clean cache; return what verify and the reader made of it."""
    from te_thd.offline_cache import verify_cache

    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(clean, work)
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

    v_out, v_exc = _attempt(lambda: verify_cache(str(work), deep=True))
    b_out, b_exc, b_same = _read_everything(str(work), "batched")
    i_out, i_exc, i_same = _read_everything(str(work), "item")
    res: dict[str, Any] = {"kind": kind, "file": target, "region": region, **detail,
                           "verify": v_out, "batched": b_out, "item": i_out,
                           "read": "ok" if b_out == i_out == "ok" else "error",
                           "read_correct": b_same and i_same,
                           "msgs": {n: str(e)[:300] for n, e in (("verify", v_exc), ("batched", b_exc),
                                                                 ("item", i_exc)) if e is not None}}
    problems = []
    for what, out, exc in (("verify", v_out, v_exc), ("batched read", b_out, b_exc), ("item read", i_out, i_exc)):
        if out == "other":
            problems.append(f"{what} raised {type(exc).__name__}: {exc}")
        elif out == "ValueError" and not _names(exc, target):
            if target == "manifest.json" and any(_names(exc, s) for s in shards):
                res.setdefault("blames_shard", []).append(what)
            else:
                problems.append(f"{what} error does not name {target}: {exc}")
    detected = v_out != "ok" or res["read"] != "ok"
    for what, out, same in (("batched read", b_out, b_same), ("item read", i_out, i_same)):
        if out == "ok" and not same and v_out == "ok":
            problems.append(f"WRONG TENSORS: verify passed and the {what} returned tensors that differ from clean")
        if out == "ok" and not same and region == "header":
            problems.append(f"header flip: the {what} returned wrong tensors without an error")
    if target != "manifest.json" and v_out == "ok":
        problems.append("deep verify passed a damaged shard")
    if kind == "shard-truncate" and "ok" in (b_out, i_out):
        problems.append("a truncated shard opened and read without error")
    res["detected"] = detected
    res["problems"] = problems
    return res


PLAN_QUICK = {"shard-flip": 120, "shard-truncate": 30, "manifest-flip": 60, "manifest-truncate": 20}
PLAN_FULL = {"shard-flip": 1000, "shard-truncate": 200, "manifest-flip": 400, "manifest-truncate": 100}


def run(quick: bool, seed: int | None = None, workdir: str | None = None,
        plan: dict[str, int] | None = None) -> dict[str, Any]:
    plan = plan or (PLAN_QUICK if quick else PLAN_FULL)
    seed = seed if seed is not None else time.time_ns() % 2**31
    rng = random.Random(seed)
    t0 = time.perf_counter()
    own = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix="te_thd_corrupt_"))
    try:
        clean = wd / "clean"
        make_clean_cache(clean)
        trials = [trial(clean, wd / "trial", kind, rng) for kind, n in plan.items() for _ in range(n)]
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    summary: dict[str, Any] = {}
    for kind in plan:
        ts = [t for t in trials if t["kind"] == kind]
        s = {
            "tried": len(ts),
            "detected": sum(t["detected"] for t in ts),
            "detected_by_verify": sum(t["verify"] != "ok" for t in ts),
            "detected_at_open_or_read": sum(t["read"] != "ok" for t in ts),
            "detected_by_both_read_paths": sum(t["batched"] != "ok" and t["item"] != "ok" for t in ts),
            "benign_undetected_reads_correct": sum(not t["detected"] and t["read_correct"] for t in ts),
            "violations": sum(bool(t["problems"]) for t in ts),
        }
        if kind == "shard-flip":
            for region in ("header", "data"):
                rs = [t for t in ts if t["region"] == region]
                s[f"{region}_flips"] = len(rs)
                s[f"{region}_flips_caught_by_reader_alone"] = sum(
                    t["batched"] != "ok" and t["item"] != "ok" for t in rs)
        if kind.startswith("manifest"):
            s["errors_blaming_a_shard"] = sum(bool(t.get("blames_shard")) for t in ts)
        summary[kind] = s
    violations = [f"{t['kind']} {t['file']} {t.get('pos', t.get('cut'))}: {p}" for t in trials for p in t["problems"]]
    kinds: dict[str, int] = {}
    for t in trials:
        for p in t["problems"]:
            k = re.sub(r"(raised \w+).*", r"\1", p)
            k = re.sub(r"(does not name \S+).*", r"\1", k)
            kinds[k] = kinds.get(k, 0) + 1
    tried = len(trials)
    damaged_shards = [t for t in trials if t["file"] != "manifest.json"]
    return {
        "ok": not violations,
        "seed": seed,
        "mode": "quick" if quick else "full",
        "commit": git_commit(),
        "tried": tried,
        "detected": sum(t["detected"] for t in trials),
        "shard_corruptions_detected_by_deep_verify": f"{sum(t['verify'] != 'ok' for t in damaged_shards)}/{len(damaged_shards)}",
        "wrong_tensors_returned_undetected": sum(
            not t["detected"] and not t["read_correct"] for t in trials),
        "by_kind": summary,
        "violation_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "violations": violations[:100],
        "n_violations": len(violations),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
