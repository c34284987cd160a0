"""One clear message per user error in a multi-rank example: printed once, non-zero exit.

A wrong flag, a cache built for another CP size, a damaged cache: every rank of the
job meets the same mistake (or, for a flipped byte, the ranks that read it). Instead
of one traceback per rank, :func:`run_main` lets the first rank that meets a user
error print it (one line, ``error: ...``) and exit with status 1; every other rank
exits with status 1 quietly, also the ones whose collectives failed because a peer
left. The first rank is elected through the job's ``torch.distributed`` store; before
the process group exists (bad flags, seen alike by every rank) rank 0 prints.

User errors are the ``ValueError`` family (te_thd's cache errors included) and a
missing file; a :class:`UsageError` (flags that contradict what is on disk) exits with
status 2, as argparse does for a bad flag. Anything else keeps its traceback;
``TE_THD_TRACEBACK=1`` shows it for user errors too.

Every way out but SIGKILL runs the interpreter's exit handlers, so what they remove goes
(an s3:// cache's read-through copy in ``$TE_THD_TMPDIR``): the error exits above,
SIGTERM, which the launcher sends to the other ranks when one exits, and SIGHUP (a closed
terminal; not under ``nohup``, which ignores it). Under a launcher a
rank also asks the kernel for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``):
torchrun starts each rank in a session of its own, so a launcher killed with SIGKILL would
otherwise leave its ranks running.

After the one line, torchrun still prints its own report (``ChildFailedError``, about 30
lines naming each rank's exit status): its agent reports every rank that exits with a
status other than 0, and 0 would tell the shell and ``te-thd demo`` that the run
succeeded. The ``error:`` line is therefore the first line of the failure, and
``te-thd demo --follow`` shows only that line (the report stays in the job's log).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

import torch.distributed as dist

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


class UsageError(ValueError):
    """A command line that cannot run as given (exit status 2); its message names the fix."""

    exit_status = 2


_KEY = "te_thd/user_error"
#: How long a rank that met the error but does not report it waits before it exits. The
#: launcher stops the whole job as soon as one worker exits, so a quiet rank that left at
#: once could stop the reporting rank before its line is out; the reporter exits right
#: after printing, which ends the wait.
QUIET_RANK_GRACE_S = 30.0


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store reachable: fall back to rank 0
        return None


def _first_to_report() -> bool:
    store = _store()
    if store is not None:
        try:
            return store.add(_KEY, 1) == 1
        except Exception:  # noqa: BLE001 - the store's host is gone: fall back to rank 0
            pass
    return int(os.environ.get("RANK", "0")) == 0


def _another_rank_reported() -> bool:
    store = _store()
    if store is None:
        return False
    try:
        return store.add(_KEY, 0) > 0
    except Exception:  # noqa: BLE001
        return False


def user_message(exc: BaseException) -> str:
    """The error's own message; for an error re-raised from a DataLoader worker, without the worker's traceback."""
    text = str(exc)
    if "Original Traceback" in text:
        text = text.rsplit(f"{type(exc).__name__}: ", 1)[-1]
    return text.strip()


def _leave(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    # the exit handlers, not the rest of an interpreter exit: that would wait for threads
    # blocked on the peers (and tear the process group down), which may be gone
    atexit._run_exitfuncs()
    os._exit(status)


#: Linux prctl option: the signal this process gets when its parent exits
_PR_SET_PDEATHSIG = 1


def _stop_with_launcher() -> None:
    """Ask for SIGTERM when the parent (the launcher) exits; nothing where prctl is missing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() == 1:  # the launcher died before the request: it would never come
        os.kill(os.getpid(), signal.SIGTERM)


def _exit_on_signals() -> None:
    """SIGTERM and SIGHUP leave through :func:`_leave` (status 128 + the signal's number) in this
    process; a process forked from it (a DataLoader worker) gets the default action, since the
    exit handlers it inherited remove what belongs to this one. An ignored SIGHUP stays ignored."""
    owner = os.getpid()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _leave(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, on_signal)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """``main(argv)``, reporting a user error once across the job (see the module docstring)."""
    _exit_on_signals()
    if "LOCAL_RANK" in os.environ:
        _stop_with_launcher()
    try:
        return main(argv)
    except USER_ERRORS as exc:
        if os.environ.get("TE_THD_TRACEBACK") == "1":
            raise
        if _first_to_report():
            print(f"error: {user_message(exc)}", file=sys.stderr)
        elif "LOCAL_RANK" in os.environ:  # under a launcher: let the reporter print first
            time.sleep(QUIET_RANK_GRACE_S)
        _leave(getattr(exc, "exit_status", 1))
    except Exception:
        if _another_rank_reported():
            _leave(1)  # a peer reported the cause and left; this rank's failure is the echo
        raise
    return 1
