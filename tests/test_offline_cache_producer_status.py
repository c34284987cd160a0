"""What ``te-thd cache info / verify / repair`` say about a cache whose producer runs or was killed.

Real producer processes (``_offline_cache_producer_script.py``): one paused after its first shard
(alive, holding the lock), one SIGKILLed mid-shard. The tools read the producer lock and the follow
record: "a producer is writing it (host, pid)" while it runs, "its producer stopped; resume with:
<the recorded command>" once it died, and that command, run as printed, finishes the cache.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

from te_thd.offline_cache import verify_cache
from te_thd.offline_cache.format.schema import FOLLOW_NAME

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_offline_cache_producer_script.py"
TE_THD = str(Path(sys.executable).with_name("te-thd"))
HOST = socket.gethostname()


def _tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([TE_THD, "cache", *argv], capture_output=True, text=True, timeout=120)


def _resume_command(d: Path) -> str:
    """What the producer script records as its resume command (``--named``): this interpreter, plain."""
    return shlex.join([sys.executable, str(SCRIPT), str(d), "none"])


def test_a_running_producer_is_named_and_repair_refuses_in_its_own_words(tmp_path: Path) -> None:
    d = tmp_path / "c"
    live = subprocess.Popen([sys.executable, str(SCRIPT), str(d), "pause:0", "--named"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "PAUSED"
        for verb in ("info", "verify"):
            out = _tool(verb, str(d))
            assert out.returncode == 1 and out.stdout == ""
            assert (
                f"(1 shard(s) so far): a producer is writing it (host {HOST}, pid {live.pid})"
                in out.stderr
            )
            assert "the manifest was lost" not in out.stderr and "repair" not in out.stderr
        out = _tool("repair", str(d))
        assert out.returncode == 1
        assert out.stderr == (
            f"te-thd cache repair: cannot repair {d}: a producer is writing {d} (host {HOST}, pid {live.pid}); "
            "repair would change the files it writes, so it changed nothing. Let the producer finish (it writes "
            f"the manifest last), or stop it and run `te-thd cache repair {d}` again\n"
        )
        assert "output_dir" not in out.stderr
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait(timeout=30)
    # the same producer, killed: its lock file is left, the pid is gone
    out = _tool("info", str(d))
    assert out.returncode == 1
    assert out.stderr.rstrip("\n").endswith(
        f"its producer stopped before it finished (host {HOST}, pid {live.pid} no longer holds its lock); resume with: "
        f"`{_resume_command(d)}`"
    )


def test_a_killed_producer_is_resumed_by_the_command_info_and_repair_print(tmp_path: Path) -> None:
    d = tmp_path / "c"
    killed = subprocess.run(
        [sys.executable, str(SCRIPT), str(d), "mid_write:1", "--named"], timeout=120
    )
    assert killed.returncode == -signal.SIGKILL
    # the follow record stores the command as a shell takes it, without the hint's backticks
    assert json.loads((d / FOLLOW_NAME).read_text())["producer_command"] == _resume_command(d)
    temps = [p.name for p in d.iterdir() if p.name.startswith(".shard-")]
    assert len(temps) == 1  # shard 1's write was in flight
    info = _tool("info", str(d))
    assert info.returncode == 1
    assert info.stderr == (
        f"te-thd cache info: offline cache manifest not found at {d}/manifest.json (1 shard(s) so far): its "
        f"producer stopped before it finished (host {HOST}, pid {_pid_of(d)} no longer holds its lock); resume "
        f"with: `{_resume_command(d)}`\n"
    )
    verify = _tool("verify", str(d))
    assert verify.returncode == 1 and f"resume with: `{_resume_command(d)}`" in verify.stderr
    repair = _tool("repair", str(d))
    assert repair.returncode == 0, repair.stderr
    assert repair.stdout.splitlines() == [
        "removed: 1 temp file(s) a killed writer left",
        "missing: 2 shards, shard-000001.safetensors to shard-000002.safetensors",
        f"{d} is reopened for a resume: re-run `{_resume_command(d)}`; it recomputes only these shards and "
        "writes the manifest.",
    ]
    assert not [p for p in d.iterdir() if p.name.startswith(".shard-")]  # removed under the lock
    cmd = re.findall(r"`([^`]+)`", repair.stdout)
    assert cmd == [_resume_command(d)]
    done = subprocess.run(
        shlex.split(cmd[0]), capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0 and "FINISHED" in done.stdout, done.stderr
    assert verify_cache(str(d), deep=True)["num_shards"] == 3


def _pid_of(d: Path) -> int:
    """The pid the killed producer recorded in the lock file it left."""
    return int(json.loads((d / ".te_thd-producer.lock").read_text())["pid"])


def test_an_old_follow_record_in_backticks_is_printed_once_in_backticks(tmp_path: Path) -> None:
    d = tmp_path / "c"
    subprocess.run([sys.executable, str(SCRIPT), str(d), "mid_write:1", "--named"], timeout=120)
    record = json.loads((d / FOLLOW_NAME).read_text())
    record["producer_command"] = f"`{record['producer_command']}`"  # what earlier versions stored
    (d / FOLLOW_NAME).write_text(json.dumps(record))
    out = _tool("info", str(d))
    assert out.stderr.rstrip("\n").endswith(f"resume with: `{_resume_command(d)}`")
    # the killed producer's pid, reused by a live process that holds no flock: still a stopped producer
    (d / ".te_thd-producer.lock").write_text(json.dumps({"pid": os.getpid(), "host": HOST}))
    out = _tool("info", str(d))
    assert (
        f"its producer stopped before it finished (host {HOST}, pid {os.getpid()} no longer "
        in out.stderr
    )
    assert _tool("repair", str(d)).returncode == 0  # not refused as a running producer


def test_many_missing_shards_are_one_line(tmp_path: Path) -> None:
    """A gap in the middle is named by its count, its first and last shard and the indices."""
    d = tmp_path / "c"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(d), "none"], check=True, capture_output=True, timeout=120
    )
    os.unlink(d / "manifest.json")
    for i in (0, 2):
        os.unlink(d / f"shard-{i:06d}.safetensors")
    out = _tool("repair", str(d))
    assert out.returncode == 0, out.stderr
    assert (
        "missing: 2 shards, shard-000000.safetensors to shard-000002.safetensors (indices 0, 2)"
        in out.stdout
    )
    assert len(out.stdout.splitlines()) == 2  # and the line that names the producer command
