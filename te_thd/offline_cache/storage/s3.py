"""The s3:// storage of a cache (:class:`S3Prefix`, made by ``schemes.open_storage``): any
S3-compatible store, through obstore; ``msc.py`` reuses all but the object operations for msc://.

- **client.** obstore issues ranged GETs concurrently and coalesces nearby ranges
  (``get_ranges``), uploads large objects in parallel multipart parts, has the conditional
  PUT the lock needs, and releases the GIL while it waits. Configured like the AWS tools
  (:data:`_VARS` over the AWS profile's files), read once per storage (DataLoader workers use
  the same); each process makes its own client (its runtime does not survive fork). Requests
  are retried by :data:`RETRY`. What stops every request alike (no answer, no such bucket,
  access denied, no keys) is one :class:`StorageError` line (:func:`_store_error`).
- **staged upload.** A shard is written in a private local directory, then uploaded whole
  (one PUT, or a multipart upload visible only once complete). Objects set aside go under
  ``<prefix>/.te_thd-damaged/``, which readers never list.
- **the producer lock**: :class:`~te_thd.offline_cache.storage.objectlock.ObjectLock`, an object
  created only if absent, which a producer on the same host takes over from a dead holder.
- **the read-through copy** (:class:`ReadThrough`): a local directory with the manifest
  and one *sparse* file per shard. Before a reader touches a byte range, the 64 KiB
  chunks of it not fetched yet are fetched (one ``get_ranges`` call per shard and batch)
  into the sparse file; the ordinary local read path then reads and verifies them. Which
  chunks are present is kept beside each file (``.<shard>.present``), so a DataLoader
  worker or the next run reuses them; ``max_bytes`` bounds the copy (LRU shards dropped).
  A damaged local copy fails the read's checksums and is fetched again once
  (:meth:`S3Prefix.refetch`); a second failure is the object's.
"""

from __future__ import annotations

import configparser
import contextlib
import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from te_thd.offline_cache.format.schema import MANIFEST_NAME, SHARD_RE, CacheLockError
from te_thd.offline_cache.storage import base as storage
from te_thd.offline_cache.storage.base import LOCK_NAME, atomic_write_bytes, unlink_quietly
from te_thd.offline_cache.storage.objectlock import ObjectLock, holder_text


class S3Prefix(storage.Storage):
    """The cache at ``s3://bucket/prefix`` (``prefix`` without leading or trailing slashes; ``""``:
    the bucket's root). ``read_cache_dir`` / ``read_cache_bytes``: where the read-through copy lives
    and its byte budget (:class:`ReadThrough`)."""

    fork_safe = False

    def __init__(
        self,
        scheme: str,
        bucket: str,
        prefix: str,
        read_cache_dir: str | None = None,
        read_cache_bytes: int | None = None,
    ) -> None:
        self.bucket, self.prefix = bucket, prefix
        self.name = f"{scheme}://{bucket}/{prefix}" if prefix else f"{scheme}://{bucket}"
        self.config = settings()  # captured here: workers may have another environment
        self._copy_options = (read_cache_dir, read_cache_bytes)
        self._copy: ReadThrough | None = None
        self._work: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "_work": None,
        }  # the staging directory belongs to the process that made it

    def display(self, obj: str) -> str:
        return f"{self.name}/{obj}"

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Around every obstore call: what every request would meet is one :class:`StorageError`
        line."""
        try:
            yield
        except Exception as exc:  # obstore's own types: _store_error picks the ones it knows
            err = self.store_error(exc)
            if err is None:
                raise
            raise err from exc

    def store_error(self, exc: BaseException) -> storage.StorageError | None:
        return _store_error(exc, self)

    def key(self, obj: str) -> str:  # the object key of ``obj``
        return f"{self.prefix}/{obj}" if self.prefix else obj

    def list(self) -> dict[str, int]:
        prefix = self.prefix + "/" if self.prefix else None
        out: dict[str, int] = {}
        with self.calls():
            for batch in _obstore().list(client(self.bucket, self.config), prefix=prefix):
                for meta in batch:
                    name = meta["path"][len(prefix or "") :]
                    if "/" not in name:
                        out[name] = int(meta["size"])
        return out

    def get(self, obj: str) -> bytes | None:
        try:
            with self.calls():
                return bytes(
                    _obstore().get(client(self.bucket, self.config), self.key(obj)).bytes()
                )
        except FileNotFoundError:
            return None

    def get_ranges(self, obj: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Bytes ``[start, end)`` of ``obj`` for each range (views, not copies): one call, obstore
        coalesces."""
        with self.calls():
            out = (
                _obstore().get_ranges(
                    client(self.bucket, self.config),
                    self.key(obj),
                    starts=[a for a, _ in ranges],
                    ends=[b for _, b in ranges],
                )
                if ranges
                else []
            )
        return [memoryview(b) for b in out]

    def put(self, obj: str, data: bytes, *, create: bool = False) -> str:
        """Also ``create``: only if it does not exist (conditional PUT); then ``""`` when it did."""
        try:
            with self.calls():
                _obstore().put(
                    client(self.bucket, self.config),
                    self.key(obj),
                    data,
                    mode="create" if create else "overwrite",
                )
        except FileExistsError:
            return ""
        # obstore raises its own AlreadyExistsError (a FileExistsError in recent versions)
        except Exception as exc:
            if type(exc).__name__ == "AlreadyExistsError":
                return ""
            raise
        return self.display(obj)

    def delete(self, obj: str) -> None:
        with contextlib.suppress(FileNotFoundError), self.calls():
            _obstore().delete(client(self.bucket, self.config), self.key(obj))

    @property
    def work_dir(self) -> str:
        if self._work is None:
            self._work = storage.private_dir("upload", self)
        return self._work

    def commit(self, obj: str, tmp_path: str) -> str:
        # one PUT (multipart when large): whole or not at all
        with open(tmp_path, "rb") as f, self.calls():
            _obstore().put(client(self.bucket, self.config), self.key(obj), f)
        unlink_quietly(tmp_path)
        return self.display(obj)

    @property
    def copy(self) -> ReadThrough:
        """The read-through copy, made and synced with the store on first use (a reader makes it
        when it opens the cache, so its DataLoader workers share it)."""
        self.prepare_reads()
        assert self._copy is not None
        return self._copy

    def readable(self, obj: str) -> tuple[str, storage.Fetch | None]:
        copy = self.copy

        def fetch(ranges: Sequence[tuple[int, int]]) -> None:
            copy.ensure(obj, ranges)

        return os.path.join(copy.root, obj), fetch

    def header(self, obj: str) -> str:
        path, fetch = self.readable(obj)
        fetch([(0, 8)])  # the length prefix, then the header it gives
        with open(path, "rb") as f:
            fetch([(0, 8 + min(int.from_bytes(f.read(8), "little"), self.copy.sizes[obj]))])
        return path

    def whole(self, obj: str) -> str:
        self.copy.ensure(obj, [(0, self.copy.sizes[obj])])
        return os.path.join(self.copy.root, obj)

    def admit(self, obj: str, size: int) -> None:
        self.copy.add(obj, size)

    def prepare_reads(self, known: storage.Known | None = None) -> None:
        if self._copy is None:  # made and synced here, before any worker starts
            self._copy = ReadThrough(self, *self._copy_options)
            self._copy.sync(known)

    def refetch(self, obj: str) -> bool:
        if obj not in self.copy.sizes:
            return False
        self.copy.invalidate(obj)
        return True

    def set_aside(self, objs: Sequence[str], into: str) -> str | None:
        for obj in objs:
            with self.calls():
                _obstore().copy(
                    client(self.bucket, self.config), self.key(obj), self.key(f"{into}/{obj}")
                )
            self.delete(obj)
        return self.display(into) if objs else None

    def lock(self) -> ObjectLock:
        return ObjectLock(self)

    def unlock(self) -> str | None:
        holder = self.lock_holder()
        if holder is None:
            return None
        if holder["alive"]:  # the rule a producer takes the lock over by: its holder runs here
            raise CacheLockError(
                f"{self.display(LOCK_NAME)} is held by a producer that runs on this host "
                f"({holder_text(holder)}); nothing was removed: wait for it to finish, or stop it "
                f"(kill {holder['pid']}): a producer started here then takes the lock over itself"
            )
        self.delete(LOCK_NAME)
        return holder_text(holder)


_CLIENTS: dict[tuple[int, str, tuple[tuple[str, str], ...]], Any] = {}
#: a failed request (no connection within CLIENT_OPTIONS' connect_timeout, a 5xx answer, a dropped
#: connection) is tried again a few times with short backoffs: a store that does not answer fails
#: in seconds
RETRY: Any = {
    "max_retries": 4,
    "retry_timeout": timedelta(seconds=30),
    "backoff": {
        "init_backoff": timedelta(seconds=0.2),
        "max_backoff": timedelta(seconds=2),
        "base": 2,
    },
}
CLIENT_OPTIONS = {
    "connect_timeout": "3s",
    "timeout": "300s",
}  # one request (a multipart part) may take 5 min
_CODE = re.compile(r"<Code>(\w+)</Code>")  # an S3 error answer's code
#: the environment variables a client is configured from
_VARS = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)
#: credential options of the shared files, by the environment variable each stands for
_CREDENTIALS = (
    ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
    ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ("aws_session_token", "AWS_SESSION_TOKEN"),
)


def _profile() -> dict[str, str]:
    """The settings of the AWS profile in the shared config and credentials files, under the
    environment variables' names (``from:<name>``: which file and profile each came from)."""
    name = os.environ.get("AWS_PROFILE") or "default"
    out: dict[str, str] = {}
    for file_var, default, section, options in (
        (
            "AWS_CONFIG_FILE",
            "~/.aws/config",
            name if name == "default" else f"profile {name}",
            (("region", "AWS_REGION"), ("endpoint_url", "AWS_ENDPOINT_URL"), *_CREDENTIALS),
        ),
        ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials", name, _CREDENTIALS),
    ):
        parser = configparser.ConfigParser(interpolation=None)
        path = os.path.expanduser(os.environ.get(file_var, default))
        parser.read(path)
        if parser.has_section(section):
            for opt, var in options:
                if parser.get(section, opt, fallback=None):
                    out[var], out[f"from:{var}"] = (
                        parser.get(section, opt),
                        f"{opt} of profile {name!r} in {path}",
                    )
    return out


def settings() -> dict[str, str]:
    """The object-store settings of this process: the AWS profile's (config and credentials files),
    overridden by the environment variables in the module docstring."""
    env = {k: os.environ[k] for k in _VARS if os.environ.get(k)}
    return {**_profile(), **env, **{f"from:{k}": k for k in env}}


def _store_error(exc: BaseException, store: S3Prefix) -> storage.StorageError | None:
    """The one line for an obstore error that every request would meet (no answer from the endpoint,
    no such bucket, access denied), naming the URL, the endpoint and its origin, and what to check;
    None for an error about one object or request."""
    text, kind = str(exc).split("\n\nDebug source:", 1)[0], type(exc).__name__
    code, (url, origin) = _CODE.search(text), endpoint(store.config)
    at = f"(endpoint {url}, from {origin})"
    # without keys, obstore asks the instance's (or container's) metadata service for them
    metadata = re.search(r"https?://169\.254\.1(69\.254|70\.2)\S*", text)
    if metadata and not store.config.get("AWS_ACCESS_KEY_ID"):
        status = re.search(r"status code: ([0-9]{3}[A-Za-z ]*)", text)
        why = (
            f"no credentials: none are set, and looking up this machine's at {metadata[0]} failed "
            f"({status[1] if status else 'no answer'}): the store {at} was never asked; set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, a profile with keys in "
            "~/.aws/credentials), and AWS_ENDPOINT_URL for a store other than AWS S3"
        )
    elif code and code[1] == "NoSuchBucket":
        why = (
            f"bucket {store.bucket!r} does not exist {at}; te_thd never creates buckets: "
            "create it first, or "
            "check the bucket name and the endpoint"
        )
    elif kind in ("PermissionDeniedError", "UnauthenticatedError") or re.search(
        r" 40[13] (Forbidden|Unauth)", text
    ):
        keys = store.config.get("from:AWS_ACCESS_KEY_ID", "obstore's provider chain: none set")
        why = (
            f"access denied: the store answered {code[1] if code else kind} {at[:-1]}; "
            f"keys from {keys}); check "
            f"the keys and that they may read and write bucket {store.bucket!r} at this endpoint"
        )
    elif (
        kind == "GenericError"
        and not code
        and re.search(r"error sending request|HTTP error|timed out", text)
    ):
        tried = re.search(r" in ([0-9.]+)(\w*s), after ([0-9]+) retries", text)
        why = (
            f"no answer from the object store {at}"
            + (f" after {tried[3]} retries in {float(tried[1]):.2g} {tried[2]}" if tried else "")
            + "; check that the server runs and the endpoint is right (AWS_ENDPOINT_URL_S3 "
            "/ AWS_ENDPOINT_URL, "
            "or endpoint_url in the AWS profile's config file; none for AWS S3)"
        )
    else:
        return None
    return storage.StorageError(f"{store.name}: {why}")


def endpoint(config: dict[str, str]) -> tuple[str, str]:
    """The endpoint the client of ``config`` (:func:`settings`) uses, and where that came from."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if config.get(var):
            return config[var], config.get(f"from:{var}", var)
    region = config.get("AWS_REGION") or config.get("AWS_DEFAULT_REGION") or "us-east-1"
    return f"https://s3.{region}.amazonaws.com", "the default: AWS S3, as no endpoint is set"


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(
            "s3:// caches need the object-store client obstore: install te_thd's s3 "
            "extra from its checkout, "
            "`pip install -e '.[s3]'`"
        ) from None
    return obstore


def client(bucket: str, config: dict[str, str] | None = None) -> Any:
    """This process's ``obstore`` store for ``bucket``, configured by ``config`` (default: this
    process's :func:`settings`), made on first use."""
    env = settings() if config is None else config
    key = (os.getpid(), bucket, tuple(sorted(env.items())))
    store = _CLIENTS.get(key)
    if store is None:
        if any(pid != key[0] for pid, *_ in _CLIENTS):
            raise RuntimeError(
                "this process was forked from one that had used the object-store client, "
                "whose runtime does not "
                "survive fork: start DataLoader workers with "
                "multiprocessing_context='forkserver' or 'spawn' "
                "(build_cached_dataloader does this for s3:// caches)"
            )
        _obstore()
        from obstore.store import S3Store

        kwargs: dict[str, Any] = {
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            "retry_config": RETRY,
            "client_options": dict(CLIENT_OPTIONS),
        }
        url = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if url:
            kwargs["endpoint"] = url
            kwargs["client_options"]["allow_http"] = url.startswith("http://")
        for opt, var in _CREDENTIALS:
            if env.get(var):
                kwargs[opt.removeprefix("aws_")] = env[var]
        store = _CLIENTS[key] = S3Store(bucket, **kwargs)
    return store


#: fetch granularity: a range is fetched as the chunks that hold it
CHUNK_BYTES = 64 * 1024


class ReadThrough:
    """The local read-through copy of the cache ``store`` (see the module docstring).

    ``cache_dir``: where the copy lives (a subdirectory per cache URL), kept between runs;
    None: a private temporary directory. ``max_bytes``: the most fetched bytes it keeps
    (None: no limit). ``root`` is the local directory readers open.
    """

    def __init__(
        self, store: S3Prefix, cache_dir: str | None = None, max_bytes: int | None = None
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        if cache_dir is None:
            self.root = storage.private_dir(store.name.partition(":")[0], self)
        else:  # the user's directory: never removed
            self.root = os.path.join(cache_dir, hashlib.sha1(store.name.encode()).hexdigest()[:16])
            os.makedirs(self.root, exist_ok=True)
        self.sizes: dict[str, int] = {}
        self._present: dict[str, bytearray] = {}
        # per shard: prefix counts of chunks not yet fetched
        self._absent: dict[str, np.ndarray] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        #: requests made and bytes fetched from the store by this process (benchmarks, docs)
        self.requests = self.fetched_bytes = 0
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # (the directory stays its maker's: the copy has no finalizer)
        state["_present"], state["_absent"], state["_lru"] = {}, {}, OrderedDict()
        return state

    def sync(self, known: storage.Known | None = None) -> None:
        """Fetch the manifest and list the shard objects (``known``: what the opener just read of
        both); drop local copies the store no longer matches."""
        if known is None:
            known = self.store.get(MANIFEST_NAME), self.store.list()
            self.requests += 2
        raw, listing = known[0] or b"", known[1]  # no manifest while a producer runs
        local = os.path.join(self.root, MANIFEST_NAME)
        old = open(local, "rb").read() if os.path.exists(local) else None
        self.sizes = {n: s for n, s in listing.items() if SHARD_RE.match(n)}
        for name in os.listdir(self.root):
            if SHARD_RE.match(name) and (name not in self.sizes or raw != old):
                self._drop(name)  # another cache, or another version of this one, was here
        for name, size in list(self.sizes.items()):
            self.add(name, size)
        if raw != old:
            atomic_write_bytes(local, raw)

    def add(self, name: str, size: int) -> None:
        """Make shard ``name`` (``size`` bytes) readable: a sparse local file, no data until
        fetched."""
        self.sizes[name], path = size, os.path.join(self.root, name)
        if not os.path.exists(path) or os.path.getsize(path) != size:
            self._drop(name)
            with open(path, "ab") as f:
                f.truncate(size)

    def _drop(self, name: str) -> None:
        unlink_quietly(os.path.join(self.root, name))
        unlink_quietly(self._bitmap_path(name))
        self._present.pop(name, None)
        self._absent.pop(name, None)
        self._lru.pop(name, None)

    def _bitmap_path(self, name: str) -> str:
        return os.path.join(self.root, f".{name}.present")

    def _bitmap(self, name: str) -> bytearray:
        bits = self._present.get(name)
        if bits is None:
            n = -(-self.sizes[name] // CHUNK_BYTES)
            try:
                with open(self._bitmap_path(name), "rb") as f:
                    bits = bytearray(f.read(n).ljust(n, b"\0"))
            except FileNotFoundError:
                bits = bytearray(n)
            self._present[name] = bits
        return bits

    def ensure(self, name: str, ranges: Iterable[tuple[int, int]]) -> None:
        """Make bytes ``[offset, offset + n)`` of shard file ``name`` present locally, for each
        range."""
        if self._pid != os.getpid():  # a forked worker: its own client and bookkeeping
            self._pid, self._present, self._absent, self._lru = os.getpid(), {}, {}, OrderedDict()
        size = self.sizes[name]
        bits = self._bitmap(name)
        spans_in = np.asarray(
            [(off, off + n) for off, n in ranges if n > 0], dtype=np.int64
        ).reshape(-1, 2)
        first = spans_in[:, 0] // CHUNK_BYTES
        last = np.minimum(-(-spans_in[:, 1] // CHUNK_BYTES), len(bits))
        self._lru[name] = None
        self._lru.move_to_end(name)
        absent = self._absent.get(name)
        # prefix counts of absent chunks: "is every chunk of these ranges here" in O(ranges)
        if absent is None:
            absent = self._absent[name] = np.concatenate(
                ([0], np.cumsum(np.frombuffer(bytes(bits), np.uint8) == 0))
            )
        if not np.any(absent[last] - absent[first]):
            return
        want: set[int] = set()
        for a, b in zip(first.tolist(), last.tolist(), strict=True):
            want.update(range(a, b))
        missing = sorted(c for c in want if not bits[c])
        runs: list[tuple[int, int]] = []
        for c in missing:
            if runs and runs[-1][1] == c:
                runs[-1] = (runs[-1][0], c + 1)
            else:
                runs.append((c, c + 1))
        spans = [(a * CHUNK_BYTES, min(b * CHUNK_BYTES, size)) for a, b in runs]
        data = self.store.get_ranges(name, spans)
        self.requests += 1
        fd = os.open(os.path.join(self.root, name), os.O_WRONLY)
        try:
            for (a, _), blob in zip(spans, data, strict=True):
                os.pwrite(fd, blob, a)
                self.fetched_bytes += len(blob)
        finally:
            os.close(fd)
        for a, b in runs:
            bits[a:b] = b"\1" * (b - a)
        self._absent.pop(name, None)
        # after the data: a set byte means its chunk is there
        with open(self._bitmap_path(name), "wb") as f:
            f.write(bits)
        self._evict(keep=name)

    def invalidate(self, name: str) -> None:
        """Forget shard ``name``'s local bytes (a read found them damaged): they are fetched
        again."""
        storage.punch_hole(os.path.join(self.root, name), self.sizes[name])
        self._present[name] = bytearray(-(-self.sizes[name] // CHUNK_BYTES))
        self._absent.pop(name, None)
        unlink_quietly(self._bitmap_path(name))

    def _evict(self, keep: str) -> None:
        """Drop least recently used shards (never ``keep``) until the fetched bytes fit
        ``max_bytes``."""
        if self.max_bytes is None:
            return
        held = (
            sum(b.count(1) for b in self._present.values()) * CHUNK_BYTES
        )  # counted once, then kept up to date
        for name in list(self._lru):
            if held <= self.max_bytes:
                break
            if name != keep:
                held -= self._present[name].count(1) * CHUNK_BYTES if name in self._present else 0
                self.invalidate(name)
                self._lru.pop(name, None)
