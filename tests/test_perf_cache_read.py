"""perf/bench_cache_read.py times the reference's large reads only in processes of their own.

In one process the reference's large-sample rate depends on the heap the readers timed
before it left (its fresh batch tensors come from reused heap or from new pages), so the
large cases time it, and te_thd's two loaders against it, each in fresh processes of
their own (the ``*_own_process`` records); the interleaved large records carry no
reference. Tiny sizes, real subprocesses, real files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[1] / "perf"
sys.path.insert(0, str(PERF))

import bench_cache_read as bench  # noqa: E402
from cache_readers import own_process_seconds  # noqa: E402
from harness import reference_offline_cache  # noqa: E402

SAMPLES, BATCH = 8, 4


@pytest.fixture(scope="module")
def large_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    cache_dir = str(tmp_path_factory.mktemp("cache_read") / "large")
    bench.write_cache(cache_dir, SAMPLES, 4, "large")
    return cache_dir


def test_interleaved_large_records_carry_no_reference(large_cache: str) -> None:
    ref = reference_offline_cache()
    records = bench._throughput_cases(
        "large_shuffled", large_cache, bench.LARGE_KEYS, BATCH, True, SAMPLES, 1, ref, True
    )
    assert [r.case for r in records] == ["large_shuffled", "unverified_large_shuffled"]
    assert not any("reference" in r.baselines for r in records)
    assert "raw_slice" in records[0].baselines and "raw_preadv" in records[1].baselines


@pytest.mark.skipif(
    reference_offline_cache() is None,
    reason="the reference implementation (perf/reference-requirements.txt) is not installed",
)
def test_own_process_records_time_every_reader_in_fresh_processes(large_cache: str) -> None:
    records = bench._own_process_cases(
        "large_sequential", large_cache, bench.LARGE_KEYS, BATCH, False, SAMPLES, 1, 1
    )
    assert [r.case for r in records] == [
        "large_sequential_own_process",
        "unverified_large_sequential_own_process",
    ]
    for r in records:
        assert set(r.baselines) == {"reference"}
        assert r.ours > 0 and r.baselines["reference"] > 0
        per = r.extra["rate_per_process"]
        assert {k: len(v) for k, v in per.items()} == {"ours": 1, "unverified": 1, "reference": 1}
    assert [r.extra["verify"] for r in records] == [True, False]
    # both records share the one reference figure, its processes' median
    assert records[0].baselines == records[1].baselines


def test_a_failed_own_process_timing_names_the_reader_and_the_cause(tmp_path: Path) -> None:
    spec = {
        "reader": "ours",
        "cache_dir": str(tmp_path / "no_cache_here"),
        "keys": list(bench.LARGE_KEYS),
        "batch": BATCH,
        "shuffle": False,
        "num_samples": SAMPLES,
        "trials": 1,
        "warmup": 1,
        "threads": 1,
    }
    with pytest.raises(RuntimeError, match=r"timing ours in its own process failed: .*\S"):
        own_process_seconds(spec)
