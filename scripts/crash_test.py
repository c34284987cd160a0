"""Crash-consistency test of the offline-cache producer: SIGKILL real producers, resume, compare.

What it does (``python scripts/crash_test.py [--quick] [--json OUT]``):

1. A clean, uninterrupted producer subprocess writes the reference cache (and
   times the work, which bounds the random kill delays).
2. Single-process chains: in a fresh directory a producer subprocess
   (``te_thd.offline_cache.produce_cache``, resume mode) is started and SIGKILLed
   after a random delay (uniform over its work window, measured from the moment
   it reports READY after its imports), restarted, killed again, ... and finally
   allowed to finish. Distributed chains do the same with 2 gloo ranks (two real
   processes; a random choice of rank 0, rank 1 or both is killed, the survivor
   is killed 0.3 s later, as a job scheduler would).
3. After EVERY kill, the directory is checked as a reader sees it: each visible
   ``shard-*.safetensors`` / ``manifest.json`` is byte-identical to the clean
   run's (no partial file under a final name); without a manifest, opening the
   cache and ``verify_cache`` fail with the "not finished" error and nothing
   else; temp files of the killed writer are dot-prefixed and ignored by every
   reader API.
4. After each chain's final (unkilled) run: the directory holds exactly the clean
   run's files, byte for byte (no temp file, lock or progress record left),
   ``verify_cache(deep=True)`` passes and every sample reads back correctly.
5. During every chain a separate reader PROCESS polls the directory, fully
   reading every visible shard and manifest, and every 0.2 s opens the cache
   like a trainer: before the manifest exists that must fail with the "not
   finished" error (the old state), after it every sample must read back right
   (the new state); anything else, or any partial file, is a violation.

Kill points are classified from what the kill left behind: ``startup`` (nothing
written yet), ``mid-write`` (a writer temp file exists), ``between-shards``
(complete shards only), ``after-manifest``.

``--quick`` (CI, ``tests/test_reliability_crash.py``): 3 single + 2 distributed
kills. Full (default): 40 single + 16 distributed = 56 kills. Exit status 1 on
any violation. docs/guarantees.md records the last full run (scripts/reliability_figures.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _run_info import git_commit

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the scenario
# A deterministic "frozen model": every stored tensor is a function of the sample
# index, so any two complete runs must produce identical bytes.
NUM_SAMPLES = 96
SHARD_SIZE = 8  # 12 shards of ~2 MiB
BATCH_SIZE = 4
HIDDEN = 65536
KEYS = ("hidden", "input_ids", "loss_mask")
OPTIONS = {"scenario": "crash_test", "hidden": HIDDEN}
COMPUTE_SLEEP_S = 0.002  # per batch: keeps kills spread over compute and writes


def expected_sample(i: int) -> dict[str, Any]:
    import torch

    t = torch.arange(HIDDEN, dtype=torch.float32)
    return {
        "hidden": torch.sin(t * 0.001 * (i + 1) + i),
        "input_ids": torch.arange(16, dtype=torch.int64) + 16 * i,
        "loss_mask": (torch.arange(16) + i) % 3 != 0,
    }


def _compute_batch(batch: Any) -> dict[str, Any]:
    import torch

    idx = batch["idx"].tolist()
    time.sleep(COMPUTE_SLEEP_S)
    samples = [expected_sample(i) for i in idx]
    return {k: torch.stack([s[k] for s in samples]) for k in KEYS}


class IndexDataset:
    """Map-style dataset of ``{"idx": i}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"idx": i}


def produce(out_dir: str) -> dict[str, Any]:
    """Run the producer of the scenario into ``out_dir`` (uses the initialised process group)."""
    from torch.utils.data import DataLoader

    from te_thd.offline_cache import produce_cache

    loader = DataLoader(IndexDataset(NUM_SAMPLES), batch_size=BATCH_SIZE, shuffle=False)
    return produce_cache(loader, out_dir, SHARD_SIZE, _compute_batch, KEYS, OPTIONS, progress=False)


def _child_produce(args: argparse.Namespace) -> int:
    """Entry point of a producer subprocess: READY after imports, DONE after the manifest."""
    import torch  # noqa: F401  (import cost before READY, so kills land in the work)

    import te_thd.offline_cache  # noqa: F401

    if args.world > 1:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.world,
            timeout=timedelta(seconds=60),
        )
    if args.sleep is not None:
        global COMPUTE_SLEEP_S
        COMPUTE_SLEEP_S = args.sleep
    print("READY", flush=True)
    t0 = time.perf_counter()
    produce(args.out)
    print(f"DONE {time.perf_counter() - t0:.4f}", flush=True)
    if args.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- reader view

SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
MANIFEST = "manifest.json"


def read_dir(path: str) -> dict[str, bytes]:
    return {n: Path(path, n).read_bytes() for n in sorted(os.listdir(path))}


def _visible(name: str) -> bool:
    return bool(SHARD_RE.match(name)) or name == MANIFEST


_EXPECTED: dict[str, Any] = {}


def expected_tensors() -> dict[str, Any]:
    """Every key of every sample, stacked ``[NUM_SAMPLES, ...]`` (computed once per process)."""
    import torch

    if not _EXPECTED:
        samples = [expected_sample(i) for i in range(NUM_SAMPLES)]
        _EXPECTED.update({k: torch.stack([s[k] for s in samples]) for k in KEYS})
    return _EXPECTED


def read_all_samples(cache_dir: str) -> list[str]:
    """Open the cache like a trainer and compare every sample; return problems."""
    import torch

    from te_thd.offline_cache import CachedTensorDataset

    want = expected_tensors()
    ds = CachedTensorDataset(cache_dir, "offline", 1, KEYS)
    if len(ds) != NUM_SAMPLES:
        return [f"len {len(ds)} != {NUM_SAMPLES}"]
    problems = []
    batch = ds.__getitems__(list(range(len(ds))))
    for k in KEYS:
        if not torch.equal(batch.tensors[k], want[k]):
            problems.append(f"key {k} differs from the expected values (batched read)")
    for i in (0, len(ds) - 1):
        got = ds[i]
        for k in KEYS:
            if not torch.equal(got[k], want[k][i]):
                problems.append(f"sample {i} key {k} differs (__getitem__)")
    return problems


def check_killed_state(cache_dir: str, clean: dict[str, bytes]) -> tuple[str, list[str]]:
    """Classify the kill point and check what a reader sees now; return (point, problems)."""
    from te_thd.offline_cache import (
        ManifestNotFoundError,
        existing_shard_indices,
        verify_cache,
    )
    from te_thd.offline_cache.storage.base import TEMP_RE

    problems: list[str] = []
    names = sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []
    temps = [n for n in names if TEMP_RE.match(n)]
    shards = [n for n in names if SHARD_RE.match(n)]
    for n in names:
        if _visible(n) and Path(cache_dir, n).read_bytes() != clean[n]:
            problems.append(
                f"after kill: visible {n} differs from the clean run's (partial or wrong)"
            )
        if not _visible(n) and not n.startswith("."):
            problems.append(f"after kill: unexpected non-hidden file {n}")
    listed = (
        {f"shard-{i:06d}.safetensors" for i in existing_shard_indices(cache_dir)}
        if names
        else set()
    )
    if listed != set(shards):
        problems.append(f"existing_shard_indices lists {sorted(listed)}, directory has {shards}")
    if MANIFEST in names:
        point = "after-manifest"
        problems += [f"after kill: {p}" for p in read_all_samples(cache_dir)]
    else:
        point = "mid-write" if temps else ("between-shards" if shards else "startup")
        for what, fn in (
            ("CachedTensorDataset", lambda: read_all_samples(cache_dir)),
            ("verify_cache", lambda: verify_cache(cache_dir, deep=True)),
        ):
            if not names:
                break
            try:
                fn()
                problems.append(f"after kill: {what} opened an unfinished cache")
            except ManifestNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - any other kind is the violation we look for
                problems.append(f"after kill: {what} raised {type(e).__name__}: {e}")
    return point, problems


def check_final(cache_dir: str, clean: dict[str, bytes]) -> list[str]:
    from te_thd.offline_cache import verify_cache

    problems = []
    got = read_dir(cache_dir)
    if sorted(got) != sorted(clean):
        problems.append(
            f"final directory has {sorted(set(got) ^ set(clean))} beyond/short of the clean run"
        )
    for n, data in got.items():
        if n in clean and data != clean[n]:
            problems.append(f"final {n} is not byte-identical to the clean run's")
    try:
        verify_cache(cache_dir, deep=True)
    except Exception as e:  # noqa: BLE001
        problems.append(f"verify_cache(deep=True) failed: {type(e).__name__}: {e}")
    problems += read_all_samples(cache_dir)
    return problems


# ---------------------------------------------------------------- the poller process


def _child_poll(args: argparse.Namespace) -> int:
    """Reader process: poll ``args.dir`` until ``args.stop`` exists; write counts to ``args.out``."""
    from te_thd.offline_cache import ManifestNotFoundError

    clean = read_dir(args.clean)
    expected_tensors()
    print("READY", flush=True)
    obs = full_reads = unfinished = 0
    violations: list[str] = []
    stop = Path(args.stop)
    last_full = 0.0
    while True:
        final_round = stop.exists()
        try:
            names = os.listdir(args.dir)
        except FileNotFoundError:
            names = []
        for n in names:
            if not _visible(n):
                continue
            try:
                with open(os.path.join(args.dir, n), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                violations.append(f"{n} vanished between listdir and open")
                continue
            obs += 1
            if data != clean[n]:
                violations.append(f"reader saw {n} with {len(data)} bytes != the complete file")
        if time.monotonic() - last_full > args.open_every:
            # Open the cache like a trainer: before the manifest exists this must be
            # the "not finished" error (the old state); after, every sample is right.
            last_full = time.monotonic()
            try:
                problems = read_all_samples(args.dir)
                full_reads += 1
                violations += [f"reader, finished cache: {p}" for p in problems]
            except ManifestNotFoundError:
                unfinished += 1
            except Exception as e:  # noqa: BLE001
                violations.append(f"reader opening the cache: {type(e).__name__}: {e}")
        if final_round:
            break
        time.sleep(0.002)
    Path(args.out).write_text(
        json.dumps(
            {
                "observations": obs,
                "full_reads": full_reads,
                "unfinished_opens": unfinished,
                "violations": violations[:50],
                "n_violations": len(violations),
            }
        )
    )
    return 0


# ---------------------------------------------------------------- orchestration
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A child process with a line reader over its stdout (binary, no hidden buffering)."""

    def __init__(self, args: list[str], log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(log, "ab") as err:
            self.p = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=str(REPO_ROOT),
            )
        self._buf = b""

    def wait_line(self, prefix: str, timeout: float) -> str | None:
        """The first stdout line starting with ``prefix``; None on EOF or timeout."""
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                if text.startswith(prefix):
                    return text
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], min(left, 0.05))
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None  # EOF: the process exited
                self._buf += chunk

    def poll(self) -> int | None:
        return self.p.poll()

    def wait(self, timeout: float | None = None) -> int:
        rc = self.p.wait(timeout=timeout)
        if self.p.stdout is not None:
            self.p.stdout.close()
        return rc

    def kill(self) -> bool:
        """SIGKILL if still running; True when this call killed it."""
        if self.p.poll() is not None:
            self.wait()
            return False
        self.p.send_signal(signal.SIGKILL)
        self.wait()
        return True


class Run:
    def __init__(self, workdir: Path, seed: int, verbose: bool) -> None:
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.violations: list[str] = []
        self.kill_points: dict[str, int] = {}
        self.kills = {"single": 0, "distributed": 0, "processes": 0}
        self.poller = {"observations": 0, "full_reads": 0, "unfinished_opens": 0, "n_violations": 0}
        self.temp_files_left = 0
        self.chains = 0
        self.window = 1.0

    def say(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def clean_run(self) -> dict[str, bytes]:
        d = self.workdir / "clean"
        p = _Proc(["_produce", "--out", str(d)], self.logs / "clean.log")
        if p.wait_line("READY", 300) is None:
            raise RuntimeError(f"clean producer failed to start; see {self.logs / 'clean.log'}")
        done = p.wait_line("DONE", 600)
        rc = p.wait()
        if done is None or rc != 0:
            raise RuntimeError(f"clean producer failed; see {self.logs / 'clean.log'}")
        self.window = float(done.split()[1])
        self.clean_dir = str(d)
        self.clean = read_dir(str(d))
        problems = check_final(str(d), self.clean)
        if problems:
            raise RuntimeError(f"the clean run itself is not sound: {problems}")
        self.say(f"clean run: {len(self.clean)} files, work window {self.window:.2f}s")
        return self.clean

    def _start_poller(self, d: Path, tag: str) -> tuple[_Proc, Path, Path]:
        stop, out = self.workdir / f"{tag}.stop", self.workdir / f"{tag}.poll.json"
        p = _Proc(
            [
                "_poll",
                "--dir",
                str(d),
                "--clean",
                self.clean_dir,
                "--stop",
                str(stop),
                "--out",
                str(out),
            ],
            self.logs / f"{tag}.poll.log",
        )
        return p, stop, out

    def _finish_poller(self, p: _Proc, stop: Path, out: Path) -> None:
        stop.touch()
        p.wait(timeout=120)
        res = json.loads(out.read_text())
        for k in self.poller:
            self.poller[k] += res[k]
        self.violations += [f"poller: {v}" for v in res["violations"]]

    def _after_kill(self, d: Path, kind: str) -> None:
        from te_thd.offline_cache.storage.base import TEMP_RE

        point, problems = check_killed_state(str(d), self.clean)
        self.kill_points[point] = self.kill_points.get(point, 0) + 1
        self.temp_files_left += (
            sum(1 for n in os.listdir(d) if TEMP_RE.match(n)) if d.exists() else 0
        )
        self.violations += [f"{kind} kill #{self.kills[kind]}: {p}" for p in problems]
        self.say(f"  {kind} kill #{self.kills[kind]} at {point}; problems: {len(problems)}")

    def chain(self, kind: str, n_kills: int) -> int:
        """One directory: up to ``n_kills`` kills, then a run to completion. Returns kills done."""
        self.chains += 1
        tag = f"{kind}{self.chains}"
        d = self.workdir / tag
        poll = self._start_poller(d, tag)
        done_kills = 0
        try:
            for attempt in range(n_kills + 3):
                want_kill = done_kills < n_kills and attempt < n_kills + 2
                procs = self._start_producers(kind, d, tag, attempt)
                if procs is None:
                    continue
                if want_kill:
                    # resumed runs have less left to do: scale the window by the missing shards
                    have = sum(1 for n in os.listdir(d) if SHARD_RE.match(n)) if d.exists() else 0
                    left = 1.0 - have / (-(-NUM_SAMPLES // SHARD_SIZE))
                    delay = self.rng.uniform(0.0, self.window * max(0.15, left))
                    time.sleep(delay)
                    killed = self._kill_some(kind, procs)
                    if killed:
                        done_kills += 1
                        self.kills[kind] += 1
                        self.kills["processes"] += killed
                        self._after_kill(d, kind)
                        continue
                    # finished before the kill: the cache is complete; start over elsewhere
                    self.window *= 0.8
                    rcs = [p.wait() for p in procs]
                    if any(rcs):
                        self.violations.append(f"{tag}: producer exited {rcs} without being killed")
                    break
                rcs = [p.wait(timeout=600) for p in procs]
                if any(rcs):
                    self.violations.append(
                        f"{tag}: final producer run exited {rcs}; see {self.logs}"
                    )
                break
            problems = check_final(str(d), self.clean)
            self.violations += [f"{tag} final: {p}" for p in problems]
            self.say(f"{tag}: {done_kills} kills, final check problems: {len(problems)}")
        finally:
            self._finish_poller(*poll)
        return done_kills

    def _start_producers(self, kind: str, d: Path, tag: str, attempt: int) -> list[_Proc] | None:
        log = self.logs / f"{tag}.{attempt}"
        if kind == "single":
            procs = [_Proc(["_produce", "--out", str(d)], Path(f"{log}.log"))]
        else:
            port = _free_port()
            procs = [
                _Proc(
                    [
                        "_produce",
                        "--out",
                        str(d),
                        "--rank",
                        str(r),
                        "--world",
                        "2",
                        "--port",
                        str(port),
                    ],
                    Path(f"{log}.rank{r}.log"),
                )
                for r in range(2)
            ]
        ready = [p.wait_line("READY", 300) for p in procs]
        if any(r is None for r in ready):
            for p in procs:
                p.kill()
            self.violations.append(
                f"{tag}: producer failed to start (attempt {attempt}); see {log}*.log"
            )
            return None
        return procs

    def _kill_some(self, kind: str, procs: list[_Proc]) -> int:
        if kind == "single":
            return int(procs[0].kill())
        which = self.rng.choice(["rank0", "rank1", "both"])
        victims = {"rank0": [0], "rank1": [1], "both": [0, 1]}[which]
        killed = sum(procs[i].kill() for i in victims)
        if killed == 0:
            return 0
        time.sleep(0.3)  # the scheduler tears the job down shortly after one rank dies
        for p in procs:
            killed += p.kill()
        return killed

    def result(self, seconds: float) -> dict[str, Any]:
        total = self.kills["single"] + self.kills["distributed"]
        return {
            "kills_survived": total if not self.violations else None,
            "kills": self.kills,
            "kill_points": dict(sorted(self.kill_points.items())),
            "chains": self.chains,
            "temp_files_left_by_kills": self.temp_files_left,
            "poller": self.poller,
            "violations": self.violations,
            "ok": not self.violations,
            "seconds": round(seconds, 1),
            "scenario": {
                "num_samples": NUM_SAMPLES,
                "shard_size": SHARD_SIZE,
                "batch_size": BATCH_SIZE,
                "shard_bytes": len(self.clean.get("shard-000000.safetensors", b"")),
            },
        }


def run(
    quick: bool,
    single_kills: int | None = None,
    dist_kills: int | None = None,
    seed: int | None = None,
    workdir: str | None = None,
    verbose: bool = False,
    keep: bool = False,
) -> dict[str, Any]:
    """Run the whole crash test; return the result dict (``ok`` False on any violation)."""
    single = single_kills if single_kills is not None else (3 if quick else 40)
    dist = dist_kills if dist_kills is not None else (2 if quick else 16)
    seed = seed if seed is not None else int(time.time())
    own = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix="te_thd_crash_"))
    t0 = time.perf_counter()
    r = Run(wd, seed, verbose)
    try:
        r.clean_run()
        per_chain = 3 if quick else 4
        for kind, target in (("single", single), ("distributed", dist)):
            while r.kills[kind] < target:
                before = r.kills[kind]
                r.chain(kind, min(per_chain, target - r.kills[kind]))
                if r.kills[kind] == before and r.chains > 4 * (single + dist):
                    r.violations.append(
                        f"could not land {kind} kills (producer always finished first)"
                    )
                    break
        res = r.result(time.perf_counter() - t0)
        res["seed"] = seed
        res["mode"] = "quick" if quick else "full"
        res["commit"] = git_commit()
        return res
    finally:
        if own and not keep and not r.violations:
            shutil.rmtree(wd, ignore_errors=True)
        elif r.violations:
            print(f"crash_test: workdir kept for inspection: {wd}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd")
    pp = sub.add_parser("_produce", help=argparse.SUPPRESS)
    pp.add_argument("--out", required=True)
    pp.add_argument("--rank", type=int, default=0)
    pp.add_argument("--world", type=int, default=1)
    pp.add_argument("--port", type=int, default=0)
    pp.add_argument("--sleep", type=float, default=None, help="seconds per batch in compute_batch")
    pl = sub.add_parser("_poll", help=argparse.SUPPRESS)
    for a in ("--dir", "--clean", "--stop", "--out"):
        pl.add_argument(a, required=True)
    pl.add_argument("--open-every", type=float, default=0.2, help="seconds between full opens")
    ap.add_argument(
        "--quick", action="store_true", help="CI mode: 3 single-process + 2 distributed kills"
    )
    ap.add_argument("--single-kills", type=int, default=None)
    ap.add_argument("--dist-kills", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workdir", default=None, help="keep everything here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "_produce":
        return _child_produce(args)
    if args.cmd == "_poll":
        return _child_poll(args)
    res = run(args.quick, args.single_kills, args.dist_kills, args.seed, args.workdir, args.verbose)
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
