"""Offline cache format: shard bytes, paths, manifest, schema, integrity checks, writer pieces."""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from _offline_cache_support import read_header, write_shard_file
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from te_thd.offline_cache import (
    MANIFEST_NAME,
    SHARD_RE,
    CacheIntegrityError,
    ManifestError,
    ManifestNotFoundError,
    SchemaError,
    TensorSpec,
    _sequential_subset_loader,
    _ShardAccumulator,
    cache_info,
    check_cache_files,
    dataloader_from_sample,
    ensure_supervision_options_match,
    existing_shard_indices,
    load_safetensors,
    manifest_path,
    partition_cache_shards,
    read_manifest,
    resume_start_sample,
    shard_path,
    validate_contiguous_shards,
    verify_cache,
    write_cache_shards,
    write_cache_shards_distributed,
    write_manifest,
    write_tensor_shard,
)
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.schema import DTYPE_TO_ST, format_indices
from te_thd.offline_cache.record.manifest import load_manifest
from te_thd.offline_cache.write.loops import shard_runs
from te_thd.offline_cache.write.shardfile import ShardStream
from te_thd.offline_cache.write.writer import DurableShardWriter

LOG = logging.getLogger("test")
DTYPES = sorted(DTYPE_TO_ST, key=str)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random BYTES viewed as ``dtype`` (any bit pattern: NaNs, odd bools; the format must not care)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * size,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# -- shard bytes --------------------------------------------------------------------------


#: tensor name -> (dtype, trailing shape) of a shard's keys
SHARD_ENTRIES = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), min_size=0, max_size=2)),
    min_size=1,
    max_size=5,
)


@given(
    entries=SHARD_ENTRIES,
    rows=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_shard_file_is_byte_identical_to_save_file(tmp_path_factory, entries, rows, seed) -> None:
    """Our bytes are save_file's with the one te_thd metadata entry (safetensors writes a single
    metadata key deterministically), and every row checksum is the row's xxh3_64 seeded by its index."""
    d = tmp_path_factory.mktemp("bytes")
    tensors = {
        k: _tensor(dt, (rows, *shape), seed + i)
        for i, (k, (dt, shape)) in enumerate(entries.items())
    }
    record = write_shard_file(str(d / "ours.safetensors"), tensors)
    with safe_open(str(d / "ours.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    assert list(metadata) == ["te_thd"]
    save_file(tensors, str(d / "ref.safetensors"), metadata=metadata)
    ours = (d / "ours.safetensors").read_bytes()
    assert ours == (d / "ref.safetensors").read_bytes()
    sums = read_shard_header(str(d / "ours.safetensors")).sums
    assert sums is not None and sums.rows == rows
    for k, t in tensors.items():
        raw = t.contiguous().reshape(rows, -1).view(torch.uint8) if rows else t
        want = [xxhash.xxh3_64_intdigest(raw[i].numpy().tobytes(), i) for i in range(rows)]
        assert sums.sums[k].tolist() == want
    assert record.bytes == len(ours)
    assert (
        record.checksum
        == f"xxh3_64:{json.loads(metadata['te_thd'])['header']}"
        == f"xxh3_64:{sums.digest}"
    )
    with safe_open(str(d / "ours.safetensors"), framework="pt") as f:
        for k, t in tensors.items():
            assert torch.equal(
                f.get_tensor(k).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            )
    header = read_header(str(d / "ours.safetensors"))
    assert {k: (e.dtype, e.shape) for k, e in header.items()} == {
        k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()
    }


@given(
    entries=SHARD_ENTRIES,
    splits=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_shard_pieces_write_the_bytes_of_the_concatenation(
    tmp_path_factory, entries, splits, seed
) -> None:
    """A shard streamed as dim-0 pieces (some empty) is byte-identical to the shard of their
    concatenation written whole: same header, row sums seeded by the shard row index, same record."""
    d = tmp_path_factory.mktemp("pieces")
    full = {
        k: _tensor(dt, (sum(splits), *shape), seed + i)
        for i, (k, (dt, shape)) in enumerate(entries.items())
    }
    specs = {k: TensorSpec(t.dtype, tuple(t.shape[1:])) for k, t in full.items()}
    stream = ShardStream(str(d / "pieces.safetensors"), specs, sum(splits))
    lo = 0
    for n in splits:
        stream.write({k: t[lo : lo + n] for k, t in full.items()})
        lo += n
    record = stream.finish()
    joined = write_shard_file(str(d / "joined.safetensors"), full)
    assert (d / "pieces.safetensors").read_bytes() == (d / "joined.safetensors").read_bytes()
    assert record == joined


def test_shard_file_of_noncontiguous_tensor(tmp_path: Path) -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]  # a strided view
    write_shard_file(str(tmp_path / "a"), {"t": t})
    with safe_open(str(tmp_path / "a"), framework="pt") as f:
        metadata = f.metadata()
    save_file({"t": t.contiguous()}, str(tmp_path / "b"), metadata=metadata)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


# -- paths ---------------------------------------------------------------------------------


def test_paths_and_names() -> None:
    assert MANIFEST_NAME == "manifest.json"
    assert shard_path("/c", 7) == "/c/shard-000007.safetensors"
    assert manifest_path("/c") == "/c/manifest.json"
    assert SHARD_RE.match("shard-000123.safetensors").group(1) == "000123"
    assert SHARD_RE.match("shard-1.safetensors") is None
    assert shard_path("/c", 999_999).endswith("shard-999999.safetensors")
    with pytest.raises(
        ValueError, match=r"shard_index=1000000 is outside \[0, 1000000\).*Use a larger shard_size"
    ):
        shard_path("/c", 1_000_000)
    save_file_fn, open_fn = load_safetensors("test")
    assert save_file_fn is save_file and open_fn is safe_open


def test_existing_shard_indices_ignores_foreign_and_temp_files(tmp_path: Path) -> None:
    for name in [
        "shard-000000.safetensors",
        "shard-000002.safetensors",
        "shard-2.safetensors",
        "notes.txt",
        ".shard-000001.safetensors.123-deadbeef.tmp",
        "shard-000003.safetensors.bak",
        "manifest.json",
    ]:
        (tmp_path / name).write_bytes(b"")
    assert existing_shard_indices(str(tmp_path)) == {0, 2}
    assert existing_shard_indices(str(tmp_path / "missing")) == set()


def test_format_indices_summarises_runs() -> None:
    assert format_indices([5, 0, 1, 2, 9, 10]) == "0-2, 5, 9-10"
    assert format_indices([]) == "none"
    assert format_indices(range(0, 40, 2), limit=3) == "0, 2, 4, ... (17 more runs)"


def _touch_shards(d: Path, indices) -> None:
    for i in indices:
        Path(shard_path(str(d), i)).write_bytes(b"")


def test_validate_contiguous_shards_ok_with_foreign_files(tmp_path: Path) -> None:
    _touch_shards(tmp_path, range(3))
    (tmp_path / "README.txt").write_text("mine")
    assert validate_contiguous_shards(str(tmp_path), "test", 9, 4) == [0, 1, 2]


def test_validate_contiguous_shards_names_gaps(tmp_path: Path) -> None:
    _touch_shards(tmp_path, [0, 1, 3])
    with pytest.raises(
        CacheIntegrityError,
        match=r"declares 16 samples in 4 shards of 4, but has missing shard indices 2 \(e\.g\. shard-000002\.safetensors\)\. Restore the missing shards from a copy, or recompute them: run `te-thd cache repair \S+` \(it reopens the cache for a resume\), then re-run the `te_thd\.offline_cache\.produce_cache\(\.\.\.\)` call that built it \(resume=True, the default, computes only the missing shards\)\.$",
    ) as e:
        validate_contiguous_shards(str(tmp_path), "test", 16, 4)
    assert e.value.path == shard_path(str(tmp_path), 2)
    assert str(e.value).count("computes only the missing shards") == 1
    assert "Move" not in str(e.value)  # nothing is extra: moving shards away does not apply


def test_validate_contiguous_shards_names_extra_indices(tmp_path: Path) -> None:
    _touch_shards(tmp_path, [0, 1, 2, 7])
    with pytest.raises(
        CacheIntegrityError,
        match=r"extra shard indices 2, 7 beyond the declared 2 .*Move the extra shards away, or run `te-thd cache repair \S+` \(it sets them aside",
    ):
        validate_contiguous_shards(str(tmp_path), "test", 8, 4)


# -- manifest ----------------------------------------------------------------------------


def _manifest(d: Path, obj) -> None:
    (d / MANIFEST_NAME).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def test_manifest_round_trip_is_deterministic(tmp_path: Path) -> None:
    m = {"shard_size": 4, "num_samples": 10, "zeta": [1, 2], "alpha": {"b": 1, "a": 2}}
    write_manifest(str(tmp_path / "a"), m, 3)
    write_manifest(str(tmp_path / "b"), dict(reversed(list(m.items()))), 3)
    assert (tmp_path / "a" / MANIFEST_NAME).read_bytes() == (
        tmp_path / "b" / MANIFEST_NAME
    ).read_bytes()
    assert read_manifest(str(tmp_path / "a"), "test", 3) == {"format_version": 3, **m}
    assert sorted(os.listdir(tmp_path / "a")) == [MANIFEST_NAME]


def test_read_manifest_missing(tmp_path: Path) -> None:
    with pytest.raises(
        ManifestNotFoundError,
        match=r"holds no manifest\.json and no shards: it is not a te_thd cache; check the path$",
    ) as e:
        read_manifest(str(tmp_path), "test", 1)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)
    # the words the reference's callers match (pytest.raises(FileNotFoundError, match=...))
    assert "manifest not found" in str(e.value)
    _touch_shards(tmp_path, [0, 2])  # shards, no manifest: rebuild it from them
    with pytest.raises(
        ManifestNotFoundError,
        match=rf"test cache manifest not found at .*manifest.json, but {tmp_path} holds 2 shard\(s\): the manifest was lost, or the cache was never finished\. Rebuild it from the shards: `te-thd cache repair {tmp_path}` \(it verifies every shard; when one is missing it prints the producer command that computes it\)\.$",
    ):
        read_manifest(str(tmp_path), "test", 1, "`the producer`")
    for i in (0, 2):
        os.unlink(shard_path(str(tmp_path), i))
    with pytest.raises(
        FileNotFoundError, match=r"cache_dir='.*nope': no such directory; check the path"
    ):
        read_manifest(str(tmp_path / "nope"), "test", 1)
    with pytest.raises(
        ManifestError,
        match=r"cache_dir='.*manifest\.json' is a file, not a cache directory; pass its directory",
    ):
        _manifest(tmp_path, {"format_version": 1, "num_samples": 0, "shard_size": 1})
        read_manifest(str(tmp_path / MANIFEST_NAME), "test", 1)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(
        ManifestError,
        match=r"cache_dir='.*notes\.txt' is a file, not a cache directory; pass the directory that holds manifest\.json and the shards$",
    ):
        read_manifest(str(tmp_path / "notes.txt"), "test", 1)


def test_read_manifest_not_json(tmp_path: Path) -> None:
    _manifest(tmp_path, '{"num_samples": 3,')
    with pytest.raises(
        ManifestError,
        match=r"manifest .*manifest.json is not valid JSON \(.*line 1.*Restore manifest.json from a copy, or rebuild it from the shards: `te-thd cache repair \S+` \(it verifies every shard and keeps the damaged file\)\.$",
    ):
        read_manifest(str(tmp_path), "test", 1)


def test_read_manifest_empty_says_so_and_names_the_repair(tmp_path: Path) -> None:
    _manifest(tmp_path, "")
    with pytest.raises(
        ManifestError,
        match=r"manifest .*manifest\.json is empty \(0 bytes\): it was cut off after it was written .*`te-thd cache repair \S+`",
    ) as e:
        read_manifest(str(tmp_path), "test", 1)
    assert "Expecting value" not in str(e.value)


def test_read_manifest_not_an_object(tmp_path: Path) -> None:
    _manifest(tmp_path, "[1, 2]")
    with pytest.raises(ManifestError, match=r"holds a JSON list, not an object"):
        read_manifest(str(tmp_path), "test", 1)


def test_read_manifest_wrong_version(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_version": 2, "num_samples": 3, "shard_size": 2})
    with pytest.raises(
        ManifestError,
        match=r"has format_version=2, expected 3: its tensors mean something else\. Point cache_dir at a cache built for format_version 3, or build one into a new directory with make_it\.$",
    ):
        read_manifest(str(tmp_path), "test", 3, producer_name="make_it")


def test_read_manifest_wrong_version_wins_over_other_damage(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_version": 1})
    with pytest.raises(ManifestError, match=r"format_version=1, expected 2"):
        read_manifest(str(tmp_path), "test", 2)


@pytest.mark.parametrize("field", ["num_samples", "shard_size"])
def test_read_manifest_missing_field(tmp_path: Path, field: str) -> None:
    m = {"format_version": 1, "num_samples": 3, "shard_size": 2}
    del m[field]
    _manifest(tmp_path, m)
    with pytest.raises(
        ManifestError,
        match=rf"manifest .* has no '{field}' field, so the cache layout is unknown.*Restore manifest.json from a copy",
    ):
        read_manifest(str(tmp_path), "test", 1)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "4"])
def test_read_manifest_bad_shard_size(tmp_path: Path, bad) -> None:
    _manifest(tmp_path, {"format_version": 1, "num_samples": 3, "shard_size": bad})
    with pytest.raises(ManifestError, match=rf"has shard_size={bad!r}; it must be an int >= 1"):
        read_manifest(str(tmp_path), "test", 1)


def test_read_manifest_bad_shard_records(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_version": 1, "num_samples": 3, "shard_size": 2, "shards": [{}]})
    with pytest.raises(
        ManifestError, match=r"lists 1 shard records but num_samples=3 / shard_size=2 means 2"
    ):
        read_manifest(str(tmp_path), "test", 1)


def test_read_manifest_defaults_fill_missing_fields_only(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_version": 1, "num_samples": 3, "shard_size": 2, "old_flag": False})
    m = read_manifest(str(tmp_path), "test", 1, defaults={"new_flag": True, "old_flag": True})
    assert m["new_flag"] is True and m["old_flag"] is False


def test_write_manifest_rejects_conflicting_version_and_non_json(tmp_path: Path) -> None:
    with pytest.raises(
        ManifestError, match=r"manifest\['format_version'\]=2 contradicts format_version=1"
    ):
        write_manifest(str(tmp_path), {"format_version": 2, "num_samples": 1, "shard_size": 1}, 1)
    with pytest.raises(
        ManifestError, match=r"not JSON-serialisable .*Producer options must be JSON values"
    ):
        write_manifest(str(tmp_path), {"num_samples": 1, "shard_size": 1, "opt": {1, 2}}, 1)
    with pytest.raises(ManifestError, match=r"has no 'shard_size' field"):
        write_manifest(str(tmp_path), {"num_samples": 1}, 1)
    assert not os.listdir(tmp_path)


# -- supervision options -----------------------------------------------------------------


def test_supervision_options_match_passes_and_compares_bools_by_truth() -> None:
    ensure_supervision_options_match(
        {"mask_prompt": 1, "cp_size": 2},
        {"mask_prompt": True, "cp_size": 2},
        cache_name="test",
        cache_dir="/c",
        producer_name="make_it",
    )


def test_supervision_options_mismatch() -> None:
    with pytest.raises(
        ManifestError,
        match=r"was built with mask_prompt=False, but the run sets mask_prompt=True\. .*rebuild the cache with make_it",
    ):
        ensure_supervision_options_match(
            {"mask_prompt": False}, {"mask_prompt": True}, "test", "/c", "make_it"
        )


def test_supervision_non_bool_options_compare_by_value() -> None:
    # The reference compared bool(2) == bool(4): a cache padded for cp=2 would train under cp=4.
    with pytest.raises(ManifestError, match=r"built with cp_size=2, but the run sets cp_size=4"):
        ensure_supervision_options_match({"cp_size": 2}, {"cp_size": 4}, "test", "/c", "make_it")


def test_supervision_option_missing_from_old_manifest_unless_defaults(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_version": 1, "num_samples": 3, "shard_size": 2})
    old = read_manifest(str(tmp_path), "test", 1)
    with pytest.raises(
        ManifestError,
        match=r"does not record mask_prompt, so the options .* cannot be verified\. Rebuild the cache with the current make_it, or pass defaults=\{'mask_prompt'",
    ):
        ensure_supervision_options_match(
            old, {"mask_prompt": True}, "test", str(tmp_path), "make_it"
        )
    filled = read_manifest(str(tmp_path), "test", 1, defaults={"mask_prompt": True})
    ensure_supervision_options_match(
        filled, {"mask_prompt": True}, "test", str(tmp_path), "make_it"
    )


# -- partition / resume arithmetic --------------------------------------------------------


@given(num_samples=st.integers(0, 200), shard_size=st.integers(1, 17), world_size=st.integers(1, 9))
def test_partition_matches_loop_oracle(num_samples: int, shard_size: int, world_size: int) -> None:
    total = -(-num_samples // shard_size)
    owners = []  # loop oracle: deal shards out, the first total % world_size ranks get one extra
    for r in range(world_size):
        owners.extend([r] * (total // world_size + (1 if r < total % world_size else 0)))
    covered = []
    for rank in range(world_size):
        start_shard, start_sample, n = partition_cache_shards(
            num_samples, shard_size, world_size, rank
        )
        mine = [i for i, o in enumerate(owners) if o == rank]
        if mine:
            assert start_shard == mine[0] and start_sample == mine[0] * shard_size
        expected_n = sum(min(shard_size, num_samples - i * shard_size) for i in mine)
        assert n == expected_n
        covered.extend(range(start_sample, start_sample + n))
    assert covered == list(range(num_samples))


def test_partition_rank_without_shards_and_errors() -> None:
    assert partition_cache_shards(7, 4, 3, 2) == (2, 8, 0)
    with pytest.raises(
        ValueError,
        match=r"shard_size=0 must be an int >= 1 \(samples per shard\); pass e\.g\. shard_size=256",
    ):
        partition_cache_shards(7, 0, 3, 0)
    with pytest.raises(ValueError, match=r"rank=3 must be an int in \[0, world_size=3\)"):
        partition_cache_shards(7, 4, 3, 3)
    with pytest.raises(ValueError, match=r"world_size=0 must be an int >= 1"):
        partition_cache_shards(7, 4, 0, 0)


def test_shard_runs_groups_contiguous_indices() -> None:
    assert shard_runs([0, 1, 4], 10, 2) == [(0, 0, 4), (4, 8, 2)]
    assert shard_runs([2, 1], 5, 2) == [(1, 2, 3)]  # shard 2 holds the single last sample
    assert shard_runs([], 5, 2) == []


def test_resume_start_sample() -> None:
    assert resume_start_sample(set(), 4) == 0
    assert resume_start_sample({0, 1, 2}, 4) == 12
    with pytest.raises(
        ValueError,
        match=r"contiguous prefix 0\.\.2, but found 0-1, 3 \(missing 2\)\. Delete the shards after the first gap",
    ):
        resume_start_sample({0, 1, 3}, 4)
    with pytest.raises(ValueError, match="shard_size=-1 must be an int >= 1"):
        resume_start_sample({0}, -1)


# -- write_tensor_shard ---------------------------------------------------------------------


def test_write_tensor_shard_writes_only_requested_keys(tmp_path: Path) -> None:
    samples = {
        "a": torch.ones(3, 2),
        "b": torch.zeros(3, dtype=torch.int64),
        "extra": torch.ones(1),
    }
    path = write_tensor_shard(str(tmp_path), 0, samples, ("a", "b"), "test")
    assert path == shard_path(str(tmp_path), 0)
    with safe_open(path, framework="pt") as f:  # the reference reader loads it unchanged
        assert sorted(f.keys()) == ["a", "b"] and list(f.metadata()) == ["te_thd"]
        save_file(
            {"a": samples["a"], "b": samples["b"]}, str(tmp_path / "ref"), metadata=f.metadata()
        )
    assert Path(path).read_bytes() == (tmp_path / "ref").read_bytes()
    assert read_shard_header(path).sums.rows == 3  # self-verifying without any manifest


def test_write_tensor_shard_missing_key(tmp_path: Path) -> None:
    with pytest.raises(
        SchemaError,
        match=r"test cache shard 4 is missing required cache keys \['b'\] \(got \['a'\]\)\. Make compute_batch return every key",
    ):
        write_tensor_shard(str(tmp_path), 4, {"a": torch.ones(2)}, ("a", "b"), "test")
    assert os.listdir(tmp_path) == []


def test_write_tensor_shard_rejects_row_mismatch_and_scalars(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match=r"key 'b' has 2 samples on dim 0 but 'a' has 3"):
        write_tensor_shard(
            str(tmp_path), 0, {"a": torch.ones(3), "b": torch.ones(2)}, ("a", "b"), "test"
        )
    with pytest.raises(SchemaError, match=r"key 'a' is a 0-d tensor"):
        write_tensor_shard(str(tmp_path), 0, {"a": torch.tensor(1.0)}, ("a",), "test")
    with pytest.raises(
        SchemaError, match=r"key 'a' has dtype torch.complex128, which safetensors cannot store"
    ):
        write_tensor_shard(
            str(tmp_path), 0, {"a": torch.ones(2, dtype=torch.complex128)}, ("a",), "test"
        )
    assert not any(tmp_path.iterdir())  # a refused shard leaves no file


def test_write_tensor_shard_rejects_schema_differences(tmp_path: Path) -> None:
    schema = {"h": TensorSpec(torch.bfloat16, (4,))}
    write_tensor_shard(
        str(tmp_path),
        0,
        {"h": torch.ones(2, 4, dtype=torch.bfloat16)},
        ("h",),
        "test",
        schema=schema,
    )
    with pytest.raises(
        SchemaError, match=r"key 'h' is float32\[n, 4\] but the cache schema says bfloat16\[n, 4\]"
    ):
        write_tensor_shard(str(tmp_path), 1, {"h": torch.ones(2, 4)}, ("h",), "test", schema=schema)
    with pytest.raises(
        SchemaError, match=r"key 'h' is bfloat16\[n, 5\] but the cache schema says bfloat16\[n, 4\]"
    ):
        write_tensor_shard(
            str(tmp_path),
            1,
            {"h": torch.ones(2, 5, dtype=torch.bfloat16)},
            ("h",),
            "test",
            schema=schema,
        )
    with pytest.raises(
        SchemaError, match=r"keys \['g', 'h'\] differ from the cache schema's \['h'\]"
    ):
        write_tensor_shard(
            str(tmp_path),
            1,
            {"h": torch.ones(2, 4), "g": torch.ones(2)},
            ("h", "g"),
            "test",
            schema=schema,
        )
    assert existing_shard_indices(str(tmp_path)) == {0}


# -- accumulator and seed loops ---------------------------------------------------------------


def _collecting_writer(store: dict[int, dict[str, torch.Tensor]]):
    def write(cache_dir: str, index: int, tensors: dict[str, torch.Tensor]) -> str:
        assert index not in store
        store[index] = {k: v.clone() for k, v in tensors.items()}
        return f"{cache_dir}/{index}"

    return write


@given(
    batch_sizes=st.lists(st.integers(0, 9), min_size=0, max_size=12),
    shard_size=st.integers(1, 7),
    start=st.integers(0, 3),
)
def test_accumulator_matches_concatenate_then_split_oracle(batch_sizes, shard_size, start) -> None:
    store: dict[int, dict[str, torch.Tensor]] = {}
    acc = _ShardAccumulator("d", shard_size, start, _collecting_writer(store), LOG)
    offset = 0
    for n in batch_sizes:
        rows = torch.arange(offset, offset + n)
        acc.add({"x": rows.float().unsqueeze(1).expand(n, 3).clone(), "i": rows})
        offset += n
    acc.finalize()
    # oracle: one big tensor cut every shard_size rows
    total = torch.arange(offset)
    expected = [total[i : i + shard_size] for i in range(0, offset, shard_size)]
    assert sorted(store) == list(range(start, start + len(expected)))
    for j, exp in enumerate(expected):
        got = store[start + j]
        assert torch.equal(got["i"], exp)
        assert torch.equal(got["x"], exp.float().unsqueeze(1).expand(-1, 3))
    assert acc._buffered == 0 and acc._chunks == []


def test_accumulator_rejects_inconsistent_batches() -> None:
    acc = _ShardAccumulator("d", 4, 0, _collecting_writer({}), LOG)
    with pytest.raises(
        SchemaError,
        match=r"compute_batch's output: key 'b' has 2 samples on dim 0 but 'a' has 3; every key must hold one row per sample",
    ):
        acc.add({"a": torch.ones(3), "b": torch.ones(2)})
    acc.add({"a": torch.ones(1)})
    with pytest.raises(
        SchemaError,
        match=r"returned keys \['b'\] after \['a'\]; every batch must return the same keys",
    ):
        acc.add({"b": torch.ones(1)})
    with pytest.raises(ValueError, match="shard_size=0 must be an int >= 1"):
        _ShardAccumulator("d", 0, 0, _collecting_writer({}), LOG)


def test_write_cache_shards_seed_loop(tmp_path: Path) -> None:
    data = [{"x": torch.full((2,), float(i))} for i in range(7)]
    dl = DataLoader(data, batch_size=3)
    store: dict[int, dict[str, torch.Tensor]] = {}
    write_cache_shards(
        dl, str(tmp_path), 2, 5, lambda b: {"y": b["x"] + 1}, _collecting_writer(store), LOG
    )
    assert sorted(store) == [5, 6, 7, 8]
    assert torch.equal(
        torch.cat([store[i]["y"][:, 0] for i in range(5, 9)]), torch.arange(7).float() + 1
    )


def test_write_cache_shards_distributed_single_process_equals_seed_loop(tmp_path: Path) -> None:
    data = [{"x": torch.full((2,), float(i))} for i in range(9)]
    dl = DataLoader(data, batch_size=2)
    keys = ("y",)

    def write(d, i, t):
        return write_tensor_shard(d, i, t, keys, "test")

    write_cache_shards(dl, str(tmp_path / "a"), 4, 0, lambda b: {"y": b["x"] * 2}, write, LOG)
    write_cache_shards_distributed(
        dl, str(tmp_path / "b"), 4, 1, 0, lambda b: {"y": b["x"] * 2}, write, LOG
    )
    for name in os.listdir(tmp_path / "a"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_write_cache_shards_distributed_pads_with_dummy_forwards(tmp_path: Path) -> None:
    """In-process, two 'ranks' of world size 3 with a fake all-reduce: counts are padded."""
    data = [{"x": torch.full((1,), float(i))} for i in range(7)]
    dl = DataLoader(data, batch_size=2)
    calls = []
    for rank in range(3):
        n = {"calls": 0}

        def compute(b, n=n):
            n["calls"] += 1
            return {"y": b["x"]}

        write_cache_shards_distributed(
            dl,
            str(tmp_path),
            2,
            3,
            rank,
            compute,
            lambda d, i, t: write_tensor_shard(d, i, t, ("y",), "test"),
            LOG,
            sync_max_steps=lambda s: 2,
        )
        calls.append(n["calls"])
    assert calls == [2, 2, 2]  # ranks own 4, 2, 1 samples -> 2, 1, 1 real steps, padded to 2
    assert existing_shard_indices(str(tmp_path)) == {0, 1, 2, 3}
    with pytest.raises(
        ValueError, match=r"sync_max_steps\(2\) returned 1; it must return the maximum over ranks"
    ):
        write_cache_shards_distributed(
            dl,
            str(tmp_path),
            2,
            3,
            0,
            lambda b: {"y": b["x"]},
            lambda *a: "",
            LOG,
            sync_max_steps=lambda s: 1,
        )


def test_dataloader_from_sample_and_subset_loader() -> None:
    data = list(range(10))

    def init(_worker_id: int) -> None:
        pass

    dl = DataLoader(data, batch_size=3, collate_fn=lambda xs: xs)
    assert dataloader_from_sample(dl, 0) is dl
    assert [x for b in dataloader_from_sample(dl, 4) for x in b] == list(range(4, 10))
    assert list(dataloader_from_sample(dl, 10)) == []
    assert list(dataloader_from_sample(dl, 25)) == []
    dlw = DataLoader(
        data,
        batch_size=4,
        num_workers=1,
        multiprocessing_context="spawn",
        worker_init_fn=init,
        prefetch_factor=3,
        persistent_workers=True,
    )
    sub = _sequential_subset_loader(dlw, 2, 9)
    assert sub.batch_size == 4 and sub.num_workers == 1 and sub.prefetch_factor == 3
    assert sub.persistent_workers and sub.worker_init_fn is init
    assert (
        sub.multiprocessing_context is not None
        and sub.multiprocessing_context.get_start_method() == "spawn"
    )
    assert list(sub.sampler) == list(range(7))


# -- integrity checks ---------------------------------------------------------------------


@pytest.fixture
def small_cache(tmp_path: Path) -> Path:
    from te_thd.offline_cache import produce_cache

    data = [{"x": torch.full((3,), float(i))} for i in range(10)]
    produce_cache(
        DataLoader(data, batch_size=2),
        str(tmp_path),
        4,
        lambda b: {"h": b["x"] * 2, "m": b["x"] > 3},
        ("h", "m"),
        {"cp_size": 2},
        progress=False,
    )
    return tmp_path


def test_check_cache_files_passes_and_names_a_short_file(small_cache: Path) -> None:
    m = read_manifest(str(small_cache), "test", 1)
    assert check_cache_files(str(small_cache), m) == [0, 1, 2]
    shard = small_cache / "shard-000001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard .*shard-000001\.safetensors has \d+ bytes, the manifest records \d+: the file was truncated or replaced",
    ) as e:
        check_cache_files(str(small_cache), m)
    assert e.value.path.endswith("shard-000001.safetensors")


def test_check_cache_files_missing_shard(small_cache: Path) -> None:
    m = read_manifest(str(small_cache), "test", 1)
    os.unlink(small_cache / "shard-000002.safetensors")
    with pytest.raises(
        CacheIntegrityError, match=r"missing shard indices 2 \(e\.g\. shard-000002\.safetensors\)"
    ):
        check_cache_files(str(small_cache), m)


def test_verify_deep_detects_bit_flip_with_same_size(small_cache: Path) -> None:
    assert verify_cache(str(small_cache))["checksums_verified"] is False  # cheap mode
    assert verify_cache(str(small_cache), deep=True)["checksums_verified"] is True
    shard = small_cache / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    verify_cache(str(small_cache))  # sizes still match: the cheap check cannot see it
    with pytest.raises(
        CacheIntegrityError,
        match=r"1 bad shard\(s\):\n  .*shard-000000\.safetensors: sample (\d+) \(row \1 of the shard\), key '\w+': checksum mismatch \(expected xxh3_64:[0-9a-f]{16}, the bytes hash to xxh3_64:[0-9a-f]{16}\)",
    ):
        verify_cache(str(small_cache), deep=True)


def test_verify_deep_detects_header_schema_mismatch_and_lists_every_bad_shard(
    small_cache: Path,
) -> None:
    # same byte sizes (the same run record in the header), other dtypes for 'h' (int32 / uint32 instead of float32)
    m = torch.ones(4, 3, dtype=torch.bool)
    run = read_shard_header(str(small_cache / "shard-000000.safetensors")).sums.run
    for i, dtype in ((0, torch.int32), (1, torch.uint32)):
        with DurableShardWriter(("h", "m"), "t", pipelined=False, run_record=run) as writer:
            writer(str(small_cache), i, {"h": torch.ones(4, 3, dtype=dtype), "m": m})
    with pytest.raises(CacheIntegrityError) as e:
        verify_cache(str(small_cache), deep=True)
    msg = str(e.value)
    assert "2 bad shard(s)" in msg
    assert "shard-000000.safetensors: key 'h' is int32[4, 3], the schema says float32[n, 3]" in msg
    assert "shard-000001.safetensors: key 'h' is uint32[4, 3], the schema says float32[n, 3]" in msg
    assert e.value.path.endswith("shard-000000.safetensors")


def test_verify_reference_manifest_without_checksums(tmp_path: Path) -> None:
    for i, n in enumerate([4, 2]):
        save_file({"x": torch.ones(n, 2)}, shard_path(str(tmp_path), i))
    write_manifest(str(tmp_path), {"num_samples": 6, "shard_size": 4}, 1)
    r = verify_cache(str(tmp_path), deep=True)
    assert r["headers_verified"] and not r["checksums_verified"]
    info = cache_info(str(tmp_path))
    assert info["schema"] == {"x": {"dtype": "float32", "shape": [2]}} and info["checksum"] is None
    save_file({"x": torch.ones(3, 2)}, shard_path(str(tmp_path), 1))  # wrong sample count
    with pytest.raises(
        CacheIntegrityError, match=r"key 'x' holds 3 samples, the manifest puts 2 in this shard"
    ):
        verify_cache(str(tmp_path), deep=True)


def test_verify_deep_reports_garbage_file(small_cache: Path) -> None:
    shard = small_cache / "shard-000002.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(b"\xff" * size)
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard-000002\.safetensors: is not a valid safetensors file: header length \d+ does not fit",
    ):
        verify_cache(str(small_cache), deep=True)


def test_cache_info(small_cache: Path) -> None:
    info = cache_info(str(small_cache))
    assert info["num_samples"] == 10 and info["shard_size"] == 4 and info["num_shards"] == 3
    assert info["schema"] == {
        "h": {"dtype": "float32", "shape": [3]},
        "m": {"dtype": "bool", "shape": [3]},
    }
    assert info["options"] == {"cp_size": 2}
    assert info["bytes"] == sum(p.stat().st_size for p in small_cache.glob("shard-*.safetensors"))
    assert (
        info["checksum"] == "xxh3_64"
        and info["layout_version"] == 3
        and info["format_version"] == 1
    )


# -- the manifest's own checksum (layout_version 2) -----------------------------------------


def _flip_in_manifest(d: Path, old: bytes, new: bytes) -> None:
    data = (d / MANIFEST_NAME).read_bytes()
    assert old in data, old
    (d / MANIFEST_NAME).write_bytes(data.replace(old, new, 1))


def test_manifest_records_a_checksum_of_its_canonical_content(small_cache: Path) -> None:
    raw = json.loads((small_cache / MANIFEST_NAME).read_text())
    assert raw["layout_version"] == 3
    body = {k: v for k, v in raw.items() if k != "manifest_checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert raw["manifest_checksum"] == f"crc32:{zlib.crc32(canonical):08x}"
    # the read view describes the cache, not the file
    assert "manifest_checksum" not in read_manifest(str(small_cache), "test", 1)
    assert "manifest_checksum" not in cache_info(str(small_cache))["options"]
    # formatting is not content: re-indented, the manifest still loads
    (small_cache / MANIFEST_NAME).write_text(json.dumps(raw, indent=None))
    assert read_manifest(str(small_cache), "test", 1)["cp_size"] == 2


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            b'"cp_size": 2',
            b'"cp_size": 3',
        ),  # a producer option (a flipped cp_size would pass a wrong-CP cache)
        (
            b'"checksum": "xxh3_64:',
            b'"checksum": "xxh3_65:',
        ),  # a shard record: must not blame the shard
        (b'"num_samples": 10', b'"num_samples": 11'),
        (b'"format_version": 1', b'"format_version": 3'),  # damage, not an old cache
    ],
)
def test_manifest_checksum_catches_a_flip_and_names_manifest_json(
    small_cache: Path, old: bytes, new: bytes
) -> None:
    from te_thd.offline_cache import CachedTensorDataset

    _flip_in_manifest(small_cache, old, new)
    pattern = r"test cache manifest .*/manifest\.json does not match its own checksum \(it records crc32:[0-9a-f]{8}, its content hashes to crc32:[0-9a-f]{8}\): the file was damaged or edited after it was written, so none of its fields can be trusted\. Restore manifest\.json from a copy"
    with pytest.raises(ManifestError, match=pattern):
        read_manifest(str(small_cache), "test", 1)
    with pytest.raises(ManifestError, match=pattern) as e:
        verify_cache(str(small_cache), deep=True, cache_name="test")
    assert "shard-0" not in str(e.value)  # the intact shards are not blamed
    with pytest.raises(ManifestError, match=pattern):
        CachedTensorDataset(str(small_cache), "test", 1, ("h",))


def test_manifest_checksum_field_itself_damaged(small_cache: Path) -> None:
    # the field's name: a layout-2 manifest always records it
    _flip_in_manifest(small_cache, b'"manifest_checksum"', b'"manifest_chedksum"')
    with pytest.raises(
        ManifestError,
        match=r"manifest .*manifest\.json declares layout_version=3 but has no 'manifest_checksum' field, which that layout always records: the file was damaged",
    ):
        read_manifest(str(small_cache), "test", 1)


def test_manifest_checksum_value_malformed(small_cache: Path) -> None:
    _flip_in_manifest(small_cache, b'"manifest_checksum": "crc32:', b'"manifest_checksum": "crc3r:')
    with pytest.raises(
        ManifestError,
        match=r"manifest .*manifest\.json has manifest_checksum='crc3r:[0-9a-f]{8}', not 'crc32:<8 hex digits>': the file was damaged",
    ):
        load_manifest(str(small_cache))


def test_manifests_without_checksum_still_load(tmp_path: Path) -> None:
    # the reference producer's manifest (json.dump, indent=2, sort_keys, no integrity fields),
    # and a te_thd layout-1 manifest written before the checksum existed
    for i, n in enumerate([4, 2]):
        save_file({"x": torch.ones(n, 2)}, shard_path(str(tmp_path), i))
    ref = {"format_version": 1, "num_samples": 6, "shard_size": 4, "mask_generation_prompt": True}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(ref, indent=2, sort_keys=True))
    assert read_manifest(str(tmp_path), "test", 1) == ref
    assert verify_cache(str(tmp_path), deep=True)["headers_verified"]
    layout1 = {
        **ref,
        "layout_version": 1,
        "schema": {"x": {"dtype": "float32", "shape": [2]}},
        "shards": [
            {
                "file": f"shard-{i:06d}.safetensors",
                "bytes": os.path.getsize(shard_path(str(tmp_path), i)),
                "checksum": f"crc32:{zlib.crc32(Path(shard_path(str(tmp_path), i)).read_bytes()):08x}",
            }
            for i in range(2)
        ],
    }
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(layout1))
    assert read_manifest(str(tmp_path), "test", 1) == layout1
    result = verify_cache(str(tmp_path), deep=True)
    # whole files match the manifest, but these shards carry no per-row checksums: said so
    assert (
        "every shard's checksum (header digest, or whole-file CRC-32 in older caches) against the manifest"
        in result["checked"]
    )
    assert not result["checksums_verified"] and result["shards_with_checksums"] == 0
    assert any(
        line.startswith("tensor bytes: no shard carries checksums")
        for line in result["not_checked"]
    )


def test_write_manifest_reseals_an_edited_manifest(small_cache: Path) -> None:
    before = (small_cache / MANIFEST_NAME).read_bytes()
    m = json.loads(before)  # the raw file, stale checksum included
    write_manifest(str(small_cache), m, 1)
    assert (small_cache / MANIFEST_NAME).read_bytes() == before  # same content -> same bytes
    m["cp_size"] = 4
    write_manifest(str(small_cache), m, 1)  # a deliberate edit, re-sealed
    assert read_manifest(str(small_cache), "test", 1)["cp_size"] == 4
    # a round trip through the read view is byte-identical too
    write_manifest(
        str(small_cache), {**read_manifest(str(small_cache), "test", 1), "cp_size": 2}, 1
    )
    assert (small_cache / MANIFEST_NAME).read_bytes() == before


def test_manifest_without_format_version_is_not_a_version_mismatch(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_versiof": 1, "num_samples": 3, "shard_size": 2})
    msg = r"test cache manifest .*/manifest\.json has no 'format_version' field: it is damaged, or it is not an offline-cache manifest"
    with pytest.raises(ManifestError, match=msg):
        read_manifest(str(tmp_path), "test", 1)
    with pytest.raises(ManifestError, match=msg):
        load_manifest(str(tmp_path), "test")


def test_wrong_format_version_names_manifest_json(tmp_path: Path) -> None:
    _manifest(tmp_path, {"format_version": 2, "num_samples": 3, "shard_size": 2})
    with pytest.raises(
        ManifestError,
        match=r"test cache manifest .*/manifest\.json has format_version=2, expected 1: its tensors mean something else",
    ):
        read_manifest(str(tmp_path), "test", 1)


def test_a_format_version_of_another_type_says_what_to_pass(tmp_path: Path) -> None:
    """ "1" is not 1 (the types differ); "1+tokens" is the manifest file's spelling of 1 for a ragged cache."""
    from te_thd.offline_cache import CachedTensorDataset, produce_cache

    data = [{"input_ids": torch.arange(1, 5)} for _ in range(4)]
    produce_cache(torch.utils.data.DataLoader(data, batch_size=2), str(tmp_path), 2, lambda b: b, ("input_ids",),
                  progress=False, token_keys=("input_ids",))  # fmt: skip
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["format_version"] == "1+tokens"
    with pytest.raises(
        ValueError,
        match=r"^format_version='1' is a str, but the version is an int \(the types differ, so it never matches\): pass format_version=1$",
    ):
        CachedTensorDataset(str(tmp_path), "offline", "1", ("input_ids",))
    with pytest.raises(
        ValueError,
        match=r"^format_version='1\+tokens' is how manifest\.json records version 1 of a cache with ragged token keys: pass format_version=1$",
    ):
        CachedTensorDataset(str(tmp_path), "offline", "1+tokens", ("input_ids",))
    with pytest.raises(
        ValueError,
        match=r"^format_version=1\.0 must be an int: the version of what the cached tensors mean, e\.g\. 1$",
    ):
        read_manifest(str(tmp_path), "offline", 1.0)
    assert len(CachedTensorDataset(str(tmp_path), "offline", 1, ("input_ids",))) == 4


@given(num_samples=st.integers(0, 60), shard_size=st.integers(1, 9), data=st.data())
def test_shard_runs_cover_exactly_the_chosen_shards(
    num_samples: int, shard_size: int, data
) -> None:
    total = -(-num_samples // shard_size)
    chosen = (
        data.draw(st.sets(st.integers(0, max(0, total - 1)), max_size=total)) if total else set()
    )
    runs = shard_runs(sorted(chosen), num_samples, shard_size)
    covered = [s for _, start, n in runs for s in range(start, start + n)]
    oracle = [s for s in range(num_samples) if s // shard_size in chosen]
    assert covered == oracle
    for s0, start, _ in runs:  # runs start on shard boundaries, at their own shard
        assert start == s0 * shard_size
    assert all(
        a[1] + a[2] < b[1] for a, b in zip(runs, runs[1:], strict=False)
    )  # maximal runs: gaps between
