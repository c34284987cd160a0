"""The producer lock of an s3:// cache: an object created with a conditional PUT.

``.te_thd-producer.lock`` under the cache's prefix is created with ``If-None-Match: *``
(obstore's ``mode="create"``), which an S3-compatible store performs atomically: of two
producers only one creates it. It records the holder (host, pid, start time) and is
deleted when the holder ends. A holder killed with SIGKILL cannot delete it: a producer
on the same host that finds its pid gone takes the lock over; across hosts nothing can
tell a dead holder from a slow one, so the second producer is refused, and the message
names ``te-thd cache unlock URL`` for the user who knows no producer runs. What users must
guarantee: at most one producer per prefix, and unlock only when none runs.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from te_thd.offline_cache import objectstore
from te_thd.offline_cache.durable import LOCK_NAME
from te_thd.offline_cache.errors import CacheLockError
from te_thd.offline_cache.location import ObjectLocation


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(loc: ObjectLocation) -> dict[str, Any] | None:
    """The lock object's holder record, or None when nobody holds the lock."""
    raw = objectstore.get(loc, LOCK_NAME)
    if raw is None:
        return None
    try:
        holder = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class ObjectLock:
    """Take (:meth:`acquire`) and release the producer lock of the cache at ``loc``."""

    def __init__(self, loc: ObjectLocation) -> None:
        self.loc = loc
        self.held = False

    def acquire(self) -> ObjectLock:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": int(time.time())}
        data = json.dumps(me, sort_keys=True).encode()
        for _ in range(2):
            if objectstore.put_bytes(self.loc, LOCK_NAME, data, create=True):
                self.held = True
                return self
            holder = read_holder(self.loc)
            if holder is None:
                continue  # released in between: try again
            if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                objectstore.delete(self.loc, LOCK_NAME)  # its holder died on this host
                continue
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(holder.get("since", 0)))
            raise CacheLockError(
                f"another producer holds {self.loc.url}/{LOCK_NAME} (host {holder.get('host')!r}, pid "
                f"{holder.get('pid')}, since {since} UTC). Wait for it to finish; if no producer is running "
                f"(one was killed on another host), run `te-thd cache unlock {self.loc.url}` and start again."
            )
        raise CacheLockError(f"could not take {self.loc.url}/{LOCK_NAME}: it changed hands twice; run again")

    def release(self) -> None:
        if self.held:
            self.held = False
            objectstore.delete(self.loc, LOCK_NAME)

    def __enter__(self) -> ObjectLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
