"""The producer lock of a cache in an object store: ``.te_thd-producer.lock`` created with
``If-None-Match: *`` (atomic in the store), recording its holder (host, pid, start time). A
holder killed with SIGKILL cannot delete it: a producer on the same host that finds its pid gone
takes it over; across hosts a dead holder looks like a slow one, so the second producer is
refused, naming ``te-thd cache unlock URL``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from te_thd.offline_cache.format.schema import CacheLockError, cache_command
from te_thd.offline_cache.storage.base import LOCK_NAME, Storage


def holder_text(holder: dict[str, Any]) -> str:
    """A :meth:`Storage.lock_holder` record as messages name it: ``host 'h', pid 7, since ...
    UTC``."""
    since = holder.get("since")
    when = time.strftime(", since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if since else ""
    if "host" not in holder:
        return "no holder"
    return f"host {holder['host']!r}, pid {holder.get('pid')}{when}"


class ObjectLock:
    """Take (:meth:`acquire`) and release the producer lock of the cache ``store``."""

    def __init__(self, store: Storage) -> None:
        self.store, self.held = store, False

    def acquire(self) -> ObjectLock:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": int(time.time())}
        data = json.dumps(me, sort_keys=True).encode()
        url = self.store.display(LOCK_NAME)
        # a missing bucket is named as such before the PUT (stores create it, or deny it)
        self.store.list()
        for _ in range(2):
            if self.store.put(LOCK_NAME, data, create=True):
                self.held = True
                return self
            holder = self.store.lock_holder()
            if holder is None:
                continue  # released in between: try again
            if holder["alive"] is False:
                self.store.delete(LOCK_NAME)  # its holder died on this host
                continue
            raise CacheLockError(
                f"another producer holds {url} ({holder_text(holder)}). Wait for it to finish; if "
                "no producer is running (one was killed on another host), run "
                f"{cache_command('unlock', self.store.name)} and start again."
            )
        raise CacheLockError(f"could not take {url}: it changed hands twice; run again")

    def release(self) -> None:
        if self.held:
            self.held = False
            self.store.delete(LOCK_NAME)
