"""A lost or damaged ``manifest.json``: every shard ``produce_cache`` writes records its run, so
``te-thd cache repair`` / ``repair_cache`` rebuild the manifest from the shards alone.

The oracle is the manifest the producer wrote: the rebuilt one must be the same bytes.
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
from _offline_cache_support import run_gloo
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from te_thd.cli import main as cli_main
from te_thd.offline_cache import (
    CachedTensorDataset,
    CacheError,
    CacheIntegrityError,
    ManifestError,
    ManifestNotFoundError,
    produce_cache,
    read_manifest,
    repair_cache,
    verify_cache,
)
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.write.producer import PROGRESS_NAME
from te_thd.offline_cache.write.writer import write_tensor_shard

REPO = Path(__file__).resolve().parents[1]
W = 6
KEYS = ("input_ids", "hidden", "length")
OPTIONS = {"cp_size": 2, "mask_prompt": True, "notes": {"run": "x", "ü": [1, 2]}}


class _Samples(torch.utils.data.Dataset):
    """``n`` samples: right-padded ids ``[W]``, a per-token ``hidden`` ``[W, 3]`` and the ``length``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        length = 1 + (i * 7) % W
        ids = torch.zeros(W, dtype=torch.int64)
        ids[:length] = torch.arange(1, length + 1) + i
        hidden = (
            torch.arange(W * 3, dtype=torch.float32).reshape(W, 3)
            * (i + 1)
            * (ids != 0).unsqueeze(1)
        )
        return {"input_ids": ids, "hidden": hidden, "length": torch.tensor(length)}


def produce(out: Path | str, n: int = 10, shard_size: int = 4, **kw) -> dict:
    """The tests' cache: ``n`` samples in shards of ``shard_size``, through ``produce_cache``."""
    kw.setdefault("options", OPTIONS)
    return produce_cache(DataLoader(_Samples(n), batch_size=2), str(out), shard_size, lambda b: b, KEYS,
                         format_version=3, progress=False, **kw)  # fmt: skip


def _record(path: Path) -> dict | None:
    sums = read_shard_header(str(path)).sums
    assert sums is not None
    return sums.run


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_every_shard_records_the_producer_run(tmp_path: Path, ragged: bool) -> None:
    kw = {"token_keys": ("input_ids", "hidden"), "length_key": "length"} if ragged else {}
    produce(tmp_path / "c", **kw)
    want = {
        "format_version": 3, "num_samples": 10, "shard_size": 4, "keys": sorted(KEYS), "options": OPTIONS,
        "length_rule": {"key": "length" if ragged else "input_ids", "kind": "last_nonpad", "pad_token_id": 0},
    }  # fmt: skip
    if ragged:
        want["token_layout"] = {"keys": ["input_ids", "hidden"], "codecs": {}}
    shards = sorted((tmp_path / "c").glob("shard-*"))
    assert len(shards) == 3 and all(_record(p) == want for p in shards)
    # the record is the producer's run parameters (what a resume compares) plus its length rule
    with pytest.raises(FileNotFoundError):  # removed once the manifest is written
        (tmp_path / "c" / PROGRESS_NAME).read_text()


def test_a_resumed_run_records_the_same_and_writes_the_same_bytes(tmp_path: Path) -> None:
    produce(tmp_path / "a")
    produce(tmp_path / "b")
    (tmp_path / "b" / "manifest.json").unlink()
    (tmp_path / "b" / "shard-000001.safetensors").unlink()
    # without a manifest, with shards that carry their run: the producer record is what a resume needs
    (tmp_path / "b" / PROGRESS_NAME).write_text(
        json.dumps(
            {
                k: v
                for k, v in _record(tmp_path / "a" / "shard-000000.safetensors").items()
                if k != "length_rule"
            }
        )
    )
    produce(tmp_path / "b")
    for name in (
        "manifest.json",
        "shard-000000.safetensors",
        "shard-000001.safetensors",
        "shard-000002.safetensors",
    ):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_the_run_record_is_one_metadata_entry_covered_by_the_header_digest(tmp_path: Path) -> None:
    produce(tmp_path / "c")
    shard = tmp_path / "c" / "shard-000000.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert list(metadata) == ["te_thd"] and '"run":' in metadata["te_thd"]
    save_file(
        tensors, str(tmp_path / "ref.safetensors"), metadata=metadata
    )  # still save_file's bytes
    assert (tmp_path / "ref.safetensors").read_bytes() == shard.read_bytes()
    data = shard.read_bytes()
    pos = data.index(b'cp_size\\":2') + len(b'cp_size\\":')
    shard.write_bytes(
        data[:pos] + b"4" + data[pos + 1 :]
    )  # a flipped option value, still valid JSON
    with pytest.raises(CacheIntegrityError, match=r"header checksum mismatch"):
        read_shard_header(str(shard))


def test_shards_without_a_run_record_read_as_before(tmp_path: Path) -> None:
    """Shards of the low-level writer (and of te_thd before the record) carry no ``run``: same bytes as
    ``save_file`` with the checksum entry alone, read and verified as always."""
    d = tmp_path / "c"
    rows = {k: torch.stack([_Samples(4)[i][k] for i in range(4)]) for k in KEYS}
    write_tensor_shard(str(d), 0, rows, KEYS, "test")
    shard = d / "shard-000000.safetensors"
    assert _record(shard) is None
    with safe_open(str(shard), framework="pt") as f:
        assert '"run"' not in f.metadata()["te_thd"]
    from te_thd.offline_cache import write_manifest
    from te_thd.offline_cache.write.writer import DurableShardWriter

    with DurableShardWriter(KEYS, "test") as w:
        os.unlink(shard)
        w(str(d), 0, rows)
        w.flush()
        write_manifest(
            str(d),
            {"num_samples": 4, "shard_size": 4, "layout_version": 3, **w.manifest_fields(str(d))},
            3,
        )
    ds = CachedTensorDataset(str(d), "test", 3, KEYS)
    assert torch.equal(ds[2]["hidden"], rows["hidden"][2])


# -- rebuilding a lost or damaged manifest -----------------------------------------------------------


def _damage(manifest: Path, how: str) -> None:
    text = manifest.read_text()
    if how == "lost":
        manifest.unlink()
    elif how == "truncated":
        manifest.write_text(text[: len(text) // 2])
    elif how == "edited":  # valid JSON, fails its own checksum
        manifest.write_text(text.replace('"cp_size": 2', '"cp_size": 3'))
    elif how == "unparseable":
        manifest.write_bytes(b"\xff\xfe not json")
    elif how == "field":  # its checksum re-sealed, a required field gone
        from te_thd.offline_cache.record.manifest import MANIFEST_CHECKSUM_KEY, manifest_checksum

        m = json.loads(text)
        del m["shard_size"]
        m[MANIFEST_CHECKSUM_KEY] = manifest_checksum(m)
        manifest.write_text(json.dumps(m))
    else:
        raise ValueError(how)


LAYOUTS = {"padded": {}, "ragged": {"token_keys": ("input_ids", "hidden"), "length_key": "length"},
           "fp8": {"token_keys": ("hidden",), "codecs": {"hidden": "fp8_e4m3"}},
           "topk": {"token_keys": ("input_ids", "hidden"), "length_key": "length",
                    "codecs": {"input_ids": "topk_index:131072"}}}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("how", ["lost", "truncated", "edited", "unparseable", "field"])
def test_a_lost_or_damaged_manifest_is_rebuilt_byte_identical(
    tmp_path: Path, layout: str, how: str
) -> None:
    d = tmp_path / "c"
    produce(d, **LAYOUTS[layout])
    clean = (d / "manifest.json").read_bytes()
    damaged = None
    _damage(d / "manifest.json", how)
    if how != "lost":
        damaged = (d / "manifest.json").read_bytes()
    with pytest.raises(ManifestError, match=rf"`te-thd cache repair {d}`"):
        read_manifest(str(d), "offline", 3)
    result = repair_cache(str(d))
    assert (
        result["rebuilt"]
        and not result["reopened"]
        and result["missing"] == []
        and result["damaged"] == {}
    )
    assert (d / "manifest.json").read_bytes() == clean
    if damaged is not None:  # kept, never deleted
        assert (d / ".te_thd-damaged" / "manifest.json").read_bytes() == damaged
        assert result["set_aside_in"] == str(d / ".te_thd-damaged")
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [
            "manifest.json",
            "shard-000000.safetensors",
            "shard-000001.safetensors",
            "shard-000002.safetensors",
        ]
        + ([".te_thd-damaged"] if damaged is not None else [])
    )  # no producer record, temp or lock file left
    assert verify_cache(str(d), deep=True)["checksums_verified"]
    assert (
        produce(d, **LAYOUTS[layout])["num_samples"] == 10
    )  # the producer's same call finds its finished cache
    assert (d / "manifest.json").read_bytes() == clean
    aside = str(d / ".te_thd-damaged")
    kept = (
        None
        if damaged is None
        else {
            "dir": aside,
            "files": 1,
            "bytes": len(damaged),
            "remove": f"`rm -r {shlex.quote(aside)}`",
        }
    )
    assert repair_cache(str(d)) | {"producer": None} == {
        "cache_dir": str(d), "damaged": {}, "missing": [], "extra": [], "set_aside_in": None, "reopened": False,
        "rebuilt": False, "from_arguments": [], "notes": [], "producer": None, "removed": [], "kept_aside": kept,
    }  # fmt: skip


def test_every_damaged_manifest_is_kept(tmp_path: Path) -> None:
    d = tmp_path / "c"
    produce(d)
    clean = (d / "manifest.json").read_bytes()
    for how in ("edited", "truncated"):
        _damage(d / "manifest.json", how)
        damaged = (d / "manifest.json").read_bytes()
        assert repair_cache(str(d))["rebuilt"] and (d / "manifest.json").read_bytes() == clean
        kept = d / ".te_thd-damaged" / ("manifest.json" if how == "edited" else "manifest.json.1")
        assert kept.read_bytes() == damaged


def test_a_sound_cache_names_what_earlier_repairs_kept_and_how_to_remove_it(
    tmp_path: Path, capsys
) -> None:
    d = tmp_path / "c"
    produce(d)
    data = bytearray((d / "shard-000001.safetensors").read_bytes())
    data[-3] ^= 0x40
    (d / "shard-000001.safetensors").write_bytes(bytes(data))
    assert repair_cache(str(d))["reopened"]
    produce(d)  # the cache is whole again; the damaged shard stays aside
    capsys.readouterr()
    assert cli_main(["cache", "repair", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    aside = d / ".te_thd-damaged"
    assert out == [
        f"OK: {d}: every shard verified; nothing to repair",
        f"kept: {aside} holds 1 file(s) ({len(data) / 1024:.1f} KiB) that earlier repairs set aside for inspection; "
        f"the cache does not need them: `rm -r {aside}`",
    ]
    cmd = out[1][out[1].index("`") + 1 : -1]
    subprocess.run(shlex.split(cmd), check=True)  # as printed
    assert not aside.exists()
    assert cli_main(["cache", "repair", str(d)]) == 0
    assert capsys.readouterr().out == f"OK: {d}: every shard verified; nothing to repair\n"


def test_a_flipped_byte_in_a_header_is_named_in_one_short_line(tmp_path: Path, capsys) -> None:
    """One bit of "__metadata__" makes the te_thd fields (the run record, every row checksum) read as a
    tensor entry: the messages name the entry and its keys, never its content."""
    d = tmp_path / "c"
    produce(d, token_keys=("input_ids", "hidden"), length_key="length")
    shard = d / "shard-000001.safetensors"
    shard.write_bytes(shard.read_bytes().replace(b'"__metadata__"', b'"__metadatb__"', 1))
    what = (
        "is not a valid safetensors file: entry '__metadatb__' is no tensor (it holds keys "
        "['te_thd'])"
    )
    with pytest.raises(CacheIntegrityError) as e:
        verify_cache(str(d), deep=True)
    assert f"\n  {shard}: {what}\n" in str(e.value)
    assert (
        len(what) < 300 and len(str(e.value)) < 1000
    )  # the header ran to kilobytes when printed whole
    ds = CachedTensorDataset(str(d), "offline", 3, ("hidden",))
    with pytest.raises(CacheIntegrityError) as e:
        ds.__getitems__([4])
    assert str(e.value).startswith(f"shard {shard} {what}. Repair: `te-thd cache repair {d}`")
    assert len(str(e.value).split(". Repair: ")[0]) < 300
    # the whole line, the fix included, is short but for the paths it names
    assert len(str(e.value).replace(str(shard), "").replace(str(d), "")) < 300
    assert cli_main(["cache", "repair", str(d)]) == 0
    assert f"set aside: {shard.name}: {what}\n" in capsys.readouterr().out
    assert "sums" not in str(e.value) and "xxh3" not in str(e.value)


def test_the_cli_rebuilds_a_lost_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "c"
    produce(d)
    clean = (d / "manifest.json").read_bytes()
    (d / "manifest.json").unlink()
    for cmd in ("info", "verify"):
        assert cli_main(["cache", cmd, str(d)]) == 1
        err = capsys.readouterr().err
        assert (
            f"holds 3 shard(s): the manifest was lost, or the cache was never finished. Rebuild it from the shards: `te-thd cache repair {d}`"
            in err
        )
        assert "computes only the missing shards" not in err
    hint = err[err.index("`te-thd ") + 1 :]
    assert cli_main(shlex.split(hint[: hint.index("`")])[1:]) == 0  # as printed
    assert (
        capsys.readouterr().out
        == f"rebuilt: {d}: manifest.json written from its shards, every shard verified\n"
    )
    assert (d / "manifest.json").read_bytes() == clean


def test_the_producer_refusal_names_the_repair_that_lets_it_finish(tmp_path: Path) -> None:
    d = tmp_path / "c"
    produce(d)
    clean = (d / "manifest.json").read_bytes()
    (d / "manifest.json").unlink()
    with pytest.raises(
        CacheError, match=r"holds shards \(0-2\) but no manifest and no producer record"
    ) as e:
        produce(d)
    cmd = re.findall(r"`([^`]+)`", str(e.value))
    assert cmd == [f"te-thd cache repair {d}"]
    assert cli_main(shlex.split(cmd[0])[1:]) == 0
    produce(d)  # finished: nothing to do
    assert (d / "manifest.json").read_bytes() == clean


def test_a_gap_is_reported_and_the_printed_producer_fills_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python users: the hint is the ``produce_cache`` call; ``resume=True`` then computes only the gap."""
    d = tmp_path / "c"
    produce(d)
    clean = {p.name: p.read_bytes() for p in d.iterdir()}
    (d / "manifest.json").unlink()
    (d / "shard-000001.safetensors").unlink()
    data = bytearray((d / "shard-000002.safetensors").read_bytes())
    data[-3] ^= 0x40
    (d / "shard-000002.safetensors").write_bytes(bytes(data))
    assert cli_main(["cache", "repair", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        "set aside: shard-000002.safetensors: sample 9 (row 1 of the shard), key 'hidden': checksum mismatch"
    )
    assert out[1:] == [
        "missing: shard-000001.safetensors",
        f"{d} is reopened for a resume (moved to {d}/.te_thd-damaged): re-run the `te_thd.offline_cache.produce_cache"
        "(...)` call that built it (resume=True, the default, computes only the missing shards); it writes the "
        "manifest.",
    ]
    assert not (d / "manifest.json").exists() and (d / PROGRESS_NAME).exists()
    with pytest.raises(
        ManifestNotFoundError,
        match=r"its producer run is unfinished \(stopped by an error, or reopened by te-thd cache repair\); resume with: the `te_thd\.offline_cache\.produce_cache\(\.\.\.\)` call",
    ):
        read_manifest(str(d), "offline", 3)
    calls = []
    produce_cache(DataLoader(_Samples(10), batch_size=2), str(d), 4, lambda b: calls.append(1) or b, KEYS,
                  OPTIONS, format_version=3, progress=False)  # fmt: skip
    assert len(calls) == 3  # shard 1 (two batches) and shard 2 (one): only the gap
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == clean


def test_a_gap_in_the_example_cache_prints_the_command_that_fills_it(tmp_path: Path) -> None:
    """The producer records how to run it again: repair prints that command, and it runs as printed."""
    d = tmp_path / "c"
    script = [sys.executable, str(REPO / "examples" / "precompute_cache.py")]
    argv = ["--out", str(d), "--num-samples", "24", "--min-len", "5", "--max-len", "24", "--shard-size", "8",
            "--batch-size", "8", "--pack-seq-len", "64"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [*script, *argv], check=True, capture_output=True, timeout=180, env=env, cwd=REPO
    )
    clean = (d / "manifest.json").read_bytes()
    (d / "manifest.json").unlink()
    (
        d / "shard-000002.safetensors"
    ).unlink()  # the last one: only the shards' record says the cache has 3
    cli = str(Path(sys.executable).with_name("te-thd"))
    out = subprocess.run(
        [cli, "cache", "repair", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "missing: shard-000002.safetensors" in out.stdout
    cmd = re.findall(r"`([^`]+)`", out.stdout)
    assert (
        len(cmd) == 1
        and f"/python {REPO / 'examples' / 'precompute_cache.py'} --out {d} " in cmd[0]
    )  # te-thd's interpreter
    subprocess.run(
        shlex.split(cmd[0]), check=True, capture_output=True, timeout=180, env=env, cwd=d.parent
    )  # as printed, elsewhere
    assert (d / "manifest.json").read_bytes() == clean
    assert verify_cache(str(d), deep=True)["checksums_verified"]
    again = subprocess.run(
        [cli, "cache", "repair", str(d)], capture_output=True, text=True, timeout=120, env=env
    )
    assert again.stdout == f"OK: {d}: every shard verified; nothing to repair\n"


def _produce_rank(rank: int, world: int, out: str) -> dict:
    return produce(out, n=13, shard_size=2, token_keys=("hidden",), length_key="length")


def test_a_cache_produced_by_two_ranks_is_rebuilt_byte_identical(tmp_path: Path) -> None:
    d = tmp_path / "c"
    run_gloo(2, _produce_rank, str(d), out_dir=str(tmp_path))
    clean = (d / "manifest.json").read_bytes()
    (d / "manifest.json").unlink()
    assert repair_cache(str(d))["rebuilt"]
    assert (d / "manifest.json").read_bytes() == clean


def test_shards_of_two_runs_are_refused_naming_both(tmp_path: Path) -> None:
    produce(tmp_path / "a")
    produce(tmp_path / "b", options={"cp_size": 4})
    (tmp_path / "a" / "manifest.json").unlink()
    os.replace(
        tmp_path / "b" / "shard-000002.safetensors", tmp_path / "a" / "shard-000002.safetensors"
    )
    with pytest.raises(
        CacheIntegrityError,
        match=r"shards 0-1 and shards 2 record different producer runs \(options\.cp_size: recorded 2, this run 4; options\.mask_prompt: recorded True, this run absent; options\.notes: recorded .*\), so they are not one cache\. Move the shards that do not belong away",
    ):
        repair_cache(str(tmp_path / "a"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        f"shard-00000{i}.safetensors" for i in range(3)
    ]


def test_arguments_the_shards_contradict_or_a_sound_manifest_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "c"
    produce(d)
    with pytest.raises(
        ValueError, match=r"format_version: only a rebuild of a lost or damaged manifest takes them"
    ):
        repair_cache(str(d), format_version=3)
    (d / "manifest.json").unlink()
    with pytest.raises(
        ValueError,
        match=r"shard_size=8 contradicts the shards of .*, which record shard_size=4; leave --shard-size out",
    ):
        repair_cache(str(d), shard_size=8)
    with pytest.raises(
        ValueError, match=r"options=\{'cp_size': 4\} contradicts the producer options the shards"
    ):
        repair_cache(str(d), options={"cp_size": 4})
    result = repair_cache(
        str(d), options={"owner": "team-a"}
    )  # metadata the shards do not record: added
    assert result["rebuilt"] and result["from_arguments"] == ["owner"]
    assert read_manifest(str(d), "offline", 3)["owner"] == "team-a"


def _old_cache(d: Path, n: int = 10, shard_size: int = 4) -> dict:
    """A cache as te_thd wrote it before shards recorded their run: the same shards, without ``run``."""
    from te_thd.offline_cache import write_manifest
    from te_thd.offline_cache.format.lengths import LengthRule
    from te_thd.offline_cache.write.writer import DurableShardWriter

    rows = {k: torch.stack([_Samples(n)[i][k] for i in range(n)]) for k in KEYS}
    with DurableShardWriter(
        KEYS, "offline", pipelined=False, length_rule=LengthRule("input_ids")
    ) as w:
        for s, lo in enumerate(range(0, n, shard_size)):
            w(str(d), s, {k: v[lo : lo + shard_size] for k, v in rows.items()})
        fields = w.manifest_fields(str(d))
    write_manifest(
        str(d),
        {**OPTIONS, "num_samples": n, "shard_size": shard_size, "layout_version": 3, **fields},
        3,
    )
    return json.loads((d / "manifest.json").read_text())


def test_shards_without_a_run_record_name_what_is_missing_and_the_arguments_pass_it_back(
    tmp_path: Path, capsys
) -> None:
    d = tmp_path / "c"
    _old_cache(d)
    clean = (d / "manifest.json").read_bytes()
    (d / "manifest.json").unlink()
    assert cli_main(["cache", "repair", str(d)]) == 1
    err = capsys.readouterr().err
    assert (
        f"cannot rebuild the manifest of {d}: its shards were written before shards recorded their producer run, "
        "so they do not tell format_version (the int its readers pass); options (the producer options, a JSON "
        f"object: {{}} for none). Pass them back: `te-thd cache repair {d} --format-version "
        "<format_version> --options <options>`, or repair_cache(cache_dir, format_version=..., options=...)."
    ) in err
    assert sorted(p.name for p in d.iterdir()) == [
        f"shard-00000{i}.safetensors" for i in range(3)
    ]  # untouched
    assert (
        cli_main(
            ["cache", "repair", str(d), "--format-version", "3", "--options", json.dumps(OPTIONS)]
        )
        == 0
    )
    assert capsys.readouterr().out == (
        "note: num_samples=10: shard 2 is taken for the last (pass --num-samples if shards after it were lost too)\n"
        "note: lengths by the non-padding length of 'input_ids' (pad 0), the producer's default (pass --length-key "
        "if it was given another length_key)\n"
        f"rebuilt: {d}: manifest.json written from its shards and the arguments (format_version, options), every "
        "shard verified\n"
    )
    assert (d / "manifest.json").read_bytes() == clean
    # one shard does not tell its shard_size
    one = tmp_path / "one"
    _old_cache(one, n=3, shard_size=4)
    (one / "manifest.json").unlink()
    with pytest.raises(
        ManifestError,
        match=r"shard_size \(samples per shard: one shard does not tell\)\. Pass them back: `te-thd cache repair \S+ --format-version <format_version> --options <options> --shard-size <shard_size>`",
    ):
        repair_cache(str(one))
    assert repair_cache(str(one), format_version=3, options=OPTIONS, shard_size=4)["rebuilt"]
    assert read_manifest(str(one), "offline", 3)["shard_size"] == 4
    assert cli_main(["cache", "repair", str(one), "--options", "{cp_size: 2}"]) == 2
    assert "--options '{cp_size: 2}' is not JSON" in capsys.readouterr().err
