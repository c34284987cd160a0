"""The object-store client of s3:// caches: obstore (Rust ``object_store``), configured like the AWS tools.

Why obstore: it issues ranged GETs concurrently and coalesces nearby ranges itself
(``get_ranges``), uploads large objects in parallel multipart parts, supports the
conditional PUT (``If-None-Match: *``) the producer lock needs, and releases the GIL
while it waits; boto3 would need a thread per request and s3fs an event loop of its
own. Measured against boto3 (``perf/bench_s3.py``, ``client_batch_ranges``):
docs/object-storage.md.

Configuration (read here, the names boto3, s3fs, obstore and MSC all honour):
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (an S3-compatible server; ``http://``
endpoints are allowed), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` (default
``us-east-1``), over the same settings of the profile ``AWS_PROFILE`` (default
``default``) in the shared files ``~/.aws/config`` (``region``, ``endpoint_url``) and
``~/.aws/credentials`` (``AWS_CONFIG_FILE`` / ``AWS_SHARED_CREDENTIALS_FILE`` move them).
Without keys anywhere obstore's own provider chain is used (instance or container
credentials). :func:`settings` reads them once; a reader keeps
them (so DataLoader workers, started by a forkserver with its own environment, use the
same), and each process makes its own client from them (DataLoader workers and torchrun
ranks each open their own connections).
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Sequence
from typing import Any

from te_thd.offline_cache.location import ObjectLocation

_CLIENTS: dict[tuple[int, str, tuple[tuple[str, str], ...]], Any] = {}
#: the environment variables a client is configured from
_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
         "AWS_REGION", "AWS_DEFAULT_REGION")  # fmt: skip


#: credential options of the shared files, by the environment variable each stands for
_CREDENTIALS = (("aws_access_key_id", "AWS_ACCESS_KEY_ID"), ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
                ("aws_session_token", "AWS_SESSION_TOKEN"))  # fmt: skip


def _profile() -> dict[str, str]:
    """The settings of the AWS profile (``AWS_PROFILE``, default ``default``) in the shared config
    and credentials files (``AWS_CONFIG_FILE`` / ``AWS_SHARED_CREDENTIALS_FILE``, default
    ``~/.aws/config`` and ``~/.aws/credentials``), under the environment variables' names."""
    name = os.environ.get("AWS_PROFILE") or "default"
    out: dict[str, str] = {}
    for file_var, default, section, options in (
        ("AWS_CONFIG_FILE", "~/.aws/config", name if name == "default" else f"profile {name}",
         (("region", "AWS_REGION"), ("endpoint_url", "AWS_ENDPOINT_URL"), *_CREDENTIALS)),
        ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials", name, _CREDENTIALS),
    ):  # fmt: skip
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(os.path.expanduser(os.environ.get(file_var, default)))
        if parser.has_section(section):
            for opt, var in options:
                if parser.get(section, opt, fallback=None):
                    out[var] = parser.get(section, opt)
    return out


def settings() -> dict[str, str]:
    """The object-store settings of this process: the AWS profile's (config and credentials files),
    overridden by the environment variables in the module docstring."""
    return {**_profile(), **{k: os.environ[k] for k in _VARS if os.environ.get(k)}}


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(
            "s3:// caches need the object-store client: install te_thd's s3 extra, "
            "`pip install 'te_thd[s3]'` (it adds obstore)"
        ) from None
    return obstore


def client(loc: ObjectLocation, config: dict[str, str] | None = None) -> Any:
    """This process's ``obstore`` store for ``loc``'s bucket, configured by ``config`` (default: this
    process's :func:`settings`), made on first use."""
    env = settings() if config is None else config
    key = (os.getpid(), loc.bucket, tuple(sorted(env.items())))
    store = _CLIENTS.get(key)
    if store is None:
        if any(pid != key[0] for pid, *_ in _CLIENTS):
            raise RuntimeError(
                "this process was forked from one that had used the object-store client, whose runtime does not "
                "survive fork: start DataLoader workers with multiprocessing_context='forkserver' or 'spawn' "
                "(build_cached_dataloader does this for s3:// caches)"
            )
        _obstore()
        from obstore.store import S3Store

        kwargs: dict[str, Any] = {"region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"}
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            kwargs["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                kwargs["client_options"] = {"allow_http": True}
        for opt, var in _CREDENTIALS:
            if env.get(var):
                kwargs[opt.removeprefix("aws_")] = env[var]
        store = _CLIENTS[key] = S3Store(loc.bucket, **kwargs)
    return store


def get(loc: ObjectLocation, name: str, config: dict[str, str] | None = None) -> bytes | None:
    """The whole object ``name`` of the cache, or None when there is none."""
    obstore = _obstore()
    try:
        return bytes(obstore.get(client(loc, config), loc.key(name)).bytes())
    except FileNotFoundError:
        return None


def get_ranges(
    loc: ObjectLocation, name: str, ranges: Sequence[tuple[int, int]], config: dict[str, str] | None = None
) -> list[bytes]:
    """Bytes ``[start, end)`` of object ``name`` for each range: one call, obstore coalesces and parallelises."""
    if not ranges:
        return []
    out = _obstore().get_ranges(client(loc, config), loc.key(name), starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
    return [bytes(b) for b in out]


def listing(loc: ObjectLocation, config: dict[str, str] | None = None) -> dict[str, int]:
    """``{file name: size}`` of the objects directly under the cache's prefix."""
    obstore = _obstore()
    prefix = loc.prefix + "/" if loc.prefix else None
    out: dict[str, int] = {}
    for batch in obstore.list(client(loc, config), prefix=prefix):
        for meta in batch:
            name = meta["path"][len(prefix or "") :]
            if "/" not in name:
                out[name] = int(meta["size"])
    return out


def get_file(loc: ObjectLocation, name: str, path: str) -> None:
    """Download object ``name`` to local file ``path`` (written to a temp name, then renamed)."""
    data = get(loc, name)
    if data is None:
        raise FileNotFoundError(f"{loc.url}/{name}")
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def put_file(loc: ObjectLocation, name: str, path: str) -> None:
    """Upload local file ``path`` as object ``name``: one PUT, or a multipart upload for a large file,
    visible only once complete (S3 semantics), so a killed upload leaves no object."""
    with open(path, "rb") as f:
        _obstore().put(client(loc), loc.key(name), f)


def put_bytes(loc: ObjectLocation, name: str, data: bytes, *, create: bool = False) -> bool:
    """Write object ``name``; ``create``: only if it does not exist (conditional PUT). False when it did."""
    obstore = _obstore()
    try:
        obstore.put(client(loc), loc.key(name), data, mode="create" if create else "overwrite")
    except FileExistsError:
        return False
    except Exception as exc:  # obstore raises its own AlreadyExistsError (a FileExistsError in recent versions)
        if type(exc).__name__ == "AlreadyExistsError":
            return False
        raise
    return True


def delete(loc: ObjectLocation, name: str) -> None:
    try:
        _obstore().delete(client(loc), loc.key(name))
    except FileNotFoundError:
        pass


def copy(loc: ObjectLocation, src: str, dst: str) -> None:
    _obstore().copy(client(loc), loc.key(src), loc.key(dst))
