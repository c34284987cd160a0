"""``te-thd demo`` stopped by a signal: every job it started stops, and it says so in one line.

Real demos (``python -m te_thd.cli demo``: torchrun, gloo, 2 ranks) get real signals:
SIGTERM and SIGINT stop the producer, the trainer and their ranks and print one line;
a demo killed with SIGKILL leaves nothing running either (its jobs get SIGTERM from the
kernel, their ranks too); a producer killed with SIGKILL under ``--follow`` is named
with its log and the command that resumes it, which then runs as printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _example_support import REPO

SMALL = ["--nproc", "2", "--cp", "2", "--ep", "1", "--num-samples", "64", "--out", "d"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TE_THD_SOURCE", None)
    return env


def _tree(pid: int) -> list[int]:
    """Every process below ``pid`` now (the main thread's children in /proc, recursively)."""
    found, pending = [], [pid]
    while pending:
        p = pending.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        found += kids
        pending += kids
    return found


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's zombie waits for whoever reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_for(what: str, cond: Callable[[], object], timeout: float = 240) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Demo:
    """A demo started in the background, its output in files; every process it started, killed at the end."""

    def __init__(self, cwd: Path, *argv: str) -> None:
        self.cwd = cwd
        self.seen: set[int] = set()
        with open(cwd / "demo.out", "w") as out, open(cwd / "demo.err", "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "te_thd.cli", "demo", *argv],
                cwd=cwd,
                env=_env(),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def tree(self) -> list[int]:
        pids = _tree(self.proc.pid)
        self.seen.update(pids)
        return pids

    def steps(self) -> int:
        try:
            return len((self.cwd / "d" / "train" / "metrics.jsonl").read_text().splitlines())
        except OSError:
            return 0

    def output(self) -> tuple[str, str]:
        return (self.cwd / "demo.out").read_text(), (self.cwd / "demo.err").read_text()

    def training(self) -> list[int]:
        """Once the trainer logged a step: every process below the demo (launchers and ranks)."""
        _wait_for(
            "the trainer's first step", lambda: self.steps() > 0 or self.proc.poll() is not None
        )
        assert self.proc.poll() is None, self.output()
        return self.tree()

    def cleanup(self) -> None:
        for pid in [*self.seen, self.proc.pid]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def demo(tmp_path):
    started: list[Demo] = []

    def start(*argv: str) -> Demo:
        started.append(Demo(tmp_path, *argv))
        return started[-1]

    yield start
    for d in started:
        d.cleanup()


def _all_stopped(pids: list[int], timeout: float = 60) -> None:
    _wait_for(f"every process of {pids} to stop", lambda: not any(map(_running, pids)), timeout)


@pytest.mark.parametrize(
    ("sig", "follow"),
    [(signal.SIGTERM, True), (signal.SIGINT, False)],
    ids=["sigterm-follow", "sigint"],
)
def test_sigterm_and_sigint_stop_every_job_and_print_one_line(demo, sig, follow):
    d = demo(*SMALL, "--steps", "100000", *(["--follow"] if follow else []))
    pids = d.training()
    ranks = [
        p
        for p in pids
        if "train_ep_cp.py" in _cmdline(p) and "torch.distributed.run" not in _cmdline(p)
    ]
    assert len(ranks) == 2, [_cmdline(p) for p in pids]
    os.kill(d.proc.pid, sig)
    assert d.proc.wait(timeout=60) == 128 + sig
    _all_stopped(pids, timeout=5)  # the demo returns once all are gone
    stdout, stderr = d.output()
    name = signal.Signals(sig).name
    assert stderr.splitlines()[-1] == (
        f"te-thd demo: stopped by {name}; its producer and trainer jobs were stopped too"
    ), stderr
    for text in ("Traceback", "KeyboardInterrupt", "SignalException", "FAILED"):
        assert text not in stdout + stderr


def test_a_demo_killed_with_sigkill_leaves_nothing_running(demo):
    d = demo(*SMALL, "--steps", "100000", "--follow")
    pids = d.training()
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    _all_stopped(pids)


@pytest.mark.parametrize("victim", ["launcher", "rank"])
def test_a_killed_producer_is_named_with_its_log_and_the_command_that_resumes_it(
    demo, tmp_path, victim
):
    """SIGKILL of the producer's torchrun (its ranks, in sessions of their own, get SIGTERM from the
    kernel), or of one of its ranks (torchrun reports it in the log)."""
    argv = [*SMALL[:-4], "--num-samples", "256", "--steps", "4", "--out", "d", "--follow"]
    d = demo(*argv)

    def producer_ranks() -> tuple[int, list[int]] | None:
        for p in d.tree():
            if "precompute_cache.py" in _cmdline(p) and "torch.distributed.run" in _cmdline(p):
                ranks = _tree(p)
                d.seen.update(ranks)
                return (p, ranks) if len(ranks) == 2 else None
        return None

    launcher, ranks = _wait_for("the producer's ranks", producer_ranks)
    os.kill(launcher if victim == "launcher" else ranks[0], signal.SIGKILL)
    assert d.proc.wait(timeout=120) == 1
    _all_stopped([*d.seen])
    stdout, stderr = d.output()
    out = tmp_path / "d"
    killed = "killed" if victim == "launcher" else "a rank was killed"
    assert (
        f"precompute: {killed} by signal 9 (log: {out}/cache-cp2-n256.log); run the same command "
        "again to resume" in stdout.splitlines()
    ), stdout + stderr
    assert f"train: stopped, the producer failed (log: {out}/train.log)" in stdout.splitlines()
    assert "Traceback" not in stdout + stderr
    assert not any(_running(p) for p in ranks)

    again = subprocess.run(
        [sys.executable, "-m", "te_thd.cli", "demo", *argv],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        f"cache ready: {out}/cache-cp2-n256 " in again.stdout
        and "summary: steps 0->4 " in again.stdout
    )
