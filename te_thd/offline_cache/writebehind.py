"""One background thread that runs a producer's file writes in order, behind its computation.

:class:`WriteBehind` is the only write-behind mechanism of the cache: callers hand it
work one way, :meth:`WriteBehind.submit` (a callable, the bytes of memory it holds
until it ran, and what to do instead if an earlier job failed). Jobs run one at a
time, in submission order, on a thread named ``te_thd-write-behind``. The queue is
bounded by memory: ``submit`` blocks while the jobs not yet done hold more than
``max_pending_bytes`` (a single job larger than that runs alone), so a producer
never holds more than a few shards' worth of computed tensors.

The first error a job raises is kept; every later job is dropped (its ``on_drop``
runs instead) and the error is raised by the next ``submit``, :meth:`flush` or
:meth:`close`. The thread is a daemon, holds no reference to its owner, and ends
when :meth:`close` is called or when the owner is garbage-collected, so it never
keeps a process alive. Its scheduling is left as the process has it.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple


class _Job(NamedTuple):
    run: Callable[[], None]
    on_drop: Callable[[], None] | None  # runs instead of ``run`` once an earlier job failed
    nbytes: int  # memory the job holds until it is done


class _State:
    """What the thread and its owner share; the thread holds only this, never the owner."""

    def __init__(self, max_pending_bytes: int | None) -> None:
        self.cond = threading.Condition()
        self.jobs: collections.deque[_Job | None] = collections.deque()
        self.pending_bytes = 0  # held by jobs submitted and not yet done
        self.unfinished = 0  # jobs submitted and not yet done
        self.max_pending_bytes = max_pending_bytes
        self.error: BaseException | None = None


def _run(state: _State) -> None:
    cond = state.cond
    while True:
        with cond:
            while not state.jobs:
                cond.wait()
            job = state.jobs.popleft()
        if job is None:
            return
        try:
            if state.error is None:
                job.run()
            elif job.on_drop is not None:
                job.on_drop()
        except BaseException as exc:  # surfaced by the owner's next call
            if state.error is None:
                state.error = exc
            # a failing clean-up of a dropped job must not end the thread: flush() would wait forever
        finally:
            nbytes = job.nbytes
            job = None  # what a finished job held (a batch's tensors) is freed before the next one
            with cond:
                state.pending_bytes -= nbytes
                state.unfinished -= 1
                cond.notify_all()


def _stop(state: _State) -> None:
    with state.cond:
        state.jobs.append(None)
        state.cond.notify_all()


class WriteBehind:
    """Run submitted jobs in order on one owned background thread (see the module docstring).

    ``max_pending_bytes``: the memory jobs not yet done may hold before ``submit``
    waits (``None``: unbounded; it may be raised later through the attribute).
    """

    def __init__(self, max_pending_bytes: int | None = None) -> None:
        self._state = _State(max_pending_bytes)
        self._thread = threading.Thread(target=_run, args=(self._state,), name="te_thd-write-behind", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._state)

    @property
    def max_pending_bytes(self) -> int | None:
        return self._state.max_pending_bytes

    @max_pending_bytes.setter
    def max_pending_bytes(self, value: int | None) -> None:
        with self._state.cond:
            self._state.max_pending_bytes = value
            self._state.cond.notify_all()

    @property
    def running(self) -> bool:
        """Whether the thread still runs (:meth:`close` not called, or interrupted)."""
        return self._thread.is_alive()

    def raise_error(self) -> None:
        """Raise the first error a job raised, if any (then every later call raises it too)."""
        if self._state.error is not None:
            raise self._state.error

    def submit(self, run: Callable[[], None], nbytes: int = 0, on_drop: Callable[[], None] | None = None) -> None:
        """Queue ``run()``, which holds ``nbytes`` of memory until it is done.

        Whatever ``run`` reads must not change until then. ``on_drop()`` runs instead
        when an earlier job failed (e.g. to remove a temp file ``run`` would have
        finished). Blocks while the budget is full; raises an earlier job's error.
        """
        state = self._state
        self.raise_error()
        if not self._thread.is_alive():
            raise RuntimeError("this write-behind writer is closed; create a new one")
        with state.cond:
            while (
                state.error is None
                and state.max_pending_bytes is not None
                and state.pending_bytes > 0
                and state.pending_bytes + nbytes > state.max_pending_bytes
            ):
                state.cond.wait()
            self.raise_error()
            state.pending_bytes += nbytes
            state.unfinished += 1
            state.jobs.append(_Job(run, on_drop, nbytes))
            state.cond.notify_all()

    def _wait(self) -> None:
        state = self._state
        with state.cond:
            while state.unfinished and self._thread.is_alive():
                state.cond.wait()

    def flush(self) -> None:
        """Wait until every submitted job is done; raise the first error one raised."""
        self._wait()
        self.raise_error()

    def close(self) -> None:
        """Finish the queued jobs, stop the thread, raise a pending error."""
        if self._thread.is_alive():
            self._wait()
            self._finalizer()
            self._thread.join()
        self.raise_error()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
