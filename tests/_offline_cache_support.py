"""Helpers shared by the offline-cache reader/sampler/loader tests: real caches on disk.

``make_cache`` writes real safetensors shards plus a manifest in the on-disk
format (docs/offline_cache.md) and returns the tensors it wrote, so tests compare what they
read with what was written (the oracle) rather than with the reader itself.
"""

from __future__ import annotations

import os
import socket

import torch
from safetensors.torch import save_file

from te_thd.offline_cache.format.integrity import HeaderEntry, read_shard_header
from te_thd.offline_cache.format.schema import TensorSpec, shard_path
from te_thd.offline_cache.record.manifest import write_manifest
from te_thd.offline_cache.write.producer import produce_cache
from te_thd.offline_cache.write.shardfile import ShardStream
from te_thd.offline_cache.record.run import ShardRecord

FORMAT_VERSION = 3
CACHE_NAME = "test"


def sample_tensors(
    num_samples: int, width: int = 8, seed: int = 0, hidden: int = 0
) -> dict[str, torch.Tensor]:
    """Every key stacked over all samples: ``sample_id`` int64 ``[N]``, ``input_ids``
    int64 ``[N, W]`` (right-padded with 0 after ``length``), ``loss_mask`` int64
    ``[N, W]``, ``position_mask`` bool ``[N, W, 1]``, ``length`` int32 ``[N]``, and
    ``hidden`` bf16 ``[N, W, hidden]`` when ``hidden > 0``."""
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, width + 1, (num_samples,), generator=g, dtype=torch.int64)
    valid = torch.arange(width).unsqueeze(0) < length.unsqueeze(1)
    ids = torch.randint(1, 1000, (num_samples, width), generator=g) * valid
    out = {
        "sample_id": torch.arange(num_samples, dtype=torch.int64),
        "input_ids": ids,
        "loss_mask": torch.randint(0, 2, (num_samples, width), generator=g) * valid,
        "position_mask": (torch.rand(num_samples, width, 1, generator=g) > 0.5)
        & valid.unsqueeze(-1),
        "length": length.to(torch.int32),
    }
    if hidden:
        out["hidden"] = torch.randn(num_samples, width, hidden, generator=g).to(torch.bfloat16)
    return out


class _Rows(torch.utils.data.Dataset):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors["sample_id"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


#: the read path's tuning constants a test changed, with their values before it: restored by
#: ``restore_read_tuning`` after every test (tests/conftest.py)
_TUNED: dict[tuple[object, str], object] = {}


def read_tuning(engine: str | None = None, parallel_min_bytes: int | None = None,
                preadv_min_run_bytes: int | None = None) -> None:  # fmt: skip
    """Set the read path's tuning constants as a bench does: ``readplan.COPY_ENGINE``
    (``"auto"`` / ``"preadv"`` / ``"mapped"``), ``readexec.PARALLEL_MIN_BYTES``,
    ``readplan.PREADV_MIN_RUN_BYTES``; ``None`` leaves one as it is."""
    from te_thd.offline_cache.read import executor as readexec
    from te_thd.offline_cache.read import planner as readplan

    for module, name, value in ((readplan, "COPY_ENGINE", engine), (readexec, "PARALLEL_MIN_BYTES", parallel_min_bytes),
                                (readplan, "PREADV_MIN_RUN_BYTES", preadv_min_run_bytes)):  # fmt: skip
        if value is not None:
            _TUNED.setdefault((module, name), getattr(module, name))
            setattr(module, name, value)


def share_every_batch(_worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: the worker's read threads share out every batch, however
    small (a spawned worker imports the constants afresh)."""
    read_tuning(parallel_min_bytes=0)


def restore_read_tuning() -> None:
    while _TUNED:
        (module, name), value = _TUNED.popitem()
        setattr(module, name, value)


def write_shard_file(path: str, tensors: dict[str, torch.Tensor]) -> ShardRecord:
    """Write ``tensors`` (every one ``[n, ...]`` with one ``n``, as the writer checks them) to a NEW
    file ``path`` as one :class:`ShardStream` piece: the serialiser alone; its record."""
    specs = {name: TensorSpec(t.dtype, tuple(t.shape[1:])) for name, t in tensors.items()}
    stream = ShardStream(path, specs, next(iter(tensors.values())).shape[0] if tensors else 0)
    try:
        stream.write(tensors)
        return stream.finish()
    except BaseException:
        stream.abort()
        raise


def read_header(path: str) -> dict[str, HeaderEntry]:
    """The checked header entries of shard ``path`` (``{key: HeaderEntry}``)."""
    return read_shard_header(path).entries


def make_cache(
    cache_dir: str,
    num_samples: int,
    shard_size: int,
    width: int = 8,
    seed: int = 0,
    hidden: int = 0,
    producer: bool = True,
) -> dict[str, torch.Tensor]:
    """Write a cache of ``num_samples`` samples in shards of ``shard_size``; return its tensors.

    ``producer=True``: through te_thd's ``produce_cache`` (manifest with schema and
    per-shard byte sizes + checksums); ``False``: plain ``save_file`` shards and a
    manifest with only the seed fields, as the reference producer writes them.
    """
    tensors = sample_tensors(num_samples, width, seed, hidden)
    if producer:
        loader = torch.utils.data.DataLoader(_Rows(tensors), batch_size=shard_size)
        produce_cache(
            loader,
            cache_dir,
            shard_size,
            lambda batch: batch,
            tuple(tensors),
            format_version=FORMAT_VERSION,
            cache_name=CACHE_NAME,
            progress=False,
        )
        return tensors
    os.makedirs(cache_dir, exist_ok=True)
    for s, start in enumerate(range(0, num_samples, shard_size)):
        save_file(
            {k: v[start : start + shard_size].contiguous() for k, v in tensors.items()},
            shard_path(cache_dir, s),
        )
    write_manifest(
        cache_dir, {"num_samples": num_samples, "shard_size": shard_size}, FORMAT_VERSION
    )
    return tensors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank: int, world: int, port: int, fn, args: tuple, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(world: int, fn, *args, out_dir: str, timeout: float = 180) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` real spawned gloo processes; results by rank.

    ``fn`` must be importable by name (spawn pickles it); results travel through files.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_gloo_entry, args=(r, world, port, fn, args, out_dir))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"gloo workers exited with {codes}")
    return [
        torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)
    ]


def damage_shard(shard: str | os.PathLike, how: str, shorter_by: int = 7) -> None:
    """Damage the shard file ``shard`` as a user finds it: ``"missing"`` (deleted), ``"truncated"``
    (``shorter_by`` bytes short) or ``"extra"`` (a copy of it under index 7, beyond a small cache)."""
    path = os.fspath(shard)
    if how == "missing":
        os.unlink(path)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) - shorter_by)
    elif how == "extra":
        with open(path, "rb") as src, open(shard_path(os.path.dirname(path), 7), "wb") as dst:
            dst.write(src.read())
    else:
        raise ValueError(f"how={how!r} must be 'missing', 'truncated' or 'extra'")
