"""The perf suite's plumbing: ratio orientation, goal judging, --check, report files.

Runs perf/run.py for real (subprocesses) against a directory of tiny fake bench
modules, so no timing and no torch work is involved.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

PERF = Path(__file__).resolve().parents[1] / "perf"
sys.path.insert(0, str(PERF))

from goals import Goal, evaluate, failures, judge, load_goals  # noqa: E402
from harness import Record, split_even  # noqa: E402


def _goal(min_ratio: float, margin: float = 0.1, **kw) -> Goal:
    base = dict(id="g", bench="b", case="*", baseline="base", statement="s")
    base.update(kw)
    return Goal(min_ratio=min_ratio, noise_margin=margin, **base)


def test_ratio_orientation_time_and_throughput():
    fast = Record("b", "c", "time", "s", ours=1.0, baselines={"base": 4.0})
    assert fast.ratios["base"] == pytest.approx(4.0)  # 4x faster -> 4
    slow = Record("b", "c", "time", "s", ours=2.0, baselines={"base": 1.0})
    assert slow.ratios["base"] == pytest.approx(0.5)  # twice the time -> 0.5
    tput = Record("b", "c", "throughput", "samples/s", ours=300.0, baselines={"base": 100.0})
    assert tput.ratios["base"] == pytest.approx(3.0)
    back = Record.from_json(json.loads(json.dumps(tput.to_json())))
    assert back == tput


def test_at_most_2x_the_time_is_min_ratio_half():
    g = _goal(0.5, margin=0.1)  # "<= 2x one index_select"
    at = Record("b", "c", "time", "s", ours=1.9, baselines={"base": 1.0}).ratios["base"]
    assert judge(at, g) == "met"
    assert (
        judge(Record("b", "c", "time", "s", ours=2.1, baselines={"base": 1.0}).ratios["base"], g)
        == "noise"
    )
    assert (
        judge(Record("b", "c", "time", "s", ours=2.5, baselines={"base": 1.0}).ratios["base"], g)
        == "missed"
    )
    assert judge(float("nan"), g) == "missed"


def test_evaluate_statuses():
    goals = [
        _goal(2.0, id="ok", bench="a"),
        _goal(2.0, id="ref", bench="a", baseline="reference", needs_reference=True),
        _goal(2.0, id="gone", bench="a", case="renamed*"),
        _goal(2.0, id="boom", bench="z"),
    ]
    recs = {"a": [Record("a", "x", "time", "s", 1.0, {"base": 3.0})]}
    res = evaluate(goals, recs, {"z": "Traceback"}, selected={"a", "z"}, reference_available=False)
    status = {r.goal: r.status for r in res}
    assert status == {"ok": "met", "ref": "skipped", "gone": "no-data", "boom": "error"}
    assert {r.goal for r in failures(res)} == {"gone", "boom"}
    res = evaluate(goals, recs, {}, selected={"a"}, reference_available=True)
    assert {r.goal: r.status for r in res}["ref"] == "no-data"  # installed but not measured
    assert {r.goal: r.status for r in res}["boom"] == "not-run"


def test_load_goals_errors(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match=r"t\.json: cannot read it as JSON"):
        load_goals(p)
    p.write_text(json.dumps({"goals": [{"id": "a", "bench": "b"}]}))
    with pytest.raises(ValueError, match=r"goal #0 lacks \['baseline', 'min_ratio', 'statement'\]"):
        load_goals(p)
    g = {
        "id": "a",
        "bench": "b",
        "baseline": "x",
        "min_ratio": 1,
        "statement": "s",
        "noise_margin": 1.5,
    }
    p.write_text(json.dumps({"goals": [g]}))
    with pytest.raises(ValueError, match=r"goal 'a' has min_ratio=1 noise_margin=1.5"):
        load_goals(p)
    p.write_text(json.dumps({"goals": [dict(g, noise_margin=0.1), dict(g, noise_margin=0.1)]}))
    with pytest.raises(ValueError, match=r"goal id 'a' appears twice"):
        load_goals(p)


def test_known_miss_is_reported_but_does_not_gate():
    import dataclasses

    g = dataclasses.replace(_goal(0.8, id="w", bench="a"), known_miss="physically bound")
    recs = {"a": [Record("a", "x", "throughput", "MB/s", 1.0, {"base": 2.0})]}  # ratio 0.5
    res = evaluate(
        [g, _goal(0.8, id="strict", bench="a")], recs, {}, selected={"a"}, reference_available=True
    )
    assert {r.goal: r.status for r in res} == {"w": "known-miss", "strict": "missed"}
    assert [r.goal for r in failures(res)] == ["strict"]
    assert judge(0.9, g) == "met"  # a known miss that is met again is simply met


def test_checked_in_thresholds_parse():
    goals = load_goals(PERF / "thresholds.json")
    ids = {g.id for g in goals}
    assert {
        "thd-conversion-vs-reference",
        "cp-shard-vs-index-select",
        "cache-write-vs-save-file",
        "cache-read-small-vs-reference",
        "cache-read-large-vs-reference",
        "cache-read-large-vs-raw-slice",
    } <= ids
    by = {g.id: g for g in goals}
    # the issues' numbers, not loosened
    assert by["thd-conversion-vs-reference"].min_ratio == 5.0
    assert by["cache-read-small-vs-reference"].min_ratio == 10.0
    assert by["cp-shard-vs-index-select"].min_ratio == 0.5
    assert by["cache-write-vs-save-file"].min_ratio == 0.8
    # the non-gating goals, each with a gating goal beside it
    assert [g.id for g in goals if g.known_miss] == [
        "cache-write-vs-save-file",
        "cache-read-large-vs-raw-preadv",
        "cache-read-large-verified-vs-raw-preadv-hash",
        "cache-read-large-vs-reference",
        "follow-pipeline-vs-producer",
        "follow-pipeline-vs-sequential",
        "balance-plan-time",
        "tokens-cp-fetch-demo",
        "tokens-cp2-throughput-warm-demo",
        "s3-cold-vs-client",
        "s3-warm-vs-local-large",
        "peers-specforge-thd-warm",
    ]
    assert not by["follow-first-step"].known_miss
    assert {
        "cache-write-vs-save-file-fsync",
        "balance-plan-vs-ffd",
        "tokens-cp2-fetch",
        "s3-warm-vs-local",
    } <= set(by)
    assert not by["s3-warm-vs-local"].known_miss and by["s3-warm-vs-local"].min_ratio == 0.8
    assert not any(
        by[g].known_miss
        for g in (
            "tokens-cp2-fetch",
            "tokens-cp4-fetch",
            "tokens-cp2-throughput",
            "tokens-cp2-throughput-warm",
        )
    )
    # the ragged and object-store read goals keep the numbers
    assert (
        by["tokens-cp2-throughput-warm"].min_ratio
        == by["tokens-cp2-throughput-warm-demo"].min_ratio
        == 1.0
    )
    assert by["s3-cold-vs-client"].min_ratio == 0.8
    assert by["cache-write-vs-save-file-fsync"].min_ratio == 0.8
    assert not by["cache-write-vs-save-file-fsync"].known_miss
    # the producer's writes hidden behind compute gate at the number
    assert by["produce-writes-hidden"].min_ratio == 0.9
    assert not by["produce-writes-hidden"].known_miss
    # the raw-loop read goals keep the numbers (reported as known misses until the read path reaches them)
    assert by["cache-read-large-vs-raw-preadv"].min_ratio == 0.9
    assert by["cache-read-large-verified-vs-raw-preadv-hash"].min_ratio == 0.85
    assert not by["cache-read-large-unverified-vs-reference"].known_miss
    # both large-vs-reference goals keep the number and are judged only on the records
    # whose readers were each timed in fresh processes of their own (in a shared process the
    # reference's rate depended on the heap the readers before it left); the unverified one
    # gates, the verified one is reported: measured that way, its shuffled ratio is short
    verified = by["cache-read-large-vs-reference"].known_miss
    assert "processes of its own" in verified and "bimodal" not in verified
    for gid, case in (
        ("cache-read-large-vs-reference", "large_{}"),
        ("cache-read-large-unverified-vs-reference", "unverified_large_{}"),
    ):
        assert by[gid].min_ratio == 1.3 and by[gid].baseline == "reference"
        for order in ("sequential", "shuffled"):
            assert fnmatch.fnmatchcase(case.format(order) + "_own_process", by[gid].case)
            assert not fnmatch.fnmatchcase(case.format(order), by[gid].case)
    # every goal says what it protects in words, and cites no tracker numbers
    import re

    for g in goals:
        assert len(g.purpose.split()) >= 6, g.id
        for text in (g.statement, g.purpose, g.known_miss):
            assert not re.search(r"(?i)\bissues?\s*#?\d+", text), (g.id, text)


FAKE_BENCH = """
from harness import Record

def run(quick):
    return [Record("{name}", "shape1", "time", "s", ours={ours}, baselines={{"base": 1.0}}),
            Record("{name}", "shape2", "throughput", "items/s", ours=50.0, baselines={{"base": 10.0}})]
"""


@pytest.fixture()
def fake_suite(tmp_path):
    bench_dir = tmp_path / "benches"
    bench_dir.mkdir()
    (bench_dir / "bench_good.py").write_text(FAKE_BENCH.format(name="good", ours=0.25))
    (bench_dir / "bench_slow.py").write_text(FAKE_BENCH.format(name="slow", ours=0.9))
    (bench_dir / "bench_boom.py").write_text(
        "def run(quick):\n    raise RuntimeError('kaput 42')\n"
    )
    goals = [
        {
            "id": "good-fast",
            "bench": "good",
            "case": "*",
            "baseline": "base",
            "min_ratio": 2.0,
            "statement": "good is 2x",
        },
        {
            "id": "slow-fast",
            "bench": "slow",
            "case": "shape1",
            "baseline": "base",
            "min_ratio": 2.0,
            "statement": "slow is 2x",
        },
    ]
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"noise_margin": 0.1, "goals": goals}))
    return bench_dir, thresholds, tmp_path / "results"


def _run(fake_suite, *args: str) -> subprocess.CompletedProcess:
    bench_dir, thresholds, results = fake_suite
    cmd = [
        sys.executable,
        str(PERF / "run.py"),
        "--quick",
        "--bench-dir",
        str(bench_dir),
        "--thresholds",
        str(thresholds),
        "--results-dir",
        str(results),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_check_fails_naming_misses_and_report_files(fake_suite):
    _, _, results = fake_suite
    p = _run(fake_suite, "--check")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "CHECK FAILED: goal slow-fast (slow/shape1 vs base): missed: ratio 1.11x" in p.stderr
    assert "CHECK FAILED: bench:boom raised: RuntimeError: kaput 42" in p.stderr
    assert "good-fast" not in p.stderr
    runs = sorted(results.glob("run-*-quick.json"))
    assert len(runs) == 1
    doc = json.loads((results / "latest-quick.json").read_text())  # strict JSON (no Infinity)
    assert doc == json.loads(runs[0].read_text())
    assert doc["mode"] == "quick" and doc["machine"]["cpu_count"] >= 1
    assert "torch" in doc["versions"] and "commit" in doc["git"]
    benches = {b["name"]: b for b in doc["benches"]}
    assert benches["boom"]["status"] == "error" and "kaput 42" in benches["boom"]["error"]
    good = benches["good"]["records"]
    assert good[0]["ratios"]["base"] == pytest.approx(4.0) and good[1]["ratios"][
        "base"
    ] == pytest.approx(5.0)
    assert not doc["check"]["passed"]
    md = (results / "latest-quick.md").read_text()
    assert "| good | shape1 | 250 ms | base | 1 s | 4.00x | - | >= 2x: met |" in md
    assert "| `slow-fast` | slow is 2x | 1.11x (shape1 vs base) | >= 2x | 1.8x | **MISSED** |" in md
    assert "`boom`: error: RuntimeError: kaput 42" in md
    png = (results / "latest-quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    # only the bench that meets its goal: exit 0; the first run's ratios appear in the
    # history column
    p = _run(fake_suite, "--check", "--only", "good")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "check passed" in p.stdout
    md = (results / "latest-partial.md").read_text()  # an --only run
    assert "| good | shape1 | 250 ms | base | 1 s | 4.00x | 4.00x | >= 2x: met |" in md
    assert not (results / "latest.json").exists()  # only a full run of every bench writes latest.*
    assert len(sorted(results.glob("run-*-quick.json"))) == 2

    p = _run(fake_suite, "--only", "nosuch")
    assert p.returncode == 2
    assert "--only nosuch: no such bench" in p.stderr and "available: boom, good, slow" in p.stderr


def _reference_suite(tmp_path: Path) -> list[str]:
    """A one-bench suite with a reference goal and a floor goal; run.py's arguments for it."""
    bench_dir = tmp_path / "benches"
    bench_dir.mkdir()
    (bench_dir / "bench_conv.py").write_text(
        "from harness import Record, reference_thd_utils\n"
        "def run(quick):\n"
        "    base = {'floor': 2.0}\n"
        "    if reference_thd_utils() is not None:\n"
        "        base['reference'] = 10.0\n"
        "    return [Record('conv', 'x', 'time', 's', 1.0, base)]\n"
    )
    goals = [
        {
            "id": "vs-ref",
            "bench": "conv",
            "baseline": "reference",
            "min_ratio": 5,
            "statement": "5x ref",
            "needs_reference": True,
        },
        {
            "id": "vs-floor",
            "bench": "conv",
            "baseline": "floor",
            "min_ratio": 1.5,
            "statement": "1.5x floor",
        },
    ]
    (tmp_path / "t.json").write_text(json.dumps({"goals": goals}))
    return [
        "--quick",
        "--check",
        "--bench-dir",
        str(bench_dir),
        "--thresholds",
        str(tmp_path / "t.json"),
        "--results-dir",
        str(tmp_path / "r"),
    ]


def test_missing_reference_is_reported_and_its_goals_skipped(tmp_path):
    p = subprocess.run(
        [sys.executable, str(PERF / "run.py"), "--no-reference", *_reference_suite(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reference implementation unavailable" in p.stdout
    doc = json.loads((tmp_path / "r" / "latest-quick.json").read_text())
    assert doc["reference"]["available"] is False
    assert {g["goal"]: g["status"] for g in doc["goals"]} == {
        "vs-ref": "skipped",
        "vs-floor": "met",
    }


def test_check_confirms_a_miss_with_the_median_of_three_runs(tmp_path):
    bench_dir = tmp_path / "benches"
    bench_dir.mkdir()
    counter = tmp_path / "calls"
    # first run misses (ratio 1.0), the two confirmation runs meet the 2x goal
    (bench_dir / "bench_flaky.py").write_text(
        "from pathlib import Path\n"
        "from harness import Record\n"
        f"COUNTER = Path({str(counter)!r})\n"
        "def run(quick):\n"
        "    n = int(COUNTER.read_text()) if COUNTER.exists() else 0\n"
        "    COUNTER.write_text(str(n + 1))\n"
        "    ours = 1.0 if n == 0 else 0.4 + 0.05 * n\n"
        "    return [Record('flaky', 'x', 'time', 's', ours, {'base': 1.0})]\n"
    )
    goals = [
        {"id": "flaky-2x", "bench": "flaky", "baseline": "base", "min_ratio": 2, "statement": "2x"}
    ]
    (tmp_path / "t.json").write_text(json.dumps({"noise_margin": 0.1, "goals": goals}))
    base_cmd = [
        sys.executable,
        str(PERF / "run.py"),
        "--quick",
        "--bench-dir",
        str(bench_dir),
        "--thresholds",
        str(tmp_path / "t.json"),
        "--results-dir",
        str(tmp_path / "r"),
    ]
    p = subprocess.run([*base_cmd, "--check"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "confirmation run 2/2" in p.stdout
    doc = json.loads((tmp_path / "r" / "latest-quick.json").read_text())
    (bench,) = doc["benches"]
    assert bench["runs"] == 3
    (rec,) = bench["records"]
    assert rec["ours"] == pytest.approx(0.5)  # median of 1.0, 0.45, 0.5
    assert [a["ours"] for a in rec["extra"]["attempts"]] == pytest.approx([1.0, 0.45, 0.5])
    assert doc["goals"][0]["status"] == "met"
    # without confirmation the same first-run miss fails the check
    counter.unlink()
    p = subprocess.run(
        [*base_cmd, "--check", "--confirm", "0"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1 and "goal flaky-2x" in p.stderr


def test_run_never_installs_the_reference_and_says_how_to(tmp_path, monkeypatch, capsys):
    import run as perf_run
    from harness import REFERENCE_REQUIREMENT, REFERENCE_REQUIREMENTS_FILE

    launched: list[list[str]] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, args, *a, **kw):
            launched.append([str(x) for x in args])
            super().__init__(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    monkeypatch.setattr(perf_run, "_installed_reference_version", lambda: None)
    monkeypatch.delenv("TE_THD_PERF_NO_REFERENCE", raising=False)
    assert perf_run.main(_reference_suite(tmp_path)) == 0
    out = capsys.readouterr().out
    assert launched, "the bench runs in a subprocess: the recorder must have seen it"
    assert not [a for a in launched if "pip" in a], launched
    hint = f"{sys.executable} -m pip install --no-deps -r {REFERENCE_REQUIREMENTS_FILE}"
    assert (
        f"reference implementation unavailable: not installed; the baselines need {REFERENCE_REQUIREMENT}"
        in out
    )
    assert hint in out and "its goals are reported as skipped" in out
    doc = json.loads((tmp_path / "r" / "latest-quick.json").read_text())
    assert doc["reference"]["available"] is False and hint in doc["reference"]["detail"]


def test_reference_requirement_file_pins_one_version(tmp_path):
    from harness import REFERENCE_REQUIREMENT, REFERENCE_VERSION, _reference_requirement

    assert REFERENCE_REQUIREMENT == f"nemo-automodel=={REFERENCE_VERSION}"
    bad = tmp_path / "req.txt"
    bad.write_text("# two pins\nnemo-automodel==0.7.0\nnemo-automodel==0.8.0\n")
    with pytest.raises(ValueError, match="must hold exactly one 'name==version' line"):
        _reference_requirement(bad)


def test_te_thd_bench_help_and_errors_name_te_thd_bench():
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from te_thd.cli import main; sys.exit(main())",
            "bench",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: te-thd bench [-h] [--quick] [--check]"), p.stdout
    assert "perf/run.py" not in p.stdout.split("\n\n")[0]
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from te_thd.cli import main; sys.exit(main())",
            "bench",
            "--only",
            "nosuch",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and p.stderr.startswith(
        "te-thd bench: --only nosuch: no such bench"
    ), p.stderr


# -- the raw loops' static split of pieces over threads ----------------------------------------


class _Piece(NamedTuple):
    nbytes: int
    tag: int = 0


def _piece(nbytes: int, tag: int = 0) -> _Piece:
    return _Piece(nbytes, tag)


def _size(p: _Piece) -> int:
    return p.nbytes


@example([1, 0], 1)  # a zero-byte piece (rows of shape [0]) after the bytes are all done
@given(
    st.lists(st.sampled_from([0, 1, 2, 64]) | st.integers(0, 1000), max_size=40), st.integers(1, 6)
)
def test_split_even_keeps_order_and_balances_bytes(sizes, parts):
    """Consecutive groups: every piece once and in order, at most ``parts`` groups,
    none empty, and a group's bytes without its last piece under ``total / parts``
    (so no group exceeds its share by more than one piece); when no piece exceeds the
    share, every thread gets a group."""
    pieces = [_piece(n, i) for i, n in enumerate(sizes)]
    groups = split_even(pieces, parts, _size)
    flat = [p for g in groups for p in g]
    assert [p.tag for p in flat] == list(range(len(sizes)))  # each once, in order
    assert len(groups) <= parts
    assert all(groups) or (not sizes and groups == [[]])
    total = sum(sizes)
    for g in groups:
        before_last = sum(p.nbytes for p in g[:-1])
        assert before_last * parts <= total, (sizes, parts, [[p.nbytes for p in g] for g in groups])
    if total and len(sizes) >= parts and max(sizes) * parts <= total:
        assert len(groups) == parts


def test_split_even_examples():
    sizes = lambda groups: [[p.nbytes for p in g] for g in groups]  # noqa: E731
    assert sizes(split_even([_piece(n) for n in (4, 4, 4, 4)], 2, _size)) == [[4, 4], [4, 4]]
    assert sizes(split_even([_piece(n) for n in (10, 1, 1, 1)], 2, _size)) == [[10], [1, 1, 1]]
    assert sizes(split_even([_piece(n) for n in (3, 3, 3)], 4, _size)) == [
        [3],
        [3],
        [3],
    ]  # fewer pieces than threads
    assert sizes(split_even([_piece(5)], 3, _size)) == [[5]]


@pytest.mark.timeout(120)  # the old naming looped for ever on a third run in one second
def test_two_runs_in_one_second_keep_both_reports(fake_suite):
    _, _, results = fake_suite
    assert _run(fake_suite, "--only", "good").returncode == 0
    from report import write_report

    doc = json.loads(next(results.glob("run-*-quick.json")).read_text())
    again = write_report(doc, results, latest=None)  # the same "started" second
    third = write_report(doc, results, latest=None)
    runs = sorted(p.name for p in results.glob("run-*-quick.json"))
    assert len(runs) == 3 and again["json"].name in runs and third["json"].name in runs
    for paths in (again, third):
        assert {p.suffix for p in paths.values()} <= {".json", ".md", ".png"}
        assert len({p.stem for p in paths.values()}) == 1 and paths["json"].stem.endswith("-quick")
