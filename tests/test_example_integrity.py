"""The example job on a damaged or mismatched cache: one message, non-zero exit, hints that run.

Real ``torchrun`` jobs of ``examples/train_ep_cp.py`` on 2 CPU ranks. A flipped byte
in a shard's tensor data stops training before the batch that would carry it; a
cache built for another CP size and a CP size that does not divide the processes
stop it at start-up. Each time exactly one rank prints one ``error:`` line (no
traceback from any rank) and the job exits non-zero. Every command the messages
name -- here and in the library's own messages -- is extracted and parsed by the
parser of the script it names.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _example_support import EXAMPLES, REPO, one_error, small_cache_argv
from _offline_cache_support import damage_shard

import te_thd.offline_cache as oc
from te_thd.cli import build_parser as te_thd_parser
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.token_index import token_index


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity_cache") / "cache"
    cmd = [sys.executable, str(EXAMPLES / "precompute_cache.py"), *small_cache_argv(str(out), 32)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180, env=_env())
    return out


def _train(cache: Path, out: Path, cp: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "train_ep_cp.py"), "--cache-dir", str(cache), "--out", str(out),
        "--cp", str(cp), "--ep", "1", "--steps", "10", "--batch-size", "4", "--log-every", "100", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)


def _commands(message: str) -> list[str]:
    return re.findall(r"`([^`]+)`", message)


def _check_command(cmd: str) -> None:
    """The command exists and parses: te-thd subcommands, example scripts, te_thd functions."""
    argv = shlex.split(cmd)
    if argv[0] == "te-thd":
        te_thd_parser().parse_args(argv[1:])  # SystemExit on an unknown command or flag
        return
    if argv[0] == sys.executable:  # a script, with the interpreter that has torch
        script = REPO / argv[1]
        assert script.is_file(), cmd
        spec = importlib.util.spec_from_file_location(script.stem + "_hint", script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.build_parser().parse_args(argv[2:])
        return
    m = re.fullmatch(r"([\w.]+)\((.*)\)", cmd)
    assert m, f"unrecognised hint {cmd!r}"
    module, _, name = m.group(1).rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn).parameters
    for arg in re.findall(r"(\w+)=", m.group(2)):
        assert arg in params, (cmd, arg)


def _flip(path: Path, key: str, row: int) -> None:
    header = read_shard_header(str(path))
    if key in header.entries:
        e = header.entries[key]
        pos = e.start + row * (e.end - e.start) // e.shape[0] + 5
    else:  # a ragged cache (the example's default): the row's first token of key@tokens
        e = header.entries[key + "@tokens"]
        first = int(token_index(str(path), header).offsets[row])
        pos = e.start + first * (e.end - e.start) // e.shape[0] + 5
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x20
    path.write_bytes(bytes(data))


def test_flipped_byte_stops_training_once_with_a_repair_that_works(
    cache_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    _flip(cache / "shard-000001.safetensors", "hidden", 3)
    msg = one_error(_train(cache, tmp_path / "run", 2))
    assert (
        f"shard {cache}/shard-000001.safetensors: sample 11 (row 3 of the shard), key 'hidden': checksum mismatch"
        in msg
    )
    cmds = _commands(msg)
    assert cmds[0] == f"te-thd cache repair {cache}"
    assert cmds[1].startswith(
        f"{shlex.quote(sys.executable)} {EXAMPLES}/precompute_cache.py --out "
    )
    for cmd in cmds:
        _check_command(cmd)
    # ... and run as printed: repair, then the producer command (from another directory than
    # the checkout: the script is named by its absolute path), give the clean cache back
    from te_thd.cli import main

    assert main(shlex.split(cmds[0])[1:]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(
        shlex.split(cmds[1]),
        check=True,
        capture_output=True,
        timeout=180,
        env=_env(),
        cwd=elsewhere,
    )
    assert oc.verify_cache(str(cache), deep=True)["checksums_verified"]
    for name in (
        "shard-000000.safetensors",
        "shard-000002.safetensors",
        "shard-000003.safetensors",
    ):
        assert (cache / name).read_bytes() == (cache_dir / name).read_bytes(), (
            name
        )  # kept, not recomputed


@pytest.mark.parametrize("how", ["lost", "truncated"])
def test_a_lost_or_damaged_manifest_stops_training_once_and_its_repair_runs_as_printed(
    cache_dir: Path, tmp_path: Path, how: str
) -> None:
    """The trainer names `te-thd cache repair` (not a producer command of its own defaults), and that
    command, run as printed, writes back the manifest the producer wrote."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    manifest = cache / "manifest.json"
    clean = manifest.read_bytes()
    if how == "lost":
        manifest.unlink()
    else:
        manifest.write_bytes(clean[: len(clean) // 2])
    msg = one_error(_train(cache, tmp_path / "run", 2))
    assert _commands(msg) == [f"te-thd cache repair {cache}"], msg
    assert "precompute_cache.py" not in msg and "computes only the missing shards" not in msg
    _check_command(_commands(msg)[0])
    _run_as_printed(_commands(msg)[0], tmp_path)
    assert manifest.read_bytes() == clean


def test_cp_mismatch_and_world_size_are_one_message(cache_dir: Path, tmp_path: Path) -> None:
    msg = one_error(_train(cache_dir, tmp_path / "a", 1))
    assert "was built with cp_size=2" in msg and "cp_size=1" in msg
    cmds = _commands(msg)
    assert cmds and "--cp 1" in cmds[0] and f"--out {cache_dir}-cp1-seq128 " in cmds[0]
    for cmd in cmds:
        _check_command(cmd)
    # the rebuild runs as printed from any directory: absolute script and output paths
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(
        shlex.split(cmds[0]),
        check=True,
        capture_output=True,
        timeout=180,
        env=_env(),
        cwd=elsewhere,
    )
    from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION

    rebuilt = oc.read_manifest(f"{cache_dir}-cp1-seq128", CACHE_NAME, FORMAT_VERSION)
    assert (rebuilt["cp_size"], rebuilt["num_samples"]) == (1, 32)
    assert not list(elsewhere.iterdir())
    msg = one_error(_train(cache_dir, tmp_path / "b", 3))
    assert "--cp=3 must divide the number of processes (2)" in msg


def test_a_rerun_with_another_argument_names_it_first(cache_dir: Path) -> None:
    """The producer's refusal starts with the argument that changed and stays short (the recorded
    command line is cut to the item that differs)."""
    argv = small_cache_argv(str(cache_dir), 32)
    argv[argv.index("--shard-size") + 1] = "4"
    res = subprocess.run([sys.executable, str(EXAMPLES / "precompute_cache.py"), *argv], capture_output=True,
                         text=True, timeout=180, env=_env())  # fmt: skip
    msg = one_error(res)
    assert msg.startswith(f"output_dir {cache_dir} holds a finished cache built with other parameters "
                          "(shard_size: recorded 8, this run 4; options.producer_args[")  # fmt: skip
    assert len(msg) < 300, msg


def test_a_cache_too_small_for_the_replicas_says_so_once(tmp_path: Path) -> None:
    """3 samples, 2 data-parallel replicas (CP=1) at --batch-size 4: the message says the cache is too
    small for the replicas and names both ways out, not only a batch size."""
    cache = tmp_path / "cache"
    argv = small_cache_argv(str(cache), 3)
    argv[argv.index("--cp") + 1] = "1"
    subprocess.run([sys.executable, str(EXAMPLES / "precompute_cache.py"), *argv], check=True, capture_output=True,
                   timeout=180, env=_env())  # fmt: skip
    msg = one_error(_train(cache, tmp_path / "run", 1))
    assert msg == (
        f"--batch-size 4: the cache at {cache} holds 3 samples, too few for 2 data-parallel replicas at "
        "4 samples each (a step takes 8); pass --batch-size 1 or less, or build a cache of at least 8 samples"
    )


def test_library_hints_name_commands_that_exist(tmp_path: Path) -> None:
    """Every backticked command in the cache's own messages parses (Python and CLI users)."""
    from torch.utils.data import DataLoader

    messages = [
        oc.format.schema.repair_hint(str(tmp_path / "c")),
        oc.format.schema.producer_hint(None),
    ]
    for exc_fn in (
        lambda: oc.read_manifest(str(tmp_path / "none"), "x", 1),
        lambda: oc.validate_contiguous_shards(str(tmp_path), "x", 4, 2),
    ):
        with pytest.raises(ValueError) as e:
            exc_fn()
        messages.append(str(e.value))
    d = tmp_path / "c"
    oc.produce_cache(DataLoader([{"x": 1.0}] * 4, batch_size=2), str(d), 2,
                     lambda b: {"x": b["x"].float()[:, None]}, ("x",), progress=False)  # fmt: skip
    text = (d / "manifest.json").read_text()
    for damaged in ("{", text.replace('"num_samples": 4', '"num_samples": 5')):
        (d / "manifest.json").write_text(damaged)
        with pytest.raises(ValueError) as e:
            oc.CachedTensorDataset(str(d), "x", 1, ("x",))
        messages.append(str(e.value))
    cmds = [c for m in messages for c in _commands(m)]
    assert {c.split()[0].split("(")[0] for c in cmds} >= {
        "te-thd", "te_thd.offline_cache.produce_cache", "te_thd.offline_cache.write_manifest"
    }  # fmt: skip
    for cmd in cmds:
        _check_command(cmd.replace("...", "") if "(" in cmd else cmd)


def _run_as_printed(cmd: str, cwd: Path) -> None:
    """Run a hint exactly as printed, from ``cwd``: ``te-thd`` is this environment's."""
    argv = shlex.split(cmd)
    if argv[0] == "te-thd":
        argv[0] = shutil.which("te-thd") or str(Path(sys.executable).with_name("te-thd"))
    subprocess.run(argv, check=True, capture_output=True, timeout=240, env=_env(), cwd=cwd)


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_every_hint_about_a_damaged_shard_runs_as_printed(
    cache_dir: Path, tmp_path: Path, damage: str
) -> None:
    """A cache the example built, one shard damaged: ``te-thd cache verify`` and the reader name the
    exact producer command the manifest records (with the interpreter that has torch), and running
    every command they print, in order, as printed, gives back a cache that verifies: the clean bytes."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    shard = cache / "shard-000001.safetensors"
    if damage == "flipped":
        _flip(shard, "hidden", 3)
    else:
        damage_shard(shard, damage)
    verify = subprocess.run([sys.executable, "-m", "te_thd.cli", "cache", "verify", str(cache)],
                            capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)  # fmt: skip
    assert verify.returncode == 1, verify.stdout + verify.stderr
    with pytest.raises(oc.CacheError) as read:  # the reader's message names the same commands
        from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION, KEYS

        # .tensors: a ragged cache reads its token keys when the batch's tensors are first used
        _ = (
            oc.CachedTensorDataset(str(cache), CACHE_NAME, FORMAT_VERSION, KEYS)
            .__getitems__(list(range(16)))
            .tensors
        )
    for message in (verify.stderr, str(read.value)):
        cmds = _commands(message)
        producer = [c for c in cmds if "precompute_cache.py" in c]
        assert producer and producer[0].startswith(
            f"{shlex.quote(sys.executable)} {EXAMPLES}/precompute_cache.py --out {cache} "
        ), message
        assert "(the producer this cache records)" not in message and "`python " not in message
    elsewhere = tmp_path / "elsewhere"  # not the checkout: the printed commands run from anywhere
    elsewhere.mkdir()
    for cmd in _commands(verify.stderr):
        _run_as_printed(cmd, elsewhere)
    assert oc.verify_cache(str(cache), deep=True)["checksums_verified"]
    for name in sorted(p.name for p in cache_dir.glob("shard-*.safetensors")):
        assert (cache / name).read_bytes() == (cache_dir / name).read_bytes(), name


def test_compact_dtypes_store_the_topk_ids_in_the_index_codec_and_verify_and_repair_work(
    cache_dir: Path, tmp_path: Path
) -> None:
    """``--compact-dtypes`` stores ``topk_indices`` as ``topk_index:<vocab>`` (the synthetic target's 256
    tokens: 16 bits an id); the ids read back are those of the cache without it, and a flipped byte
    in them is found by ``te-thd cache verify``, whose printed commands give the clean bytes back."""
    from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION, KEYS

    cache = tmp_path / "compact"
    cmd = [
        sys.executable,
        str(EXAMPLES / "precompute_cache.py"),
        *small_cache_argv(str(cache), 32),
        "--compact-dtypes",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180, env=_env())
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["token_layout"]["codecs"] == {"topk_indices": "topk_index:256"}
    entries = read_shard_header(str(cache / "shard-000000.safetensors")).entries
    plain = read_shard_header(str(cache_dir / "shard-000000.safetensors")).entries
    assert (
        entries["topk_indices@tokens"].end - entries["topk_indices@tokens"].start
        == (plain["topk_indices@tokens"].end - plain["topk_indices@tokens"].start) // 2
    )  # int16 for int32
    a = (
        oc.CachedTensorDataset(str(cache_dir), CACHE_NAME, FORMAT_VERSION, KEYS)
        .__getitems__(list(range(32)))
        .tensors
    )
    b = (
        oc.CachedTensorDataset(str(cache), CACHE_NAME, FORMAT_VERSION, KEYS)
        .__getitems__(list(range(32)))
        .tensors
    )
    assert b["topk_indices"].dtype == a["topk_indices"].dtype and b["topk_indices"].equal(
        a["topk_indices"]
    )
    clean = {p.name: p.read_bytes() for p in cache.glob("shard-*.safetensors")}
    _flip(cache / "shard-000001.safetensors", "topk_indices", 3)
    verify = subprocess.run([sys.executable, "-m", "te_thd.cli", "cache", "verify", str(cache)],
                            capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)  # fmt: skip
    assert verify.returncode == 1 and "key 'topk_indices'" in verify.stderr, (
        verify.stdout + verify.stderr
    )
    cmds = _commands(verify.stderr)
    assert any("precompute_cache.py" in c and c.endswith("--compact-dtypes") for c in cmds), cmds
    for c in cmds:
        _run_as_printed(c, tmp_path)
    assert oc.verify_cache(str(cache), deep=True)["checksums_verified"]
    assert {p.name: p.read_bytes() for p in cache.glob("shard-*.safetensors")} == clean
