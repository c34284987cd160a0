"""Follow a cache while its producer still writes it (``CachedTensorDataset(follow=True)``).

Before the manifest exists, a reader learns the cache from the producer's **follow record**,
``.te_thd-follow.json`` (:data:`FOLLOW_NAME`), which ``produce_cache`` writes before its first
shard and deletes once ``manifest.json`` is committed: ``run``, the run's parameters (the record
every shard of the run carries in its header, so a shard of another run is refused), and
``producer_command``, the command that resumes the producer, named in every hint.

A read of a shard not committed yet waits for it (:meth:`Follower.wait`): one listing per poll
(which also tells every other shard committed so far), polls spaced :data:`POLL_FIRST_S` doubling
to :data:`POLL_MAX_S`; after :attr:`Follower.timeout` seconds, :class:`FollowTimeoutError` names
the shard and the command that resumes the producer. Each new shard is checked as any shard is,
and against the run record. Once the manifest appears the reader switches to it
(:meth:`Follower.finished`), refusing one whose parameters differ from the record. Each process
follows on its own; what it reads is fixed by the record, never by when a shard arrived.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from te_thd.offline_cache.format.integrity import ShardHeader, shard_checksum
from te_thd.offline_cache.format.schema import (
    FOLLOW_NAME,
    MANIFEST_NAME,
    SHARD_RE,
    CacheError,
    CacheIntegrityError,
    ManifestNotFoundError,
    TensorSpec,
    recorded_command,
    schema_to_json,
    shard_name,
)
from te_thd.offline_cache.read.planner import OpenShard
from te_thd.offline_cache.record.files import check_cache_files
from te_thd.offline_cache.record.manifest import (
    check_manifest,
    manifest_schema,
    shard_records,
)
from te_thd.offline_cache.record.run import (
    build_manifest,
    describe_diff,
    params_of_manifest,
    split_record,
)
from te_thd.offline_cache.storage.base import Storage

__all__ = [
    "FOLLOW_NAME",
    "DEFAULT_FOLLOW_TIMEOUT",
    "FollowTimeoutError",
    "Follower",
    "open_followed",
]

#: seconds a followed read waits for a shard before :class:`FollowTimeoutError`
DEFAULT_FOLLOW_TIMEOUT = 600.0
#: the first and the longest pause between two polls (seconds): a few requests per second at most
POLL_FIRST_S, POLL_MAX_S = 0.25, 1.0


class FollowTimeoutError(CacheError):
    """A followed read waited ``follow_timeout`` seconds for a shard its producer did not commit."""


def _pauses() -> Iterator[float]:
    pause = POLL_FIRST_S
    while True:
        yield pause
        pause = min(2 * pause, POLL_MAX_S)


def _check_timeout(follow_timeout: Any) -> float:
    if (
        isinstance(follow_timeout, bool)
        or not isinstance(follow_timeout, int | float)
        or not follow_timeout > 0
    ):
        raise ValueError(
            f"follow_timeout={follow_timeout!r}: it must be a number of seconds > 0 (how "
            "long a read waits "
            "for a shard the producer has not committed yet); pass e.g. "
            f"follow_timeout={DEFAULT_FOLLOW_TIMEOUT}"
        )
    return float(follow_timeout)


def record_view(run: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest a finished run will write, as far as the record knows it (no schema, no shards):
    what readers and the options checks (``ensure_supervision_options_match``) read."""
    params, rule = split_record(run)
    return {
        "format_version": params["format_version"],
        **build_manifest(params, params.get("options") or {}, rule),
    }


def open_followed(
    storage: Storage,
    cache_dir: str,
    cache_name: str,
    format_version: int,
    producer: str | None,
    follow_timeout: float = DEFAULT_FOLLOW_TIMEOUT,
) -> tuple[dict[str, Any], dict[str, Any] | None, str | None, bytes | None]:
    """``(manifest, None, producer, manifest bytes)`` of a finished cache, else ``(record_view,
    run, command, None)`` of the running producer's record (``command``: ``producer``, else the
    one the producer recorded). The bytes let the caller prepare reads without a second GET.

    Neither there yet (the producer has not started): waits up to ``follow_timeout`` seconds for
    one. Raises :class:`FollowTimeoutError`, or ``ManifestError`` for a record of another
    ``format_version``."""
    timeout = _check_timeout(follow_timeout)
    try:  # a local path that is a file holds no cache, now or later
        storage.must_exist(MANIFEST_NAME)
    except ManifestNotFoundError:
        pass  # not there yet: the producer makes it
    deadline = time.monotonic() + timeout
    for pause in _pauses():
        if (raw := storage.get(MANIFEST_NAME)) is not None:
            return (
                check_manifest(storage, raw, cache_name, format_version, producer),
                None,
                producer,
                raw,
            )
        raw = storage.get(FOLLOW_NAME)
        if raw is not None:
            return (*_parse(raw, storage, cache_name, format_version, producer), None)
        if time.monotonic() >= deadline:
            raise FollowTimeoutError(
                f"waited {timeout:g} s (follow_timeout) for the {cache_name} cache at "
                f"{cache_dir}: it has no "
                f"manifest.json and no producer records following it ({FOLLOW_NAME}); "
                "start its producer, or pass "
                "the cache_dir it writes"
            )
        time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


def _parse(
    raw: bytes, storage: Storage, cache_name: str, format_version: int, producer: str | None
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    where = storage.display(FOLLOW_NAME)
    try:
        record = json.loads(raw.decode())
        run = record["run"]
        view = record_view(run)
        command = record.get("producer_command")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CacheError(
            f"cannot read the follow record {where} ({type(exc).__name__}: {exc}); open "
            "the cache with "
            "follow=False once its producer has finished"
        ) from None
    if view["format_version"] != format_version:
        raise CacheError(
            f"{cache_name} cache being produced at {storage.name} has "
            f"format_version={view['format_version']!r} "
            f"({where}), expected {format_version}: its tensors mean something else; "
            "follow a cache built for "
            f"format_version {format_version}"
        )
    return view, dict(run), producer or recorded_command(command)


class Follower:
    """One reader's view of a cache whose producer still runs: which shards it has seen committed,
    how to wait for the others, and when to switch to the manifest. Picklable (DataLoader workers
    follow on their own)."""

    def __init__(
        self,
        storage: Storage,
        cache_dir: str,
        cache_name: str,
        run: Mapping[str, Any],
        timeout: float,
        command: str,
    ) -> None:
        self.storage, self.cache_dir, self.cache_name = storage, cache_dir, cache_name
        self.run, self.timeout, self.command = dict(run), _check_timeout(timeout), command
        self.committed: set[int] = set()

    def wait(self, shard: int) -> None:
        """Return once shard ``shard`` is committed (and readable through the storage), or raise
        :class:`FollowTimeoutError` after :attr:`timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        for pause in _pauses():
            if shard not in self.committed:
                # one listing tells every shard committed so far: later ones cost no request
                self._admit_committed()
            if shard in self.committed:
                return
            if time.monotonic() >= deadline:
                raise FollowTimeoutError(
                    f"waited {self.timeout:g} s (follow_timeout) for "
                    f"{self.storage.display(shard_name(shard))}, which "
                    f"the producer of the {self.cache_name} cache has not committed: it "
                    "stopped or runs slower than "
                    f"that. Resume it with {self.command} (it keeps the committed "
                    "shards), then restart training: "
                    "from its last checkpoint if it saved one, else from the start"
                )
            time.sleep(pause)

    def has(self, shards: Iterable[int]) -> bool:
        """Whether every shard of ``shards`` is committed (one listing when one was not yet); never
        waits."""
        missing = set(shards) - self.committed
        if missing:
            self._admit_committed()
        return missing <= self.committed

    def _admit_committed(self) -> None:
        """List the cache and make every shard committed since the last listing readable through the
        storage."""
        for obj, size in self.storage.list().items():
            m = SHARD_RE.match(obj)
            if m is not None and int(m.group(1)) not in self.committed:
                self.storage.admit(obj, size)
                self.committed.add(int(m.group(1)))

    def check_shard(self, path: str, header: ShardHeader) -> None:
        """Refuse a shard that another producer run wrote (its header's run record is not the
        followed one): a :class:`CacheError`, not damage, so nothing is fetched again or
        repaired."""
        theirs = header.sums.run if header.sums is not None else None
        if theirs is not None and theirs != self.run:
            raise CacheError(
                f"shard {path} was written by a producer run with other arguments than "
                "the one this reader "
                f"follows ({describe_diff(self.run, theirs)}): {self._changed}"
            )

    @property
    def _changed(self) -> str:
        """What a reader whose cache was rebuilt under it says: the data it trained on is gone."""
        return (
            f"the {self.cache_name} cache changed under this reader (another producer run "
            "now writes it), so "
            "training stops; train again on it from the start once that run has finished"
        )

    def check_keys(self, disk_keys: Sequence[str]) -> None:
        """Refuse ``disk_keys`` the followed producer does not store (``ValueError`` naming
        them)."""
        stored = list(self.run.get("keys") or ())
        unknown = [k for k in disk_keys if k not in stored]
        if unknown:
            raise ValueError(
                f"disk_keys {unknown} are not in the {self.cache_name} cache being "
                f"produced at {self.cache_dir} "
                f"(its producer stores {stored}, {self.storage.display(FOLLOW_NAME)}); "
                "pass keys the producer writes"
            )

    def finished(
        self,
        versions: tuple[int, str | None],
        opened: Sequence[tuple[int, OpenShard]],
        seen: Mapping[str, TensorSpec] | None,
        repair: str,
    ) -> tuple[dict[str, Any], dict[int, str]] | None:
        """The manifest and its shard checksums once the producer has committed it (else None),
        checked: it records the run followed (``versions``: the reader's format version and producer
        command), all its shards are there, and it records the shards this process opened while
        following (``opened``) and their schema (``seen``)."""
        if (raw := self.storage.get(MANIFEST_NAME)) is None:
            return None
        # the reader stops listing: the shards committed since its last listing
        self._admit_committed()
        manifest = check_manifest(self.storage, raw, self.cache_name, *versions)
        recorded = params_of_manifest(manifest, self.run.get("keys", ()))
        followed, _ = split_record(self.run)
        if recorded != followed:
            raise CacheError(
                f"{self.storage.display(MANIFEST_NAME)} was written by a producer run "
                "with other arguments than "
                f"the one this reader followed ({describe_diff(followed, recorded)}): "
                f"{self._changed}"
            )
        check_cache_files(self.storage, manifest, self.cache_name, versions[1])
        checksums = {i: str(r["checksum"]) for i, r in enumerate(shard_records(manifest) or [])}
        schema = manifest_schema(manifest)
        if (
            schema is not None
            and seen is not None
            and any(schema.get(k) != spec for k, spec in seen.items())
        ):
            raise CacheIntegrityError(
                f"the manifest of {self.cache_dir} records the schema "
                f"{schema_to_json(schema)}, the shards read while "
                f"its producer ran showed {schema_to_json(dict(seen))}. {repair}"
            )
        for i, f in opened:
            actual = shard_checksum(f.header.sums.digest) if f.header.sums is not None else None
            if actual != checksums.get(i):
                raise CacheIntegrityError(
                    f"shard {f.name} was replaced after this reader read it (its header "
                    f"digest is {actual}, the "
                    f"manifest records {checksums.get(i)}). {repair}",
                    path=f.name,
                )
        return manifest, checksums
