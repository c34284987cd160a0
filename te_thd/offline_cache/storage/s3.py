"""The s3:// storage of a cache (:class:`S3Prefix`, made by ``schemes.open_storage``): any
S3-compatible store, through obstore; ``msc.py`` reuses everything but the client calls
(``_list``, ``_get``, ``_put``, ...) for msc://.

- **client.** obstore issues ranged GETs concurrently and coalesces nearby ranges
  (``get_ranges``), uploads large objects in parallel multipart parts, has the conditional
  PUT the lock needs, and releases the GIL while it waits. Configured like the AWS tools
  (:data:`_VARS` over the AWS profile's files), read once per storage (DataLoader workers use
  the same); each process makes its own client (its runtime does not survive fork). Requests
  are retried by :data:`RETRY`. What stops every request alike (no answer, no such bucket,
  access denied, no keys) is one :class:`StorageError` line (:meth:`S3Prefix.store_error`).
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
import functools
import hashlib
import importlib
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
        # the staging directory belongs to the process that made it
        return {**self.__dict__, "_work": None}

    def display(self, obj: str) -> str:
        return f"{self.name}/{obj}"

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Around every client call: what every request would meet is one :class:`StorageError`
        line."""
        try:
            yield
        except storage.StorageError:
            raise
        except Exception as exc:  # the client's own types: store_error picks the ones it knows
            err = self.store_error(exc)
            if err is None:
                raise
            raise err from exc

    def store_error(self, exc: BaseException) -> storage.StorageError | None:
        """The one line for an obstore error that every request would meet (no answer from the
        endpoint, no such bucket, access denied), naming the URL, the endpoint and its origin, and
        what to check; None for an error about one object or request."""
        text, kind = str(exc).split("\n\nDebug source:", 1)[0], type(exc).__name__
        code, (url, origin) = _CODE.search(text), endpoint(self.config)
        at = f"(endpoint {url}, from {origin})"
        # without keys, obstore asks the instance's (or container's) metadata service for them
        metadata = re.search(r"https?://169\.254\.1(69\.254|70\.2)\S*", text)
        if metadata and not self.config.get("AWS_ACCESS_KEY_ID"):
            status = re.search(r"status code: ([0-9]{3}[A-Za-z ]*)", text)
            why = (
                "no credentials: none are set, and looking up this machine's at "
                f"{metadata[0]} failed ({status[1] if status else 'no answer'}): the store {at} "
                "was never asked; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, "
                "a profile with keys in ~/.aws/credentials), and AWS_ENDPOINT_URL for a store "
                "other than AWS S3"
            )
        elif code and code[1] == "NoSuchBucket":
            why = (
                f"bucket {self.bucket!r} does not exist {at}; te_thd never creates buckets: "
                "create it first, or check the bucket name and the endpoint"
            )
        elif kind in ("PermissionDeniedError", "UnauthenticatedError") or re.search(
            r" 40[13] (Forbidden|Unauth)", text
        ):
            keys = self.config.get("from:AWS_ACCESS_KEY_ID", "obstore's provider chain: none set")
            why = (
                f"access denied: the store answered {code[1] if code else kind} {at[:-1]}; "
                f"keys from {keys}); check the keys and that they may read and write bucket "
                f"{self.bucket!r} at this endpoint"
            )
        elif kind == "GenericError" and not code and re.search(_NO_ANSWER, text):
            tried = re.search(r" in ([0-9.]+)(\w*s), after ([0-9]+) retries", text)
            after = (
                f" after {tried[3]} retries in {float(tried[1]):.2g} {tried[2]}" if tried else ""
            )
            why = (
                f"no answer from the object store {at}{after}; check that the server runs and the "
                "endpoint is right (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, or endpoint_url in "
                "the AWS profile's config file; none for AWS S3)"
            )
        else:
            return None
        return storage.StorageError(f"{self.name}: {why}")

    def key(self, obj: str) -> str:  # the object key of ``obj``
        return f"{self.prefix}/{obj}" if self.prefix else obj

    # The operations on objects, each made of one client call (the ``_`` methods below, by object
    # key: obstore's here, MSC's in ``msc.py``) inside :meth:`calls`.

    def list(self) -> dict[str, int]:
        prefix = self.prefix + "/" if self.prefix else ""
        with self.calls():  # one level: the objects set aside below it are not listed
            found = self._list(prefix)
        return {k[len(prefix) :]: size for k, size in found if "/" not in k[len(prefix) :]}

    def get(self, obj: str) -> bytes | None:
        try:
            with self.calls():
                return self._get(self.key(obj))
        except FileNotFoundError:
            return None

    def get_ranges(self, obj: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Bytes ``[start, end)`` of ``obj`` for each range."""
        with self.calls():
            return self._get_ranges(self.key(obj), ranges) if ranges else []

    def put(self, obj: str, data: bytes, *, create: bool = False) -> str:
        """Also ``create``: only if it does not exist (conditional PUT); then ``""`` when it did."""
        with self.calls():
            written = self._put(self.key(obj), data, create)
        return self.display(obj) if written else ""

    def delete(self, obj: str) -> None:
        with contextlib.suppress(FileNotFoundError), self.calls():
            self._delete(self.key(obj))

    def commit(self, obj: str, tmp_path: str) -> str:
        with self.calls():  # one upload (multipart when large): whole or not at all
            self._upload(self.key(obj), tmp_path)
        unlink_quietly(tmp_path)
        return self.display(obj)

    def set_aside(self, objs: Sequence[str], into: str) -> str | None:
        for obj in objs:
            with self.calls():
                self._copy_object(self.key(obj), self.key(f"{into}/{obj}"))
            self.delete(obj)
        return self.display(into) if objs else None

    def _client(self) -> tuple[Any, Any]:
        """obstore, and this process's client of the bucket."""
        return _obstore(), client(self.bucket, self.config)

    def _list(self, prefix: str) -> list[tuple[str, int]]:
        """``[(key, size)]`` of every object under ``prefix``, at any depth."""
        ob, store = self._client()
        return [
            (m["path"], int(m["size"])) for b in ob.list(store, prefix=prefix or None) for m in b
        ]

    def _get(self, key: str) -> bytes:
        ob, store = self._client()
        return bytes(ob.get(store, key).bytes())

    def _get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views, not copies: one call, obstore coalesces nearby ranges."""
        ob, store = self._client()
        out = ob.get_ranges(store, key, starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
        return [memoryview(b) for b in out]

    def _put(self, key: str, data: bytes, create: bool) -> bool:
        """Write ``data`` at ``key``; with ``create``, only where there is none: False when there
        was."""
        ob, store = self._client()
        try:
            ob.put(store, key, data, mode="create" if create else "overwrite")
        except FileExistsError:
            return False
        # obstore raises its own AlreadyExistsError (a FileExistsError in recent versions)
        except Exception as exc:
            if type(exc).__name__ == "AlreadyExistsError":
                return False
            raise
        return True

    def _delete(self, key: str) -> None:
        ob, store = self._client()
        ob.delete(store, key)

    def _upload(self, key: str, path: str) -> None:
        """One PUT of the local file ``path`` (multipart when large)."""
        ob, store = self._client()
        with open(path, "rb") as f:
            ob.put(store, key, f)

    def _copy_object(self, key: str, to: str) -> None:
        ob, store = self._client()
        ob.copy(store, key, to)

    @property
    def work_dir(self) -> str:
        if self._work is None:
            self._work = storage.private_dir("upload", self)
        return self._work

    @property
    def copy(self) -> ReadThrough:
        """The read-through copy, made and synced with the store on first use (a reader makes it
        when it opens the cache, so its DataLoader workers share it)."""
        self.prepare_reads()
        assert self._copy is not None
        return self._copy

    def readable(self, obj: str) -> tuple[str, storage.Fetch | None]:
        return os.path.join(self.copy.root, obj), functools.partial(self.copy.ensure, obj)

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
#: one request (a multipart part) may take 5 min
CLIENT_OPTIONS = {"connect_timeout": "3s", "timeout": "300s"}
_CODE = re.compile(r"<Code>(\w+)</Code>")  # an S3 error answer's code
#: what obstore says of a request no server answered
_NO_ANSWER = re.compile(r"error sending request|HTTP error|timed out")
#: credential options of the shared files, by the environment variable each stands for
_CREDENTIALS = (
    ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
    ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ("aws_session_token", "AWS_SESSION_TOKEN"),
)
#: the environment variables a client is configured from: the endpoint, the region, the credentials
_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION") + tuple(
    var for _, var in _CREDENTIALS
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
                if value := parser.get(section, opt, fallback=None):
                    out[var], out[f"from:{var}"] = value, f"{opt} of profile {name!r} in {path}"
    return out


def settings() -> dict[str, str]:
    """The object-store settings of this process: the AWS profile's (config and credentials files),
    overridden by the environment variables in the module docstring."""
    env = {k: os.environ[k] for k in _VARS if os.environ.get(k)}
    return {**_profile(), **env, **{f"from:{k}": k for k in env}}


def endpoint(config: dict[str, str]) -> tuple[str, str]:
    """The endpoint the client of ``config`` (:func:`settings`) uses, and where that came from."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if config.get(var):
            return config[var], config.get(f"from:{var}", var)
    return (
        f"https://s3.{_region(config)}.amazonaws.com",
        "the default: AWS S3, as no endpoint is set",
    )


def _region(config: dict[str, str]) -> str:
    """The region of the client of ``config`` (:func:`settings`)."""
    return config.get("AWS_REGION") or config.get("AWS_DEFAULT_REGION") or "us-east-1"


def client_module(name: str, scheme: str, what: str) -> Any:
    """Module ``name``, the client of ``scheme`` caches (``what``: as messages name it), imported on
    first use: an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(
            f"{scheme}:// caches need {what}: install te_thd's {scheme} extra from its checkout, "
            f"`pip install -e '.[{scheme}]'`"
        ) from None


def _obstore() -> Any:
    return client_module("obstore", "s3", "the object-store client obstore")


def client(bucket: str, env: dict[str, str]) -> Any:
    """This process's ``obstore`` store for ``bucket``, configured by ``env`` (:func:`settings`),
    made on first use."""
    key = (os.getpid(), bucket, tuple(sorted(env.items())))
    store = _CLIENTS.get(key)
    if store is None:
        if any(pid != key[0] for pid, *_ in _CLIENTS):
            raise RuntimeError(
                "this process was forked from one that had used the object-store client, whose "
                "runtime does not survive fork: start DataLoader workers with "
                "multiprocessing_context='forkserver' or 'spawn' (build_cached_dataloader does "
                "this for s3:// caches)"
            )
        _obstore()
        from obstore.store import S3Store

        kwargs: dict[str, Any] = {
            "region": _region(env),
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
        # the bookkeeping is this process's (the directory stays its maker's: no finalizer)
        return {**self.__dict__, "_present": {}, "_absent": {}, "_lru": OrderedDict()}

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
        # the chunks of some range (+1 where a range starts, -1 past its end) that are absent,
        # as runs [a, b) of consecutive chunks
        edges = np.zeros(len(bits) + 1, np.int64)
        np.add.at(edges, first, 1)
        np.add.at(edges, last, -1)
        missing = (np.cumsum(edges[:-1]) > 0) & (np.frombuffer(bytes(bits), np.uint8) == 0)
        runs = np.flatnonzero(np.diff(missing, prepend=False, append=False)).reshape(-1, 2).tolist()
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
        # counted once, then kept up to date
        held = sum(b.count(1) for b in self._present.values()) * CHUNK_BYTES
        for name in list(self._lru):
            if held <= self.max_bytes:
                break
            if name != keep:
                held -= self._present[name].count(1) * CHUNK_BYTES if name in self._present else 0
                self.invalidate(name)
                self._lru.pop(name, None)
