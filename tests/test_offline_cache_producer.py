"""produce_cache in one process: the directory states it accepts, refuses, and what it writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _offline_cache_support import damage_shard
from crash_test import IndexDataset
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

from te_thd.offline_cache import (
    CachedTensorDataset,
    CacheError,
    ManifestError,
    SchemaError,
    existing_shard_indices,
    produce_cache,
    read_manifest,
    verify_cache,
    write_tensor_shard,
)
from te_thd.offline_cache.storage.base import LOCK_NAME
from te_thd.offline_cache.write.producer import PROGRESS_NAME

KEYS = ("h", "ids")


def _data(n: int = 10) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(3, generator=g), "i": torch.tensor([i, -i])} for i in range(n)]


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"h": (batch["x"] * 2).to(torch.bfloat16), "ids": batch["i"]}


def _produce(
    out: Path, n: int = 10, shard_size: int = 4, batch_size: int = 2, compute=_compute, **kw
):
    return produce_cache(
        DataLoader(_data(n), batch_size=batch_size),
        str(out),
        shard_size,
        compute,
        KEYS,
        kw.pop("options", {"cp_size": 2}),
        progress=False,
        **kw,
    )


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_produce_writes_shards_and_manifest_readable_by_the_reader(tmp_path: Path) -> None:
    m = _produce(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "manifest.json",
        "shard-000000.safetensors",
        "shard-000001.safetensors",
        "shard-000002.safetensors",
    ]
    assert m == read_manifest(str(tmp_path), "test", 1)
    assert m["schema"] == {
        "h": {"dtype": "bfloat16", "shape": [3]},
        "ids": {"dtype": "int64", "shape": [2]},
    }
    assert m["cp_size"] == 2 and m["num_samples"] == 10 and m["shard_size"] == 4
    assert [s["bytes"] for s in m["shards"]] == [
        os.path.getsize(tmp_path / s["file"]) for s in m["shards"]
    ]
    ds = CachedTensorDataset(
        cache_dir=str(tmp_path), cache_name="test", format_version=1, disk_keys=KEYS
    )
    data = _data()
    for i in (0, 5, 9):
        assert torch.equal(ds[i]["h"], (data[i]["x"] * 2).to(torch.bfloat16))
        assert torch.equal(ds[i]["ids"], data[i]["i"])
    assert verify_cache(str(tmp_path), deep=True)["checksums_verified"]


def test_output_is_independent_of_batch_size(tmp_path: Path) -> None:
    _produce(tmp_path / "a", batch_size=1)
    _produce(tmp_path / "b", batch_size=4)
    _produce(
        tmp_path / "c", batch_size=3
    )  # shard_size 4 not a multiple of 3: batches straddle shards
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b") == _bytes(tmp_path / "c")


def test_finished_cache_is_reused_without_computing(tmp_path: Path) -> None:
    first = _produce(tmp_path)
    before = _bytes(tmp_path)

    def never(batch):
        raise AssertionError("a finished cache must not be recomputed")

    assert _produce(tmp_path, compute=never) == first
    assert _bytes(tmp_path) == before


def test_finished_cache_with_other_parameters_is_refused(tmp_path: Path) -> None:
    _produce(tmp_path)
    with pytest.raises(
        CacheError,
        match=r"holds a finished cache built with other parameters \(shard_size: recorded 4, this run 5\)\. Choose another output_dir",
    ):
        _produce(tmp_path, shard_size=5)
    with pytest.raises(CacheError, match=r"\(options\.cp_size: recorded 2, this run 4\)"):
        _produce(tmp_path, options={"cp_size": 4})


def test_resume_false_refuses_existing_cache_and_partial_run(tmp_path: Path) -> None:
    _produce(tmp_path / "done")
    with pytest.raises(
        CacheError,
        match=r"already holds a finished cache \(manifest.json\)\. Pass resume=True to reuse it",
    ):
        _produce(tmp_path / "done", resume=False)

    calls = {"n": 0}

    def dies(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return _compute(batch)

    with pytest.raises(RuntimeError):
        _produce(tmp_path / "partial", compute=dies)
    with pytest.raises(
        CacheError, match=r"holds 1 shards of an unfinished run\. Pass resume=True to continue it"
    ):
        _produce(tmp_path / "partial", resume=False)


def test_resume_false_refuses_a_directory_of_other_files_and_keeps_them(tmp_path: Path) -> None:
    """docs/offline_cache.md: resume=False builds only in an empty directory; nothing there is touched."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        CacheError,
        match=rf"output_dir {out} is not empty: it holds notes\.txt, which no te_thd producer wrote.*pass resume=True to write the cache beside these files",
    ):
        _produce(out, resume=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt"
    ]  # the lock is released and removed
    _produce(out)  # resume=True (the default) writes beside it
    assert (out / "notes.txt").read_text() == "mine" and (out / "manifest.json").exists()


def test_resume_with_other_parameters_is_refused(tmp_path: Path) -> None:
    calls = {"n": 0}

    def dies(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return _compute(batch)

    with pytest.raises(RuntimeError):
        _produce(tmp_path, compute=dies)
    assert (tmp_path / PROGRESS_NAME).exists()
    with pytest.raises(
        CacheError,
        match=r"holds shards of an unfinished run with other parameters \(num_samples: recorded 10, this run 12\)",
    ):
        _produce(tmp_path, n=12)


def test_shards_of_an_unknown_producer_are_refused(tmp_path: Path) -> None:
    write_tensor_shard(
        str(tmp_path),
        0,
        _compute({"x": torch.ones(4, 3), "i": torch.ones(4, 2, dtype=torch.int64)}),
        KEYS,
        "t",
    )
    with pytest.raises(
        CacheError,
        match=rf"holds shards \(0\) but no manifest and no producer record \(\.te_thd-producer\.json\), so their parameters cannot be checked\. Rebuild the manifest from the shards: `te-thd cache repair {tmp_path}`",
    ):
        _produce(tmp_path)


def test_foreign_files_in_output_dir_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "README.txt").write_text("notes")
    _produce(tmp_path)
    assert (tmp_path / "README.txt").read_text() == "notes"
    verify_cache(str(tmp_path), deep=True)


def test_schema_change_mid_run_is_rejected_at_write_time(tmp_path: Path) -> None:
    calls = {"n": 0}

    def drifting(batch):
        calls["n"] += 1
        out = _compute(batch)
        if calls["n"] >= 3:  # shard 0 (batches 1-2) was bf16; now float32
            out["h"] = out["h"].float()
        return out

    with pytest.raises(
        SchemaError, match=r"key 'h' is float32\[n, 3\] but the cache schema says bfloat16\[n, 3\]"
    ):
        _produce(tmp_path, compute=drifting)
    assert existing_shard_indices(str(tmp_path)) == {0}
    assert not (tmp_path / "manifest.json").exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_missing_key_in_compute_output(tmp_path: Path) -> None:
    with pytest.raises(
        SchemaError,
        match=r"compute_batch output is missing required cache keys \['ids'\] \(got \['h'\]\)",
    ):
        _produce(tmp_path, compute=lambda b: {"h": b["x"]})


def test_existing_shard_with_other_schema_is_refused_on_resume(tmp_path: Path) -> None:
    calls = {"n": 0}

    def dies(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return _compute(batch)

    with pytest.raises(RuntimeError):
        _produce(tmp_path, compute=dies)

    def float_h(batch):
        out = _compute(batch)
        out["h"] = out["h"].float()
        return out

    with pytest.raises(
        SchemaError, match=r"key 'h' is float32\[n, 3\] but the cache schema says bfloat16\[n, 3\]"
    ):
        _produce(tmp_path, compute=float_h)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shard_size": 0}, r"shard_size=0 must be an int >= 1 \(samples per shard\)"),
        ({"shard_size": -3}, r"shard_size=-3 must be an int >= 1 \(samples per shard\)"),
        (
            {"options": {"num_samples": 3}},
            r"options \['num_samples'\] clash with manifest fields te_thd writes itself",
        ),
        (
            {"options": {"when": object()}},
            r"options must be JSON values \(recorded in manifest.json\)",
        ),
        (
            {"world_size": 2, "rank": 1},
            r"world_size=2, rank=1 need an initialised torch.distributed process group",
        ),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _produce(tmp_path, **kwargs)
    assert existing_shard_indices(str(tmp_path)) == set()


def test_bad_keys_and_iterable_dataset(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"keys=\('h', 'h'\) must be a non-empty tuple of distinct key names"
    ):
        produce_cache(DataLoader(_data()), str(tmp_path), 4, _compute, ("h", "h"))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(_data())

    with pytest.raises(ValueError, match=r"needs a map-style dataset with len\(\)"):
        produce_cache(DataLoader(Stream()), str(tmp_path), 4, _compute, KEYS)


def test_an_empty_dataset_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^the dataloader's dataset is empty \(len\(\) == 0\): there is nothing to "
                                         r"cache; check what builds it \(a data path, a filter that drops every sample\)$"):  # fmt: skip
        _produce(tmp_path / "c", n=0)
    assert not (tmp_path / "c").exists()


def test_a_list_or_a_file_is_one_line_naming_the_argument(tmp_path: Path) -> None:
    """A list where the DataLoader goes, an existing file as output_dir: no AttributeError, no bare
    FileExistsError, and nothing written."""
    with pytest.raises(TypeError, match=r"^dataloader is a list, not a torch DataLoader; pass DataLoader\(samples, "
                                        r"batch_size=\.\.\.\) \(its batch size and collate_fn are used\)$"):  # fmt: skip
        produce_cache(_data(), str(tmp_path / "c"), 4, _compute, KEYS, progress=False)
    assert not (tmp_path / "c").exists()
    (tmp_path / "f").write_text("notes")
    with pytest.raises(ValueError, match=rf"^output_dir='{tmp_path}/f' is a file, not a directory; pass a directory "
                                         r"\(new, or one this producer wrote\)$"):  # fmt: skip
        _produce(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "notes"


def test_manifest_has_no_volatile_fields(tmp_path: Path) -> None:
    _produce(tmp_path / "a")
    _produce(tmp_path / "b")
    a = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert set(a) == {
        "format_version",
        "num_samples",
        "shard_size",
        "layout_version",
        "schema",
        "shards",
        "cp_size",
        "manifest_checksum",
    }
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (
        tmp_path / "b" / "manifest.json"
    ).read_bytes()


def test_manifest_error_type_for_reader_mismatch(tmp_path: Path) -> None:
    _produce(tmp_path, format_version=2)
    with pytest.raises(ManifestError, match=r"has format_version=2, expected 1"):
        read_manifest(str(tmp_path), "test", 1)


def test_logs_each_shard_and_shows_a_progress_bar_on_request(
    tmp_path: Path, caplog, capsys
) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="te_thd.offline_cache"):
        produce_cache(
            DataLoader(_data(), batch_size=2), str(tmp_path), 4, _compute, KEYS, progress=True
        )
    wrote = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Wrote ")]
    assert wrote == [
        f"Wrote {tmp_path}/shard-000000.safetensors (4 samples)",
        f"Wrote {tmp_path}/shard-000001.safetensors (4 samples)",
        f"Wrote {tmp_path}/shard-000002.safetensors (2 samples)",
        f"Wrote {tmp_path}/manifest.json (10 samples, 3 shards)",
    ]
    err = capsys.readouterr().err
    assert "cache: 100%" in err and "5/5" in err  # 5 batches of 2


def test_progress_bar_is_off_when_stderr_is_not_a_tty(tmp_path: Path, capsys) -> None:
    produce_cache(
        DataLoader(_data(), batch_size=2), str(tmp_path), 4, _compute, KEYS
    )  # progress=None
    assert "cache:" not in capsys.readouterr().err  # pytest's captured stderr is not a TTY


def test_compute_batch_returning_a_tensor(tmp_path: Path) -> None:
    with pytest.raises(
        SchemaError, match=r"compute_batch returned a Tensor; it must return a dict of tensors"
    ):
        _produce(tmp_path, compute=lambda b: b["x"])


def test_a_rerun_with_other_options_names_only_the_fields_that_differ(tmp_path: Path) -> None:
    """The refusal names each differing field with both values, not both option dicts."""
    from te_thd.offline_cache.format.schema import CacheError

    many = {f"opt_{i}": "x" * 40 for i in range(30)}
    loader = DataLoader(IndexDataset(4), batch_size=2)
    compute = lambda b: {"h": b["idx"].float()[:, None]}  # noqa: E731
    produce_cache(
        loader, str(tmp_path / "c"), 2, compute, ("h",), {**many, "cp_size": 2}, progress=False
    )
    with pytest.raises(CacheError) as err:
        produce_cache(
            loader,
            str(tmp_path / "c"),
            2,
            compute,
            ("h",),
            {**many, "cp_size": 4, "new": 1},
            progress=False,
        )
    msg = str(err.value)
    assert (
        "(options.cp_size: recorded 2, this run 4; options.new: recorded absent, this run 1)" in msg
    )
    assert "opt_0" not in msg and len(msg) < 400


def test_a_rerun_names_what_changed_first_and_cuts_long_values(tmp_path: Path) -> None:
    """A recorded command line differs whenever any argument does: it is cut to the item that differs and
    listed after the fields themselves, however they sort."""
    from te_thd.offline_cache.format.schema import CacheError

    loader = DataLoader(IndexDataset(4), batch_size=2)
    compute = lambda b: {"h": b["idx"].float()[:, None]}  # noqa: E731
    argv = ["--out", "{cache_dir}", *[f"--flag-{i}" for i in range(60)], "--shard-size", "2"]
    produce_cache(loader, str(tmp_path / "c"), 2, compute, ("h",), {"argv": argv}, progress=False)
    with pytest.raises(CacheError) as err:
        produce_cache(
            loader,
            str(tmp_path / "c"),
            4,
            compute,
            ("h",),
            {"argv": [*argv[:-1], "4"]},
            progress=False,
        )
    assert str(err.value) == (
        f"output_dir {tmp_path / 'c'} holds a finished cache built with other parameters (shard_size: recorded 2, "
        "this run 4; options.argv[63]: recorded '2', this run '4'). Choose another output_dir, or delete this cache."
    )


@given(
    st.dictionaries(st.sampled_from("abcd"), st.integers(0, 2)),
    st.dictionaries(st.sampled_from("abcd"), st.integers(0, 2)),
)
def test_describe_diff_lists_exactly_the_differing_fields(a: dict, b: dict) -> None:
    from te_thd.offline_cache.record.run import describe_diff

    text = describe_diff({"options": a, "n": 1}, {"options": b, "n": 1})
    named = {part.split(":")[0] for part in text.split("; ") if part}
    assert named == {f"options.{k}" for k in set(a) | set(b) if a.get(k, -1) != b.get(k, -1)}


@pytest.mark.parametrize("damage", ["missing", "truncated", "extra"])
def test_the_same_call_fills_a_gap_in_a_finished_cache(tmp_path: Path, damage: str) -> None:
    """Re-running the call that built a finished cache recomputes a missing or truncated shard (the
    truncated one set aside, never read) and ends byte-identical to the clean cache."""
    loader = DataLoader(IndexDataset(10), batch_size=2)
    compute = lambda b: {"h": b["idx"].float()[:, None] * 2}  # noqa: E731
    clean, d = tmp_path / "clean", tmp_path / "cache"
    for out in (clean, d):
        produce_cache(loader, str(out), 4, compute, ("h",), {"cp_size": 1}, progress=False)
    damage_shard(d / "shard-000001.safetensors", damage)
    produce_cache(loader, str(d), 4, compute, ("h",), {"cp_size": 1}, progress=False)
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in clean.iterdir()
    )
    for p in clean.iterdir():
        assert (d / p.name).read_bytes() == p.read_bytes(), p.name
    aside = (
        sorted(p.name for p in (d / ".te_thd-damaged").iterdir())
        if (d / ".te_thd-damaged").exists()
        else []
    )
    assert (
        aside
        == {
            "missing": [],
            "truncated": ["shard-000001.safetensors"],
            "extra": ["shard-000007.safetensors"],
        }[damage]
    )
