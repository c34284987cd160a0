"""Distributed producer: 2 and 3 real gloo processes vs a single-process run, byte for byte.

Every rank runs ``tests/_offline_cache_dist_worker.py`` (one process per rank, all
scenarios per spawn to keep the process count low). The single-process reference
is produced here with the same dataset and compute function.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from te_thd.offline_cache import (
    existing_shard_indices,
    partition_cache_shards,
    produce_cache,
    verify_cache,
)
from te_thd.offline_cache.write.producer import PROGRESS_NAME

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_offline_cache_dist_worker.py"
sys.path.insert(0, str(HERE))
import _offline_cache_dist_worker as w  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _reference(tmp: Path, name: str, n: int, shard_size: int, bs: int) -> dict[str, bytes]:
    out = tmp / f"ref-{name}-{n}-{shard_size}-{bs}"
    if not out.exists():
        kw = w.produce_kwargs(name)
        produce_cache(w.loader(n, bs), str(out), shard_size, w.compute, kw.pop("keys"), w.OPTIONS, progress=False,
                      length_key=w.LENGTH_KEY, **kw)  # fmt: skip
    return _bytes(out)


def _spawn(world: int, base: Path) -> list[dict]:
    port = _free_port()
    outs = [base / f"result-{r}.json" for r in range(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(r),
                str(world),
                str(port),
                str(base / "caches"),
                str(outs[r]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(se)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r]}"
    return [json.loads(o.read_text()) for o in outs]


def _expected_steps(
    n: int, shard_size: int, bs: int, world: int, present: set[int] = frozenset()
) -> list[int]:
    local = []
    for r in range(world):
        s0, _, k = partition_cache_shards(n, shard_size, world, r)
        shards = range(s0, s0 + -(-k // shard_size)) if k else range(0)
        local.append(
            sum(-(-min(shard_size, n - i * shard_size) // bs) for i in shards if i not in present)
        )
    return local


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refs")


def _check_same_cache(results: list[dict], name: str, cache: Path, ref: dict[str, bytes]) -> None:
    manifests = [r[name]["manifest"] for r in results if name in r]
    assert all(m == manifests[0] for m in manifests)  # every rank returns the same manifest
    assert _bytes(cache) == ref  # shards AND manifest byte-identical; no temp, lock, progress file
    # every sample's length recorded, from the data, whichever rank wrote (or a resume read back) its shard
    m = manifests[0]
    assert m["length_rule"] == {"key": "n", "kind": "value", "pad_token_id": 0}
    assert [v for r in m["shards"] for v in r["lengths"]] == [
        i % 5 + 1 for i in range(m["num_samples"])
    ]
    assert verify_cache(str(cache), deep=True)["lengths_verified"]


def test_two_ranks_uneven_counts_match_single_process(tmp_path: Path, ref_dir: Path) -> None:
    results = _spawn(2, tmp_path)
    for name, (n, shard_size, bs) in w.SCENARIOS[2].items():
        _check_same_cache(
            results, name, tmp_path / "caches" / name, _reference(ref_dir, name, n, shard_size, bs)
        )
        local = _expected_steps(n, shard_size, bs, 2)
        calls = [r[name]["calls"] for r in results]
        assert calls == [max(local)] * 2, (name, calls, local)  # lockstep: equal counts, padded
    assert _expected_steps(13, 2, 2, 2) == [4, 3]  # the scenario really is uneven
    ragged = results[0]["ragged"]["manifest"]
    assert ragged["token_layout"] == {"keys": ["tok"], "codecs": {"tok": "fp8_e4m3"}}
    assert all(r["fidelity"]["tok"]["max_rel_l2"] < 0.1 for r in ragged["shards"])


def test_three_ranks_uneven_zero_shard_rank_resume_subgroup_and_errors(
    tmp_path: Path, ref_dir: Path
) -> None:
    # 'resume': a single-process run died after 3 of 7 shards; the 3 ranks finish it
    n, shard_size, bs = w.SCENARIOS[3]["resume"]
    resume_dir = tmp_path / "caches" / "resume"
    calls = {"n": 0}

    def dies(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("node lost")
        return w.compute(batch)

    with pytest.raises(RuntimeError):
        produce_cache(w.loader(n, bs), str(resume_dir), shard_size, dies, w.KEYS, w.OPTIONS, progress=False,
                      length_key=w.LENGTH_KEY)  # fmt: skip
    assert existing_shard_indices(str(resume_dir)) == {0, 1, 2}

    results = _spawn(3, tmp_path)
    caches = tmp_path / "caches"

    for name in ("uneven", "zero_rank", "resume"):
        n, shard_size, bs = w.SCENARIOS[3][name]
        _check_same_cache(
            results, name, caches / name, _reference(ref_dir, name, n, shard_size, bs)
        )
        present = {0, 1, 2} if name == "resume" else set()
        local = _expected_steps(n, shard_size, bs, 3, present)
        assert [r[name]["calls"] for r in results] == [max(local)] * 3, (name, local)
    assert _expected_steps(7, 4, 2, 3) == [2, 2, 0]  # rank 2 owns no shard, runs 2 dummy forwards
    assert _expected_steps(13, 2, 2, 3, {0, 1, 2}) == [0, 2, 2]  # rank 0's block was already done

    # a process group that is not the world: ranks 1 and 2 only (group rank 0 = global rank 1)
    n, shard_size, bs = w.SCENARIOS[3]["subgroup"]
    assert "subgroup" not in results[0]
    _check_same_cache(
        results, "subgroup", caches / "subgroup", _reference(ref_dir, "subgroup", n, shard_size, bs)
    )
    assert [results[r]["subgroup"]["calls"] for r in (1, 2)] == [
        max(_expected_steps(n, shard_size, bs, 2))
    ] * 2

    # rank 1 writes a wrong dtype: every rank raises (nobody hangs), no manifest is written
    errs = [r["schema_error"].get("error", "") for r in results]
    assert "key 'h' is float32[n, 4] but the cache schema says bfloat16[n, 4]" in errs[1]
    assert all("rank 1:" in e and "cache schema says bfloat16" in e for e in errs), errs
    bad = caches / "schema_error"
    assert not (bad / "manifest.json").exists()
    assert (bad / PROGRESS_NAME).exists()  # resumable once compute_batch is fixed
    produce_cache(
        w.loader(9, 2),
        str(bad),
        2,
        w.compute,
        w.KEYS,
        w.OPTIONS,
        progress=False,
        length_key=w.LENGTH_KEY,
    )
    assert _bytes(bad) == _reference(ref_dir, "schema_error", 9, 2, 2)


def test_reference_output_is_what_the_dataset_says(ref_dir: Path) -> None:
    """Guard for the byte comparisons above: the reference cache holds the computed tensors."""
    from te_thd.offline_cache import CachedTensorDataset

    _reference(ref_dir, "uneven", 13, 2, 2)
    ds = CachedTensorDataset(
        cache_dir=str(ref_dir / "ref-uneven-13-2-2"),
        cache_name="t",
        format_version=1,
        disk_keys=w.KEYS,
    )
    data = w.dataset(13)
    for i in range(13):
        assert torch.equal(ds[i]["ids"], data[i]["i"] + 1)
        assert torch.equal(ds[i]["h"], (data[i]["x"] * 0.5).to(torch.bfloat16))
