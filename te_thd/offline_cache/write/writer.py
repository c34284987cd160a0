"""Shard writes: one shard, validated, self-verifying, durable; the writer of a stream of shards.

- :class:`DurableShardWriter` is the ``write_shard_fn`` of a stream of shards: one schema, a
  manifest record per shard, its rows streamed into the shard's temp file
  (:class:`~te_thd.offline_cache.write.shardfile.ShardStream`, the one serialiser) and committed
  (fsync, rename) in order, optionally behind the caller on the :class:`WriteBehind` thread.
  It is the boundary where a written batch is validated, once (:func:`validate_shard_tensors`).
  :func:`write_tensor_shard` (the reference API) writes one shard through it.
- :class:`WriteBehind`: the one background writer thread. Jobs run one at a time, in order;
  ``submit`` blocks while the jobs not yet done hold more than ``max_pending_bytes`` (a single
  larger job runs alone), so a producer holds a few shards' worth of tensors at most. The first
  error a job raises is kept, every later job is dropped (its ``on_drop`` runs instead) and the
  error is raised by the next call. The thread is a daemon that holds no reference to its owner
  and ends with :meth:`WriteBehind.close` or the owner's collection.

The producer loops that call them live in :mod:`~te_thd.offline_cache.write.loops`.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from te_thd.args import check_int
from te_thd.offline_cache.format.lengths import LengthRule, for_tensor
from te_thd.offline_cache.format.ragged import TokenLayout, check_token_schema
from te_thd.offline_cache.format.schema import (
    DTYPE_TO_ST,
    CacheSchema,
    SchemaError,
    TensorSpec,
    load_safetensors,
    shard_name,
    tensor_nbytes,
)
from te_thd.offline_cache.record.run import ShardRecord, manifest_fields
from te_thd.offline_cache.storage.base import Storage, temp_path_for
from te_thd.offline_cache.storage.schemes import as_storage
from te_thd.offline_cache.write.shardfile import ShardStream

WriteShardFn = Callable[[str, int, dict[str, torch.Tensor]], str]

#: write-behind queue bound: shards (of the largest size seen) not yet written
PENDING_SHARDS = 3


class _Job(NamedTuple):
    run: Callable[[], None]
    on_drop: Callable[[], None] | None  # runs instead of ``run`` once an earlier job failed
    nbytes: int  # memory the job holds until it is done


class _State:
    """What the thread and its owner share; the thread holds only this, never the owner."""

    def __init__(self, max_pending_bytes: int | None) -> None:
        self.cond = threading.Condition()
        self.jobs: collections.deque[_Job | None] = collections.deque()
        self.pending_bytes = 0  # held by jobs submitted and not yet done
        self.unfinished = 0  # jobs submitted and not yet done
        self.max_pending_bytes = max_pending_bytes
        self.error: BaseException | None = None


def _run(state: _State) -> None:
    cond = state.cond
    while True:
        with cond:
            while not state.jobs:
                cond.wait()
            job = state.jobs.popleft()
        if job is None:
            return
        try:
            if state.error is None:
                job.run()
            elif job.on_drop is not None:
                job.on_drop()
        except BaseException as exc:  # surfaced by the owner's next call
            if state.error is None:
                state.error = exc
            # a failing clean-up of a dropped job must not end the thread: flush() would wait
            # forever
        finally:
            nbytes = job.nbytes
            job = None  # what a finished job held (a batch's tensors) is freed before the next one
            with cond:
                state.pending_bytes -= nbytes
                state.unfinished -= 1
                cond.notify_all()


def _stop(state: _State) -> None:
    with state.cond:
        state.jobs.append(None)
        state.cond.notify_all()


class WriteBehind:
    """Run submitted jobs in order on one owned background thread (see the module docstring);
    ``max_pending_bytes``: what jobs not yet done may hold before ``submit`` waits (``None``:
    unbounded)."""

    def __init__(self, max_pending_bytes: int | None = None) -> None:
        self._state = _State(max_pending_bytes)
        self._thread = threading.Thread(
            target=_run, args=(self._state,), name="te_thd-write-behind", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._state)

    def bound(self, nbytes: int) -> None:
        """Let the jobs not yet done hold ``nbytes``, unless a higher bound is set already."""
        state = self._state
        with state.cond:
            if state.max_pending_bytes is None or nbytes > state.max_pending_bytes:
                state.max_pending_bytes = nbytes
                state.cond.notify_all()

    @property
    def running(self) -> bool:
        """Whether the thread still runs (:meth:`close` not called, or interrupted)."""
        return self._thread.is_alive()

    def raise_error(self) -> None:
        """Raise the first error a job raised, if any (then every later call raises it too)."""
        if self._state.error is not None:
            raise self._state.error

    def submit(
        self, run: Callable[[], None], nbytes: int = 0, on_drop: Callable[[], None] | None = None
    ) -> None:
        """Queue ``run()``, which holds ``nbytes`` of memory (unchanged) until it is done;
        ``on_drop()`` runs instead once an earlier job failed. Blocks while the budget is full."""
        state = self._state
        self.raise_error()
        if not self._thread.is_alive():
            raise RuntimeError("this write-behind writer is closed; create a new one")
        with state.cond:
            while (
                state.error is None
                and state.max_pending_bytes is not None
                and state.pending_bytes > 0
                and state.pending_bytes + nbytes > state.max_pending_bytes
            ):
                state.cond.wait()
            self.raise_error()
            state.pending_bytes += nbytes
            state.unfinished += 1
            state.jobs.append(_Job(run, on_drop, nbytes))
            state.cond.notify_all()

    def _wait(self) -> None:
        state = self._state
        with state.cond:
            while state.unfinished and self._thread.is_alive():
                state.cond.wait()

    def flush(self) -> None:
        """Wait until every submitted job is done; raise the first error one raised."""
        self._wait()
        self.raise_error()

    def close(self) -> None:
        """Finish the queued jobs, stop the thread, raise a pending error."""
        if self._thread.is_alive():
            self._wait()
            self._finalizer()
            self._thread.join()
        self.raise_error()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def validate_shard_tensors(
    samples: Any,
    keys: Sequence[str] | None,
    cache_name: str,
    shard_index: int,
    schema: Mapping[str, TensorSpec] | None = None,
    where: str | None = None,
) -> dict[str, torch.Tensor]:
    """The ``keys`` of ``samples`` (``None``: every key it holds), checked: ``{key: tensor [n,
    *trailing]}`` with one ``n``.

    The one check of a written batch, made where the batch enters: the writer's calls, and the
    producer loops' for a ``compute_batch`` output (``where`` names it; it replaces "<cache_name>
    cache shard <i>" in messages). Raises :class:`SchemaError` naming the shard and key when
    ``samples`` is not a dict or holds no key, a key is missing, not a tensor, 0-d, has another
    sample count, or -- with ``schema`` -- another dtype or trailing shape. Extra keys are
    ignored (``compute_batch`` may return more than the cache stores).
    """
    if not isinstance(samples, Mapping):
        got = type(samples).__name__
        raise SchemaError(
            f"compute_batch returned a {got}; it must return a dict of tensors"
            if where is not None
            else f"{cache_name} cache shard {shard_index}: samples is a {got}; pass a dict of "
            "tensors, {key: [n, ...]}"
        )
    if keys is None and not samples:
        raise SchemaError("compute_batch returned an empty dict; it must return the cache tensors")
    where = where or f"{cache_name} cache shard {shard_index}"
    keys = tuple(samples if keys is None else keys)
    if not keys:
        raise SchemaError(
            f"{where}: keys=() names no tensors to store; pass e.g. keys=('hidden_states',)"
        )
    missing = [k for k in keys if k not in samples]
    if missing:
        raise SchemaError(
            f"{where} is missing required cache keys {missing} (got {sorted(samples)}). "
            "Make compute_batch return every key in `keys`, or drop it from `keys`."
        )
    if schema is not None and set(schema) != set(keys):
        raise SchemaError(
            f"{where}: keys {sorted(keys)} differ from the cache schema's "
            f"{sorted(schema)}; a cache "
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
                f"{where}: key {k!r} has dtype {t.dtype}, which safetensors cannot store; "
                "cast it to "
                f"one of {sorted(str(d).removeprefix('torch.') for d in DTYPE_TO_ST)}"
            )
        if schema is not None:
            want = schema[k]
            # compared field by field: no TensorSpec built per call
            if t.dtype != want.dtype or tuple(t.shape[1:]) != want.shape:
                got = TensorSpec(t.dtype, tuple(t.shape[1:]))
                raise SchemaError(
                    f"{where}: key {k!r} is {got.describe()} but the cache schema says "
                    f"{want.describe()} (dtype and per-sample shape are fixed per cache). "
                    "Cast/reshape "
                    "the tensor in compute_batch, or write to a new output directory."
                )
        out[k] = t
    return out


class _StreamedShard:
    """One shard being written: its temp file (beside its final name), rows, and the
    :class:`ShardStream` its first piece opens."""

    def __init__(self, final: str, rows: int, open_stream: Callable[[str], ShardStream]) -> None:
        self.tmp_path, self.rows, self._open_stream = temp_path_for(final), rows, open_stream
        self.queued = 0  # rows handed over by the caller
        self._stream: ShardStream | None = None

    def _opened(self) -> ShardStream:
        if self._stream is None:
            os.makedirs(os.path.dirname(self.tmp_path) or ".", exist_ok=True)
            self._stream = self._open_stream(self.tmp_path)
        return self._stream

    def write(self, piece: Mapping[str, torch.Tensor]) -> None:
        """The next rows into the temp file (opened by the first piece)."""
        try:
            self._opened().write(piece)
        except BaseException:
            self.abort()
            raise

    def finish(self) -> ShardRecord:
        """The header; the record."""
        try:
            return self._opened().finish()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        # without a stream there is no file: the stream creates it, as its last step
        if self._stream is not None:
            self._stream.abort()


class DurableShardWriter:
    """``write_shard_fn`` for a stream of shards: one schema, a record per shard, durable commits.

    ``writer(cache_dir, shard_index, samples) -> path`` validates ``samples`` against the schema
    (the first shard's, unless ``schema`` is given), writes the shard and keeps its
    :class:`~te_thd.offline_cache.record.run.ShardRecord` in ``records``. :meth:`write_piece`
    takes the next rows of a shard whose row count is known up front, :meth:`finish_shard`
    commits it (the producer streams each batch this way: its memory is free once written).

    - ``pipelined=False``: everything on the caller's thread; a shard is durable when the call
      returns.
    - ``pipelined=True`` (default): the fsync + rename of each finished shard on a background
      thread.
    - ``write_behind=True`` (needs ``pipelined``): the writes too; a call validates its tensors
      and returns, the caller must not modify them. Calls wait while ``PENDING_SHARDS`` shards'
      worth of data is not yet written.

    Call :meth:`flush` (or leave the ``with`` block) before relying on the files or ``records``;
    a background error is raised by the next call. ``length_rule``: every record also holds its
    rows' lengths (:meth:`manifest_fields` gives ``schema``, ``shards``, ``length_rule``).
    ``token_layout`` (needs a ``length_rule``): its keys are stored ragged, each sample's first
    ``length`` tokens. ``run_record``: the producer's run record every shard's header keeps.
    """

    def __init__(
        self,
        keys: Sequence[str],
        cache_name: str = "offline",
        schema: Mapping[str, TensorSpec] | None = None,
        pipelined: bool = True,
        write_behind: bool = False,
        length_rule: LengthRule | None = None,
        token_layout: TokenLayout | None = None,
        run_record: Mapping[str, Any] | None = None,
    ) -> None:
        if write_behind and not pipelined:
            raise ValueError(
                "write_behind=True needs pipelined=True (the writes run on the commit thread)"
            )
        self.keys = tuple(keys)
        if length_rule is not None and length_rule.key not in self.keys:
            raise ValueError(
                f"length_rule reads key {length_rule.key!r}, which is not one of the "
                f"stored keys {list(self.keys)}; "
                "name a stored key"
            )
        if token_layout is not None and length_rule is None:
            raise ValueError(
                "token_layout needs a length_rule: the rule says how many tokens of each "
                "sample are stored"
            )
        self.length_rule = length_rule
        self.token_layout = token_layout
        self.run_record = dict(run_record) if run_record is not None else None
        self.cache_name = cache_name
        self.schema: CacheSchema | None = dict(schema) if schema is not None else None
        self.records: dict[int, ShardRecord] = {}
        self._thread = WriteBehind() if pipelined else None
        self._write_behind = write_behind
        self._resolved = False  # length rule kind fixed, safetensors import checked
        self._streams: dict[int, _StreamedShard] = {}
        self._dirty: set[Storage] = set()  # with commits not yet flushed
        self._storages: dict[str | Storage, Storage] = {}

    def validate(
        self, samples: Mapping[str, Any], shard_index: int = -1, where: str | None = None
    ) -> dict[str, torch.Tensor]:
        """The stored keys of ``samples``, checked against the schema (the first call fixes it if
        unset)."""
        checked = validate_shard_tensors(
            samples, self.keys, self.cache_name, shard_index, self.schema, where
        )
        if self.schema is None:
            self.schema = {k: TensorSpec(t.dtype, tuple(t.shape[1:])) for k, t in checked.items()}
        return checked

    def __call__(self, cache_dir: str | Storage, shard_index: int, samples: dict[str, Any]) -> str:
        checked = self.validate(samples, shard_index)
        self.queue(cache_dir, shard_index, checked[self.keys[0]].shape[0], checked)
        return self.finish_shard(cache_dir, shard_index)

    def write_piece(
        self, cache_dir: str | Storage, shard_index: int, rows: int, piece: Mapping[str, Any]
    ) -> None:
        """Write the next rows (``{key: [n, ...]}``) of shard ``shard_index``, which holds ``rows``
        rows. With ``write_behind`` the caller must not modify the piece (it may drop it)."""
        check_int("rows", rows, 1, meaning=f": the number of rows shard {shard_index} will hold")
        self.queue(cache_dir, shard_index, rows, self.validate(piece, shard_index))

    def queue(
        self,
        cache_dir: str | Storage,
        shard_index: int,
        rows: int,
        checked: dict[str, torch.Tensor],
    ) -> None:
        """:meth:`write_piece` of rows :meth:`validate` returned: a batch is checked once, at this
        boundary."""
        if self._thread is not None:
            self._thread.raise_error()  # a failed writer writes nothing more
        n = checked[self.keys[0]].shape[0]
        st = self._streams.get(shard_index)
        if st is not None and rows != st.rows:
            raise ValueError(f"shard {shard_index} was started with rows={st.rows}, not {rows}")
        queued = 0 if st is None else st.queued
        if queued + n > rows:  # checked before a first piece opens the shard
            raise ValueError(
                f"shard {shard_index} holds {rows} rows; {n} more after {queued} overflow it"
            )
        nbytes = sum(tensor_nbytes(t.dtype, t.shape) for t in checked.values())
        if st is None:
            self._resolve_once(checked)
            assert self.schema is not None
            specs, run = {k: self.schema[k] for k in self.keys}, self.run_record
            tokens, rule = self.token_layout, self.length_rule
            first = shard_index * run["shard_size"] if run else None
            st = _StreamedShard(
                os.path.join(self._storage(cache_dir).work_dir, shard_name(shard_index)),
                rows,
                lambda tmp: ShardStream(tmp, specs, rows, run, tokens, rule, first),
            )
            self._streams[shard_index] = st
            if self._write_behind and n:  # the queue: PENDING_SHARDS shards of the largest size
                assert self._thread is not None
                self._thread.bound(PENDING_SHARDS * (rows * nbytes // n))
        st.queued += n
        if self._write_behind:
            assert self._thread is not None
            self._thread.submit(lambda: st.write(checked), nbytes, on_drop=st.abort)
        else:
            st.write(checked)

    def finish_shard(self, cache_dir: str | Storage, shard_index: int) -> str:
        """Commit shard ``shard_index`` once all its rows were handed over; its path."""
        st = self._streams.get(shard_index)
        if st is None:
            raise ValueError(f"shard {shard_index} has no pieces; call write_piece first")
        if st.queued != st.rows:
            raise ValueError(
                f"shard {shard_index} got {st.queued} of its {st.rows} rows; queue the rest first"
            )
        records, dirty, storage = self.records, self._dirty, self._storage(cache_dir)

        def finish() -> None:
            records[shard_index] = st.finish()

        def commit() -> None:
            storage.commit(shard_name(shard_index), st.tmp_path)
            dirty.add(storage)

        # a shard stays in _streams until its commit is queued: close() removes what is left
        if self._thread is None:
            finish()
            commit()
            self._sync_dirs()
        elif self._write_behind:
            self._thread.submit(lambda: (finish(), commit()), on_drop=st.abort)
        else:
            finish()
            self._thread.submit(commit, on_drop=st.abort)
        del self._streams[shard_index]
        return storage.display(shard_name(shard_index))

    def _storage(self, cache_dir: str | Storage) -> Storage:
        """Where ``cache_dir`` lives (its shards are written in its ``work_dir``, then
        committed); a producer passes the storage it opened."""
        storage = self._storages.get(cache_dir)
        if storage is None:
            storage = self._storages[cache_dir] = as_storage(cache_dir)
        return storage

    def _resolve_once(self, piece: Mapping[str, torch.Tensor]) -> None:
        """First shard: fix the length rule's kind by the key's shape (the same in every shard);
        check that safetensors imports (fail on the caller's thread, not on the writer's)."""
        if not self._resolved:
            if self.length_rule is not None:
                self.length_rule = for_tensor(self.length_rule, piece[self.length_rule.key])
            if self.token_layout is not None:
                assert self.schema is not None
                try:
                    check_token_schema(self.token_layout, self.schema)
                except ValueError as exc:
                    raise SchemaError(f"{self.cache_name} cache: {exc}") from None
            load_safetensors(self.cache_name)
            self._resolved = True

    def manifest_fields(self, cache_dir: str) -> dict[str, Any]:
        """``schema``, ``shards`` (in index order) and, with lengths, ``length_rule`` for
        ``write_manifest`` (call :meth:`flush` first: in the background modes the records land when
        written), as :func:`~te_thd.offline_cache.record.run.manifest_fields` writes them for every
        manifest. ``cache_dir``: where the shards were written (their names are the same in
        every directory)."""
        return manifest_fields(self.schema, self.records, self.length_rule, self.token_layout)

    def _sync_dirs(self) -> None:
        while self._dirty:
            self._dirty.pop().flush()

    def flush(self) -> None:
        """Block until every shard finished so far is durable under its final name."""
        if self._thread is not None:
            self._thread.flush()
        self._sync_dirs()

    def close(self) -> None:
        """Commit what is queued, stop the thread, raise a pending error; unfinished shards are
        removed."""
        try:
            if self._thread is not None:
                self._thread.close()
            self._sync_dirs()
        finally:
            # an interrupted producer: its partial shards are never committed. After a write error
            # too (the thread dropped their pieces). If the wait for the thread was interrupted,
            # its temp files stay for the next producer to remove.
            if self._thread is None or not self._thread.running:
                streams, self._streams = list(self._streams.values()), {}
                for st in streams:
                    st.abort()

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
    """Write one cache shard of exactly ``keys`` (``samples[k]``: ``[n, *trailing]``; extra keys
    dropped).

    The file is byte-identical to ``safetensors.torch.save_file`` of those tensors (plus te_thd's
    checksum metadata) and lands atomically and durably at ``shard_path``. ``schema`` (te_thd
    extension) pins each key's dtype and trailing shape. Returns the shard's path.
    """
    with DurableShardWriter(keys, cache_name, schema, pipelined=False) as writer:
        return writer(cache_dir, shard_index, samples)
