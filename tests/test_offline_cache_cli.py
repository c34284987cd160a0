"""``te-thd cache info`` / ``te-thd cache verify [--deep]``: output and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from te_thd.cli import main
from te_thd.offline_cache import produce_cache, write_manifest


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    data = [{"x": torch.full((2, 3), float(i))} for i in range(9)]
    out = tmp_path / "cache"
    produce_cache(
        DataLoader(data, batch_size=2),
        str(out),
        4,
        lambda b: {"hidden": b["x"].to(torch.bfloat16), "mask": b["x"][:, 0] > 2},
        ("hidden", "mask"),
        {"cp_size": 2, "mask_prompt": True},
        progress=False,
    )
    return out


def test_info_prints_everything_a_user_checks(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "info", str(cache)]) == 0
    out = capsys.readouterr().out
    size = sum(p.stat().st_size for p in cache.glob("shard-*"))
    for line in [
        "format_version: 1",
        "layout_version: 3",
        "samples:        9",
        "shards:         3 x 4 samples (the last holds 1)",
        f"bytes:          {size} ({size / 1024:.1f} KiB)",
        "checksum:       xxh3_64",
        "  hidden               bfloat16   [n, 2, 3]",
        "  mask                 bool       [n, 3]",
        "  cp_size = 2",
        "  mask_prompt = true",
    ]:
        assert line in out.splitlines(), (line, out)


def test_info_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "info", "--json", str(cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["schema"]["hidden"] == {"dtype": "bfloat16", "shape": [2, 3]}
    assert info["options"] == {"cp_size": 2, "mask_prompt": True}


def test_info_of_a_directory_without_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / ".te_thd-producer.json").write_text(
        "{}"
    )  # what a producer killed before its first shard leaves
    assert main(["cache", "info", str(tmp_path)]) == 1
    assert "manifest not found" in capsys.readouterr().err


def test_a_directory_that_is_not_a_cache_is_named_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify /tmp`: not "the cache was never finished" -- nothing a producer writes is there."""
    (tmp_path / "notes.txt").write_text("not a cache")
    for cmd in ("info", "verify", "repair"):
        assert main(["cache", cmd, str(tmp_path)]) == 1
        assert (
            f"cache_dir='{tmp_path}' holds no manifest.json and no shards: it is not a te_thd cache; check the path"
            in capsys.readouterr().err
        )
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # repair left nothing behind


def test_a_missing_directory_is_named_alike_by_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    for cmd in ("info", "verify", "repair", "unlock"):
        assert main(["cache", cmd, str(missing)]) == 1
        assert (
            f"cache_dir='{missing}': no such directory; check the path" in capsys.readouterr().err
        )
    assert not missing.exists()  # repair's lock did not create it


def test_unlock_of_a_file_says_it_is_a_file_not_a_cache_directory(cache: Path, capsys) -> None:
    for path, hint in ((cache / "manifest.json", f"pass its directory, cache_dir={str(cache)!r}"),
                       (cache / "shard-000000.safetensors", "pass the directory that holds manifest.json")):  # fmt: skip
        assert main(["cache", "unlock", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(
            f"te-thd cache unlock: cache_dir='{path}' is a file, not a cache directory; {hint}"
        )
        assert "is a local directory" not in err


def test_unlock_of_a_local_cache_whose_producer_runs_removes_nothing(tmp_path: Path) -> None:
    """A real producer holds the cache's flock; `unlock` says there is nothing to remove, and the lock still
    refuses a second producer."""
    from _s3_producer_script import produce

    from te_thd.offline_cache import CacheLockError

    out = tmp_path / "cache"
    producer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_s3_producer_script.py")), str(out),
                                 "hold:1"], stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "shard-000001.safetensors").exists():
            assert producer.poll() is None and time.monotonic() < deadline, producer.communicate()[
                1
            ][-2000:]
            time.sleep(0.2)
        res = subprocess.run([sys.executable, "-m", "te_thd.cli", "cache", "unlock", str(out)], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert res.returncode == 1 and res.stderr.startswith(
            f"te-thd cache unlock: {out} is a local directory: its producer lock is a flock the kernel drops when "
            "the producer dies, so there is nothing to remove"
        ), res.stderr
        with pytest.raises(CacheLockError, match=f"pid {producer.pid} on host"):
            produce(str(out))
        assert producer.poll() is None
    finally:
        producer.kill()
        producer.communicate()


def test_verify_takes_one_depth(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["cache", "verify", "--quick", "--deep", str(cache)])
    assert done.value.code == 2
    assert (
        "te-thd cache verify: error: argument --deep: not allowed with argument --quick"
        in capsys.readouterr().err
    )


def test_a_reader_that_closes_the_pipe_gets_no_traceback(cache: Path) -> None:
    """`te-thd cache info DIR | head -1`: the pipe's reader is gone before te-thd writes (here: closed
    before it starts, so the write fails every time)."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run([sys.executable, "-m", "te_thd.cli", "cache", "info", str(cache)], stdout=w,
                             stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(w)
    assert res.returncode == 1 and res.stderr == ""


def test_help_does_not_import_torch() -> None:
    """`te-thd --help` answers at once: torch is imported only by the commands that use it."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "te_thd.cli", "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert (
        res.returncode == 0 and res.stdout.startswith("usage: te-thd") and "cache" in res.stdout
    ), res.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in res.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "te_thd" in imported and not {m for m in imported if m.split(".")[0] == "torch"}


def test_verify_sound_cache(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "verify", "--quick", str(cache)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {cache}: 9 samples in 3 shards\n")
    assert "  checked: shard sizes against the manifest" in out
    assert (
        f"  NOT checked: shard headers and contents (a full verify reads them: `te-thd cache verify {cache}`)"
        in out
    )
    for argv in (["cache", "verify", str(cache)], ["cache", "verify", "--deep", str(cache)]):
        assert main(argv) == 0
        captured = capsys.readouterr()
        assert (
            "  checked: every row of every key against the xxh3_64 checksums each shard carries"
            in captured.out
        )
        assert (
            "  checked: every shard's checksum (header digest, or whole-file CRC-32 in older caches) against the manifest"
            in captured.out
        )
        assert "NOT checked" not in captured.out and captured.err == ""


def test_verify_names_the_bad_shard(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = cache / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert (
        main(["cache", "verify", "--quick", str(cache)]) == 0
    )  # same size: only reading it can tell
    capsys.readouterr()
    assert main(["cache", "verify", str(cache)]) == 1
    err = capsys.readouterr().err
    assert (
        "FAILED" in err
        and f"{shard}: sample 7 (row 3 of the shard), key 'mask': checksum mismatch (expected xxh3_64:"
        in err
    )
    assert f"Repair: `te-thd cache repair {cache}`" in err

    shard.write_bytes(bytes(data[:-10]))
    assert main(["cache", "verify", "--quick", str(cache)]) == 1
    assert (
        f"{shard}: has {len(data) - 10} bytes, the manifest records {len(data)}"
        in capsys.readouterr().err
    )


def test_verify_missing_shard(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.unlink(cache / "shard-000002.safetensors")
    assert main(["cache", "verify", str(cache)]) == 1
    assert "missing shard indices 2 (e.g. shard-000002.safetensors)" in capsys.readouterr().err


def test_console_script_exit_codes(cache: Path, tmp_path: Path) -> None:
    """The installed ``te-thd`` entry point, as a user runs it."""
    exe = shutil.which("te-thd", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "te_thd.cli"]
    (cache / "shard-000000.safetensors").write_bytes(b"")
    bad = subprocess.run(
        [*cmd, "cache", "verify", str(cache)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and "shard-000000.safetensors" in bad.stderr


@pytest.mark.parametrize(
    ("num_samples", "shard_size", "line"),
    [
        (24, 128, "shards:         1 of 24 samples (shard_size 128)"),
        (8, 4, "shards:         2 x 4 samples"),
        (0, 4, "shards:         0 (shard_size 4)"),
    ],
)
def test_info_says_how_the_samples_sit_in_the_shards(
    tmp_path: Path, capsys, num_samples, shard_size, line
) -> None:
    data = [{"x": torch.full((2,), float(i))} for i in range(num_samples)]
    out = tmp_path / "cache"
    if num_samples:
        produce_cache(
            DataLoader(data, batch_size=2),
            str(out),
            shard_size,
            lambda b: {"x": b["x"]},
            ("x",),
            progress=False,
        )
    else:  # an empty cache: produce_cache refuses an empty dataset, the reference's API writes one
        out.mkdir()
        write_manifest(str(out), {"num_samples": 0, "shard_size": shard_size}, 1)
    assert main(["cache", "info", str(out)]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_repair_flags_are_the_keywords_repair_cache_takes() -> None:
    """`te-thd cache repair` passes each rebuild flag's value as the keyword argparse derives from
    the flag; the parser's table (torch-free) and repair's must name the same five."""
    from te_thd._cache_parser import _REBUILD_FLAGS
    from te_thd.offline_cache.tools.repair import REBUILD_ARGS

    assert [flag for flag, *_ in _REBUILD_FLAGS] == list(REBUILD_ARGS.values())
    assert {flag.lstrip("-").replace("-", "_") for flag, *_ in _REBUILD_FLAGS} == set(REBUILD_ARGS)
