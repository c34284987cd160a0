"""``te-thd cache plan``: a cache's bytes, shards and CP reads, predicted before it is produced.

* the predicted shard bytes are exactly the writers' (hypothesis: random schemas,
  lengths, shard sizes, padded / ragged / each codec, against ``produce_cache``);
* the planner's CP share (``cp_share_tokens``) covers every token of a sample across
  the ranks, and no rank reads more than the sample's blocks;
* the demo's cache and the Hugging Face example's cache, produced padded and ragged:
  predicted bytes within 1% of the directory on disk, and predicted bytes per CP rank
  within 5% of what a real read of one epoch at cp=2 fetches (the process's
  ``/proc/self/io`` ``rchar``: every byte its read calls returned);
* the CLI: the table, ``--json``, the example's ``--plan`` through ``te-thd cache plan
  --target/--data``, and one line naming the argument, value and fix on bad input (exit 2).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from _example_support import EXAMPLES, REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from te_thd.offline_cache import (
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    produce_cache,
)
from te_thd.offline_cache.format.codecs import CODECS
from te_thd.offline_cache.format.schema import TensorSpec
from te_thd.offline_cache.read import planner as readplan
from te_thd.offline_cache.read.cp_reads import cp_spans, cp_tokens_read
from te_thd.offline_cache.tools.plan import (
    CacheSpec,
    layouts,
    parse_key,
    plan_cache,
    read_lengths,
)

SAMPLE = EXAMPLES / "data" / "sample_chat.jsonl"
PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _shard_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("shard-"))


def _disk_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


# -- the layout math against the writers ---------------------------------------------------


@PROPERTY
@given(
    lengths=st.lists(st.integers(0, 24), min_size=1, max_size=40),
    shard_size=st.integers(1, 16),
    hidden=st.integers(1, 70),
    topk=st.integers(1, 4),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
    vocab=st.sampled_from([100, 65_536, 65_537, 131_073]),
)
def test_predicted_shard_bytes_are_the_writers(
    tmp_path_factory, lengths, shard_size, hidden, topk, dtype, vocab
):
    width = 24
    schema = {
        "input_ids": TensorSpec(torch.int64, (width,)), "seq_len": TensorSpec(torch.int64, ()),
        "ids": TensorSpec(torch.int32, (width, topk)), "hidden": TensorSpec(dtype, (width, hidden)),
    }  # fmt: skip
    spec = CacheSpec(
        schema,
        ("input_ids", "ids", "hidden"),
        shard_size,
        2,
        length_key="seq_len",
        vocab_size=vocab,
    )
    costs = {c.name: c for c in plan_cache(lengths, spec)}
    combined = "ragged+" + "+".join(CODECS)  # every codec on the keys it takes, as a producer asks
    assert set(costs) == {"padded", "ragged", *(f"ragged+{c}" for c in CODECS), combined}
    samples = [{"n": torch.tensor(v)} for v in lengths]

    def compute(batch):
        n = batch["n"]
        real = torch.arange(width)[None, :] < n[:, None]
        g = torch.Generator().manual_seed(int(n.sum()))
        return {
            "input_ids": torch.randint(1, 100, (n.numel(), width), generator=g) * real, "seq_len": n,
            "ids": torch.randint(0, vocab, (n.numel(), width, topk), generator=g, dtype=torch.int32) * real[..., None],
            "hidden": (torch.randn(n.numel(), width, hidden, generator=g) * real[..., None]).to(dtype),
        }  # fmt: skip

    for name, layout in layouts(spec):
        out = str(tmp_path_factory.mktemp("cache"))
        kw = {} if layout is None else {"token_keys": layout.keys, "codecs": dict(layout.codecs)}
        manifest = produce_cache(DataLoader(samples, batch_size=4), out, shard_size, compute, tuple(schema),
                                 progress=False, length_key="seq_len", **kw)  # fmt: skip
        assert (
            costs[name].total_bytes
            == _shard_bytes(out)
            == sum(s["bytes"] for s in manifest["shards"])
        ), name
        assert costs[name].num_shards == len(manifest["shards"])
        # the manifest as the producer writes it: only its codecs' loss figures differ in width
        real = os.path.getsize(os.path.join(out, "manifest.json"))
        assert abs(costs[name].manifest_bytes - real) <= 0.05 * real, (
            name,
            costs[name].manifest_bytes,
            real,
        )


@PROPERTY
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=30),
    cp=st.integers(1, 4),
    block_tokens=st.integers(1, 64),
    gap=st.integers(0, 64),
    packed=st.sampled_from([None, 1, 2]),
    batch=st.integers(1, 8),
)
def test_cp_reads_cover_every_token_and_stay_within_the_samples(
    lengths, cp, block_tokens, gap, packed, batch
):
    lengths = np.asarray(lengths, dtype=np.int64)
    multiple = 2 * cp if cp > 1 else 1
    seq = None if packed is None else packed * -(-300 // multiple) * multiple
    spans = cp_spans(lengths, cp, seq, batch)
    assert np.all(spans >= lengths) and np.all(spans % multiple == 0)
    groups = np.arange(lengths.size) // batch
    reads = [cp_tokens_read(lengths, spans, groups, cp, r, block_tokens, gap) for r in range(cp)]
    # no rank reads past its groups' samples (a gap is read only between blocks of one group),
    # every real token is read by some rank, and one rank alone reads every token once
    assert all(0 <= r <= lengths.sum() for r in reads)
    assert sum(reads) >= lengths.sum()
    if cp == 1:
        assert reads[0] == lengths.sum()
    alone = np.arange(lengths.size)
    assert (
        sum(cp_tokens_read(lengths, spans, alone, cp, r, block_tokens, 0) for r in range(cp))
        >= lengths.sum()
    )


def test_parse_key_and_read_lengths():
    assert parse_key("hidden=bfloat16:L,4096", 96) == (
        "hidden",
        TensorSpec(torch.bfloat16, (96, 4096)),
    )
    assert parse_key("seq_len=int64", 96) == ("seq_len", TensorSpec(torch.int64, ()))
    assert read_lengths("# a comment\n3\n\n 5 \n", "f").tolist() == [3, 5]


# -- produced caches: the demo's and the Hugging Face example's -----------------------------


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _fetched(cache: str, cp: int, rank: int, seq_len: int) -> int:
    """Bytes one epoch at ``cp`` reads for CP rank ``rank`` (every read call of this process)."""
    with open(os.path.join(cache, "manifest.json")) as f:
        keys = tuple(json.load(f)["schema"])
    before = _rchar()
    ds = CachedTensorDataset(cache, "ep_cp_distill", 1, keys)
    col = CachedThdCollator(seq_len, length_key="seq_len", cp_size=cp, cp_rank=rank)
    for _ in build_cached_dataloader(dataset=ds, batch_size=8, shuffle=False, collate_fn=col):
        pass
    return _rchar() - before


def _plan(argv: list[str]) -> tuple[dict[str, dict], str]:
    """The example's plan of ``argv``: every layout's figures, and the layout those flags produce."""
    import precompute_cache

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert precompute_cache.main([*argv, "--plan", "--json", "--plan-batch-size", "8"]) == 0
    out = json.loads(buf.getvalue())
    return {lay["layout"]: lay for lay in out["layouts"]}, out["produced_layout"]


def _check_against_caches(tmp_path, monkeypatch, argv: list[str], seq_len: int) -> None:
    import precompute_cache

    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io to count the bytes a read fetches")
    # every key read with preadv (a read call rchar counts), not copied from a mapping
    monkeypatch.setattr(readplan, "COPY_ENGINE", "preadv")
    torch.set_num_threads(1)
    caches = {"padded": ["--layout", "padded"], "ragged": [], "ragged+fp8_e4m3": ["--hidden-codec", "fp8_e4m3"],
              # both of the producer's codecs at once (and its compact dtypes): the column those flags ask for
              "ragged+fp8_e4m3+topk_index": ["--compact-dtypes", "--hidden-codec", "fp8_e4m3"]}  # fmt: skip
    plan = {}
    for name, extra in caches.items():
        figures, produced = _plan([*argv, *extra])
        assert produced == name, (extra, produced)
        plan[name] = figures[name]
        out = str(tmp_path / name.replace("+", "-"))
        assert precompute_cache.main([*argv, "--out", out, *extra]) == 0
        disk = _disk_bytes(out)
        want = plan[name]["total_bytes"] + plan[name]["manifest_bytes"]
        assert abs(want - disk) <= 0.01 * disk, (name, want, disk)
        assert plan[name]["total_bytes"] == _shard_bytes(out), name
        manifest = os.path.getsize(os.path.join(out, "manifest.json"))
        assert abs(plan[name]["manifest_bytes"] - manifest) <= 0.02 * manifest, (
            name,
            plan[name]["manifest_bytes"],
            manifest,
        )
    _fetched(
        str(tmp_path / "ragged"), 2, 0, seq_len
    )  # the reader's modules imported, not counted below
    for name in caches:
        for rank in range(2):
            got = _fetched(str(tmp_path / name.replace("+", "-")), 2, rank, seq_len)
            want = plan[name]["cp_rank_bytes"][rank]
            assert abs(want - got) <= 0.05 * got, (name, rank, want, got)


def test_demo_cache_bytes_and_cp_reads_match_the_plan(tmp_path, monkeypatch):
    argv = [
        "--cp",
        "2",
        "--num-samples",
        "256",
        "--shard-size",
        "64",
    ]  # the demo's producer, 256 samples
    _check_against_caches(tmp_path, monkeypatch, argv, 256)


def test_hf_example_cache_bytes_and_cp_reads_match_the_plan(tmp_path, monkeypatch):
    from ep_cp.tiny_hf import make_tiny_model_dir

    model = make_tiny_model_dir(str(tmp_path / "model"), "llama", str(SAMPLE))
    argv = [
        "--target", f"hf:{model}", "--data", f"jsonl:{SAMPLE}", "--messages-key", "messages",
        "--cp", "2", "--max-len", "128", "--pack-seq-len", "128", "--shard-size", "8", "--batch-size", "8",
        "--layers", "0,2", "--dtype", "fp32",
    ]  # fmt: skip
    _check_against_caches(tmp_path, monkeypatch, argv, 128)


# -- the command line --------------------------------------------------------------------------


def _te_thd(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "te_thd.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
    )


KEYS = ("--key", "input_ids=int64:L", "--key", "seq_len=int64", "--key", "hidden=bfloat16:L,64")


def test_cli_prints_every_layout_side_by_side_and_json(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# one per line\n16\n40\n96\n")
    res = _te_thd("cache", "plan", "--lengths", str(lengths), "--max-len", "96", *KEYS, "--length-key", "seq_len",
                  "--cp", "2")  # fmt: skip
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if "padded" in line and "ragged" in line)
    assert header.split() == [
        "padded",
        "ragged",
        "ragged+fp8_e4m3",
    ]  # no vocabulary: no index codec
    assert "CP rank 1 reads/epoch" in res.stdout
    res = _te_thd("cache", "plan", "--lengths", str(lengths), "--max-len", "96", *KEYS, "--length-key", "seq_len",
                  "--cp", "2", "--vocab-size", "70000")  # fmt: skip
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if "padded" in line and "ragged" in line)
    assert header.split() == [
        "padded",
        "ragged",
        *(f"ragged+{c}" for c in CODECS),
        "ragged+" + "+".join(CODECS),
    ]
    assert "input_ids as topk_index:70000" in res.stdout
    res = _te_thd("cache", "plan", "--lengths", str(lengths), "--max-len", "96", *KEYS, "--length-key", "seq_len",
                  "--cp", "2", "--json")  # fmt: skip
    out = json.loads(res.stdout)
    spec = CacheSpec({k: v for k, v in (parse_key(a, 96) for a in KEYS[1::2])}, ("input_ids", "hidden"), 128, 2,
                     length_key="seq_len")  # fmt: skip
    assert [lay["total_bytes"] for lay in out["layouts"]] == [
        c.total_bytes for c in plan_cache([16, 40, 96], spec)
    ]
    assert (
        out["num_samples"] == 3
        and out["real_tokens"] == 152
        and len(out["layouts"][0]["cp_rank_bytes"]) == 2
    )


def test_cli_target_and_data_run_the_examples_plan(tmp_path):
    res = _te_thd(
        "cache",
        "plan",
        "--data",
        "synthetic",
        "--num-samples",
        "64",
        "--cp",
        "2",
        "--json",
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["num_samples"] == 64 and [lay["layout"] for lay in out["layouts"]][:2] == [
        "padded",
        "ragged",
    ]
    assert "hidden" in out["schema"] and out["schema"]["hidden"]["shape"] == [96, 64]


@pytest.mark.parametrize(
    "lines, extra, message",
    [
        ("16\nabc\n", (), r"--lengths {f}:2 holds 'abc', not a length; write one integer >= 0 per line"),
        ("", (), r"--lengths {f} holds no lengths; write one integer >= 0 per line, one line per sample"),
        ("16\n200\n", ("--max-len", "96"), r"lengths: sample 1 has length 200, longer than L=96 of the token keys; "
         r"raise the padded length (te-thd cache plan --max-len) to at least 200, or truncate the samples"),
        ("16\n", ("--key", "x=int65:L"), r"--key 'x=int65:L' is not NAME=DTYPE[:SHAPE]; write e.g. --key "
         r"hidden=bfloat16:L,4096"),
        ("16\n", ("--cp", "0"), r"--cp=0 must be >= 1: the context-parallel size of training, e.g. --cp 2"),
        ("16\n", ("--shard-size", "0"), r"--shard-size=0 must be >= 1: samples per shard, e.g. --shard-size 128"),
        ("16\n", ("--length-key", "nope"), r"--length-key: 'nope' is not a --key (['hidden', 'input_ids', 'seq_len']); "
         r"name one of them"),
        ("16\n", ("--key", "x=bfloat16:L,8"), None),
        ("16\n", ("--codec-keys", "hidden,hiden"), r"--codec-keys: 'hiden' is not a --key (['hidden', 'input_ids', "
         r"'seq_len']); name one of them"),
        ("16\n90\n", ("--cp", "2", "--pack-seq-len", "50"), r"--pack-seq-len=50 must be a multiple of 2*cp=4 and hold "
         r"the longest sample padded to it (92); pass a multiple of 4 of at least 92"),
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line_exit_2(tmp_path, lines, extra, message):
    f = tmp_path / "lengths.txt"
    f.write_text(lines)
    if message is None:  # no key the lengths come from
        res = _te_thd("cache", "plan", "--lengths", str(f), *extra)
        message = "--length-key: none given and no --key input_ids, but a ragged layout stores each sample's real tokens: "
        message += "pass --length-key KEY naming the key that holds each length"
    else:
        res = _te_thd("cache", "plan", "--lengths", str(f), *KEYS, *extra)
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("te-thd cache plan: "), res.stderr
    assert message.format(f=f) in err[0], err[0]


def test_cli_missing_lengths_file_names_it(tmp_path):
    res = _te_thd("cache", "plan", "--lengths", str(tmp_path / "none.txt"), *KEYS)
    assert res.returncode == 2
    assert res.stderr.strip().startswith(
        f"te-thd cache plan: --lengths {tmp_path / 'none.txt'}: cannot be read"
    )
    assert "pass a text file with one length per line" in res.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [],
            "--out is required: pass the cache directory, e.g. --out runs/cache (or --plan to cost it)",
        ),
        (["--out", "x", "--json"], "--json applies to --plan only: add --plan, or drop --json"),
        (["--plan", "--plan-batch-size", "0"], "--plan-batch-size=0 must be >= 1"),
    ],
)
def test_example_plan_flag_errors(argv, message):
    from precompute_cache import build_parser, check_args

    with pytest.raises(ValueError) as exc:
        check_args(build_parser().parse_args(argv))
    assert str(exc.value) == message


def test_library_refusals_name_the_argument():
    schema = {"hidden": TensorSpec(torch.bfloat16, (8, 4))}
    with pytest.raises(ValueError, match=r"^a ragged cache needs each sample's length: pass length_key \(a stored key\) "
                                         r"or store input_ids$"):  # fmt: skip
        plan_cache([3], CacheSpec(schema, ("hidden",), 4))
    with pytest.raises(ValueError, match=r"^cp=0 "):
        plan_cache([3], CacheSpec(schema, (), 4, cp=0))
    with pytest.raises(ValueError, match=r"^pack_seq_len=6 must be a multiple of 2\*cp=4"):
        cp_spans(np.asarray([3]), 2, 6, 1)


def test_cli_target_without_a_checkout_says_what_to_do(monkeypatch, tmp_path, capsys):
    from te_thd.cli import main

    monkeypatch.setenv("TE_THD_SOURCE", str(tmp_path))
    assert (
        main(["cache", "plan", "--target", "hf:models/my-llm", "--data", "jsonl:chats.jsonl"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "te-thd cache plan: --target/--data read the samples as examples/precompute_cache.py does: "
        f"TE_THD_SOURCE={tmp_path} has no examples/precompute_cache.py; set it to the root of a te_thd checkout "
        "(the directory with pyproject.toml, examples/ and perf/)"
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "jsonl:chats.jsonl"], "--data jsonl:chats.jsonl needs --target hf:DIR: text is tokenized with "
         "the model's tokenizer, and the synthetic target has none"),
        (["--num-samples", "0"], "--num-samples=0 must be >= 1"),
        (["--compact-dtypes", "--hidden-codec", "fp4"], "argument --hidden-codec: invalid choice: 'fp4' (choose from "
         "'none', 'fp8_e4m3')"),
        (["--cp", "2"], "pass --lengths FILE with a --key NAME=DTYPE[:SHAPE] per stored key (any producer's cache), or "
         "the example producer's flags, e.g. --num-samples 1024 (see te-thd cache plan --help)"),
    ],
)  # fmt: skip
def test_cli_producer_route_bad_input_is_one_line_exit_2(tmp_path, argv, message):
    res = _te_thd("cache", "plan", *argv, cwd=str(tmp_path))
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.strip().splitlines() == [f"te-thd cache plan: {message}"]


def test_cli_help_shows_both_ways_in_with_an_example_of_each_and_one_shard_size():
    from precompute_cache import build_parser

    from te_thd.cli import build_parser as te_thd_parser

    res = _te_thd("cache", "plan", "--help")
    assert res.returncode == 0, res.stderr
    usage = res.stdout.split("\n\n", 1)[0]
    assert "[--lengths FILE] [--key NAME=DTYPE[:SHAPE]]" in usage  # neither required: two ways in
    for flag in ("--target", "--data", "--num-samples", "--compact-dtypes", "--hidden-codec"):
        assert f"[{flag}" in usage, flag
    examples = [
        ln.strip()
        for ln in res.stdout.split("two ways in", 1)[1].splitlines()
        if "te-thd cache plan" in ln
    ]
    assert any("--compact-dtypes" in ln for ln in examples) and any(
        "--lengths" in ln for ln in examples
    )
    # one shard size by default, whichever way in
    ours = te_thd_parser().parse_args(["cache", "plan"]).shard_size
    assert ours == build_parser().parse_args(["--plan"]).shard_size == 128


def test_cli_producer_route_marks_the_column_its_flags_write(tmp_path):
    res = _te_thd("cache", "plan", "--num-samples", "64", "--compact-dtypes", "--hidden-codec", "fp8_e4m3",
                  cwd=str(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "the producer's flags as given write: ragged+fp8_e4m3+topk_index" in res.stdout
    assert (
        "ragged+fp8_e4m3+topk_index: hidden as fp8_e4m3, topk_indices as topk_index:256"
        in res.stdout
    )
