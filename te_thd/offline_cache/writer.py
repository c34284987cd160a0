"""Producer building blocks of the reference API: shard writes, the accumulator, the loops.

- :func:`write_tensor_shard` writes one shard durably (``atomic_write``) and
  rejects tensors that do not fit the cache: a missing key, keys whose sample
  counts disagree, and -- given a ``schema`` -- a dtype or trailing shape that
  differs from it.
- :class:`_ShardAccumulator` turns a stream of computed batches into
  fixed-size shards with global indices; the single-process and the
  distributed loops share it, so both lay out identical files.
- :func:`write_cache_shards` / :func:`write_cache_shards_distributed` are the
  reference loops; :func:`lockstep_write` is their engine, generalised to a
  list of shard runs so a resumed (or distributed-resumed) producer recomputes
  only missing shards. ``te_thd.offline_cache.producer.produce_cache`` builds on it.

Byte-identical output across resume / world sizes holds when ``compute_batch``
gives each sample the same result whatever batch it is in. Runs start at shard
boundaries, so with ``shard_size % batch_size == 0`` every run forms exactly the
batches an uninterrupted single-process run forms, and even batch-dependent
numerics (padding, kernel choice) reproduce.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from te_thd.offline_cache.durable import BackgroundCommitter, commit_temp, write_temp
from te_thd.offline_cache.errors import SchemaError
from te_thd.offline_cache.format import (
    DTYPE_TO_ST,
    CacheSchema,
    TensorSpec,
    check_shard_size,
    format_indices,
    load_safetensors,
    shard_path,
)
from te_thd.offline_cache.shardfile import ShardRecord, write_shard_file

WriteShardFn = Callable[[str, int, dict[str, torch.Tensor]], str]


def validate_shard_tensors(
    samples: Mapping[str, Any],
    keys: Sequence[str],
    cache_name: str,
    shard_index: int,
    schema: Mapping[str, TensorSpec] | None = None,
    where: str | None = None,
) -> dict[str, torch.Tensor]:
    """The ``keys`` of ``samples``, checked: ``{key: tensor [n, *trailing]}`` with one ``n``.

    Raises :class:`SchemaError` naming the shard and key when a key is missing,
    not a tensor, 0-d, has another sample count than the first key, or -- with
    ``schema`` -- another dtype or trailing shape. Extra keys in ``samples`` are
    ignored (``compute_batch`` may return more than the cache stores), as in the
    reference. ``where`` replaces "<cache_name> cache shard <i>" in messages.
    """
    where = where or f"{cache_name} cache shard {shard_index}"
    keys = tuple(keys)
    if not keys:
        raise SchemaError(f"{where}: keys=() names no tensors to store; pass e.g. keys=('hidden_states',)")
    missing = [k for k in keys if k not in samples]
    if missing:
        raise SchemaError(
            f"{where} is missing required cache keys {missing} (got {sorted(samples)}). "
            "Make compute_batch return every key in `keys`, or drop it from `keys`."
        )
    if schema is not None and set(schema) != set(keys):
        raise SchemaError(
            f"{where}: keys {sorted(keys)} differ from the cache schema's {sorted(schema)}; a cache "
            "holds one fixed set of keys. Write to a new output directory to change them."
        )
    out: dict[str, torch.Tensor] = {}
    n_first: int | None = None
    for k in keys:
        t = samples[k]
        if not isinstance(t, torch.Tensor):
            raise SchemaError(f"{where}: key {k!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() == 0:
            raise SchemaError(
                f"{where}: key {k!r} is a 0-d tensor; cache tensors are [n_samples, ...] "
                "stacked on dim 0 (unsqueeze(0) a per-sample scalar)"
            )
        if n_first is None:
            n_first = t.shape[0]
        elif t.shape[0] != n_first:
            raise SchemaError(
                f"{where}: key {k!r} has {t.shape[0]} samples on dim 0 but {keys[0]!r} has "
                f"{n_first}; every key must hold one row per sample"
            )
        if t.dtype not in DTYPE_TO_ST:
            raise SchemaError(
                f"{where}: key {k!r} has dtype {t.dtype}, which safetensors cannot store; cast it to "
                f"one of {sorted(str(d).removeprefix('torch.') for d in DTYPE_TO_ST)}"
            )
        if schema is not None:
            want, got = schema[k], TensorSpec(t.dtype, tuple(t.shape[1:]))
            if got != want:
                raise SchemaError(
                    f"{where}: key {k!r} is {got.describe()} but the cache schema says "
                    f"{want.describe()} (dtype and per-sample shape are fixed per cache). Cast/reshape "
                    "the tensor in compute_batch, or write to a new output directory."
                )
        out[k] = t
    return out


def schema_of(tensors: Mapping[str, torch.Tensor]) -> CacheSchema:
    """``{key: TensorSpec(dtype, trailing shape)}`` of ``[n, ...]`` tensors."""
    return {k: TensorSpec(t.dtype, tuple(t.shape[1:])) for k, t in tensors.items()}


def write_shard_with_record(
    cache_dir: str,
    shard_index: int,
    samples: Mapping[str, Any],
    keys: Sequence[str],
    cache_name: str,
    schema: Mapping[str, TensorSpec] | None = None,
    committer: BackgroundCommitter | None = None,
) -> tuple[str, ShardRecord]:
    """:func:`write_tensor_shard` that also returns the shard's ``(bytes, checksum)`` record.

    With a ``committer`` only the temp file is written here; its fsync + rename
    happen on the committer's thread (the shard is visible once it committed).
    """
    tensors = validate_shard_tensors(samples, keys, cache_name, shard_index, schema)
    load_safetensors(cache_name)  # the format is safetensors': fail early if it is missing
    final = shard_path(cache_dir, shard_index)
    record: list[ShardRecord] = []
    tmp = write_temp(final, lambda tmp: record.append(write_shard_file(tmp, tensors)))
    if committer is None:
        commit_temp(tmp, final)
    else:
        committer.submit(tmp, final)
    return final, record[0]


class DurableShardWriter:
    """``write_shard_fn`` for a stream of shards: one schema, a record per shard, pipelined durability.

    ``writer(cache_dir, shard_index, samples) -> path`` validates ``samples``
    against the schema (the first shard's, unless ``schema`` is given), writes the
    shard and keeps its :class:`ShardRecord` in ``records``. With
    ``pipelined=True`` the fsync + rename of shard ``k`` run on a background
    thread while shard ``k+1`` is serialised (:class:`BackgroundCommitter`); call
    :meth:`flush` (or leave the ``with`` block) before relying on the files,
    e.g. before writing the manifest.
    """

    def __init__(
        self,
        keys: Sequence[str],
        cache_name: str = "offline",
        schema: Mapping[str, TensorSpec] | None = None,
        pipelined: bool = True,
    ) -> None:
        self.keys = tuple(keys)
        self.cache_name = cache_name
        self.schema: CacheSchema | None = dict(schema) if schema is not None else None
        self.records: dict[int, ShardRecord] = {}
        self._committer = BackgroundCommitter() if pipelined else None

    def __call__(self, cache_dir: str, shard_index: int, samples: dict[str, torch.Tensor]) -> str:
        path, record = write_shard_with_record(
            cache_dir, shard_index, samples, self.keys, self.cache_name, self.schema, self._committer
        )
        if self.schema is None:
            self.schema = schema_of({k: samples[k] for k in self.keys})
        self.records[shard_index] = record
        return path

    def flush(self) -> None:
        """Block until every shard written so far is durable under its final name."""
        if self._committer is not None:
            self._committer.flush()

    def close(self) -> None:
        if self._committer is not None:
            self._committer.close()

    def __enter__(self) -> DurableShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_tensor_shard(
    cache_dir: str,
    shard_index: int,
    samples: dict[str, torch.Tensor],
    keys: tuple[str, ...],
    cache_name: str,
    schema: Mapping[str, TensorSpec] | None = None,
) -> str:
    """Write one cache shard containing exactly the requested tensor keys.

    ``samples[k]`` is ``[n, *trailing]`` for every ``k`` in ``keys`` (extra keys
    are dropped). The file is byte-identical to ``safetensors.torch.save_file``
    of those tensors and lands atomically and durably at ``shard_path``.
    ``schema`` (te_thd extension) pins each key's dtype and trailing shape.
    Returns the shard's path.
    """
    return write_shard_with_record(cache_dir, shard_index, samples, keys, cache_name, schema)[0]


def _batch_rows(batch_cache: Mapping[str, Any]) -> int:
    rows = None
    for k, t in batch_cache.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise SchemaError(
                f"compute_batch returned {k!r} as {type(t).__name__}"
                f"{'' if not isinstance(t, torch.Tensor) else ' (0-d)'}; every returned value must be "
                "a tensor [batch, ...] (filter extra outputs, or store them with a batch dim)"
            )
        if rows is None:
            rows = t.shape[0]
        elif t.shape[0] != rows:
            raise SchemaError(
                f"compute_batch returned {k!r} with {t.shape[0]} rows but other keys with {rows}; "
                "every key must hold one row per sample"
            )
    if rows is None:
        raise SchemaError("compute_batch returned an empty dict; it must return the cache tensors")
    return rows


class _ShardAccumulator:
    """Buffer per-batch cache tensors and flush them as fixed-size sequential shards.

    Shard indices count up from ``start_shard_index``; a trailing partial shard is
    written by ``finalize``. Shared by the single-process and distributed
    precompute loops so both produce the identical on-disk shard layout.

    Batches are moved to the CPU as they arrive (a GPU producer does not hold a
    shard's worth of outputs in device memory) and each shard concatenates only
    the pieces it needs, so buffering is linear in the shard size.
    """

    def __init__(
        self,
        output_dir: str,
        shard_size: int,
        start_shard_index: int,
        write_shard_fn: WriteShardFn,
        logger: logging.Logger,
    ) -> None:
        self._output_dir = output_dir
        self._shard_size = check_shard_size(shard_size)
        self._write_shard_fn = write_shard_fn
        self._logger = logger
        self._shard_index = start_shard_index
        self._chunks: list[dict[str, torch.Tensor]] = []
        self._buffered = 0
        self.shards_written: list[int] = []

    @property
    def next_shard_index(self) -> int:
        return self._shard_index

    def _flush(self, max_samples: int | None = None) -> None:
        if self._buffered == 0:
            return
        n = self._buffered if max_samples is None else min(self._buffered, max_samples)
        pieces: list[dict[str, torch.Tensor]] = []
        taken = 0
        while taken < n:
            chunk = self._chunks[0]
            rows = next(iter(chunk.values())).shape[0]
            need = n - taken
            if rows <= need:
                pieces.append(self._chunks.pop(0))
                taken += rows
            else:
                pieces.append({k: v[:need] for k, v in chunk.items()})
                self._chunks[0] = {k: v[need:] for k, v in chunk.items()}
                taken += need
        shard = {k: pieces[0][k] if len(pieces) == 1 else torch.cat([p[k] for p in pieces]) for k in pieces[0]}
        path = self._write_shard_fn(self._output_dir, self._shard_index, shard)
        self._logger.info("Wrote %s (%d samples)", path, n)
        self.shards_written.append(self._shard_index)
        self._buffered -= n
        self._shard_index += 1

    def add(self, batch_cache: dict[str, torch.Tensor]) -> None:
        """Append one computed batch, flushing whole shards as they fill."""
        rows = _batch_rows(batch_cache)
        if self._chunks and set(batch_cache) != set(self._chunks[0]):
            raise SchemaError(
                f"compute_batch returned keys {sorted(batch_cache)} after {sorted(self._chunks[0])}; "
                "every batch must return the same keys"
            )
        if rows == 0:
            return
        self._chunks.append({k: v.detach().to("cpu") for k, v in batch_cache.items()})
        self._buffered += rows
        while self._buffered >= self._shard_size:
            self._flush(self._shard_size)

    def finalize(self) -> None:
        """Write the trailing partial shard, if any."""
        self._flush()


def write_cache_shards(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    start_shard_index: int,
    compute_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
) -> None:
    """Run a precompute loop and write sequential cache shards.

    Every batch of ``dataloader`` goes through ``compute_batch``; outputs are
    cut into shards of ``shard_size`` samples numbered from ``start_shard_index``
    and written with ``write_shard_fn(output_dir, index, tensors) -> path``.
    """
    accumulator = _ShardAccumulator(output_dir, shard_size, start_shard_index, write_shard_fn, logger)
    for batch in dataloader:
        accumulator.add(compute_batch(batch))
    accumulator.finalize()


def partition_cache_shards(num_samples: int, shard_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """Assign a contiguous, shard-aligned block of samples to ``rank``.

    Splits the ``ceil(num_samples / shard_size)`` shards into contiguous runs across
    ``world_size`` ranks (the first ``total_shards % world_size`` ranks take one
    extra shard). Because the split is on whole shards, every shard is owned by
    exactly one rank, so ranks can write straight into a shared output directory
    with global shard indices and no cross-rank overlap. Ranks that receive no
    shards (when ``total_shards < world_size``) get ``num_local_samples == 0``.

    Returns ``(start_shard_index, start_sample, num_local_samples)``.
    """
    check_shard_size(shard_size)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise ValueError(f"num_samples must be an int >= 0, got {num_samples!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be an int in [0, {world_size}) for world_size={world_size}")
    total_shards = -(-num_samples // shard_size)
    base, remainder = divmod(total_shards, world_size)
    num_local_shards = base + (1 if rank < remainder else 0)
    start_shard_index = rank * base + min(rank, remainder)
    start_sample = start_shard_index * shard_size
    end_sample = min((start_shard_index + num_local_shards) * shard_size, num_samples)
    return start_shard_index, start_sample, max(0, end_sample - start_sample)


def shard_runs(
    shard_indices: Sequence[int], num_samples: int, shard_size: int
) -> list[tuple[int, int, int]]:
    """Group shard indices into contiguous runs: ``[(start_shard, start_sample, n_samples)]``.

    ``shard_runs([0, 1, 4], 10, 2) == [(0, 0, 4), (4, 8, 2)]``.
    """
    runs: list[tuple[int, int, int]] = []
    for i in sorted(shard_indices):
        n = max(0, min(shard_size, num_samples - i * shard_size))
        if runs and runs[-1][0] * shard_size + runs[-1][2] == i * shard_size:
            s0, start, m = runs[-1]
            runs[-1] = (s0, start, m + n)
        else:
            runs.append((i, i * shard_size, n))
    return [r for r in runs if r[2] > 0]


def _batch_size(dataloader: DataLoader) -> int:
    return int(getattr(dataloader, "batch_size", None) or 1)


def lockstep_write(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    runs: Sequence[tuple[int, int, int]],
    compute_batch: Callable[[Any], dict[str, torch.Tensor]],
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
    sync_max_steps: Callable[[int], int] | None = None,
    progress: Any = None,
) -> tuple[int, int]:
    """Compute and write the shard ``runs`` of this rank, padding to the global step count.

    ``runs`` are ``(start_shard_index, start_sample, num_samples)`` blocks (see
    :func:`shard_runs`); each gets a sequential loader over its samples and its own
    accumulator, so batches never straddle a run. After the real batches, dummy
    forwards (one sample, ``dataset[0]``, output discarded) pad this rank to
    ``sync_max_steps(local_steps)``: every rank calls ``compute_batch`` equally
    often, which a sharded model's collectives require. ``progress`` (a tqdm-like
    object or ``None``) gets ``update(1)`` per step. A ``compute_batch`` result of
    ``None`` stores nothing for that batch (the producer uses it to keep stepping
    after an error without writing). Returns
    ``(local_steps, global_steps)``.
    """
    dataset = dataloader.dataset
    bs = _batch_size(dataloader)
    local_steps = sum(-(-n // bs) for _, _, n in runs)
    global_steps = local_steps if sync_max_steps is None else int(sync_max_steps(local_steps))
    if global_steps < local_steps:
        raise ValueError(
            f"sync_max_steps({local_steps}) returned {global_steps}; it must return the maximum "
            "over ranks (an all-reduce MAX), which is at least this rank's count"
        )
    steps = 0
    for start_shard, start, n in runs:
        accumulator = _ShardAccumulator(output_dir, shard_size, start_shard, write_shard_fn, logger)
        for batch in _sequential_subset_loader(dataloader, start, start + n):
            out = compute_batch(batch)
            if out is not None:  # None: the caller chose not to store this batch (see produce_cache)
                accumulator.add(out)
            steps += 1
            if progress is not None:
                progress.update(1)
        accumulator.finalize()
    if steps != local_steps:
        raise RuntimeError(f"the dataloader produced {steps} batches, expected {local_steps}")
    if global_steps > steps:
        # Built lazily: only ranks that must pad need it, and an empty dataset has no index 0.
        collate_fn = getattr(dataloader, "collate_fn", None)
        dummy = collate_fn([dataset[0]]) if collate_fn is not None else dataset[0]
        for _ in range(global_steps - steps):
            compute_batch(dummy)  # keeps collectives aligned; output discarded
            if progress is not None:
                progress.update(1)
    return local_steps, global_steps


def write_cache_shards_distributed(
    dataloader: DataLoader,
    output_dir: str,
    shard_size: int,
    world_size: int,
    rank: int,
    compute_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
    sync_max_steps: Callable[[int], int] | None = None,
) -> None:
    """Distributed precompute loop: each rank writes its contiguous shard block.

    The target model is sharded across all ranks (expert-parallel / FSDP), so every
    ``compute_batch`` call is a collective that all ranks must enter the same number
    of times. This rank forwards its own contiguous slice of the dataset (a different
    slice per rank -- pure data parallelism, which the MoE all-to-all routes tokens
    for), and pads its step count up to the global maximum with dummy forwards whose
    output is discarded, keeping the collectives in lockstep.

    Writes are idempotent (atomic replace), so re-running after a partial failure
    safely recomputes and overwrites rather than resuming. ``sync_max_steps`` reduces
    the per-rank step count to the global max across ranks (an all-reduce MAX); it
    defaults to the identity for a single-process run.
    """
    num_samples = len(dataloader.dataset)
    start_shard, start_sample, n_local = partition_cache_shards(num_samples, shard_size, world_size, rank)
    runs = [(start_shard, start_sample, n_local)] if n_local > 0 else []
    local_steps, global_steps = lockstep_write(
        dataloader, output_dir, shard_size, runs, compute_batch, write_shard_fn, logger, sync_max_steps
    )
    logger.info(
        "Rank %d/%d: samples [%d, %d) -> shards from %d (%d local samples, %d/%d steps)",
        rank, world_size, start_sample, start_sample + n_local, start_shard, n_local, local_steps, global_steps,
    )


def resume_start_sample(existing_shards: set[int], shard_size: int) -> int:
    """Return the sample index where a deterministic sequential resume should start.

    ``existing_shards`` must be a contiguous prefix ``{0, ..., k-1}``; the resume
    starts at sample ``k * shard_size``.
    """
    check_shard_size(shard_size)
    expected = set(range(len(existing_shards)))
    if set(existing_shards) != expected:
        gaps = sorted(set(range(max(existing_shards) + 1)) - set(existing_shards))
        raise ValueError(
            f"resume expects the existing shards to be a contiguous prefix 0..{len(existing_shards) - 1}, "
            f"but found {format_indices(existing_shards)} (missing {format_indices(gaps)}). Delete the "
            "shards after the first gap, or restart from a clean directory (produce_cache fills gaps itself)."
        )
    return len(existing_shards) * shard_size


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "batch_size": _batch_size(dataloader),
        "collate_fn": getattr(dataloader, "collate_fn", None),
        "pin_memory": bool(getattr(dataloader, "pin_memory", False)),
    }
    num_workers = int(getattr(dataloader, "num_workers", 0))
    kwargs["num_workers"] = num_workers
    if num_workers > 0:
        kwargs["persistent_workers"] = bool(getattr(dataloader, "persistent_workers", False))
        for name in ("multiprocessing_context", "worker_init_fn", "prefetch_factor"):
            value = getattr(dataloader, name, None)
            if value is not None:
                kwargs[name] = value
        kwargs["timeout"] = getattr(dataloader, "timeout", 0)
    return kwargs


def _sequential_subset_loader(dataloader: DataLoader, start: int, end: int) -> DataLoader:
    """Return a sequential loader over ``dataset[start:end)`` mirroring ``dataloader``.

    Preserves the source loader's worker settings: in particular
    ``multiprocessing_context`` -- the precompute paths load the target onto CUDA
    before iterating, so fork-started workers would inherit a live CUDA context and
    abort; a source loader built with ``multiprocessing_context="forkserver"`` keeps it
    here. Also kept:
    ``batch_size``, ``collate_fn``, ``pin_memory``, ``persistent_workers``,
    ``worker_init_fn``, ``prefetch_factor``, ``timeout``.
    """
    dataset: Dataset = dataloader.dataset
    return DataLoader(Subset(dataset, range(start, end)), shuffle=False, drop_last=False, **_loader_kwargs(dataloader))


def dataloader_from_sample(dataloader: DataLoader, start_sample: int) -> DataLoader:
    """Return an equivalent sequential dataloader beginning at ``start_sample``.

    ``start_sample <= 0`` returns ``dataloader`` itself; past the end, an empty loader.
    """
    if start_sample <= 0:
        return dataloader
    n = len(dataloader.dataset)
    if start_sample >= n:
        return DataLoader(
            Subset(dataloader.dataset, []),
            batch_size=_batch_size(dataloader),
            shuffle=False,
            num_workers=0,
            collate_fn=getattr(dataloader, "collate_fn", None),
            drop_last=False,
        )
    return _sequential_subset_loader(dataloader, start_sample, n)
