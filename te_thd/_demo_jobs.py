"""The demo's torchrun jobs: started so that none outlives the demo, stopped as a whole.

A job runs in a process group of its own, so a Ctrl-C at the terminal reaches the demo
alone and the demo stops each job once. It asks the kernel for SIGTERM when the demo dies
(``PR_SET_PDEATHSIG``, on Linux), so even a demo killed with SIGKILL leaves no job behind:
torchrun stops its ranks on SIGTERM. torchrun starts every rank in a session of its own;
:func:`stop` therefore signals the ranks themselves too, and the example scripts ask for
SIGTERM when their launcher dies (``examples/ep_cp/errors.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

#: Linux prctl option: the signal a process gets when its parent exits
_PR_SET_PDEATHSIG = 1
#: how long stopped ranks get to remove their temporary files before SIGKILL (seconds)
STOP_GRACE_S = 15.0


class Stopped(Exception):
    """The demo got SIGTERM or SIGINT (``signum``); its jobs are to be stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


def _own_group_dying_with(parent: int, prctl: Callable[..., int] | None) -> Callable[[], None]:
    """The ``preexec_fn`` of a job: a process group of its own, SIGTERM when ``parent`` exits.

    ``prctl`` is looked up before the fork: the child only calls it.
    """

    def preexec() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the demo died before the request took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def start(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen)`` in its own process group, sent SIGTERM if the demo
    dies."""
    return subprocess.Popen(cmd, preexec_fn=_own_group_dying_with(os.getpid(), _prctl()), **popen)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (``/proc``; empty where there is none), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces and parentheses: the ppid follows its last
            # ")"
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we read
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found: list[int] = []
    pending = list(children.get(pid, []))
    while pending:
        p = pending.pop(0)
        found.append(p)
        pending.extend(children.get(p, []))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop(jobs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Stop every job that still runs and everything it started; return once all are gone.

    The launcher is killed first (SIGKILL: torchrun's own shutdown prints a traceback), then
    its ranks get SIGTERM, which lets them remove their temporary files; what still runs
    after ``grace_s`` seconds is killed. Without ``/proc`` (not Linux) the launcher gets
    SIGTERM and stops its ranks itself.
    """
    running = [j for j in jobs if j.poll() is None]
    if not Path("/proc/self/stat").exists():  # no process table to walk: torchrun stops its ranks
        for j in running:
            j.terminate()
        for j in running:
            j.wait()
        return
    below = [p for j in running for p in descendants(j.pid)]
    for j in running:
        j.kill()
    for p in below:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for j in running:
        j.wait()
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in below:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def raise_stopped(signum: int, frame: FrameType | None) -> None:
    """Signal handler: turn SIGTERM or SIGINT into :class:`Stopped` in the main thread."""
    raise Stopped(signum)


def handle_stop_signals() -> dict[int, Any]:
    """Make SIGTERM and SIGINT raise :class:`Stopped`; the handlers they had, to restore."""
    return {s: signal.signal(s, raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}


def ignore_stop_signals() -> None:
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def restore_signals(saved: dict[int, Any]) -> None:
    for s, handler in saved.items():
        signal.signal(s, handler)


@contextlib.contextmanager
def stopping(jobs: list[subprocess.Popen]) -> Iterator[None]:
    """SIGTERM or SIGINT inside the block stops ``jobs`` (the list as it is then) and all they
    started, then raises :class:`Stopped`; a second signal meanwhile does not cut that short."""
    saved = handle_stop_signals()
    try:
        yield
    except Stopped:
        ignore_stop_signals()
        stop(jobs)
        raise
    finally:
        restore_signals(saved)


def stopped_line(
    signum: int, command: str = "te-thd demo", jobs: str = "its producer and trainer jobs"
) -> str:
    """What ``command`` says when a signal stopped it (its ``jobs`` are stopped by then)."""
    return f"{command}: stopped by {signal.Signals(signum).name}; {jobs} were stopped too"


def killed_line(name: str, signum: int, log: Path | None, resume: str, rank: bool = False) -> str:
    """``name: killed by signal N (log: ...); <resume>`` for a job (or, ``rank``, one of its ranks)
    that signal ``signum`` ended."""
    where = f" (log: {log})" if log is not None else ""
    return f"{name}: {'a rank was ' if rank else ''}killed by signal {signum}{where}; {resume}"


#: torchrun's report on a rank that a signal ended (``traceback : Signal 9 (SIGKILL) received by
#: PID 7``)
RANK_SIGNAL = re.compile(r"traceback\s*: Signal (\d+) \(\w+\) received by PID \d+")


def rank_signal(log_lines: list[str]) -> int | None:
    """The signal that ended the first failed rank, read from torchrun's report in its log; None
    when that rank exited on its own (or there is no report)."""
    text = "\n".join(log_lines)
    root = (
        text.rpartition("Root Cause (first observed failure):")[2] if "Root Cause" in text else ""
    )
    m = RANK_SIGNAL.search(root)
    return int(m.group(1)) if m else None
