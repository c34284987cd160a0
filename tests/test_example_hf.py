"""The example pipeline on a real Hugging Face model and real text, with no download.

Tiny Llama and Qwen2 models are built from ``transformers`` configs (random init),
saved with ``save_pretrained`` and loaded back by path; their tokenizer is a byte-level
BPE trained in-process with ``tokenizers`` on ``examples/data/sample_chat.jsonl``.

* the cached rows equal what the model computes for each sample run alone (no
  padding): top-k log-probs and ids, ``hidden_states[-1]``, the chosen layers;
* the loss mask of a chat sample covers exactly its assistant turns;
* the whole job, as docs/own-model.md prints it: a tiny model directory, ``torchrun``
  precompute on 2 ranks (the same shards as one process), then 20 training steps at
  CP=2, EP=2 on 4 gloo ranks;
* every bad input gets an error naming the flag / line and the fix.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _example_support import EXAMPLES, REPO

SAMPLE = EXAMPLES / "data" / "sample_chat.jsonl"
LAYERS = "0,2,4"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from ep_cp.tiny_hf import make_tiny_model_dir

    root = tmp_path_factory.mktemp("hf_models")
    return {a: make_tiny_model_dir(str(root / a), a, str(SAMPLE)) for a in ("llama", "qwen2")}


def _precompute_argv(
    model_dir: str, out: str, *extra: str, data: str | Path = SAMPLE, key: str = "--messages-key"
) -> list[str]:
    return [
        "--target", f"hf:{model_dir}",
        "--data", f"jsonl:{data}",
        key, "messages" if key == "--messages-key" else "text",
        "--out", out,
        "--cp", "2", "--max-len", "128", "--pack-seq-len", "128",
        "--shard-size", "8", "--batch-size", "8",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def caches(model_dirs, tmp_path_factory) -> dict[str, str]:
    """One fp32 cache per architecture, produced in this process, with --layers."""
    import precompute_cache

    torch.set_num_threads(1)
    out = {}
    for arch, d in model_dirs.items():
        path = str(tmp_path_factory.mktemp(f"cache_{arch}") / "cache")
        argv = _precompute_argv(d, path, "--layers", LAYERS, "--dtype", "fp32")
        assert precompute_cache.main(argv) == 0
        out[arch] = path
    return out


def _rows(cache_dir: str, keys: tuple[str, ...]):
    from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION

    from te_thd.offline_cache import CachedTensorDataset

    return CachedTensorDataset(cache_dir, CACHE_NAME, FORMAT_VERSION, keys)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cached_rows_equal_the_model_run_on_each_sample_alone(arch, model_dirs, caches):
    from transformers import AutoModelForCausalLM

    from te_thd.offline_cache import read_manifest

    keys = ("input_ids", "seq_len", "loss_mask", "topk_logprobs", "topk_indices", "hidden")
    data = _rows(caches[arch], (*keys, "layer_hidden"))
    manifest = read_manifest(caches[arch], "ep_cp_distill", 1)
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch]).float().eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    assert manifest["target"]["vocab_size"] == vocab == 640  # padded past the tokenizer's 600
    assert manifest["target"]["hidden_size"] == 48 and manifest["topk"] == 8
    assert manifest["layers"] == [0, 2, 4]
    lens = [int(data[i]["seq_len"]) for i in range(len(data))]
    assert len(set(lens)) > 4 and max(lens) == 128  # varied lengths: every batch is padded
    for i in range(0, len(data), 3):
        row = data[i]
        n = int(row["seq_len"])
        with torch.no_grad():
            out = model(input_ids=row["input_ids"][None, :n], output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        top_v, _ = logp.topk(8, dim=-1)
        torch.testing.assert_close(row["topk_logprobs"][:n], top_v, rtol=0, atol=2e-5)
        # the cached ids hold those log-probs (robust to near-ties swapping two ids)
        torch.testing.assert_close(
            logp.gather(-1, row["topk_indices"][:n].long()), row["topk_logprobs"][:n],
            rtol=0, atol=2e-5,
        )  # fmt: skip
        bf16 = {"rtol": 1.6e-2, "atol": 1e-5}  # the cache stores hidden states in bf16
        torch.testing.assert_close(
            row["hidden"][:n].float(), out.hidden_states[-1][0].to(torch.bfloat16).float(), **bf16
        )
        for j, layer in enumerate((0, 2, 4)):
            torch.testing.assert_close(
                row["layer_hidden"][:n, j].float(),
                out.hidden_states[layer][0].to(torch.bfloat16).float(),
                **bf16,
            )
        for key in ("topk_logprobs", "topk_indices", "hidden", "layer_hidden", "input_ids"):
            assert not row[key][n:].any(), f"{key} is not zero on padding"
        assert not row["loss_mask"][n:].any() and row["loss_mask"][:n].any()


def test_bf16_cache_is_as_close_to_fp32_as_the_model_run_alone(model_dirs, tmp_path):
    """bf16 kernels round differently for other batch shapes, so padded rows cannot equal
    an unpadded bf16 run bit for bit; they must carry no more error than bf16 itself:
    measured against the fp32 model, the cache's error matches the unpadded bf16 run's."""
    import precompute_cache
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "c")
    argv = _precompute_argv(model_dirs["llama"], out, "--dtype", "bf16")
    torch.set_num_threads(1)
    assert precompute_cache.main(argv) == 0
    assert json.loads(Path(out, "manifest.json").read_text())["target"]["dtype"] == "bf16"
    data = _rows(out, ("input_ids", "seq_len", "topk_logprobs", "topk_indices", "hidden"))
    ref = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).float().eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).to(torch.bfloat16).eval()
    err = {"cached_logp": 0.0, "alone_logp": 0.0, "cached_hidden": 0.0, "alone_hidden": 0.0}
    for i in range(len(data)):
        row = data[i]
        n = int(row["seq_len"])
        ids = row["input_ids"][None, :n]
        with torch.no_grad():
            exact = ref(input_ids=ids, output_hidden_states=True)
            alone = bf16(input_ids=ids, output_hidden_states=True)
        idx = row["topk_indices"][:n].long()
        truth = torch.log_softmax(exact.logits[0], -1).gather(-1, idx)
        alone_logp = torch.log_softmax(alone.logits[0].float(), -1).gather(-1, idx)
        err["cached_logp"] += (row["topk_logprobs"][:n] - truth).abs().sum().item()
        err["alone_logp"] += (alone_logp - truth).abs().sum().item()
        h = exact.hidden_states[-1][0]
        err["cached_hidden"] += (row["hidden"][:n].float() - h).abs().sum().item()
        err["alone_hidden"] += (alone.hidden_states[-1][0].float() - h).abs().sum().item()
    assert err["alone_logp"] > 0 and err["alone_hidden"] > 0  # bf16 does round
    assert err["cached_logp"] <= 1.5 * err["alone_logp"], err
    assert err["cached_hidden"] <= 1.5 * err["alone_hidden"], err


def test_chat_loss_mask_covers_exactly_the_assistant_turns(model_dirs, caches):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    lines = [json.loads(x) for x in SAMPLE.read_text().splitlines() if x.strip()]
    data = _rows(caches["llama"], ("input_ids", "seq_len", "loss_mask"))
    checked = 0
    for i, line in enumerate(lines):
        row = data[i]
        n = int(row["seq_len"])
        ids = row["input_ids"][:n]
        rendered = tok.apply_chat_template(line["messages"], tokenize=False)
        full = tok(rendered, add_special_tokens=False)["input_ids"]
        assert ids.tolist() == full[:128]
        if len(full) > 128:
            continue  # truncated: the reply's tail is gone
        replies = "".join(
            m["content"] + "<|im_end|>\n" for m in line["messages"] if m["role"] == "assistant"
        )
        assert tok.decode(ids[row["loss_mask"][:n]]) == replies
        checked += 1
    assert checked >= 10


def test_plain_text_is_fully_supervised_and_truncated(model_dirs, tmp_path):
    import precompute_cache
    from transformers import AutoTokenizer

    out = str(tmp_path / "cache")
    argv = _precompute_argv(model_dirs["qwen2"], out, "--num-samples", "8", key="--text-key")
    argv[argv.index("--max-len") + 1] = "24"
    assert precompute_cache.main(argv) == 0
    tok = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    lines = [json.loads(x) for x in SAMPLE.read_text().splitlines()][:8]
    data = _rows(out, ("input_ids", "seq_len", "loss_mask"))
    assert len(data) == 8
    for i, line in enumerate(lines):
        row = data[i]
        expect = tok(line["text"])["input_ids"][:24]
        assert expect[0] == tok.bos_token_id
        assert row["input_ids"][: len(expect)].tolist() == expect
        assert int(row["seq_len"]) == len(expect) and int(row["loss_mask"].sum()) == len(expect)
    manifest = json.loads(Path(out, "manifest.json").read_text())
    assert manifest["mask_prompt"] is False and manifest["data"]["truncated"] == 8
    assert manifest["data"]["text_key"] == "text" and "layers" not in manifest


def test_tokenizer_from_another_directory(model_dirs, tmp_path):
    """A model directory without tokenizer files: --tokenizer DIR supplies it."""
    import shutil

    import precompute_cache

    bare = tmp_path / "weights_only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(model_dirs["llama"], name), bare / name)
    argv = _precompute_argv(str(bare), str(tmp_path / "c"), "--num-samples", "4")
    with pytest.raises(ValueError, match=r"no tokenizer could be loaded from .*--tokenizer DIR"):
        precompute_cache.main(argv)
    assert precompute_cache.main([*argv, "--tokenizer", model_dirs["llama"]]) == 0
    manifest = json.loads(Path(tmp_path, "c", "manifest.json").read_text())
    assert manifest["data"]["tokenizer"] == os.path.abspath(model_dirs["llama"])


def _docs_commands(section: str) -> list[str]:
    """The bash lines of the first code block under ``section`` in docs/own-model.md."""
    text = (REPO / "docs" / "own-model.md").read_text().split(section, 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_docs_try_it_commands_run_the_whole_job(tmp_path):
    """The docs' CPU try-out, run as printed (paths under tmp): tiny model, 2-rank
    precompute (= the one-process shards), 20 steps at CP=2, EP=2 on 4 gloo ranks."""
    commands = _docs_commands("### Try it on the CPU without a model")
    assert len(commands) == 3
    runs = tmp_path / "runs"
    for line in commands:
        argv = shlex.split(line.replace("runs/", f"{runs}/"))
        assert argv[0] == ".venv/bin/python"
        run = subprocess.run(
            [sys.executable, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=240,
            env=_env(),
            cwd=REPO,
        )
        assert run.returncode == 0, f"{line}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    summary = json.loads((runs / "tiny-student" / "summary.json").read_text())
    assert summary["steps"] == 20 and (summary["cp"], summary["ep"], summary["dp"]) == (2, 2, 2)
    assert summary["loss_last"] < summary["loss_first"]

    # distributed production = one process over the same samples, byte for byte
    import precompute_cache

    argv = shlex.split(commands[1].replace("runs/", f"{runs}/"))
    argv = argv[argv.index("examples/precompute_cache.py") + 1 :]
    argv[argv.index("--out") + 1] = str(tmp_path / "single")
    torch.set_num_threads(1)
    assert precompute_cache.main(argv) == 0
    shards = [
        json.loads((d / "manifest.json").read_text())["shards"]
        for d in (runs / "tiny-cache", tmp_path / "single")
    ]
    assert [s["checksum"] for s in shards[0]] == [s["checksum"] for s in shards[1]]
    schema = json.loads((runs / "tiny-cache" / "manifest.json").read_text())["schema"]
    assert schema["layer_hidden"]["shape"] == [128, 2, 48]  # trained on, not read by the trainer

    # the student is sized from the cache: resuming it on another target's cache is refused
    other = str(tmp_path / "synthetic")
    assert precompute_cache.main(["--out", other, "--num-samples", "8", "--max-len", "32"]) == 0
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
    ]
    run = subprocess.run(
        [*torchrun, str(EXAMPLES / "train_ep_cp.py"), "--cache-dir", other,
         "--out", str(runs / "tiny-student"), "--resume", "--steps", "30"],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert run.returncode != 0
    assert "holds a student for a target with vocabulary 640 and hidden size 48" in run.stderr
    assert "this cache's target has vocabulary 256 and hidden size 64" in run.stderr


def test_docs_main_commands_parse():
    """The docs' three commands name flags the scripts accept, with consistent values."""
    import precompute_cache
    import train_ep_cp

    setup, pre, train = _docs_commands("## Three commands")
    assert setup == "bash scripts/setup.sh"
    pre_argv = shlex.split(pre)
    args = precompute_cache.build_parser().parse_args(
        pre_argv[pre_argv.index("examples/precompute_cache.py") + 1 :]
    )
    precompute_cache.check_args(args)
    assert (args.model_dir, args.messages_key, args.dtype) == ("models/my-llm", "messages", "bf16")
    tr_argv = shlex.split(train)
    targs = train_ep_cp.build_parser().parse_args(
        tr_argv[tr_argv.index("examples/train_ep_cp.py") + 1 :]
    )
    train_ep_cp.check_args(targs)
    assert (targs.cache_dir, targs.cp) == (args.out, args.cp)


# -- bad inputs -----------------------------------------------------------------------------


def _check(*argv: str):
    from precompute_cache import build_parser, check_args

    args = build_parser().parse_args(["--out", "unused", *argv])
    check_args(args)
    return args


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--target", "llama"], r"--target='llama' must be 'synthetic' or hf:PATH"),
        (["--data", "x.jsonl"], r"--data='x.jsonl' must be 'synthetic' or jsonl:PATH"),
        (["--data", "jsonl:x.jsonl"], r"needs --target hf:DIR"),
        (["--target", "hf:m"], r"needs --data jsonl:PATH .* --data jsonl:examples/data/"),
        (["--layers", "2"], r"--layers apply to --target hf:DIR --data jsonl:PATH only"),
        (
            ["--target", "hf:m", "--data", "jsonl:x", "--text-key", "a", "--messages-key", "b"],
            r"--text-key='a' and --messages-key='b': pass one",
        ),
        (
            ["--target", "hf:m", "--data", "jsonl:x", "--mask-prompt"],
            r"--mask-prompt needs --messages-key: plain text .* has no prompt",
        ),
        (
            ["--target", "hf:m", "--data", "jsonl:x", "--layers", "2,x"],
            r"--layers='2,x' must be comma-separated layer indices",
        ),
        (["--target", "hf:m", "--data", "jsonl:x", "--layers", "2,2"], r"distinct indices >= 0"),
    ],
)
def test_flag_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        _check(*argv)


def test_flag_defaults_follow_the_source():
    a = _check()
    assert (a.num_samples, a.mask_prompt, a.model_dir) == (1024, True, None)
    a = _check("--target", "hf:m", "--data", "jsonl:x")
    assert (a.text_key, a.mask_prompt, a.dtype, a.num_samples) == ("text", False, "fp32", None)
    a = _check("--target", "hf:m", "--data", "jsonl:x", "--messages-key", "m", "--device", "cuda")
    assert (a.text_key, a.mask_prompt, a.dtype) == (None, True, "bf16")


def _write(path: Path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _hf_run(
    model_dir: str, tmp_path: Path, data: str, *extra: str, key: str = "--messages-key"
) -> None:
    import precompute_cache

    precompute_cache.main(
        _precompute_argv(model_dir, str(tmp_path / "c"), *extra, data=data, key=key)
    )


CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


@pytest.mark.parametrize(
    ("lines", "extra", "match"),
    [
        ([], [], r"is empty \(no JSON lines\)"),
        (["", "  "], [], r"is empty \(no JSON lines\)"),
        ([CHAT, "{oops"], [], r":2 is not valid JSON"),
        (["[1, 2]"], [], r":1 holds a list, not a JSON object"),
        (
            ['{"prompt": "a"}'],
            [],
            r":1 has no 'messages' key \(its keys: 'prompt'\); pass --messages-key",
        ),
        ([CHAT, '{"messages": "hi"}'], [], r":2: 'messages' must be a list of"),
        (
            ['{"messages": [{"role": "user", "content": "hi"}]}'],
            [],
            r":1 has no supervised token: no message has role 'assistant'",
        ),
        (
            [
                '{"messages": [{"role": "user", "content": "' + "long prompt " * 80 + '"}, '
                '{"role": "assistant", "content": "yo"}]}'
            ],
            [],
            r":1 has no supervised token: its first reply token is at position \d+, past "
            r"--max-len=128; raise --max-len above \d+",
        ),
        ([CHAT], ["--num-samples", "3"], r"--num-samples=3 but .* has 1 samples"),
        ([CHAT], ["--topk", "1000"], r"--topk=1000 exceeds the vocabulary of .* \(640\)"),
        ([CHAT], ["--layers", "1,5"], r"\[5\] out of range for .*which has 4 layers"),
    ],
)
def test_jsonl_errors_name_the_line_and_the_fix(model_dirs, tmp_path, lines, extra, match):
    data = _write(tmp_path / "d.jsonl", *lines)
    with pytest.raises(ValueError, match=match):
        _hf_run(model_dirs["llama"], tmp_path, data, *extra)


def test_text_errors(model_dirs, tmp_path):
    for line, match in (
        ('{"text": ""}', r":1 has no supervised token: its 'text' is empty"),
        ('{"text": 3}', r":1: 'text' holds a int; it must be a string"),
        ('{"body": "x"}', r":1 has no 'text' key \(its keys: 'body'\); pass --text-key"),
    ):
        data = _write(tmp_path / "t.jsonl", line)
        with pytest.raises(ValueError, match=match):
            _hf_run(model_dirs["llama"], tmp_path, data, key="--text-key")


def test_missing_model_and_data_files(tmp_path):
    import precompute_cache

    argv = ["--out", str(tmp_path / "c"), "--target", f"hf:{tmp_path}/nope", "--data"]
    with pytest.raises(
        ValueError, match=r"--target hf:.*/nope: .* does not exist; pass the directory"
    ):
        precompute_cache.main([*argv, "jsonl:x.jsonl"])
    with pytest.raises(ValueError, match=r"has no config.json"):
        precompute_cache.main([*argv[:3], f"hf:{tmp_path}", "--data", "jsonl:x.jsonl"])


def test_a_bad_line_is_reported_before_the_model_is_loaded(model_dirs, tmp_path):
    """A directory whose weights are missing still reports the data error first."""
    import shutil

    no_weights = tmp_path / "m"
    shutil.copytree(model_dirs["llama"], no_weights)
    (no_weights / "model.safetensors").unlink()
    data = _write(tmp_path / "d.jsonl", '{"prompt": "a"}')
    with pytest.raises(ValueError, match=r":1 has no 'messages' key"):
        _hf_run(str(no_weights), tmp_path, data)


def test_missing_data_file(model_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"--data jsonl:.*/none.jsonl: .* does not exist"):
        _hf_run(model_dirs["llama"], tmp_path, str(tmp_path / "none.jsonl"))


def test_a_model_dir_tokenizer_without_chat_template(model_dirs, tmp_path):
    import shutil

    tok_dir = tmp_path / "tok"
    shutil.copytree(model_dirs["llama"], tok_dir)
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)  # transformers < 4.47 has none
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = _write(tmp_path / "d.jsonl", CHAT)
    with pytest.raises(ValueError, match=r"the tokenizer has no chat template"):
        _hf_run(model_dirs["llama"], tmp_path, data, "--tokenizer", str(tok_dir))


def test_a_tokenizer_with_ids_beyond_the_model_vocabulary(model_dirs, tmp_path):
    from ep_cp.tiny_hf import corpus_texts, train_tokenizer

    big = train_tokenizer(list(corpus_texts(str(SAMPLE))), vocab_size=900)
    assert len(big) > 640
    big.save_pretrained(str(tmp_path / "big"))
    with pytest.raises(
        ValueError, match=r"produces token id \d+, but the model .* has 640 vocabulary rows"
    ):
        _hf_run(model_dirs["llama"], tmp_path, str(SAMPLE), "--tokenizer", str(tmp_path / "big"))


def test_no_mask_prompt_supervises_every_chat_token(model_dirs, tmp_path):
    import precompute_cache

    out = str(tmp_path / "c")
    argv = _precompute_argv(model_dirs["llama"], out, "--num-samples", "4", "--no-mask-prompt")
    assert precompute_cache.main(argv) == 0
    data = _rows(out, ("seq_len", "loss_mask"))
    for i in range(4):
        assert int(data[i]["loss_mask"].sum()) == int(data[i]["seq_len"])
    assert json.loads(Path(out, "manifest.json").read_text())["mask_prompt"] is False


# -- trainer sizes, packaging -----------------------------------------------------------------


def test_cache_dims_are_checked_against_the_stored_shapes():
    from ep_cp.cache_format import CacheDims, cache_dims, check_student_fits

    m = {
        "target": {"vocab_size": 640, "hidden_size": 48},
        "topk": 8,
        "schema": {
            "hidden": {"dtype": "bfloat16", "shape": [128, 48]},
            "topk_logprobs": {"dtype": "float32", "shape": [128, 8]},
        },
    }
    assert cache_dims(m, "c") == CacheDims(640, 48, 8)
    with pytest.raises(
        ValueError,
        match=r"stores hidden width 48 and top-8, but its manifest records hidden_size=64",
    ):
        cache_dims({**m, "target": {"vocab_size": 640, "hidden_size": 64}}, "c")
    with pytest.raises(ValueError, match=r"does not record its target's sizes"):
        cache_dims({"topk": 8}, "c")
    check_student_fits({"vocab_size": 640, "target_hidden_size": 48}, CacheDims(640, 48, 8), "x")
    with pytest.raises(ValueError, match=r"ckpt holds a student for a target with vocabulary 256"):
        check_student_fits(
            {"vocab_size": 256, "target_hidden_size": 48}, CacheDims(640, 48, 8), "ckpt"
        )


def test_core_package_does_not_import_transformers_or_tokenizers():
    code = (
        "import pkgutil, importlib, sys, te_thd\n"
        "for m in pkgutil.walk_packages(te_thd.__path__, 'te_thd.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in ('transformers', 'tokenizers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_examples_extra_never_requires_torch():
    """The extra's packages (as installed) require torch only through their own extras."""
    import tomllib
    from importlib.metadata import requires

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = [r.split(">")[0].split("=")[0].strip() for r in extra["examples"]]
    assert {"transformers", "tokenizers"} <= set(names)
    for name in names:
        hard = [r for r in requires(name) or [] if r.startswith("torch") and "extra ==" not in r]
        assert not hard, f"{name} requires {hard}: installing the extra could pull another torch"
