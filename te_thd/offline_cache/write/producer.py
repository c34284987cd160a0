"""``produce_cache``: the complete producer -- lock, resume, distributed lockstep, manifest last.

One call turns ``dataloader`` + ``compute_batch`` into a finished cache::

    manifest = produce_cache(loader, "/data/cache", shard_size=256,
                             compute_batch=lambda b: {"hidden": model(b)},
                             keys=("hidden",), options={"cp_size": 2})

In order (``rank`` in ``group``; one process is rank 0 of 1):

1. rank 0 takes the producer lock, inspects the directory and tells every rank what to do
   (:func:`~te_thd.offline_cache.write.resume.prepare_directory`): reuse a finished cache
   with the same parameters, refuse one with others (naming the difference), or record the
   run's parameters and produce.
2. every rank takes its contiguous shard block (:func:`partition_cache_shards`), verifies the
   shards of it that exist, and computes only the missing ones, padding to the global step
   count with dummy forwards (:func:`lockstep_write`). :class:`ProducerComm` holds the few
   collectives this needs, trivial for one process.
3. the ranks all-gather their shard records; rank 0 checks that every shard exists once with
   one schema and writes ``manifest.json`` atomically, last; every rank returns it.

A write error on one rank (a schema mismatch) does not hang the others: the rank keeps stepping
without writing and the error is raised on every rank after the all-gather. An exception inside
``compute_batch`` propagates at once. A producer killed at any point is finished by the same
call (``resume=True``): temp files removed, existing shards verified and kept, the directory
byte-identical to an uninterrupted run (the manifest holds no timestamps or host names).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from te_thd.args import check_names
from te_thd.offline_cache.format.lengths import LengthRule, producer_rule
from te_thd.offline_cache.format.ragged import TokenLayout, check_token_keys
from te_thd.offline_cache.format.schema import (
    FOLLOW_NAME,
    MANIFEST_NAME,
    MAX_SHARDS,
    CacheError,
    CacheSchema,
    SchemaError,
    check_shard_size,
    format_indices,
    num_shards,
    schema_to_json,
    shard_path,
)
from te_thd.offline_cache.record.manifest import (
    existing_shard_indices,
    read_manifest,
    write_manifest,
)
from te_thd.offline_cache.record.run import ShardRecord, follow_record, run_params, run_record
from te_thd.offline_cache.storage.base import Lock, Storage
from te_thd.offline_cache.storage.schemes import open_storage
from te_thd.offline_cache.write.loops import (
    loader_num_samples,
    lockstep_write,
    partition_cache_shards,
    shard_runs,
)
from te_thd.offline_cache.write.resume import (
    PROGRESS_NAME,
    assemble_manifest,
    check_options,
    prepare_directory,
    verify_existing,
)
from te_thd.offline_cache.write.writer import DurableShardWriter

_log = logging.getLogger(__name__)


class ProducerComm:
    """The few collectives the producer needs, trivial for a single process."""

    def __init__(self, rank: int, world_size: int, group: Any) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.distributed = world_size > 1
        if self.distributed:
            backend = dist.get_backend(group)
            self.device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
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

    def on_rank0(self, fn: Callable[[], Any], failed: str) -> Any:
        """``fn()`` on rank 0, its result broadcast to every rank. An error there is raised on rank
        0 and, as a :class:`CacheError` ``"<failed>: <error>"``, on the others: told before rank 0
        raises, or they would wait in the broadcast forever."""
        outcome: tuple[str, Any] | None = None
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except Exception as exc:
                self.broadcast(("error", f"{type(exc).__name__}: {exc}"))
                raise
        outcome = self.broadcast(outcome)
        if outcome[0] == "error":
            raise CacheError(f"{failed}: {outcome[1]}")
        return outcome[1]

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())


def resolve_ranks(rank: int | None, world_size: int | None, group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of this process: the initialised ``group``'s (the arguments, if given,
    must agree), else ``(0, 1)``; any other value without a process group is a ``ValueError``."""
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        g_rank, g_size = dist.get_rank(group), dist.get_world_size(group)
        if (rank is not None and rank != g_rank) or (
            world_size is not None and world_size != g_size
        ):
            raise ValueError(
                f"rank={rank!r}, world_size={world_size!r} contradict the process group "
                f"(rank {g_rank} of {g_size}); omit them to use the group's"
            )
        return g_rank, g_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size != 1 or rank != 0:
        raise ValueError(
            f"world_size={world_size!r}, rank={rank!r} need an initialised "
            "torch.distributed process "
            "group (call torch.distributed.init_process_group first, or use world_size=1)"
        )
    return 0, 1


class _RecordingWriter(DurableShardWriter):
    """:class:`DurableShardWriter` that keeps a rank's first write error instead of raising.

    After it, writes are skipped (the rank keeps stepping so the lockstep holds)
    and the error travels to every rank through the all-gather.
    """

    error: str | None = None  # the first write error, set once

    def validate(
        self, samples: Any, shard_index: int = -1, where: str | None = None
    ) -> dict[str, torch.Tensor]:
        """One ``compute_batch`` result, validated against the schema (the first batch fixes it if
        unset): the stored keys, or ``{}`` (nothing to store) once the first error is recorded."""
        if self.error is None:
            try:
                return super().validate(samples, shard_index, "compute_batch output")
            except SchemaError as exc:
                self.error = str(exc)
        return {}

    def finish_shard(self, cache_dir: str, shard_index: int) -> str:
        if self.error is not None:  # the shard stays unfinished; close() removes its temp file
            return shard_path(cache_dir, shard_index)
        return super().finish_shard(cache_dir, shard_index)


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
    producer_name: str | None = None,
    resume: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    group: Any = None,
    lock: bool = True,
    progress: bool | None = None,
    logger: logging.Logger | None = None,
    length_key: str | None = None,
    token_keys: Sequence[str] = (),
    codecs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Produce (or finish, or reuse) the cache of ``dataloader`` in ``output_dir``; return its
    manifest.

    Args:
        dataloader: sequential loader over a map-style dataset (``len(dataset)``
            samples); its batch size, collate_fn and worker settings are reused.
        shard_size: samples per shard (> 0). Prefer a multiple of the batch size
            (see ``loops``: then resumed/distributed runs form identical batches).
        compute_batch: ``batch -> {key: tensor [batch, ...]}``; may be a
            collective (called equally often on every rank). Each batch is written
            behind the computation (into its shard's temp file while the next
            batches are computed; a shard is fsynced and renamed after its last
            batch), so the returned tensors must not be modified afterwards (return
            new tensors, as a model's forward does).
        keys: the keys to store; each ``[n, *trailing]`` with a fixed dtype and
            trailing shape (the schema, fixed by the first shard).
        options: producer options recorded top-level in the manifest (JSON
            values), checked later by :func:`ensure_supervision_options_match`.
        format_version: the caller's version of what the tensors mean.
        producer_name: the command that re-runs this producer, named in error
            messages (e.g. a script's command line).
        resume: continue an interrupted run / reuse a finished identical cache.
            ``False`` refuses a directory that holds shards or a manifest.
        rank, world_size, group: default to the initialised process group
            (``group=None``: the world); ``world_size == 1`` runs single-process.
        lock: take the producer lock (refuse a second producer). Only disable
            on filesystems without flock, when you guarantee a single producer.
        progress: tqdm bar on rank 0; ``None`` = only when stderr is a TTY.
        length_key: the stored key each sample's real length is read from,
            recorded per shard in the manifest (``te_thd.offline_cache.format.lengths``):
            its value when it holds one number per sample, else its non-padding
            length. Default ``input_ids`` when stored, else no lengths are recorded.
        token_keys: stored keys shaped ``[n, L, ...]`` to store ragged: only each
            sample's first ``length`` tokens (``length`` by ``length_key``), back to
            back (``te_thd.offline_cache.format.ragged``). Every reader returns them as the
            padded cache would: ``[L, ...]`` per sample, zeros past the length.
            Needs the lengths (``length_key``, or a stored ``input_ids``).
        codecs: ``{token key: "fp8_e4m3"}``: store that float key as float8 e4m3
            with one float32 scale per token; read back as its logical dtype
            (``te_thd.offline_cache.format.ragged``). What it lost is recorded per shard.
            ``{token key: "topk_index:<V>"}``: store that int32/int64 key of indices
            in ``[0, V)`` losslessly in 16, 17 or 32 bits each, as ``V`` needs.

    ``output_dir`` may be ``s3://bucket/prefix`` (the ``s3`` extra; any S3-compatible
    store, configured by the standard AWS environment variables): every shard is
    uploaded whole once written (a multipart upload when large, visible only once
    complete), the manifest last; the lock is a conditional PUT
    (:mod:`~te_thd.offline_cache.storage.s3`); a run killed at any point is finished
    by the same call, with the same bytes. ``msc://profile/path`` (the ``msc`` extra) is a
    profile of MSC's config file, the same way (:mod:`~te_thd.offline_cache.storage.msc`). A URL of
    another scheme is refused.

    Every rank returns the same manifest dict (``read_manifest``'s view).
    """
    storage = open_storage(output_dir, "output_dir")  # a bad URL is refused before anything else
    # every argument is checked before any rank touches the directory
    check_shard_size(shard_size)
    keys = check_names("keys", keys, non_empty=True, distinct=True)
    opts = check_options(options)
    length_rule = producer_rule(length_key, keys)
    token_layout = check_token_keys(token_keys, codecs, keys)
    if token_layout is not None and length_rule is None:
        raise ValueError(
            f"token_keys={tuple(token_keys)} needs each sample's length to know which "
            "tokens to store; pass "
            "length_key=<the stored key with each sample's length or its token ids>"
        )
    num_samples = loader_num_samples(dataloader)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(
            f"output_dir={output_dir!r} is a file, not a directory; pass a directory "
            "(new, or one this producer wrote)"
        )
    if num_shards(num_samples, shard_size) > MAX_SHARDS:
        raise ValueError(
            f"shard_size={shard_size} gives {num_shards(num_samples, shard_size)} shards for "
            f"{num_samples} samples; at most {MAX_SHARDS} fit the six-digit names. Use a "
            "larger shard_size."
        )
    rank, world_size = resolve_ranks(rank, world_size, group)
    params = run_params(format_version, num_samples, shard_size, keys, opts, token_layout)
    job = _Job(
        output_dir=output_dir,
        shard_size=shard_size,
        keys=keys,
        options=opts,
        format_version=format_version,
        cache_name=cache_name,
        producer_name=producer_name,
        num_samples=num_samples,
        logger=logger or _log,
        comm=ProducerComm(rank, world_size, group),
        length_rule=length_rule,
        token_layout=token_layout,
        params=params,
        record=run_record(params, length_rule),
        storage=storage,
    )
    producer_lock = storage.lock() if (lock and job.comm.rank == 0) else None
    return job.run(producer_lock, resume, dataloader, compute_batch, progress)


@dataclass(frozen=True)
class _Job:
    """One ``produce_cache`` call on one rank: its parameters (validated) and its phases, in
    order."""

    output_dir: str
    shard_size: int
    keys: tuple[str, ...]
    options: dict[str, Any]  # the producer options, JSON values
    format_version: int
    cache_name: str
    producer_name: str | None
    num_samples: int
    logger: logging.Logger
    comm: ProducerComm
    length_rule: LengthRule | None
    token_layout: TokenLayout | None
    params: dict[str, Any]  # what two runs must share to write one cache (``run_params``)
    record: dict[str, Any]  # what every shard's header keeps (``run_record``): the run's identity
    storage: Storage  # where ``output_dir`` lives

    def run(
        self,
        producer_lock: Lock | None,
        resume: bool,
        dataloader: DataLoader,
        compute_batch: Callable[[Any], Any],
        progress: bool | None,
    ) -> dict[str, Any]:
        """Every phase in order, the lock (rank 0) held throughout; the finished manifest."""
        try:
            finished = self.prepare(producer_lock, resume)
            if finished is not None:
                self.logger.info(
                    "%s is already a finished cache (%d samples); nothing to do",
                    self.output_dir,
                    self.num_samples,
                )
                return finished
            records, schema, missing = self.verify_block()
            writer = self.compute(dataloader, compute_batch, missing, schema, progress)
            return self.finish({**records, **writer.records}, writer)
        finally:
            if producer_lock is not None:
                producer_lock.release()

    def prepare(self, producer_lock: Lock | None, resume: bool) -> dict[str, Any] | None:
        """Rank 0 inspects the directory under the lock; every rank learns the outcome.

        Returns the finished manifest (nothing to do) or ``None`` (produce).
        """

        def decide() -> dict[str, Any] | None:
            if producer_lock is not None:
                producer_lock.acquire()
            finished = prepare_directory(
                self.storage, self.params, resume, self.cache_name, self.producer_name
            )
            # before any shard: what a reader following this run needs (follow.py)
            if finished is None:
                self.storage.put(FOLLOW_NAME, follow_record(self.record, self.producer_name))
            return finished

        return self.comm.on_rank0(decide, "rank 0 refused to produce the cache")

    def verify_block(self) -> tuple[dict[int, ShardRecord], CacheSchema | None, list[int]]:
        """This rank's shard block: verify the shards that exist; return their records, schema, the
        rest."""
        comm = self.comm
        start_shard, _, n_local = partition_cache_shards(
            self.num_samples, self.shard_size, comm.world_size, comm.rank
        )
        block = range(start_shard, start_shard + num_shards(n_local, self.shard_size))
        present = existing_shard_indices(self.storage) & set(block)
        local_exc: Exception | None = None
        records: dict[int, ShardRecord] = {}
        schema: CacheSchema | None = None
        try:
            records, schema = verify_existing(
                self.storage,
                sorted(present),
                self.keys,
                self.num_samples,
                self.shard_size,
                self.length_rule,
                self.record,
            )
        except Exception as exc:
            local_exc = exc
        errors = comm.all_gather(
            (None if local_exc is None else f"rank {comm.rank}: {local_exc}", self.num_samples)
        )
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
            self.logger.info(
                "Rank %d: resuming; %d existing shard(s) verified (%s)",
                comm.rank,
                len(present),
                format_indices(present),
            )
        return records, schema, sorted(set(block) - present)

    def compute(
        self,
        dataloader: DataLoader,
        compute_batch: Callable[[Any], Any],
        missing: Sequence[int],
        schema: CacheSchema | None,
        progress: bool | None,
    ) -> _RecordingWriter:
        """Compute and write the shards ``missing`` in lockstep with the other ranks."""
        # write-behind: batches are written (streamed into their shard) while the next are computed
        writer = _RecordingWriter(
            self.keys,
            self.cache_name,
            schema,
            write_behind=True,
            length_rule=self.length_rule,
            token_layout=self.token_layout,
            run_record=self.record,
        )
        try:
            lockstep_write(
                dataloader,
                self.storage,  # the writer commits through the storage this run opened
                self.shard_size,
                shard_runs(missing, self.num_samples, self.shard_size),
                compute_batch,
                writer,
                self.logger,
                sync_max_steps=self.comm.max_int,
                progress=lambda steps: _progress_bar(steps, progress, self.comm.rank),
            )
        finally:
            # Even when compute_batch raised: finish committing the complete shards
            # (a resume keeps them) and stop the commit thread.
            writer.close()
        return writer

    def finish(
        self, records: Mapping[int, ShardRecord], writer: _RecordingWriter
    ) -> dict[str, Any]:
        """Gather every rank's records; rank 0 writes the manifest last; all return it."""
        comm = self.comm
        mine = (
            writer.error,
            dict(records),
            schema_to_json(writer.schema) if writer.schema is not None else None,
        )
        gathered = comm.all_gather(mine)

        def write() -> dict[str, Any]:
            manifest = assemble_manifest(
                gathered,
                self.params,
                self.options,
                self.output_dir,
                self.cache_name,
                self.length_rule,
            )
            write_manifest(self.storage, manifest, self.format_version)
            self.storage.delete(PROGRESS_NAME)
            self.storage.delete(FOLLOW_NAME)
            finished = read_manifest(
                self.storage, self.cache_name, self.format_version, self.producer_name
            )
            self.logger.info(
                "Wrote %s (%d samples, %d shards)",
                self.storage.display(MANIFEST_NAME),
                self.num_samples,
                len(manifest["shards"]),
            )
            return finished

        return comm.on_rank0(write, "rank 0 could not finish the cache")


__all__ = ["PROGRESS_NAME", "produce_cache"]
