"""Host resources of the write-behind producer (te_thd.offline_cache.hostmem): the idle-priority
writer thread and the malloc thresholds that keep freed batch memory mapped.

Checked against the kernel and glibc themselves: the writer thread's scheduling policy is read
with ``sched_getscheduler`` on its native thread id, and the allocator's behaviour with
``mallinfo2`` (mmapped blocks, releasable top of the heap) in a fresh interpreter.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from te_thd.offline_cache.durable import BackgroundCommitter
from te_thd.offline_cache.hostmem import (
    WRITER_PRIORITIES,
    WriterPriority,
    check_writer_priority,
    idle_priority_available,
    retained_freed_memory,
    set_malloc_thresholds,
)
from te_thd.offline_cache.writer import DurableShardWriter

HOSTMEM = Path(__file__).resolve().parents[1] / "te_thd" / "offline_cache" / "hostmem.py"
WAIT = 10.0
_CAP_SYS_NICE = 23


def _glibc_version() -> tuple[int, ...] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (ValueError, OSError, AttributeError):
        return None
    return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else None


def _may_leave_sched_idle() -> bool:
    """What the kernel allows (sched_setscheduler(2)): leaving SCHED_IDLE needs CAP_SYS_NICE or an
    RLIMIT_NICE that allows the thread's nice value."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    caps = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    if int(caps.split()[1], 16) >> _CAP_SYS_NICE & 1:
        return True
    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - os.getpriority(os.PRIO_PROCESS, 0)


IDLE_OK = sys.platform.startswith("linux") and _may_leave_sched_idle()
needs_idle = pytest.mark.skipif(not IDLE_OK, reason="this host does not let a thread leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20)")


def test_idle_priority_is_available_exactly_where_the_kernel_allows_it() -> None:
    assert idle_priority_available() is IDLE_OK
    assert idle_priority_available() is IDLE_OK  # probed once, cached
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the probe ran on its own thread


@pytest.mark.parametrize("mode", ["low", "IDLE", "", 3, None, True])
def test_check_writer_priority_names_the_argument(mode: object) -> None:
    match = rf"writer_priority={mode!r} must be one of \('idle', 'normal'\)"
    with pytest.raises(ValueError, match=match):
        check_writer_priority(mode)
    with pytest.raises(ValueError, match=match):
        WriterPriority(mode)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        BackgroundCommitter(writer_priority=mode)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        DurableShardWriter(("a",), write_behind=True, writer_priority=mode)  # type: ignore[arg-type]


def test_check_writer_priority_accepts_the_modes() -> None:
    assert WRITER_PRIORITIES == ("idle", "normal")
    for mode in WRITER_PRIORITIES:
        assert check_writer_priority(mode) == mode


class _Probe:
    """Tasks for a BackgroundCommitter that report the policy their thread runs at."""

    def __init__(self) -> None:
        self.tid: int | None = None
        self.seen: list[int] = []

    def record(self) -> None:
        self.tid = threading.get_native_id()
        self.seen.append(os.sched_getscheduler(0))

    def hold(self, started: threading.Event, gate: threading.Event):
        def task() -> None:
            self.record()
            started.set()
            assert gate.wait(WAIT)

        return task


def _policy_becomes(tid: int, policy: int, timeout: float = WAIT) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.sched_getscheduler(tid) == policy:
            return True
        time.sleep(0.002)
    return False


@needs_idle
def test_idle_writer_runs_at_sched_idle_only_while_nobody_waits() -> None:
    probe = _Probe()
    c = BackgroundCommitter(max_pending=8, writer_priority="idle")
    try:
        done = threading.Event()
        c.submit_task(lambda: (probe.record(), done.set()))
        assert done.wait(WAIT)  # waited on an event, not on the writer: it stays idle
        assert probe.seen == [os.SCHED_IDLE] and c.priority.active
        tid = probe.tid
        assert tid is not None and tid != threading.get_native_id()

        started, gate = threading.Event(), threading.Event()
        c.submit_task(probe.hold(started, gate))
        assert started.wait(WAIT)
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        with c.priority.waiting():  # a caller waits on the writer: normal priority at once
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        gate.set()

        started, gate = threading.Event(), threading.Event()
        c.submit_task(probe.hold(started, gate))
        assert started.wait(WAIT)
        assert probe.seen[-1] == os.SCHED_IDLE  # the next job with nobody waiting: idle again
        c.submit_task(probe.record)  # starts while the flush below waits
        flusher = threading.Thread(target=c.flush, daemon=True)
        flusher.start()
        assert _policy_becomes(tid, os.SCHED_OTHER), "flush() waits on an idle writer"
        gate.set()
        flusher.join(WAIT)
        assert not flusher.is_alive()
        assert probe.seen[-1] == os.SCHED_OTHER  # a job started during the flush: normal priority

        done = threading.Event()
        c.submit_task(lambda: (probe.record(), done.set()))
        assert done.wait(WAIT)
        assert probe.seen[-1] == os.SCHED_IDLE
    finally:
        c.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread was never touched


@needs_idle
def test_idle_writer_is_normal_while_a_submit_waits_for_room() -> None:
    probe = _Probe()
    c = BackgroundCommitter(max_pending=1, writer_priority="idle")
    try:
        started, gate = threading.Event(), threading.Event()
        c.submit_task(probe.hold(started, gate))
        assert started.wait(WAIT)
        assert probe.tid is not None and os.sched_getscheduler(probe.tid) == os.SCHED_IDLE
        c.submit_task(probe.record)  # fills the one-slot queue
        blocked = threading.Thread(target=c.submit_task, args=(probe.record,), daemon=True)
        blocked.start()  # the queue is full: this submit waits on the writer
        assert _policy_becomes(probe.tid, os.SCHED_OTHER)
        gate.set()
        blocked.join(WAIT)
        c.flush()
    finally:
        gate.set()
        c.close()


def test_normal_writer_never_changes_its_policy() -> None:
    probe = _Probe()
    c = BackgroundCommitter(max_pending=8, writer_priority="normal")
    try:
        started, gate = threading.Event(), threading.Event()
        c.submit_task(probe.hold(started, gate))
        assert started.wait(WAIT)
        assert probe.tid is not None and os.sched_getscheduler(probe.tid) == os.SCHED_OTHER
        with c.priority.waiting():
            assert os.sched_getscheduler(probe.tid) == os.SCHED_OTHER
        gate.set()
        for _ in range(3):
            c.submit_task(probe.record)
        c.flush()
    finally:
        gate.set()
        c.close()
    assert not c.priority.active
    assert probe.seen == [os.SCHED_OTHER] * 4


@needs_idle
def test_durable_writer_priority_reaches_its_thread(tmp_path: Path) -> None:
    for mode, policy in (("idle", os.SCHED_IDLE), ("normal", os.SCHED_OTHER)):
        probe = _Probe()
        with DurableShardWriter(("a",), write_behind=True, writer_priority=mode) as w:
            done = threading.Event()
            w._committer.submit_task(lambda p=probe, d=done: (p.record(), d.set()))
            assert done.wait(WAIT)
        assert probe.seen == [policy], mode
    # a writer without write-behind does no whole writes: its thread keeps the default scheduling
    probe = _Probe()
    with DurableShardWriter(("a",)) as w:
        w._committer.submit_task(probe.record)
        w.flush()
    assert probe.seen == [os.SCHED_OTHER]


# -- malloc thresholds -------------------------------------------------------------------


def test_retained_freed_memory_disabled_yields_false() -> None:
    with retained_freed_memory(False) as on:
        assert on is False


@pytest.mark.skipif(_glibc_version() is None, reason="the malloc thresholds are glibc's (elsewhere a no-op)")
def test_retained_freed_memory_yields_true_and_nests() -> None:
    with retained_freed_memory() as outer:
        with retained_freed_memory() as inner:
            assert inner is True
        assert outer is True
    assert set_malloc_thresholds(32 << 20, 64 << 20) is True


_MALLOC_SCRIPT = textwrap.dedent(
    """
    import ctypes, importlib.util, sys
    spec = importlib.util.spec_from_file_location("hostmem", sys.argv[1])
    hostmem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hostmem)

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    MB = 1 << 20

    def mmapped(size):
        before = libc.mallinfo2().hblks
        p = libc.malloc(size)
        n = libc.mallinfo2().hblks - before
        libc.free(p)
        return n

    out = {}
    assert hostmem.set_malloc_thresholds(128 << 10, 128 << 10)  # glibc's initial threshold, pinned
    out["mmapped, default"] = mmapped(20 * MB)
    with hostmem.retained_freed_memory() as outer:
        with hostmem.retained_freed_memory() as inner:
            out["mmapped, inside"] = mmapped(20 * MB)
        out["yielded"] = (outer, inner)
        blocks = [libc.malloc(30 * MB) for _ in range(3)]
        for p in blocks:
            libc.free(p)
        out["kept MB, inside after the inner exit"] = libc.mallinfo2().keepcost // MB
    p = libc.malloc(MB)
    libc.free(p)  # the first free after the exit trims the heap's top to the settled threshold
    out["kept MB, after"] = libc.mallinfo2().keepcost // MB
    out["mmapped, after"] = mmapped(20 * MB)
    print(out)
    """
)


@pytest.mark.skipif((_glibc_version() or (0,)) < (2, 33), reason="needs glibc >= 2.33 (mallinfo2)")
def test_retained_freed_memory_keeps_freed_blocks_mapped_and_settles_on_exit() -> None:
    """In a fresh interpreter: a 20 MiB block is its own mmap at glibc's initial threshold and a heap
    block inside the context; 90 MiB freed inside stay at the heap's top (nesting included) and the
    first free after the exit trims them down to the settled 64 MiB trim threshold."""
    res = subprocess.run([sys.executable, "-c", _MALLOC_SCRIPT, str(HOSTMEM)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = eval(res.stdout)  # a dict of ints and bools printed by the script
    assert out == {
        "mmapped, default": 1,
        "mmapped, inside": 0,
        "yielded": (True, True),
        "kept MB, inside after the inner exit": 90,
        "kept MB, after": 0,
        "mmapped, after": 0,  # the settled mmap threshold is 32 MiB
    }
