"""The msc:// storage of a cache (:class:`MSCPrefix`, made by ``schemes.open_storage``):
``msc://profile/path`` through NVIDIA's multi-storage-client (MSC), the way Megatron-LM
addresses object storage behind ``--enable-msc``.

- **the profile** is MSC's own: defined in the file ``MSC_CONFIG`` names, else in MSC's
  default config file (``~/.msc_config.yaml``, ``~/.config/msc/config.yaml``,
  ``/etc/msc_config.yaml``,
  ...). Its provider (s3, gcs, azure, oci, ais, ...), credentials, endpoint and retries are MSC's;
  ``path`` is relative to the profile's ``base_path``. The process that opens the cache finds the
  file as MSC does; each process (every rank, every DataLoader worker) makes its own client from
  that file, whatever its own environment says.
- **everything but the client calls** is :class:`~te_thd.offline_cache.storage.s3.S3Prefix`'s:
  the object operations, the staged upload (a shard goes up whole, with MSC's multipart upload
  when large), the read-through copy, the producer lock's record and its takeover, the objects set
  aside. Here each client call (``_get``, ``_put`` and the rest) goes through MSC's
  ``StorageClient``, and what every request would meet (a profile MSC does not know, no answer,
  no such bucket, access denied) becomes one :class:`StorageError` line.
- **the producer lock** is created with a conditional write (``If-None-Match: *``) where the
  profile's provider sends one (:data:`CONDITIONAL`): atomic in the store. With any other provider
  it is created when a read finds none, which refuses a producer started while another runs but not
  two started at the same moment: docs/object-storage.md says what the user must guarantee.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from te_thd.offline_cache.storage import base as storage
from te_thd.offline_cache.storage.s3 import S3Prefix, client_module

#: the MSC providers (classes, and those derived from them) that send ``If-None-Match: *`` on a
#: write
CONDITIONAL = ("S3StorageProvider", "OracleStorageProvider")
#: ranged reads of one batch in flight at once (MSC issues one request per range)
RANGE_THREADS = 8
_CLIENTS: dict[tuple[int, str, str | None], tuple[Any, Any]] = {}
#: what MSC (and the client below it) says of a request no server answered
_NO_ANSWER = re.compile(
    r"Could not connect|EndpointConnectionError|ConnectTimeout|Connection refused|timed out|"
    r"network timeout"
)


def _msc() -> Any:
    return client_module("multistorageclient", "msc", "NVIDIA's multi-storage-client")


# found again only when a logger was added (``count``: how many there are)
@functools.lru_cache(maxsize=1)
def _msc_loggers(count: int) -> tuple[logging.Logger, ...]:
    """MSC's loggers (``multistorageclient`` and those below it)."""
    return tuple(
        logger
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if (name == "multistorageclient" or name.startswith("multistorageclient."))
        and isinstance(logger, logging.Logger)
    )


@contextlib.contextmanager
def _msc_logs_held() -> Iterator[list[logging.LogRecord]]:
    """MSC's own log records, held while one of our calls runs and let through after it: the caller
    empties the list it is given when its one line says what they would (MSC logs an error before
    raising it). Only MSC's loggers are touched, and only for the call."""
    records: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:  # a logging filter: kept here, not let through
        records.append(record)
        return False

    loggers = _msc_loggers(len(logging.Logger.manager.loggerDict))
    for logger in loggers:
        logger.addFilter(hold)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
        for record in records:
            logging.getLogger(record.name).handle(record)


class MSCPrefix(S3Prefix):
    """The cache at ``msc://profile/prefix`` (``prefix`` without leading or trailing slashes,
    relative to the profile's ``base_path``). ``read_cache``: ``read_cache_dir`` /
    ``read_cache_bytes``, as :class:`S3Prefix`'s."""

    def __init__(self, scheme: str, profile: str, prefix: str, **read_cache: Any) -> None:
        super().__init__(scheme, profile, prefix, **read_cache)
        self.profile = profile
        self.config = {}  # the client's settings are MSC's own, read from the file below
        # The file MSC finds here (MSC_CONFIG, else its default files), found once: a DataLoader
        # worker started from a forkserver has the forkserver's environment, not this process's.
        try:
            self.config_file: str | None = _msc().StorageClientConfig.read_msc_config()[1]
        except Exception:  # noqa: BLE001 - a malformed file: the client's own error names it on first use
            self.config_file = None

    def client(self) -> tuple[Any, Any]:
        """This process's MSC ``StorageClient`` of the profile and its storage provider, made on
        first use."""
        key = (os.getpid(), self.profile, self.config_file)
        if key not in _CLIENTS:
            msc = _msc()
            paths = [self.config_file] if self.config_file else None
            with _msc_logs_held() as held:
                try:
                    conf = msc.StorageClientConfig.from_file(
                        config_file_paths=paths, profile=self.profile
                    )
                    _CLIENTS[key] = msc.StorageClient(conf), conf.storage_provider
                except Exception as exc:  # MSC reports every configuration problem as its own error
                    held.clear()
                    raise storage.StorageError(f"{self.name}: {self.profile_problem(exc)}") from exc
        return _CLIENTS[key]

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """As :meth:`S3Prefix.calls`; what MSC logs of an error that becomes our one line is not
        shown."""
        with _msc_logs_held() as held:
            try:
                with super().calls():
                    yield
            except storage.StorageError:
                held.clear()
                raise

    def profile_problem(self, exc: BaseException) -> str:
        """What is wrong with the profile, for a client MSC could not make from it."""
        named = os.environ.get("MSC_CONFIG")
        if re.search(r"Profile .* not found in configuration", str(exc)):
            if named and not os.path.isfile(named):
                return (
                    f"MSC_CONFIG={named} names no file; point MSC_CONFIG at the MSC config file "
                    f"that defines profile {self.profile!r}"
                )
            return (
                f"MSC profile {self.profile!r} is not defined {self.where()}; add it under "
                "`profiles:` there, or set MSC_CONFIG to the MSC config file that defines it"
            )
        return (
            f"MSC cannot make a client of profile {self.profile!r} {self.where()}: "
            f"{str(exc).splitlines()[0]}; fix the profile"
        )

    def where(self) -> str:
        """Where the profile is defined, and its provider's endpoint and base path, as messages say
        it."""
        try:
            conf, path = _msc().StorageClientConfig.read_msc_config(
                [self.config_file] if self.config_file else None
            )
        except Exception:  # noqa: BLE001 - a malformed file: the caller's message names MSC's own error
            return "in the MSC config file"
        if path is None:
            return (
                "in any MSC config file (MSC_CONFIG is not set, and none of MSC's default "
                "files such as ~/.msc_config.yaml exists)"
            )
        provider = ((conf or {}).get("profiles", {}).get(self.profile) or {}).get(
            "storage_provider"
        ) or {}
        opts = provider.get("options") or {}
        shown = ", ".join(f"{k} {opts[k]}" for k in ("endpoint_url", "base_path") if opts.get(k))
        return f"in {path}" + (f" (type {provider.get('type')}, {shown})" if provider else "")

    def store_error(self, exc: BaseException) -> storage.StorageError | None:
        """The one line for an MSC error that every request would meet; None for one about one
        object."""
        # MSC raises its own errors from the client's (a missing bucket's GET: a FileNotFoundError
        # from NoSuchBucket)
        text = " ".join(
            f"{type(e).__name__}: {e}"
            for e in (exc, exc.__cause__, exc.__context__)
            if e is not None
        )
        if "NoSuchBucket" in text:
            why = (
                "the profile's bucket does not exist {}; te_thd never creates buckets: create it "
                "first, or check the profile's base_path and endpoint_url"
            )
        elif isinstance(exc, PermissionError) or re.search(
            r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch", text
        ):
            why = (
                "access denied {}; check the profile's credentials_provider, and that its keys "
                "may read and write the profile's base_path"
            )
        elif _NO_ANSWER.search(text):
            why = (
                "no answer from the object store {}; check that the server runs and the "
                "profile's endpoint_url"
            )
        else:
            return None
        return storage.StorageError(
            f"{self.name}: " + why.format(f"(MSC profile {self.profile!r} {self.where()})")
        )

    def _list(self, prefix: str) -> list[tuple[str, int]]:
        """One level (the objects set aside below it are not listed)."""
        metas = self.client()[0].list(prefix, include_directories=True)
        return [(m.key, int(m.content_length)) for m in metas if m.type == "file"]

    def _get(self, key: str) -> bytes:
        return bytes(self.client()[0].read(key))

    def _get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Read concurrently (MSC reads one range a request)."""
        cli, rng = self.client()[0], _msc().types.Range

        def read(r: tuple[int, int]) -> bytes:
            return bytes(cli.read(key, byte_range=rng(r[0], r[1] - r[0])))

        with ThreadPoolExecutor(min(RANGE_THREADS, len(ranges))) as pool:
            return list(pool.map(read, ranges))

    def _put(self, key: str, data: bytes, create: bool) -> bool:
        """``create`` as the module docstring says."""
        cli, provider = self.client()
        if not create:
            cli.write(key, data)
            return True
        with contextlib.suppress(FileNotFoundError):
            cli.read(key)
            return False  # there is one
        conditional = any(c.__name__ in CONDITIONAL for c in type(provider).__mro__)
        try:
            provider.put_object(key, data, if_none_match="*" if conditional else None)
        except _msc().types.PreconditionFailedError:
            return False
        return True

    def _delete(self, key: str) -> None:
        self.client()[0].delete(key)

    def _upload(self, key: str, path: str) -> None:
        self.client()[0].upload_file(key, path)

    def _copy_object(self, key: str, to: str) -> None:
        self.client()[0].copy(key, to)
