"""Shard writes of the reference API: one shard, validated, self-verifying, durable.

- :func:`write_tensor_shard` writes one shard durably (``atomic_write``) and
  rejects tensors that do not fit the cache: a missing key, keys whose sample
  counts disagree, and -- given a ``schema`` -- a dtype or trailing shape that
  differs from it. Every shard carries its row count and per-row checksums in
  its header (:mod:`~te_thd.offline_cache.integrity`), so a cache written only
  through this function (the reference producers' way: one call per shard, then
  ``write_manifest``) is verified on read like any other.
- :class:`DurableShardWriter` is the ``write_shard_fn`` of a stream of shards:
  one schema, a manifest record per shard, pipelined durability.

The producer loops that call them live in :mod:`~te_thd.offline_cache.loops`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from te_thd.offline_cache.durable import BackgroundCommitter, commit_temp, temp_path_for, write_temp
from te_thd.offline_cache.errors import SchemaError
from te_thd.offline_cache.format import (
    DTYPE_TO_ST,
    CacheSchema,
    TensorSpec,
    load_safetensors,
    schema_to_json,
    shard_path,
)
from te_thd.offline_cache.hostmem import check_writer_priority
from te_thd.offline_cache.lengths import LENGTH_RULE_KEY, LengthRule, for_tensor
from te_thd.offline_cache.shardfile import ShardRecord, write_shard_file, write_shard_pieces
from te_thd.offline_cache.shardstream import ShardStream

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
            want = schema[k]
            if t.dtype != want.dtype or tuple(t.shape[1:]) != want.shape:  # (a TensorSpec per call costs ~1 us)
                got = TensorSpec(t.dtype, tuple(t.shape[1:]))
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
    length_rule: LengthRule | None = None,
) -> tuple[str, ShardRecord]:
    """:func:`write_tensor_shard` that also returns the shard's ``(bytes, checksum)`` record.

    With a ``committer`` only the temp file is written here; its fsync + rename
    happen on the committer's thread (the shard is visible once it committed).
    With a ``length_rule`` the record also holds every row's length under it.
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
    return final, with_lengths(record[0], tensors, length_rule)


def with_lengths(record: ShardRecord, tensors: Mapping[str, torch.Tensor], rule: LengthRule | None) -> ShardRecord:
    """``record`` holding every row's length under ``rule`` (``tensors``: the shard's keys); as is without a rule."""
    if rule is None:
        return record
    t = tensors[rule.key]
    return replace(record, lengths=tuple(int(v) for v in for_tensor(rule, t).lengths(t)))


class DurableShardWriter:
    """``write_shard_fn`` for a stream of shards: one schema, a record per shard, pipelined durability.

    ``writer(cache_dir, shard_index, samples) -> path`` validates ``samples``
    against the schema (the first shard's, unless ``schema`` is given), writes the
    shard and keeps its :class:`ShardRecord` in ``records``. With
    ``pipelined=True`` the fsync + rename of shard ``k`` run on a background
    thread while shard ``k+1`` is serialised (:class:`BackgroundCommitter`).
    With ``write_behind=True`` as well, the whole write (serialise, checksum,
    write, fsync, rename) runs on that thread: the call validates ``samples`` and
    returns, so the caller computes the next shard meanwhile (a call waits while
    three shards' worth of data is not yet written). The caller must then not
    modify the tensors it passed. In this mode
    ``samples[key]`` may also be a list of ``[n_i, ...]`` pieces, stored
    concatenated on dim 0 but written straight from the pieces, never joined in
    memory (``takes_pieces``: te_thd's shard accumulator hands over the batches
    of a shard that way). Write-behind writers also stream (``takes_stream``):
    :meth:`write_piece` queues the next rows of a shard whose row count is known
    up front, each written into the shard's temp file as soon as the thread gets
    to it (:class:`~te_thd.offline_cache.shardstream.ShardStream`, the same
    bytes), and :meth:`finish_shard` commits the shard once all its rows were
    queued; a batch's memory is free once it is written, not once its shard is.
    Call :meth:`flush` (or
    leave the ``with`` block) before relying on the files or on ``records``, e.g.
    before writing the manifest; a write error is raised by the next call,
    ``flush`` or ``close``.
    ``writer_priority="idle"`` (write-behind only) lets the caller's thread
    preempt the writer whenever it wakes (:class:`~te_thd.offline_cache.durable.BackgroundCommitter`);
    ``"normal"`` keeps the default scheduling.
    With a ``length_rule`` (:class:`~te_thd.offline_cache.lengths.LengthRule`)
    every record also holds its rows' lengths, and :meth:`manifest_fields` gives
    the manifest's ``schema``, ``shards`` and ``length_rule``.
    """

    def __init__(
        self,
        keys: Sequence[str],
        cache_name: str = "offline",
        schema: Mapping[str, TensorSpec] | None = None,
        pipelined: bool = True,
        write_behind: bool = False,
        length_rule: LengthRule | None = None,
        writer_priority: str = "idle",
    ) -> None:
        check_writer_priority(writer_priority)
        if write_behind and not pipelined:
            raise ValueError("write_behind=True needs pipelined=True (the writes run on the commit thread)")
        self.keys = tuple(keys)
        if length_rule is not None and length_rule.key not in self.keys:
            raise ValueError(
                f"length_rule reads key {length_rule.key!r}, which is not one of the stored keys {list(self.keys)}; "
                "name a stored key"
            )
        self.length_rule = length_rule
        self.cache_name = cache_name
        self.schema: CacheSchema | None = dict(schema) if schema is not None else None
        self.records: dict[int, ShardRecord] = {}
        if not pipelined:
            self._committer = None
        elif write_behind:
            # only a thread that does whole writes competes with the caller for the CPU; its
            # queue is bounded by memory (PENDING_SHARDS shards, set once a shard's size is known)
            self._committer = BackgroundCommitter(max_pending=1 << 20, writer_priority=writer_priority)
        else:
            self._committer = BackgroundCommitter()
        self._write_behind = write_behind
        self.takes_pieces = self.takes_stream = write_behind
        self._resolved = False  # write-behind: length rule kind and the safetensors check done
        self._streams: dict[int, _StreamedShard] = {}

    def __call__(self, cache_dir: str, shard_index: int, samples: dict[str, Any]) -> str:
        if self._write_behind:
            return self._submit_write(cache_dir, shard_index, samples)
        path, record = write_shard_with_record(
            cache_dir, shard_index, samples, self.keys, self.cache_name, self.schema, self._committer, self.length_rule
        )
        self.records[shard_index] = record
        if self.schema is None:
            self.schema = schema_of({k: samples[k] for k in self.keys})
        self._resolve_length_rule(samples)
        return path

    def _resolve_length_rule(self, samples: Mapping[str, Any]) -> LengthRule | None:
        """Fix the length rule's kind by the key's shape (the same in every shard)."""
        if self.length_rule is not None:
            self.length_rule = for_tensor(self.length_rule, samples[self.length_rule.key])
        return self.length_rule

    def _submit_write(self, cache_dir: str, shard_index: int, samples: Mapping[str, Any]) -> str:
        """Validate now, write on the commit thread; the record lands in ``records`` once written."""
        if samples and all(isinstance(samples.get(k), list) for k in self.keys):
            pieces = [{k: samples[k][j] for k in self.keys} for j in range(len(samples[self.keys[0]]))]
        else:
            pieces = [samples]
        checked = self._check_pieces(pieces, shard_index)
        self._resolve_once(checked[0])
        rule = self.length_rule
        final = shard_path(cache_dir, shard_index)
        nbytes = sum(_nbytes(p) for p in checked)
        self._budget(nbytes)

        def write(tmp: str) -> None:
            parts = {k: [p[k] for p in checked] for k in self.keys}
            record = write_shard_pieces(tmp, parts)
            if rule is not None:  # only the length key is joined (one small tensor)
                record = with_lengths(record, {rule.key: torch.cat(parts[rule.key])}, rule)
            self.records[shard_index] = record

        assert self._committer is not None
        self._committer.submit_write(final, write, nbytes)
        return final

    def _resolve_once(self, piece: Mapping[str, Any]) -> None:
        """Write-behind, first shard: fix the length rule's kind; check that safetensors imports
        (fail on the caller's thread, not on the writer's)."""
        if not self._resolved:
            self._resolve_length_rule(piece)
            load_safetensors(self.cache_name)
            self._resolved = True

    def _budget(self, shard_bytes: int) -> None:
        """Bound the write-behind queue to PENDING_SHARDS shards of the largest size seen."""
        assert self._committer is not None
        limit = PENDING_SHARDS * shard_bytes
        if self._committer.max_pending_bytes is None or limit > self._committer.max_pending_bytes:
            self._committer.max_pending_bytes = limit

    def write_piece(self, cache_dir: str, shard_index: int, rows: int, piece: Mapping[str, Any]) -> None:
        """Write-behind: queue the next rows (``{key: [n, ...]}``) of shard ``shard_index`` of ``rows`` rows.

        The piece is validated here and written into the shard's temp file on the
        thread; the caller must not modify it until then (it may drop it).
        """
        if not self._write_behind:
            raise ValueError("write_piece needs a write-behind writer: DurableShardWriter(..., write_behind=True)")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows={rows!r} must be an int >= 1: the number of rows shard {shard_index} will hold")
        checked = self._check_pieces([piece], shard_index)[0]
        n = checked[self.keys[0]].shape[0]
        nbytes = _nbytes(checked)
        st = self._streams.get(shard_index)
        if st is not None and rows != st.rows:
            raise ValueError(f"shard {shard_index} was started with rows={st.rows}, not {rows}")
        queued = 0 if st is None else st.queued
        if queued + n > rows:  # checked before a first piece opens the shard
            raise ValueError(f"shard {shard_index} holds {rows} rows; {n} more after {queued} overflow it")
        if st is None:
            self._resolve_once(checked)
            assert self.schema is not None
            st = _StreamedShard(shard_path(cache_dir, shard_index), {k: self.schema[k] for k in self.keys}, rows,
                                self.length_rule)  # fmt: skip
            self._streams[shard_index] = st
            if n:
                self._budget(rows * nbytes // n)
        st.queued += n
        assert self._committer is not None
        self._committer.submit_task(partial(st.write, checked), st.abort, nbytes)

    def finish_shard(self, cache_dir: str, shard_index: int) -> str:
        """Write-behind: commit shard ``shard_index`` once its queued pieces are written; its path."""
        st = self._streams.get(shard_index)
        if st is None:
            raise ValueError(f"shard {shard_index} has no pieces; call write_piece first")
        if st.queued != st.rows:
            raise ValueError(f"shard {shard_index} got {st.queued} of its {st.rows} rows; queue the rest first")
        del self._streams[shard_index]
        records = self.records

        def finish() -> None:
            records[shard_index] = st.finish()

        assert self._committer is not None
        self._committer.submit(st.tmp_path, st.final, before=finish, on_drop=st.abort)
        return st.final

    def _abort_streams(self) -> None:
        """Remove the temp files of shards left unfinished; only once the writer thread ended (every
        queued piece of theirs written or dropped), on the caller's thread."""
        streams, self._streams = list(self._streams.values()), {}
        for st in streams:
            st.abort()

    def _check_pieces(self, pieces: list[Mapping[str, Any]], shard_index: int) -> list[dict[str, torch.Tensor]]:
        """The pieces of one shard, validated against the schema (the first piece fixes it if unset)."""
        checked = [validate_shard_tensors(p, self.keys, self.cache_name, shard_index, self.schema) for p in pieces]
        if self.schema is None:
            self.schema = schema_of(checked[0])
            for p in checked[1:]:  # every piece must agree with the first one's dtypes and shapes
                validate_shard_tensors(p, self.keys, self.cache_name, shard_index, self.schema)
        return checked

    def manifest_fields(self, cache_dir: str) -> dict[str, Any]:
        """``schema``, ``shards`` (in index order) and, with lengths, ``length_rule`` for ``write_manifest``.

        Call :meth:`flush` first: with ``write_behind`` the records land when written.
        """
        fields: dict[str, Any] = {
            "schema": schema_to_json(self.schema or {}),
            "shards": [self.records[i].to_json(os.path.basename(shard_path(cache_dir, i))) for i in sorted(self.records)],
        }
        if self.length_rule is not None:
            fields[LENGTH_RULE_KEY] = self.length_rule.to_json()
        return fields

    def flush(self) -> None:
        """Block until every shard written so far is durable under its final name."""
        if self._committer is not None:
            self._committer.flush()

    def close(self) -> None:
        if self._committer is not None:
            try:
                self._committer.close()
            finally:
                # an interrupted producer: its partial shards are never committed. After a write
                # error too (a job queued now would be dropped, and its abort with it). If the wait
                # for the thread was interrupted, its temp files stay for the next producer to remove.
                if not self._committer.running:
                    self._abort_streams()

    def __enter__(self) -> DurableShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: write-behind queue bound: shards (of the largest size seen) not yet written
PENDING_SHARDS = 3


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _StreamedShard:
    """One streamed shard: its names, rows, and the :class:`ShardStream` the writer thread opens."""

    def __init__(self, final: str, specs: Mapping[str, TensorSpec], rows: int, rule: LengthRule | None) -> None:
        self.final, self.tmp_path = final, temp_path_for(final)
        self.specs, self.rows, self.rule = dict(specs), rows, rule
        self.queued = 0  # rows queued by the caller
        self.lengths: list[int] = []
        self._stream: ShardStream | None = None

    def write(self, piece: Mapping[str, torch.Tensor]) -> None:
        """On the writer thread: the next rows into the temp file (opened by the first piece)."""
        try:
            if self._stream is None:
                os.makedirs(os.path.dirname(self.final) or ".", exist_ok=True)
                self._stream = ShardStream(self.tmp_path, self.specs, self.rows)
            self._stream.write(piece)
            if self.rule is not None:
                self.lengths += self.rule.lengths(piece[self.rule.key]).tolist()
        except BaseException:
            self.abort()
            raise

    def finish(self) -> ShardRecord:
        """On the writer thread: the header, the record (with lengths under the rule)."""
        try:
            assert self._stream is not None
            record = self._stream.finish()
        except BaseException:
            self.abort()
            raise
        return record if self.rule is None else replace(record, lengths=tuple(self.lengths))

    def abort(self) -> None:
        # without a stream there is no file: the stream creates it, as its last step
        if self._stream is not None:
            self._stream.abort()


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
