"""Producer loops of the reference API: the accumulator, the single-process and distributed loops.

- :class:`ShardAccumulator` (the reference's ``_ShardAccumulator``) turns a stream of computed
  batches into fixed-size shards with global indices; both loops share it, so both lay out
  identical files.
- :func:`write_cache_shards` / :func:`write_cache_shards_distributed` are the reference loops;
  :func:`lockstep_write` is their engine, over a list of shard runs so a resumed producer
  recomputes only missing shards (``produce_cache`` builds on it).

Output is byte-identical across resume / world sizes when ``compute_batch`` gives each sample
the same result whatever batch it is in. Runs start at shard boundaries, so with
``shard_size % batch_size == 0`` every run forms exactly the batches of an uninterrupted
single-process run, and even batch-dependent numerics reproduce.

Every loader these loops build is made by ``te_thd.offline_cache.DataLoader``, looked up on
the package at call time: tests of the reference module's consumers patch it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from te_thd.args import check_int
from te_thd.offline_cache.format.integrity import on_cpu
from te_thd.offline_cache.format.schema import (
    SchemaError,
    check_shard_size,
    format_indices,
    num_shards,
    shard_rows,
)
from te_thd.offline_cache.storage.base import Storage
from te_thd.offline_cache.write.writer import (
    DurableShardWriter,
    WriteShardFn,
    validate_shard_tensors,
)

#: how a producer's loader must read its dataset (the end of both messages for one that does not)
_ONE_PASS = (
    "Shards are cut by sample index, so a producer's loader must yield each sample of its "
    "dataset once, in order."
)


def _loader_class() -> type:
    """``te_thd.offline_cache.DataLoader`` (torch's unless a test patched it), looked up per
    call."""
    import te_thd.offline_cache as package

    return package.DataLoader


class ShardAccumulator:
    """Buffer per-batch cache tensors and flush them as fixed-size sequential shards.

    Shard indices count up from ``start_shard_index``; ``finalize`` writes a trailing partial
    shard. Batches are moved to the CPU as they arrive (a GPU producer holds no shard's worth
    of outputs in device memory). A :class:`~te_thd.offline_cache.write.writer.DurableShardWriter`
    gets the pieces as they are, never concatenated; given the run's ``total_samples`` too,
    every shard's row count is known before its first batch, so each batch goes to the writer
    at once and nothing is buffered here. Any other ``write_shard_fn`` gets each shard as one
    ``{key: tensor}`` dict.
    """

    def __init__(
        self,
        output_dir: str | Storage,
        shard_size: int,
        start_shard_index: int,
        write_shard_fn: WriteShardFn,
        logger: logging.Logger,
        total_samples: int | None = None,
    ) -> None:
        self._output_dir = output_dir
        self._shard_size = check_shard_size(shard_size)
        self._write_shard_fn = write_shard_fn
        self._logger = logger
        self._shard_index = start_shard_index
        self._chunks: list[dict[str, torch.Tensor]] = []
        self._buffered = 0
        self.shards_written: list[int] = []
        self._streaming = total_samples is not None and isinstance(
            write_shard_fn, DurableShardWriter
        )
        # streaming: samples of the run from the current shard on
        self._total = self._remaining = total_samples or 0
        self._keys: set[str] | None = None  # the first batch's keys; every batch returns the same

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
        writer = self._write_shard_fn
        if isinstance(writer, DurableShardWriter):
            for piece in pieces:
                writer.queue(self._output_dir, self._shard_index, n, piece)
            path = writer.finish_shard(self._output_dir, self._shard_index)
        else:
            shard = {
                k: pieces[0][k] if len(pieces) == 1 else torch.cat([p[k] for p in pieces])
                for k in pieces[0]
            }
            path = writer(self._output_dir, self._shard_index, shard)
        self._logger.info("Wrote %s (%d samples)", path, n)
        self.shards_written.append(self._shard_index)
        self._buffered -= n
        self._shard_index += 1

    def add(self, batch_cache: dict[str, torch.Tensor]) -> None:
        """Append one computed batch, flushing whole shards as they fill (the reference's call)."""
        self.add_batch(batch_cache)

    def add_batch(self, batch_cache: dict[str, torch.Tensor], samples: int | None = None) -> None:
        """:meth:`add`, where ``samples`` is how many samples the batch held, when known: the
        output must have as many rows, so that a short ``compute_batch`` is named at its batch."""
        # checked once, as it enters: a DurableShardWriter checks its stored keys against the
        # schema (``{}``: a producer's writer that recorded an error stores nothing more); for any
        # other write_shard_fn every key is checked here
        writer, where = self._write_shard_fn, "compute_batch's output"
        if isinstance(writer, DurableShardWriter):
            checked = writer.validate(batch_cache, where=where)
        else:
            checked = validate_shard_tensors(batch_cache, None, "", 0, where=where)
        if not checked:
            return
        rows = next(iter(checked.values())).shape[0]
        if samples is not None and rows != samples:
            first = self._shard_index * self._shard_size + self._buffered  # its first sample
            raise ValueError(
                f"compute_batch returned {rows} row{'s' * (rows != 1)} for a batch of "
                f"{samples} samples ({first}..{first + samples - 1} "
                "of the dataset): it must return one row per sample of its batch, in "
                "order, as must the loader's "
                "collate_fn (shards are cut by sample index)"
            )
        if self._keys is None:
            self._keys = set(checked)
        elif checked.keys() != self._keys:
            raise SchemaError(
                f"compute_batch returned keys {sorted(checked)} after {sorted(self._keys)}; "
                "every batch must return the same keys"
            )
        if rows == 0:
            return
        batch = {k: on_cpu(v) for k, v in checked.items()}
        if self._streaming:
            self._stream(batch, rows)
            return
        self._chunks.append(batch)
        self._buffered += rows
        while self._buffered >= self._shard_size:
            self._flush(self._shard_size)

    def _stream(self, batch: dict[str, torch.Tensor], rows: int) -> None:
        """Hand ``batch``'s rows to the writer now, cut at shard boundaries."""
        writer = self._write_shard_fn
        assert isinstance(writer, DurableShardWriter)
        offset = 0
        while offset < rows:
            shard_rows = min(self._shard_size, self._remaining)
            if shard_rows == 0:
                raise RuntimeError(
                    f"compute_batch returned {rows - offset} rows beyond the "
                    f"{self._total} samples of this run: "
                    "the dataloader yields more samples than its dataset holds, e.g. "
                    f"a collate_fn or sampler that adds samples. {_ONE_PASS}"
                )
            take = min(rows - offset, shard_rows - self._buffered)
            piece = (
                batch if take == rows else {k: v[offset : offset + take] for k, v in batch.items()}
            )
            writer.queue(self._output_dir, self._shard_index, shard_rows, piece)
            offset += take
            self._buffered += take
            if self._buffered == shard_rows:
                path = writer.finish_shard(self._output_dir, self._shard_index)
                self._logger.info("Wrote %s (%d samples)", path, shard_rows)
                self.shards_written.append(self._shard_index)
                self._shard_index += 1
                self._remaining -= shard_rows
                self._buffered = 0

    def finalize(self) -> None:
        """Write the trailing partial shard, if any."""
        if self._streaming:
            if self._buffered:  # a writer that recorded an error drops the shard; else it is short
                try:
                    assert isinstance(self._write_shard_fn, DurableShardWriter)
                    self._write_shard_fn.finish_shard(self._output_dir, self._shard_index)
                except ValueError as exc:
                    want = min(self._shard_size, self._remaining)
                    raise RuntimeError(
                        f"the run ended with {self._buffered} of shard "
                        f"{self._shard_index}'s {want} rows: the "
                        "dataloader yielded fewer samples than its dataset holds (e.g. "
                        f"drop_last, or a collate_fn that drops samples). {_ONE_PASS}"
                    ) from exc
            return
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
    accumulator = ShardAccumulator(
        output_dir, shard_size, start_shard_index, write_shard_fn, logger
    )
    for batch in dataloader:
        accumulator.add(compute_batch(batch))
    accumulator.finalize()


def partition_cache_shards(
    num_samples: int, shard_size: int, world_size: int, rank: int
) -> tuple[int, int, int]:
    """Assign a contiguous, shard-aligned block of samples to ``rank``:
    ``(start_shard_index, start_sample, num_local_samples)``.

    The shards are split into contiguous runs across ``world_size`` ranks (the first
    ``total_shards % world_size`` take one extra), so every shard is owned by exactly one rank
    and ranks write straight into one directory. A rank without shards gets 0 samples.
    """
    check_shard_size(shard_size)
    check_int("num_samples", num_samples, 0)
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, below=world_size, bound_name="world_size")
    total_shards = num_shards(num_samples, shard_size)
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
        n = shard_rows(i, num_samples, shard_size)
        if runs and runs[-1][0] * shard_size + runs[-1][2] == i * shard_size:
            s0, start, m = runs[-1]
            runs[-1] = (s0, start, m + n)
        else:
            runs.append((i, i * shard_size, n))
    return [r for r in runs if r[2] > 0]


def loader_batch_size(dataloader: DataLoader) -> int:
    return int(getattr(dataloader, "batch_size", None) or 1)


def loader_num_samples(dataloader: DataLoader) -> int:
    """``len(dataloader.dataset)`` of a producer's loader: a DataLoader over a non-empty map-style
    dataset (shards are assigned by sample index), else one line saying what to pass."""
    if not hasattr(dataloader, "dataset"):
        raise TypeError(
            f"dataloader is a {type(dataloader).__name__}, not a torch DataLoader; pass "
            "DataLoader(samples, batch_size=...) (its batch size and collate_fn are used)"
        )
    try:
        num_samples = len(dataloader.dataset)
    except TypeError:
        raise ValueError(
            "produce_cache needs a map-style dataset with len(): shards are assigned by sample "
            "index (got an iterable dataset)"
        ) from None
    if num_samples == 0:
        raise ValueError(
            "the dataloader's dataset is empty (len() == 0): there is nothing to cache; check what "
            "builds it (a data path, a filter that drops every sample)"
        )
    return num_samples


def lockstep_write(
    dataloader: DataLoader,
    output_dir: str | Storage,
    shard_size: int,
    runs: Sequence[tuple[int, int, int]],
    compute_batch: Callable[[Any], dict[str, torch.Tensor]],
    write_shard_fn: WriteShardFn,
    logger: logging.Logger,
    sync_max_steps: Callable[[int], int] | None = None,
    progress: Callable[[int], Any] | None = None,
) -> tuple[int, int]:
    """Compute and write the shard ``runs`` of this rank, padding to the global step count;
    ``(local_steps, global_steps)``.

    ``runs``: ``(start_shard_index, start_sample, num_samples)`` blocks (:func:`shard_runs`), each
    with its own sequential loader and accumulator, so batches never straddle a run. Dummy
    forwards (``dataset[0]``, output discarded) then pad this rank to
    ``sync_max_steps(local_steps)``: a sharded model's collectives need every rank to call
    ``compute_batch`` equally often. ``progress(global_steps)``: a tqdm-like bar (or ``None``) that
    gets ``update(1)`` per step and is closed at the end.
    """
    dataset = dataloader.dataset
    bs = loader_batch_size(dataloader)
    local_steps = sum(-(-n // bs) for _, _, n in runs)
    global_steps = local_steps if sync_max_steps is None else int(sync_max_steps(local_steps))
    if global_steps < local_steps:
        raise ValueError(
            f"sync_max_steps({local_steps}) returned {global_steps}; it must return the maximum "
            "over ranks (an all-reduce MAX), which is at least this rank's count"
        )
    bar = progress(global_steps) if progress is not None else None
    steps = 0
    try:
        for start_shard, start, n in runs:
            accumulator = ShardAccumulator(
                output_dir, shard_size, start_shard, write_shard_fn, logger, total_samples=n
            )
            for k, batch in enumerate(sequential_subset_loader(dataloader, start, start + n)):
                # the subset loader's batches: bs samples, the last fewer
                accumulator.add_batch(compute_batch(batch), min(bs, n - k * bs))
                steps += 1
                if bar is not None:
                    bar.update(1)
            accumulator.finalize()
        if steps != local_steps:
            raise RuntimeError(f"the dataloader produced {steps} batches, expected {local_steps}")
        if global_steps > steps:
            # Built lazily: only ranks that must pad need it, and an empty dataset has no index 0.
            collate_fn = getattr(dataloader, "collate_fn", None)
            dummy = collate_fn([dataset[0]]) if collate_fn is not None else dataset[0]
            for _ in range(global_steps - steps):
                compute_batch(dummy)  # keeps collectives aligned; output discarded
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
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

    The model is sharded across all ranks (expert-parallel / FSDP), so every ``compute_batch``
    is a collective all ranks enter equally often: this rank forwards its own slice of the
    dataset and pads its step count to the global maximum with dummy forwards. Writes are
    atomic replaces, so a re-run after a failure recomputes and overwrites. ``sync_max_steps``
    reduces the step count to the max across ranks (an all-reduce MAX); default: identity.
    """
    num_samples = len(dataloader.dataset)
    start_shard, start_sample, n_local = partition_cache_shards(
        num_samples, shard_size, world_size, rank
    )
    runs = [(start_shard, start_sample, n_local)] if n_local > 0 else []
    local_steps, global_steps = lockstep_write(
        dataloader,
        output_dir,
        shard_size,
        runs,
        compute_batch,
        write_shard_fn,
        logger,
        sync_max_steps,
    )
    logger.info(
        "Rank %d/%d: samples [%d, %d) -> shards from %d (%d local samples, %d/%d steps)",
        rank,
        world_size,
        start_sample,
        start_sample + n_local,
        start_shard,
        n_local,
        local_steps,
        global_steps,
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
            "resume expects the existing shards to be a contiguous prefix "
            f"0..{len(existing_shards) - 1}, "
            f"but found {format_indices(existing_shards)} (missing "
            f"{format_indices(gaps)}). Delete the "
            "shards after the first gap, or restart from a clean directory "
            "(produce_cache fills gaps itself)."
        )
    return len(existing_shards) * shard_size


_TORCH_DEFAULT_PREFETCH = 2


def _loader_kwargs(dataloader: DataLoader, workers: bool = True) -> dict[str, Any]:
    """``dataloader``'s settings a loader over part of its dataset keeps (``workers=False``: none
    of its worker settings, for a loader that has nothing to load)."""
    kwargs: dict[str, Any] = {
        "batch_size": loader_batch_size(dataloader),
        "collate_fn": getattr(dataloader, "collate_fn", None),
        "pin_memory": bool(getattr(dataloader, "pin_memory", False)),
    }
    num_workers = int(getattr(dataloader, "num_workers", 0)) if workers else 0
    kwargs["num_workers"] = num_workers
    if num_workers > 0:
        kwargs["persistent_workers"] = bool(getattr(dataloader, "persistent_workers", False))
        for name in ("multiprocessing_context", "worker_init_fn"):
            value = getattr(dataloader, name, None)
            if value is not None:
                kwargs[name] = value
        # torch stores prefetch_factor=2 on every loader with workers; passing that default on
        # breaks a patched DataLoader that forces num_workers=0 (torch rejects prefetch_factor
        # without workers), so only a value the user chose travels.
        prefetch = getattr(dataloader, "prefetch_factor", None)
        if prefetch is not None and prefetch != _TORCH_DEFAULT_PREFETCH:
            kwargs["prefetch_factor"] = prefetch
        kwargs["timeout"] = getattr(dataloader, "timeout", 0)
    return kwargs


def sequential_subset_loader(dataloader: DataLoader, start: int, end: int) -> DataLoader:
    """Return a sequential loader over ``dataset[start:end)`` mirroring ``dataloader``'s settings.

    Kept: ``multiprocessing_context`` (the precompute paths load the target onto CUDA first, so
    fork-started workers would inherit a live CUDA context: use ``"forkserver"`` or ``"spawn"``),
    ``batch_size``, ``collate_fn``, ``pin_memory``, ``persistent_workers``, ``worker_init_fn``,
    ``prefetch_factor`` (when not torch's default) and ``timeout``; an empty range starts no
    workers.
    """
    dataset: Dataset = dataloader.dataset
    return _loader_class()(
        Subset(dataset, range(start, end)),
        shuffle=False,
        drop_last=False,
        **_loader_kwargs(dataloader, workers=end > start),
    )


def dataloader_from_sample(dataloader: DataLoader, start_sample: int) -> DataLoader:
    """Return an equivalent sequential dataloader beginning at ``start_sample``.

    ``start_sample <= 0`` returns ``dataloader`` itself; past the end, an empty loader.
    """
    if start_sample <= 0:
        return dataloader
    n = len(dataloader.dataset)
    return sequential_subset_loader(dataloader, min(start_sample, n), n)
