"""Self-verifying shards on every writer path, verified reads, repair, and the reference patch points.

Real files throughout: shards are written by each public writer, damaged by
flipping one byte on disk, and read back through the dataset, the DataLoader
(with worker processes) and ``verify_cache``.
"""

from __future__ import annotations

import logging
import os
import shutil
import traceback
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from _offline_cache_support import read_tuning, share_every_batch
from crash_test import IndexDataset
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import te_thd.offline_cache as oc
from te_thd.offline_cache import (
    CachedTensorDataset,
    CacheIntegrityError,
    DurableShardWriter,
    UnverifiedCacheWarning,
    build_cached_dataloader,
    collate_cached,
    produce_cache,
    repair_cache,
    verify_cache,
    write_cache_shards,
    write_cache_shards_distributed,
    write_manifest,
    write_tensor_shard,
)
from te_thd.offline_cache.format.integrity import read_shard_header
from te_thd.offline_cache.format.schema import num_shards, shard_layout, shard_path, shard_rows

KEYS = ("hidden", "ids")
N, SHARD = 10, 4
_log = logging.getLogger("test")


def _rows(start: int, n: int) -> dict[str, torch.Tensor]:
    i = torch.arange(start, start + n)
    return {
        "hidden": torch.sin(i[:, None] * 0.1 + torch.arange(6)).to(torch.bfloat16),
        "ids": i[:, None] * 3 + torch.arange(5),
    }


def _compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rows = [_rows(int(i), 1) for i in batch["idx"]]
    return {k: torch.cat([r[k] for r in rows]) for k in KEYS}


def _finish(d: Path) -> None:
    write_manifest(str(d), {"num_samples": N, "shard_size": SHARD}, 1)


def _via_write_tensor_shard(d: Path) -> None:
    """The reference producers' way: one write_tensor_shard per shard, then write_manifest."""
    for s in range(num_shards(N, SHARD)):
        write_tensor_shard(str(d), s, _rows(s * SHARD, shard_rows(s, N, SHARD)), KEYS, "test")
    _finish(d)


def _via_durable_writer(d: Path) -> None:
    with DurableShardWriter(KEYS) as w:
        for s in range(num_shards(N, SHARD)):
            w(str(d), s, _rows(s * SHARD, shard_rows(s, N, SHARD)))
    _finish(d)


def _via_write_cache_shards(d: Path) -> None:
    loader = DataLoader(IndexDataset(N), batch_size=3)
    write_cache_shards(
        loader,
        str(d),
        SHARD,
        0,
        _compute,
        lambda c, i, t: write_tensor_shard(c, i, t, KEYS, "test"),
        _log,
    )
    _finish(d)


def _via_distributed_loop(d: Path) -> None:
    loader = DataLoader(IndexDataset(N), batch_size=3)
    write_cache_shards_distributed(
        loader,
        str(d),
        SHARD,
        1,
        0,
        _compute,
        lambda c, i, t: write_tensor_shard(c, i, t, KEYS, "test"),
        _log,
    )
    _finish(d)


def _via_produce_cache(d: Path) -> None:
    produce_cache(
        DataLoader(IndexDataset(N), batch_size=2), str(d), SHARD, _compute, KEYS, progress=False
    )


WRITERS = {
    "write_tensor_shard": _via_write_tensor_shard,
    "DurableShardWriter": _via_durable_writer,
    "write_cache_shards": _via_write_cache_shards,
    "write_cache_shards_distributed": _via_distributed_loop,
    "produce_cache": _via_produce_cache,
}


def _flip_data(path: Path, key: str, row: int) -> None:
    """Flip the first byte of ``row`` of ``key`` inside shard file ``path``."""
    e = read_shard_header(str(path)).entries[key]
    pos = e.start + row * (e.end - e.start) // e.shape[0]
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_writes_self_verifying_shards_and_reads_catch_a_flip(
    tmp_path: Path, writer: str
) -> None:
    d = tmp_path / "cache"
    WRITERS[writer](d)
    for s in range(num_shards(N, SHARD)):
        p = shard_path(str(d), s)
        with safe_open(p, framework="pt") as f:  # still a plain safetensors file
            assert torch.equal(
                f.get_tensor("ids"), _rows(s * SHARD, shard_rows(s, N, SHARD))["ids"]
            )
        assert read_shard_header(p).sums.rows == shard_rows(s, N, SHARD)
    result = verify_cache(str(d), deep=True)
    assert result["checksums_verified"] and result["shards_with_checksums"] == 3
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    batch = ds.__getitems__(list(range(N)))
    assert torch.equal(batch.tensors["ids"], _rows(0, N)["ids"])

    _flip_data(d / "shard-000001.safetensors", "ids", 2)  # sample 6
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    assert torch.equal(
        ds.__getitems__([4, 5]).tensors["ids"], _rows(4, 2)["ids"]
    )  # rows before the flip
    with pytest.raises(CacheIntegrityError) as e:
        ds.__getitems__([5, 6, 7])
    err = e.value
    assert err.path == shard_path(str(d), 1) and err.sample == 6 and err.key == "ids"
    assert (
        err.expected.startswith("xxh3_64:")
        and err.actual.startswith("xxh3_64:")
        and err.expected != err.actual
    )
    msg = str(err)
    assert (
        f"shard {shard_path(str(d), 1)}: sample 6 (row 2 of the shard), key 'ids': checksum mismatch"
        in msg
    )
    assert f"Repair: `te-thd cache repair {d}`" in msg
    with pytest.raises(CacheIntegrityError, match="sample 6"):
        ds[6]  # the reference per-item path
    with pytest.raises(
        CacheIntegrityError, match=r"sample 6 \(row 2 of the shard\), key 'ids': checksum mismatch"
    ):
        verify_cache(str(d), deep=True)


@pytest.mark.parametrize("read_threads", [None, 2])
def test_verification_through_dataloader_workers(tmp_path: Path, read_threads: int | None) -> None:
    """Workers read on one thread by default; with ``read_threads=2`` (and every batch
    shared out) a worker's helper thread checks rows too, and its error still reaches
    the training loop after every intact batch."""
    d = tmp_path / "cache"
    _via_produce_cache(d)
    _flip_data(d / "shard-000002.safetensors", "hidden", 1)  # sample 9
    ds = CachedTensorDataset(str(d), "test", 1, KEYS, read_threads=read_threads)
    loader = build_cached_dataloader(ds, 2, False, lambda b: collate_cached(b, KEYS), num_workers=2)
    loader.worker_init_fn = share_every_batch
    seen = []
    with pytest.raises(
        CacheIntegrityError, match=r"sample 9 \(row 1 of the shard\), key 'hidden'"
    ) as e:
        for batch in loader:
            seen.append(batch["ids"])
    assert torch.equal(
        torch.cat(seen), _rows(0, 8)["ids"]
    )  # every batch before the damaged one, intact
    # The traceback's frames hold torch's worker iterator in a reference cycle; left to the
    # garbage collector, its queues are finalised before it shuts the workers down, and the
    # shutdown then waits 5 s per worker (in whichever later test the collection happens).
    traceback.clear_frames(e.tb)


def test_verify_off_is_explicit_and_warned(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    _via_produce_cache(d)
    _flip_data(d / "shard-000000.safetensors", "ids", 0)
    with pytest.warns(UnverifiedCacheWarning, match="reads are not verified"):
        ds = CachedTensorDataset(str(d), "test", 1, KEYS, verify=False)
    assert not torch.equal(
        ds.__getitems__([0]).tensors["ids"], _rows(0, 1)["ids"]
    )  # the risk, documented


def test_large_rows_are_verified_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows over the chunk size take the pipelined path (copy k+1 while hashing k)."""
    import te_thd.offline_cache.read.dataset as reader

    monkeypatch.setattr(reader, "VERIFY_CHUNK_BYTES", 16)
    d = tmp_path / "cache"
    _via_produce_cache(d)
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    assert torch.equal(
        ds.__getitems__([3, 1, 2, 0]).tensors["hidden"], _rows(0, 4)["hidden"][[3, 1, 2, 0]]
    )
    _flip_data(d / "shard-000000.safetensors", "hidden", 2)
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    with pytest.raises(CacheIntegrityError, match=r"sample 2 \(row 2 of the shard\), key 'hidden'"):
        ds.__getitems__([0, 1, 2, 3])


def test_reference_format_cache_reads_unverified_and_verify_says_so(tmp_path: Path) -> None:
    """Shards written by save_file (the reference implementation's writer): readable, said to be unverified."""
    d = tmp_path / "cache"
    d.mkdir()
    for s in range(num_shards(N, SHARD)):
        save_file(_rows(s * SHARD, shard_rows(s, N, SHARD)), shard_path(str(d), s))
    _finish(d)
    with pytest.warns(UnverifiedCacheWarning, match="carries no checksums"):
        batch = CachedTensorDataset(str(d), "test", 1, KEYS).__getitems__(list(range(N)))
    assert torch.equal(batch.tensors["ids"], _rows(0, N)["ids"])
    result = verify_cache(str(d), deep=True)
    assert not result["checksums_verified"] and result["headers_verified"]
    assert "every shard header against the schema and row counts" in result["checked"]
    assert any("no shard carries checksums" in line for line in result["not_checked"])
    assert any("swapped for another valid shard" in line for line in result["not_checked"])


def test_a_layout3_cache_refuses_a_shard_without_checksums(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    _via_produce_cache(d)
    p = shard_path(str(d), 1)
    with safe_open(p, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, p)  # same tensor data, metadata stripped
    with pytest.raises(
        CacheIntegrityError, match=r"shard-000001\.safetensors has \d+ bytes, the manifest records"
    ):
        CachedTensorDataset(str(d), "test", 1, KEYS)
    # even with the manifest's record edited to match (and the manifest resealed)
    from te_thd.offline_cache.record.manifest import load_manifest

    m = load_manifest(str(d))
    m["shards"][1].update(
        bytes=Path(p).stat().st_size, checksum=f"crc32:{zlib.crc32(Path(p).read_bytes()):08x}"
    )
    write_manifest(str(d), m, 1)
    with pytest.raises(
        CacheIntegrityError,
        match="carries no te_thd checksums although the manifest's layout records them",
    ):
        CachedTensorDataset(str(d), "test", 1, KEYS).__getitems__([4])


def test_repair_then_resume_restores_the_identical_cache(tmp_path: Path) -> None:
    clean, d = tmp_path / "clean", tmp_path / "cache"
    _via_produce_cache(clean)
    shutil.copytree(clean, d)
    _flip_data(d / "shard-000001.safetensors", "ids", 0)
    (d / "shard-000002.safetensors").unlink()
    result = repair_cache(str(d))
    assert result["reopened"] and list(result["damaged"]) == ["shard-000001.safetensors"]
    assert result["missing"] == ["shard-000002.safetensors"]
    assert (d / ".te_thd-damaged" / "shard-000001.safetensors").exists() and not (
        d / "manifest.json"
    ).exists()
    _via_produce_cache(d)  # the same call that built it: resumes, computes shards 1 and 2
    for name in (
        "manifest.json",
        "shard-000000.safetensors",
        "shard-000001.safetensors",
        "shard-000002.safetensors",
    ):
        assert (d / name).read_bytes() == (clean / name).read_bytes(), name
    assert repair_cache(str(d))["reopened"] is False  # sound now: nothing changes


def test_repair_cli_runs_as_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from te_thd.cli import main

    d = tmp_path / "cache"
    _via_produce_cache(d)
    _flip_data(d / "shard-000000.safetensors", "hidden", 3)
    assert main(["cache", "verify", str(d)]) == 1
    err = capsys.readouterr().err
    hint = err[err.index("`te-thd cache repair ") + 1 :]
    argv = hint[: hint.index("`")].split()[1:]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "set aside: shard-000000.safetensors" in out and "reopened for a resume" in out


# -- the reference module's patch points --------------------------------------------------


def test_distributed_loop_builds_loaders_with_the_patched_dataloader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference consumers' tests patch ``offline_cache.DataLoader`` with a capturing loader that
    forces ``num_workers=0``; a ``prefetch_factor`` passed on by default would make torch reject it."""
    captured: list[dict] = []
    real = torch.utils.data.DataLoader

    def capturing(*args, **kwargs):
        kwargs["num_workers"] = 0
        kwargs.pop("persistent_workers", None)
        captured.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(oc, "DataLoader", capturing)
    source = real(
        IndexDataset(N), batch_size=3, num_workers=2
    )  # torch sets prefetch_factor=2 on it
    write_cache_shards_distributed(
        source,
        str(tmp_path),
        SHARD,
        2,
        1,
        _compute,
        lambda c, i, t: write_tensor_shard(c, i, t, KEYS, "test"),
        _log,
    )
    assert len(captured) == 1 and "prefetch_factor" not in captured[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000002.safetensors"]
    assert oc.dataloader_from_sample(source, 4) is not source and len(captured) == 2


def test_load_safetensors_honours_a_patched_safe_import_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert oc.load_safetensors("test")[1] is safe_open
    monkeypatch.setattr(oc, "safe_import_from", lambda *a, **k: (False, None))
    with pytest.raises(ImportError, match="requires the 'safetensors' package"):
        oc.load_safetensors("DSpark")


def test_safe_import_from_signature_of_the_reference() -> None:
    assert oc.safe_import_from("safetensors", "safe_open") == (True, safe_open)
    assert oc.safe_import_from("no_such_module_xyz", "x", alt=3) == (False, 3)
    assert oc.safe_import_from(
        "no_such_module_xyz", "safe_open", fallback_module="safetensors"
    ) == (True, safe_open)


# -- shard layout: one derivation -----------------------------------------------------------


@given(st.integers(0, 10_000), st.integers(1, 300))
def test_shard_layout_tiles_the_samples(num_samples: int, shard_size: int) -> None:
    count, last = shard_layout(num_samples, shard_size)
    rows = [shard_rows(i, num_samples, shard_size) for i in range(count)]
    assert sum(rows) == num_samples and all(r == shard_size for r in rows[:-1])
    assert (rows[-1] if rows else 0) == last and 0 < last <= shard_size or count == 0
    assert (
        shard_rows(count, num_samples, shard_size) == 0
        and shard_rows(-1, num_samples, shard_size) == 0
    )


def test_no_warning_for_a_verified_cache(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    _via_produce_cache(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CachedTensorDataset(str(d), "test", 1, KEYS).__getitems__(list(range(N)))


@pytest.mark.parametrize("chunk", [1 << 20, 16])
@pytest.mark.parametrize("indices", [[4, 5, 6, 7], [7, 5, 6, 4], [6, 2, 9, 6]])
def test_preadv_reads_are_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, indices: list[int]
) -> None:
    """The preadv engine (forced: the test rows are small) checks every row it read,
    in whole runs, in pieces of ``VERIFY_CHUNK_BYTES``, and row by row for scattered
    batch rows; a flip is reported for its sample, wherever it sits in the batch."""
    import te_thd.offline_cache.read.dataset as reader

    monkeypatch.setattr(reader, "VERIFY_CHUNK_BYTES", chunk)
    d = tmp_path / "cache"
    _via_produce_cache(d)
    read_tuning(engine="preadv")
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    got = ds.__getitems__(indices)
    for k in KEYS:
        assert torch.equal(got.tensors[k], _rows(0, N)[k][indices])
    _flip_data(d / "shard-000001.safetensors", "hidden", 2)  # sample 6
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    with pytest.raises(CacheIntegrityError, match=r"sample 6 \(row 2 of the shard\), key 'hidden'"):
        ds.__getitems__(indices)


# -- verification on the read threads ----------------------------------------------------


def _threaded_ds(d: Path, threads: int) -> CachedTensorDataset:
    """A preadv dataset that reads every batch on ``threads`` threads (the rows here are
    far below ``PARALLEL_MIN_BYTES``)."""
    read_tuning(engine="preadv", parallel_min_bytes=0)
    return CachedTensorDataset(str(d), "test", 1, KEYS, read_threads=threads)


def _record_verifiers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, list[int], bool]]:
    """Wrap the batched reader's check (``verify_row_views``; the real check still runs) to log
    ``(thread name, key, shard rows, passed)`` per call."""
    import threading

    import te_thd.offline_cache.read.planner as readplan

    log: list[tuple[str, str, list[int], bool]] = []
    real = readplan.verify_row_views

    def verify(views, rows, expected, **kw):
        try:
            real(views, rows, expected, **kw)
        except CacheIntegrityError:
            log.append((threading.current_thread().name, kw["key"], list(rows), False))
            raise
        log.append((threading.current_thread().name, kw["key"], list(rows), True))

    monkeypatch.setattr(readplan, "verify_row_views", verify)
    return log


def test_a_flip_read_by_a_helper_thread_names_its_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row per piece. Read ahead (``start_read``) and left to the helper threads, the
    damaged row (shard 2, key 'ids', sample 9) is checked on a helper, whose error reaches
    ``result()`` with the sample and key. Then many batches through ``__getitems__``, with
    and without the damaged row: each error names it, every other batch is right, no
    exception escapes a thread and no helper thread is added."""
    import threading
    import time

    import te_thd.offline_cache.read.dataset as reader

    monkeypatch.setattr(reader, "VERIFY_CHUNK_BYTES", 16)
    hooked: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args))
    d = tmp_path / "cache"
    _via_produce_cache(d)
    _flip_data(d / "shard-000002.safetensors", "ids", 1)  # sample 9
    log = _record_verifiers(monkeypatch)
    ds = _threaded_ds(d, 2)
    pending = ds.start_read(list(range(N)))
    deadline = time.monotonic() + 10
    while not any(not ok for *_, ok in log) and time.monotonic() < deadline:
        time.sleep(0.01)  # the helpers read while nobody waits
    with pytest.raises(
        CacheIntegrityError,
        match=r"shard-000002\.safetensors: sample 9 \(row 1 of the shard\), key 'ids'",
    ) as e:
        pending.result()
    assert (e.value.sample, e.value.key) == (9, "ids")
    failed = [entry for entry in log if not entry[3]]
    assert (
        len(failed) == 1
        and failed[0][0].startswith("te_thd-read")
        and failed[0][1:3] == ("ids", [1])
    )
    helpers = sum(t.name.startswith("te_thd-read") for t in threading.enumerate())
    good, want = list(range(8)), _rows(0, N)
    for i in range(30):
        if i % 3 == 0:
            with pytest.raises(
                CacheIntegrityError, match=r"sample 9 \(row 1 of the shard\), key 'ids'"
            ):
                ds.__getitems__([9, *good] if i % 2 else [*good, 9])
        else:
            order = good[i % 4 :] + good[: i % 4]
            batch = ds.__getitems__(order)
            for k in KEYS:
                assert torch.equal(batch.tensors[k], want[k][order])
    assert sum(t.name.startswith("te_thd-read") for t in threading.enumerate()) == helpers
    assert not hooked


@pytest.mark.parametrize("threads", [1, 2])
def test_a_shard_truncated_after_open_names_the_shard(tmp_path: Path, threads: int) -> None:
    """The descriptor is open and the header checked when the file shrinks: the read
    that runs past its end (on any thread with ``threads=2``; by ``__getitems__`` or
    read ahead by ``start_read``) is an integrity error naming the shard, not a short batch."""
    d = tmp_path / "cache"
    _via_produce_cache(d)
    ds = _threaded_ds(d, threads)
    everything = list(range(N))
    assert torch.equal(
        ds.__getitems__(everything).tensors["ids"], _rows(0, N)["ids"]
    )  # opens every shard
    p = shard_path(str(d), 2)
    e = read_shard_header(p).entries["ids"]
    os.truncate(
        p, e.start + (e.end - e.start) // 2
    )  # from 'ids' row 1 of shard 2 on, nothing is left
    for read in (ds.__getitems__, lambda idx: ds.start_read(idx).result()):
        with pytest.raises(
            CacheIntegrityError,
            match=r"shard-000002\.safetensors cannot be read .*file ended at byte \d+ while reading",
        ) as err:
            read(everything)
        assert err.value.path == p
    assert torch.equal(
        ds.__getitems__([0, 5, 7]).tensors["ids"], _rows(0, N)["ids"][[0, 5, 7]]
    )  # other shards still read


def _garble_header(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(9)
        f.write(
            b"\x01"
        )  # a control character inside the header JSON: the shard fails its open check


@pytest.mark.parametrize(
    ("path", "damage"),
    [(p, d) for p in ("inline", "torch") for d in ("row", "header", "removed")]
    + [("read_ahead", d) for d in ("row", "header", "removed")],
)  # fmt: skip
def test_a_damaged_shard_stops_the_loader_at_the_same_batch_on_every_path(
    tmp_path: Path, damage: str, path: str
) -> None:
    """Differential, ``num_workers=0``: the inline loader (with and without read-ahead)
    hands out every batch before the damaged one, then raises, exactly as torch's own
    iterator does -- for a flipped row, for a shard whose header fails its check when
    first opened, and for a shard removed after the cache was opened. The loop spends
    50 ms per batch (far above a small read, even on a loaded machine), so the loader does read ahead (it only does behind a consumer that
    leaves it time)."""
    import time

    d = tmp_path / "cache"
    _via_produce_cache(d)
    ds = CachedTensorDataset(str(d), "test", 1, KEYS)
    started: list[list[int]] = []
    start_read = ds.start_read

    def spy(indices):
        started.append(list(indices))
        return start_read(indices)

    ds.start_read = spy
    shard1 = (
        d / "shard-000001.safetensors"
    )  # samples 4..7: the third batch of 2 in sequential order
    if damage == "row":
        _flip_data(shard1, "ids", 1)
    elif damage == "header":
        _garble_header(shard1)
    else:
        shard1.unlink()
    loader = build_cached_dataloader(ds, 2, False, lambda b: collate_cached(b, KEYS), pin_memory=False,
                                     read_ahead=path == "read_ahead")  # fmt: skip
    if path == "torch":
        loader._reads_inline = lambda: False
    got = []
    with pytest.raises(CacheIntegrityError, match=r"shard-000001\.safetensors"):
        for batch in loader:
            got.append(batch["ids"][:, 0].tolist())
            time.sleep(0.05)
    assert bool(started) == (path == "read_ahead")
    assert got == [[0, 3], [6, 9]]  # batches 0 and 1 arrived, whole


class _WithEmpty(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor([i, 2 * i]), "empty": torch.zeros(0)}


@pytest.mark.parametrize("engine", ["preadv", "mapped"])
def test_a_key_of_zero_size_samples_reads_back(tmp_path: Path, engine: str) -> None:
    """A key whose samples hold no elements (shape ``[0]``): written and checksummed by
    ``produce_cache`` like any other key, so it must read back, on both engines and per item."""
    d = tmp_path / "cache"
    produce_cache(
        DataLoader(_WithEmpty(), batch_size=4),
        str(d),
        4,
        lambda b: b,
        ("ids", "empty"),
        progress=False,
    )
    read_tuning(engine=engine)
    ds = CachedTensorDataset(str(d), "test", 1, ("ids", "empty"))
    batch = ds.__getitems__([5, 1, 2])
    assert batch.tensors["empty"].shape == (3, 0) and batch.tensors["ids"][:, 0].tolist() == [
        5,
        1,
        2,
    ]
    assert ds[6]["empty"].shape == (0,)


def test_verify_names_every_bad_shard_truncated_and_flipped(tmp_path: Path) -> None:
    """A shard truncated (a size mismatch) does not hide the flipped ones: verify, quick or deep, and
    the CLI name every bad shard, the same set ``repair`` sets aside."""
    from te_thd.cli import main

    clean = tmp_path / "clean"
    produce_cache(
        DataLoader(IndexDataset(16), batch_size=2), str(clean), 2, _compute, KEYS, progress=False
    )
    d = tmp_path / "cache"
    shutil.copytree(clean, d)
    p1 = d / "shard-000001.safetensors"
    os.truncate(p1, p1.stat().st_size - 3)
    _flip_data(d / "shard-000003.safetensors", "hidden", 1)
    _flip_data(d / "shard-000006.safetensors", "ids", 0)
    with pytest.raises(CacheIntegrityError, match=r"3 bad shard\(s\)") as deep:
        verify_cache(str(d), deep=True)
    named = [f"shard-00000{i}.safetensors" for i in (1, 3, 6)]
    assert all(n in str(deep.value) for n in named) and deep.value.path == str(p1)
    with pytest.raises(
        CacheIntegrityError, match=r"(?s)1 bad shard\(s\).*shard-000001\.safetensors: has \d+ bytes"
    ):
        verify_cache(str(d), deep=False)  # a quick verify reads no data: only the size is wrong
    assert main(["cache", "verify", str(d)]) == 1
    result = repair_cache(str(d))
    assert sorted(result["damaged"]) == named


def _flip_last_byte(path: Path, key: str) -> None:
    """Flip the last byte of stored tensor ``key`` of shard file ``path`` (its last row's, or last token's)."""
    e = read_shard_header(str(path)).entries[key]
    data = bytearray(path.read_bytes())
    data[e.end - 1] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("ragged", [False, True], ids=["rows", "ragged"])
def test_every_path_names_a_damaged_row_by_its_global_sample(tmp_path: Path, ragged: bool) -> None:
    """A flipped byte in the last row of shard 2 (shards of 4) is sample 11, not "sample 3": verify (the
    API and the CLI), repair (the CLI) and the batched and per-item reads all name sample 11; verify and
    repair, which return no batch, do not say that a batch was not returned."""
    import subprocess
    import sys

    import _s3_producer_script as P

    d = tmp_path / "cache"
    produce_cache(DataLoader(P.dataset(), batch_size=2), str(d), 4, P.compute_batch, P.KEYS, progress=False,
                  length_key="length", token_keys=P.TOKEN_KEYS if ragged else ())  # fmt: skip
    _flip_last_byte(d / "shard-000002.safetensors", "hidden@tokens" if ragged else "hidden")
    where = f"{d / 'shard-000002.safetensors'}: sample 11 (row 3 of the shard), key 'hidden': checksum mismatch"
    ds = CachedTensorDataset(str(d), "test", 1, P.KEYS)
    for read in (lambda: ds.__getitems__([8, 9, 10, 11]).tensors, lambda: ds[11]):
        with pytest.raises(CacheIntegrityError) as e:
            read()
        assert e.value.sample == 11 and f"shard {where}" in str(e.value)
    with pytest.raises(CacheIntegrityError) as e:
        verify_cache(str(d), deep=True)
    assert where in str(e.value) and "batch" not in str(e.value)
    cli = [sys.executable, "-m", "te_thd.cli", "cache"]
    out = subprocess.run([*cli, "verify", str(d)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and where in out.stderr and "batch" not in out.stderr, out.stderr
    out = subprocess.run([*cli, "repair", str(d)], capture_output=True, text=True, timeout=120)
    assert (
        out.returncode == 0
        and f"set aside: shard-000002.safetensors: {where.split(': ', 1)[1]}" in out.stdout
    ), out.stderr
    assert "batch" not in out.stdout
