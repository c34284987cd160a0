"""``produce_cache``: the complete producer -- lock, resume, distributed lockstep, manifest last.

One call turns ``dataloader`` + ``compute_batch`` into a finished cache::

    manifest = produce_cache(loader, "/data/cache", shard_size=256,
                             compute_batch=lambda b: {"hidden": model(b)},
                             keys=("hidden",), options={"cp_size": 2})

What happens, in order (``rank`` is the rank in ``group``; one process is rank 0 of 1):

1. rank 0 takes the :class:`ProducerLock` (a second producer on the directory
   is refused), inspects the directory and tells every rank what to do:
   - a finished cache with the same parameters: nothing (returns its manifest);
   - a finished cache with other parameters, or shards of an unknown producer:
     refuse, naming the difference;
   - otherwise it deletes temp files of killed writers and records the run's
     parameters in ``.te_thd-producer.json`` (so a resume with other parameters
     is refused instead of mixing shards).
2. every rank takes its contiguous shard block (:func:`partition_cache_shards`),
   re-reads the shards of it that already exist (resume: checksum + header
   check), and computes only the missing ones, padding to the global step count
   with dummy forwards (:func:`lockstep_write`).
3. the ranks all-gather their shard records (bytes, CRC-32, schema); rank 0
   checks that every shard exists exactly once with one schema and writes
   ``manifest.json`` atomically, last; then every rank returns the manifest.

Errors raised while writing on one rank (a schema mismatch) do not hang the
others: the rank keeps stepping (without writing) to the end of the lockstep
loop and the error is raised on every rank after the all-gather. An exception
inside ``compute_batch`` itself propagates at once, as in any training loop.

Crash safety: a producer killed at any point leaves complete shards, maybe temp
files, maybe no manifest. Run the same call again (``resume=True``, the
default): temp files are removed, existing shards are verified and kept, the
missing ones are computed, and the finished directory is byte-identical to an
uninterrupted run (manifest included: it holds no timestamps or host names).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from te_thd.offline_cache.durable import (
    ProducerLock,
    atomic_write,
    fsync_dir,
    remove_stale_temp_files,
)
from te_thd.offline_cache.errors import CacheError, CacheIntegrityError, SchemaError
from te_thd.offline_cache.format import (
    LAYOUT_VERSION,
    MAX_SHARDS,
    RESERVED_MANIFEST_KEYS,
    CacheSchema,
    TensorSpec,
    check_shard_size,
    existing_shard_indices,
    format_indices,
    manifest_path,
    num_shards,
    read_manifest,
    schema_from_json,
    schema_to_json,
    shard_num_samples,
    shard_path,
    write_manifest,
)
from te_thd.offline_cache.shardfile import ShardRecord, file_checksum
from te_thd.offline_cache.verify import check_cache_files, check_shard_header
from te_thd.offline_cache.writer import (
    DurableShardWriter,
    _batch_size,
    lockstep_write,
    partition_cache_shards,
    shard_runs,
    validate_shard_tensors,
)

PROGRESS_NAME = ".te_thd-producer.json"
_log = logging.getLogger("te_thd.offline_cache")


class _Comm:
    """The few collectives the producer needs, trivial for a single process."""

    def __init__(self, rank: int, world_size: int, group: Any) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.distributed = world_size > 1
        if self.distributed:
            backend = dist.get_backend(group)
            self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            self.src = dist.get_global_rank(group, 0) if group is not None else 0

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def _resolve_ranks(rank: int | None, world_size: int | None, group: Any) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        g_rank, g_size = dist.get_rank(group), dist.get_world_size(group)
        if (rank is not None and rank != g_rank) or (world_size is not None and world_size != g_size):
            raise ValueError(
                f"rank={rank!r}, world_size={world_size!r} contradict the process group "
                f"(rank {g_rank} of {g_size}); omit them to use the group's"
            )
        return g_rank, g_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size != 1 or rank != 0:
        raise ValueError(
            f"world_size={world_size!r}, rank={rank!r} need an initialised torch.distributed process "
            "group (call torch.distributed.init_process_group first, or use world_size=1)"
        )
    return 0, 1


def _check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(options or {})
    clash = sorted(set(options) & RESERVED_MANIFEST_KEYS)
    if clash:
        raise ValueError(
            f"options {clash} clash with manifest fields te_thd writes itself "
            f"({sorted(RESERVED_MANIFEST_KEYS)}); rename them"
        )
    try:
        json.dumps(options, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"options must be JSON values (recorded in manifest.json): {exc}") from None
    return options


def _run_params(
    format_version: int, num_samples: int, shard_size: int, keys: Sequence[str], options: Mapping[str, Any]
) -> dict[str, Any]:
    # What must be equal for shards of two runs to belong to one cache.
    return {
        "format_version": format_version,
        "num_samples": num_samples,
        "shard_size": shard_size,
        "keys": sorted(keys),
        "options": dict(options),
    }


def _write_json(path: str, obj: Any) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

    def _write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, _write)


def _describe_diff(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    diffs = [f"{k}: recorded {recorded.get(k)!r}, this run {wanted[k]!r}" for k in wanted if recorded.get(k) != wanted[k]]
    return "; ".join(diffs)


def _prepare_directory(
    output_dir: str, params: dict[str, Any], resume: bool, cache_name: str, producer_name: str
) -> dict[str, Any] | None:
    """Rank 0, under the lock: decide. Returns the finished manifest, or ``None`` (= produce)."""
    os.makedirs(output_dir, exist_ok=True)
    progress_path = os.path.join(output_dir, PROGRESS_NAME)
    shards = existing_shard_indices(output_dir)
    if os.path.exists(manifest_path(output_dir)):
        if not resume:
            raise CacheError(
                f"output_dir {output_dir} already holds a finished cache (manifest.json). Pass "
                "resume=True to reuse it, or choose an empty output_dir."
            )
        manifest = read_manifest(output_dir, cache_name, params["format_version"], producer_name)
        recorded = {
            "format_version": manifest.get("format_version"),
            "num_samples": manifest.get("num_samples"),
            "shard_size": manifest.get("shard_size"),
            # An empty cache has no schema to read its keys from.
            "keys": sorted(manifest.get("schema") or {}) if manifest.get("num_samples") else params["keys"],
            "options": {k: v for k, v in manifest.items() if k not in RESERVED_MANIFEST_KEYS},
        }
        if recorded != params:
            raise CacheError(
                f"output_dir {output_dir} holds a finished cache built with other parameters "
                f"({_describe_diff(recorded, params)}). Choose another output_dir, or delete this cache."
            )
        check_cache_files(output_dir, manifest, cache_name)
        if os.path.exists(progress_path):  # killed after the manifest, before this cleanup
            os.unlink(progress_path)
            fsync_dir(output_dir)
        return manifest
    if os.path.exists(progress_path):
        try:
            with open(progress_path, "rb") as f:
                recorded = json.loads(f.read().decode())
        except (OSError, ValueError) as exc:
            raise CacheError(f"cannot read the producer record {progress_path} ({exc}); delete it and the shards") from None
        if shards and not resume:
            raise CacheError(
                f"output_dir {output_dir} holds {len(shards)} shards of an unfinished run. Pass resume=True "
                "to continue it, or choose an empty output_dir."
            )
        if shards and recorded != params:
            raise CacheError(
                f"output_dir {output_dir} holds shards of an unfinished run with other parameters "
                f"({_describe_diff(recorded, params)}). Resume with the same parameters, or choose "
                "another output_dir."
            )
    elif shards:
        raise CacheError(
            f"output_dir {output_dir} holds shards ({format_indices(shards)}) but no manifest and no "
            f"producer record ({PROGRESS_NAME}), so their parameters cannot be checked. Move them "
            "away or choose an empty output_dir."
        )
    removed = remove_stale_temp_files(output_dir)
    if removed:
        _log.info("Removed %d temp file(s) of an interrupted writer in %s", len(removed), output_dir)
    _write_json(progress_path, params)
    return None


class _RecordingWriter(DurableShardWriter):
    """:class:`DurableShardWriter` that keeps a rank's first write error instead of raising.

    After it, writes are skipped (the rank keeps stepping so the lockstep holds)
    and the error travels to every rank through the all-gather.
    """

    def __init__(self, keys: Sequence[str], cache_name: str, schema: CacheSchema | None) -> None:
        super().__init__(keys, cache_name, schema, pipelined=True)
        self.error: str | None = None

    def __call__(self, cache_dir: str, shard_index: int, samples: dict[str, torch.Tensor]) -> str:
        if self.error is not None:
            return shard_path(cache_dir, shard_index)
        try:
            return super().__call__(cache_dir, shard_index, samples)
        except SchemaError as exc:
            self.error = str(exc)
            return shard_path(cache_dir, shard_index)


def _verify_existing(
    output_dir: str, indices: Sequence[int], keys: Sequence[str], num_samples: int, shard_size: int
) -> tuple[dict[int, ShardRecord], CacheSchema | None]:
    """Records of shards a previous run wrote (read back: checksum + header against one schema)."""
    from te_thd.offline_cache.shardfile import read_header

    records: dict[int, ShardRecord] = {}
    schema: CacheSchema | None = None
    for i in sorted(indices):
        path = shard_path(output_dir, i)
        if schema is None:
            entries = read_header(path)
            schema = {k: TensorSpec(e.dtype, e.shape[1:]) for k, e in entries.items() if e.shape}
            if set(schema) != set(keys):
                raise SchemaError(
                    f"existing shard {path} holds keys {sorted(entries)}, this run stores {sorted(keys)}; "
                    "resume with the same keys, or choose another output_dir"
                )
        problems = check_shard_header(path, schema, shard_num_samples(i, num_samples, shard_size))
        if problems:
            raise CacheIntegrityError(
                f"existing shard {path}: {'; '.join(problems)}. Delete it and resume to recompute it.", path=path
            )
        records[i] = ShardRecord(bytes=os.stat(path).st_size, checksum=file_checksum(path))
    return records, schema


def _progress_bar(total: int, enabled: bool | None, rank: int) -> Any:
    if rank != 0 or enabled is False:
        return None
    from tqdm.auto import tqdm

    # disable=None: tqdm turns itself off when stderr is not a TTY (logs, CI).
    return tqdm(total=total, desc="cache", unit="batch", disable=None if enabled is None else False)


def produce_cache(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    compute_batch: Callable[[Any], dict[str, torch.Tensor]],
    keys: Sequence[str],
    options: Mapping[str, Any] | None = None,
    *,
    format_version: int = 1,
    cache_name: str = "offline",
    producer_name: str = "produce_cache",
    resume: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    group: Any = None,
    lock: bool = True,
    progress: bool | None = None,
    logger: logging.Logger | None = None,
) -> dict[str, Any]:
    """Produce (or finish, or reuse) the cache of ``dataloader`` in ``output_dir``; return its manifest.

    Args:
        dataloader: sequential loader over a map-style dataset (``len(dataset)``
            samples); its batch size, collate_fn and worker settings are reused.
        shard_size: samples per shard (> 0). Prefer a multiple of the batch size
            (see ``writer``: then resumed/distributed runs form identical batches).
        compute_batch: ``batch -> {key: tensor [batch, ...]}``; may be a
            collective (called equally often on every rank).
        keys: the keys to store; each ``[n, *trailing]`` with a fixed dtype and
            trailing shape (the schema, fixed by the first shard).
        options: producer options recorded top-level in the manifest (JSON
            values), checked later by :func:`ensure_supervision_options_match`.
        format_version: the caller's version of what the tensors mean.
        resume: continue an interrupted run / reuse a finished identical cache.
            ``False`` refuses a directory that holds shards or a manifest.
        rank, world_size, group: default to the initialised process group
            (``group=None``: the world); ``world_size == 1`` runs single-process.
        lock: take the producer lock (refuse a second producer). Only disable
            on filesystems without flock, when you guarantee a single producer.
        progress: tqdm bar on rank 0; ``None`` = only when stderr is a TTY.

    Every rank returns the same manifest dict (``read_manifest``'s view).
    """
    logger = logger or _log
    check_shard_size(shard_size)
    keys = tuple(keys)
    if not keys or not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"keys={keys!r} must be a non-empty tuple of distinct key names, e.g. ('hidden',)")
    opts = _check_options(options)
    dataset = dataloader.dataset
    try:
        num_samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            "produce_cache needs a map-style dataset with len(): shards are assigned by sample "
            "index (got an iterable dataset)"
        ) from None
    if num_shards(num_samples, shard_size) > MAX_SHARDS:
        raise ValueError(
            f"shard_size={shard_size} gives {num_shards(num_samples, shard_size)} shards for "
            f"{num_samples} samples; at most {MAX_SHARDS} fit the six-digit names. Use a larger shard_size."
        )
    rank, world_size = _resolve_ranks(rank, world_size, group)
    comm = _Comm(rank, world_size, group)
    params = _run_params(format_version, num_samples, shard_size, keys, opts)

    producer_lock = ProducerLock(output_dir) if (lock and rank == 0) else None
    try:
        # -- 1. rank 0 inspects and prepares the directory -------------------------------
        status: tuple[str, Any]
        if rank == 0:
            try:
                if producer_lock is not None:
                    producer_lock.acquire()
                finished = _prepare_directory(output_dir, params, resume, cache_name, producer_name)
                status = ("done", finished) if finished is not None else ("work", None)
            except Exception as exc:
                # Tell the other ranks before raising, or they wait in broadcast forever.
                comm.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                raise
        status = comm.broadcast(status if rank == 0 else None)
        if status[0] == "error":
            raise CacheError(f"rank 0 refused to produce the cache: {status[1]}")
        if status[0] == "done":
            logger.info("%s is already a finished cache (%d samples); nothing to do", output_dir, num_samples)
            return status[1]

        # -- 2. this rank's block: verify what exists, compute what is missing -----------
        start_shard, _, n_local = partition_cache_shards(num_samples, shard_size, world_size, rank)
        block = range(start_shard, start_shard + num_shards(n_local, shard_size)) if n_local else range(0)
        present = existing_shard_indices(output_dir) & set(block)
        local_exc: Exception | None = None
        existing_records: dict[int, ShardRecord] = {}
        schema: CacheSchema | None = None
        try:
            existing_records, schema = _verify_existing(output_dir, sorted(present), keys, num_samples, shard_size)
        except Exception as exc:
            local_exc = exc
        errors = comm.all_gather((None if local_exc is None else f"rank {rank}: {local_exc}", num_samples))
        if local_exc is not None:
            raise local_exc
        first = next((e for e, _ in errors if e is not None), None)
        if first is not None:
            raise CacheError(f"another rank failed to verify its existing shards: {first}")
        lengths = sorted({n for _, n in errors})
        if len(lengths) > 1:
            raise ValueError(
                f"ranks see different dataset lengths {lengths}; every rank must build the same "
                "dataset (each computes its own block of it)"
            )
        if present:
            logger.info("Rank %d: resuming; %d existing shard(s) verified (%s)", rank, len(present), format_indices(present))

        writer = _RecordingWriter(keys, cache_name, schema)
        runs = shard_runs(sorted(set(block) - present), num_samples, shard_size)
        bs = _batch_size(dataloader)
        global_steps = comm.max_int(sum(-(-n // bs) for _, _, n in runs))
        bar = _progress_bar(global_steps, progress, rank)

        def compute(batch: Any) -> dict[str, torch.Tensor] | None:
            out = compute_batch(batch)
            if writer.error is not None:
                return None
            if not isinstance(out, Mapping):
                writer.error = f"compute_batch returned a {type(out).__name__}; it must return a dict of tensors"
                return None
            try:
                return validate_shard_tensors(out, keys, cache_name, -1, where="compute_batch output")
            except SchemaError as exc:
                writer.error = str(exc)
                return None

        try:
            lockstep_write(
                dataloader, output_dir, shard_size, runs, compute, writer, logger,
                sync_max_steps=lambda _steps: global_steps, progress=bar,
            )
        finally:
            if bar is not None:
                bar.close()
            # Even when compute_batch raised: finish committing the complete shards
            # (a resume keeps them) and stop the commit thread.
            writer.close()

        # -- 3. gather records; rank 0 writes the manifest last --------------------------
        records = {**existing_records, **writer.records}
        mine = (
            writer.error,
            {i: (r.bytes, r.checksum) for i, r in records.items()},
            schema_to_json(writer.schema) if writer.schema is not None else None,
        )
        gathered = comm.all_gather(mine)
        outcome: tuple[str, Any]
        rank0_exc: Exception | None = None
        if rank == 0:
            try:
                manifest = _assemble_manifest(gathered, params, opts, output_dir, cache_name)
                write_manifest(output_dir, manifest, format_version)
                os.unlink(os.path.join(output_dir, PROGRESS_NAME))
                fsync_dir(output_dir)
                outcome = ("ok", read_manifest(output_dir, cache_name, format_version, producer_name))
                logger.info("Wrote %s (%d samples, %d shards)", manifest_path(output_dir), num_samples, len(manifest["shards"]))
            except Exception as exc:
                rank0_exc = exc
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        outcome = comm.broadcast(outcome if rank == 0 else None)
        if rank0_exc is not None:
            raise rank0_exc
        if outcome[0] == "error":
            raise CacheError(f"rank 0 could not finish the cache: {outcome[1]}")
        return outcome[1]
    finally:
        if producer_lock is not None:
            producer_lock.release()


def _assemble_manifest(
    gathered: Sequence[tuple[str | None, dict[int, tuple[int, str]], dict[str, Any] | None]],
    params: Mapping[str, Any],
    options: Mapping[str, Any],
    output_dir: str,
    cache_name: str,
) -> dict[str, Any]:
    errors = [(r, e) for r, (e, _, _) in enumerate(gathered) if e is not None]
    if errors:
        raise SchemaError("; ".join(f"rank {r}: {e}" for r, e in errors))
    num_samples, shard_size = params["num_samples"], params["shard_size"]
    expected = num_shards(num_samples, shard_size)
    records: dict[int, tuple[int, str]] = {}
    for _, recs, _ in gathered:
        records.update(recs)
    missing = sorted(set(range(expected)) - set(records))
    if missing:
        raise CacheIntegrityError(
            f"{cache_name} cache at {output_dir}: no rank reported shards {format_indices(missing)}; "
            "the dataloader yielded fewer samples than len(dataset). Fix the dataset, then resume.",
            path=shard_path(output_dir, missing[0]),
        )
    schemas = {json.dumps(s, sort_keys=True): (r, s) for r, (_, _, s) in enumerate(gathered) if s is not None}
    if len(schemas) > 1:
        desc = "; ".join(f"rank {r}: {schema_from_json(s)}" for r, s in schemas.values())
        raise SchemaError(f"ranks wrote shards with different schemas ({desc}); compute_batch must be deterministic in dtype/shape")
    schema = next(iter(schemas.values()))[1] if schemas else {}
    return {
        **options,
        "num_samples": num_samples,
        "shard_size": shard_size,
        "layout_version": LAYOUT_VERSION,
        "schema": schema,
        "shards": [
            {"file": os.path.basename(shard_path(output_dir, i)), "bytes": records[i][0], "checksum": records[i][1]}
            for i in range(expected)
        ],
    }


__all__ = ["PROGRESS_NAME", "produce_cache"]
