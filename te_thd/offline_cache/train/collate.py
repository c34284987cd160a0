"""The collates of cached samples: stacked (:func:`collate_cached`) or packed THD
(:class:`CachedThdCollator`).

Both run where a ``collate_fn`` runs, on the CPU inside DataLoader workers, so every
piece of THD metadata (``cu_seqlens*``, ``max_seqlen``, CP partition indices) is built on
the host and the training step gets tensors plus Python ints/bools: nothing in it
forces a host-device synchronisation. The THD path is the package's batch path::

    CachedBatch -> te_thd.packing.PackingCollator -> te_thd.thd_utils.process_input_for_thd
                -> te_thd.cp.shard_thd_batch_for_cp (cp_size > 1)

Cached samples are fixed-width rows ``[L, ...]`` (a producer pads every sample to
``L``); a sample's real length comes from ``length_key`` (a per-sample count), from
``mask_key`` (a right-padded per-token mask, length = its nonzero prefix), or is the
whole row. Only the token ids (and labels) go through the packer, together with a
per-token source index; every other per-token key — any dtype, any trailing shape,
e.g. hidden states ``[L, H]`` — is then placed with one ``index_select`` by that index.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import get_worker_info

from te_thd._cp_strategy import DUAL_CHUNK_SWAP, NO_LOAD_BALANCE, normalize_strategy
from te_thd.args import check_int, check_names
from te_thd.boundaries import check_cp_args
from te_thd.cp import partition_indices, shard_thd_batch_for_cp
from te_thd.layout import LAYOUT_KEY, ThdLayout
from te_thd.offline_cache.format.lengths import LENGTH_RULE_KEY, collator_rule
from te_thd.offline_cache.format.ragged import TOKEN_LAYOUT_KEY, token_places
from te_thd.offline_cache.read.dataset import CachedBatch
from te_thd.offline_cache.read.executor import DestinationBuffers, fill_rows, new_tensor
from te_thd.offline_cache.train.sampler import PlannedSamples
from te_thd.packing import PackingCollator, pad_to_multiple_for
from te_thd.thd_utils import process_input_for_thd

__all__ = ["CachedThdCollator", "collate_cached"]

_SRC = "__te_thd_src__"  # per-token source position, packed alongside the ids


def collate_cached(
    features: Sequence[dict[str, torch.Tensor]], keys: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Stack per-sample cache dicts into a batch: ``{key: [B, *sample_shape]}``.

    A :class:`CachedBatch` (what ``CachedTensorDataset.__getitems__`` returns) is
    already stacked: its tensors are returned as they are, without the unstack +
    restack a list of samples needs. Inside a DataLoader worker a list is stacked
    straight into shared memory (one copy less on the way to the main process).
    """
    if isinstance(features, CachedBatch):
        try:
            return features.padded(keys)  # (a key the dataset deferred is read here, whole)
        except KeyError as e:
            raise ValueError(
                f"collate_cached: key {e.args[0]!r} was not read (the dataset's disk_keys are "
                f"{features.keys}); add it to disk_keys or drop it from keys"
            ) from None
    if len(features) == 0:
        raise ValueError(
            "collate_cached: features is empty; a batch needs at least one sample (a sampler "
            "or batch_sampler yielded an empty batch)"
        )
    shared = get_worker_info() is not None
    out = {}
    for key in keys:
        try:
            rows = [feature[key] for feature in features]
        except KeyError:
            i = next(i for i, f in enumerate(features) if key not in f)
            raise ValueError(
                f"collate_cached: sample {i} has no key {key!r} (it holds {sorted(features[i])}); "
                "add it to the dataset's disk_keys or drop it from keys"
            ) from None
        dst = None
        if shared:
            # torch.stack promotes mixed dtypes; the shared-memory output must too
            dtype = (
                functools.reduce(torch.promote_types, {r.dtype for r in rows})
                if all(isinstance(r, torch.Tensor) for r in rows)
                else None
            )
            if dtype is not None:
                dst = new_tensor((len(rows), *rows[0].shape), dtype, shared=True)
        try:
            out[key] = torch.stack(rows, dim=0, out=dst)
        except (RuntimeError, TypeError) as exc:
            raise _stack_error(key, rows, exc) from None
    return out


def _stack_error(key: str, rows: list[Any], exc: Exception) -> ValueError:
    """Why ``torch.stack(rows)`` failed, naming the key and the first offending sample."""
    for i, r in enumerate(rows):
        if not isinstance(r, torch.Tensor):
            return ValueError(
                f"collate_cached: key {key!r} of sample {i} is of type "
                f"{type(r).__name__}, not a tensor"
            )
    first = list(rows[0].shape)
    for i, r in enumerate(rows):
        if list(r.shape) != first:
            return ValueError(
                f"collate_cached: key {key!r} of sample {i} is {list(r.shape)}, sample "
                f"0's is {first}: "
                "the samples of one batch must share each key's shape (pad them when producing the "
                "cache, or collate variable lengths with CachedThdCollator)"
            )
    return ValueError(f"collate_cached: cannot stack key {key!r} ({exc})")


class CachedThdCollator:
    """Collate cached samples into one THD batch (optionally this CP rank's shard).

    Args:
        seq_len: S, token slots per packed row (a multiple of ``2*cp_size``).
        keys: cache keys to carry (default: every key the dataset read).
        input_key: key of the token ids ``[L]`` per sample.
        label_key: key of per-sample labels aligned with the ids (unshifted, HF
            convention); None: the labels are the ids. The packer shifts them
            inside each document (Megatron/TE convention, -100 on padding).
        length_key: per-sample real length (``[]`` or ``[1]`` int per sample).
        mask_key: right-padded per-token mask ``[L]`` / ``[L, 1]``; length = its
            nonzero prefix. Neither given: every row is ``L`` real tokens.
        token_keys: keys placed per token (default: every carried key shaped
            ``[L, ...]`` except the ids, labels and ``length_key``). Other keys are
            returned per sample, ``[B_samples, ...]``, unchanged.
        cp_size, cp_rank: context parallelism; ``cp_size > 1`` pads every document to
            a multiple of ``2*cp_size`` (times ``tp_size`` under sequence
            parallelism) and returns rank ``cp_rank``'s tokens.
        strategy: the CP partition (:func:`te_thd.cp.partition_indices`):
            ``"dual_chunk_swap"`` (default) or ``"no_load_balance"``, which pads no
            document (``seq_len`` a multiple of ``cp_size``) and gives rank ``r`` the
            ``r``-th contiguous piece of the stream. Either way a rank reads only its
            own tokens of each token key.
        rows: fixed number of packed rows (fixed shapes, e.g. CUDA graphs); None
            uses as many rows as the samples need.
        max_num_seqs: with ``rows``, identical shapes every step (CUDA graphs): the
            layout's boundary arrays are padded to ``[max_num_seqs + 1]`` with
            zero-length trailing sequences and its ``max_seqlen`` is fixed to the stream
            length ``rows * seq_len`` (:meth:`~te_thd.layout.ThdLayout.padded_to`); a
            batch with more documents raises. None: as many boundaries as documents.
        overlong: a sample longer than S: ``"raise"`` (default) or ``"truncate"``.
        pad_token_id, pad_values: filler of ``input_ids`` / of each other token key
            in padding slots (default 0).
        absorb_trailing_pad: forwarded to ``process_input_for_thd`` (False for
            bidirectional attention).

    Returns (``T`` tokens of this CP rank, ``T = rows*S / cp_size``): the
    ``process_input_for_thd`` dict — ``input_ids``, ``labels``, ``position_ids``,
    ``padding_mask`` ``[T]``, global ``cu_seqlens`` / ``cu_seqlens_padded`` int32
    ``[N+1]``, ``max_seqlen`` (int32 0-d), ``max_seqlen_int`` / ``num_seqs`` (int),
    ``pad_between_seqs`` (bool) — plus each token key ``[T, ...]``, each per-sample
    key ``[B_samples, ...]``, ``num_samples`` (int), ``packing_efficiency``
    (float), ``cp_size`` / ``cp_rank`` when sharded, and ``thd_layout``: the batch's
    :class:`~te_thd.layout.ThdLayout` (host boundaries, ``.sharded(cp_size, cp_rank)``
    under CP) -- pass it to ``te_attention_kwargs`` / ``ThdAttention`` as it is; it
    stays on the host when ``to_device`` moves the tensors, and the adapters move its
    boundaries with ``device=``.
    """

    def __init__(
        self,
        seq_len: int,
        *,
        keys: Sequence[str] | None = None,
        input_key: str = "input_ids",
        label_key: str | None = None,
        length_key: str | None = None,
        mask_key: str | None = None,
        token_keys: Sequence[str] | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        rows: int | None = None,
        overlong: Literal["truncate", "raise"] = "raise",
        pad_token_id: int = 0,
        pad_values: Mapping[str, int | float] | None = None,
        seq_lens_padding_value: int = -1000,
        absorb_trailing_pad: bool = True,
        max_num_seqs: int | None = None,
        strategy: Any = DUAL_CHUNK_SWAP,
    ) -> None:
        if length_key is not None and mask_key is not None:
            raise ValueError(
                f"pass length_key={length_key!r} or mask_key={mask_key!r}, not both: one "
                "source of sample lengths"
            )
        check_cp_args(cp_size, cp_rank)
        self.keys = check_names("keys", keys, optional=True)
        self.input_key = input_key
        self.label_key = label_key
        self.length_key = length_key
        self.mask_key = mask_key
        self.token_keys = check_names("token_keys", token_keys, optional=True)
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.strategy = normalize_strategy(strategy)
        if self.strategy == NO_LOAD_BALANCE and seq_len % cp_size:
            raise ValueError(
                f"seq_len={seq_len} must be a multiple of cp_size={cp_size} with "
                f"strategy='no_load_balance' (each rank holds 1/cp_size of the stream); use "
                f"seq_len={-(-seq_len // cp_size) * cp_size}"
            )
        self.pad_token_id = pad_token_id
        self.pad_values = dict(pad_values or {})
        self.seq_lens_padding_value = seq_lens_padding_value
        self.absorb_trailing_pad = absorb_trailing_pad
        check_int("max_num_seqs", max_num_seqs, 1, optional=True)
        self.max_num_seqs = max_num_seqs
        self.packer = PackingCollator(
            seq_len,
            pad_to_multiple_of=pad_to_multiple_for(
                cp_size, tp_size, sequence_parallel, self.strategy
            ),
            overlong=overlong,
            label_key="labels" if label_key is not None else None,
            input_key="input_ids",
            pad_token_id=pad_token_id,
            seq_lens_padding_value=seq_lens_padding_value,
            rows=rows,
            pad_values={_SRC: -1},
        )

    def check_dataset(self, dataset: Any) -> None:
        """Refuse a ``CachedTensorDataset`` whose ragged keys (each sample's real tokens, zeros past
        them) this collator would pack as full rows of ``L`` tokens, having no ``length_key`` nor
        ``mask_key``: ``ValueError`` naming ``length_key`` and the key the producer recorded the
        lengths under."""
        layout = dataset.manifest.get(TOKEN_LAYOUT_KEY)
        ragged = tuple(k for k in dataset.disk_keys if layout and k in layout.get("keys", ()))
        rule = dataset.manifest.get(LENGTH_RULE_KEY)
        key = rule.get("key") if isinstance(rule, dict) and rule.get("kind") == "value" else None
        fix = None
        if key is not None:
            add = "" if key in dataset.disk_keys else f" and add {key!r} to the dataset's disk_keys"
            fix = f"pass CachedThdCollator(..., length_key={key!r}){add}"
        where = f"the {dataset.cache_name} cache at {dataset.cache_dir}"
        self._check_ragged(ragged, where, fix)

    def _check_ragged(self, ragged: Sequence[str], where: str, fix: str | None) -> None:
        if self.length_key is not None or self.mask_key is not None:
            return
        carried = [k for k in ragged if self.keys is None or k in self.keys]
        if carried:
            raise ValueError(
                "CachedThdCollator(length_key=None) packs every sample as its full row "
                "of L tokens, but "
                f"{where} stores {carried} ragged (each sample's real tokens only); "
                + (
                    fix
                    or "pass length_key=<the key holding each sample's length, one int per sample>"
                )
            )

    def gathered_keys(self, keys: Sequence[str]) -> tuple[str, ...]:
        """Of a dataset's keys ``keys``, those this collator reads only token by token
        (``CachedBatch.gather``), never whole: what ``build_cached_dataloader`` has a
        ``CachedTensorDataset`` defer (``defer_keys``)."""
        whole = {self.input_key, self.label_key, self.length_key, self.mask_key}
        carried = keys if self.keys is None else [k for k in keys if k in self.keys]
        return tuple(
            k
            for k in carried
            if k not in whole and (self.token_keys is None or k in self.token_keys)
        )

    # -- helpers ---------------------------------------------------------------------------

    def _batch(
        self, features: Sequence[Mapping[str, torch.Tensor]]
    ) -> tuple[CachedBatch, tuple[str, ...]]:
        """The batch as a :class:`CachedBatch` (a list of samples is stacked into one), and the keys
        it carries (``keys``, else all). Its keys are reached the same way whatever their stored
        layout."""
        if not isinstance(features, CachedBatch):
            if len(features) == 0:
                raise ValueError("features is empty; a THD batch needs at least one sample")
            features = CachedBatch(collate_cached(features, tuple(features[0])), len(features))
        if features.ragged:  # the first batch of a loader built without build_cached_dataloader
            self._check_ragged(features.ragged, "the cache these samples come from", None)
        if self.keys is None:
            return features, features.keys
        missing = [k for k in self.keys if k not in features.keys]
        if missing:
            raise ValueError(
                f"keys {missing} were not read (read: {sorted(features.keys)}); add them "
                "to the dataset's disk_keys"
            )
        return features, tuple(self.keys)

    def _lengths(
        self, tensors: Mapping[str, torch.Tensor], b: int, width: int, read: Sequence[str]
    ) -> torch.Tensor:
        """Real length of every sample, int64 ``[B]`` on the CPU, by the rule the balanced
        loader plans with (:func:`~te_thd.offline_cache.format.lengths.collator_rule`)."""
        rule = collator_rule(self)
        if rule.kind != "row" and rule.key not in tensors:
            arg = "length_key" if rule.kind == "value" else "mask_key"
            raise ValueError(f"{arg}={rule.key!r} was not read (read: {sorted(read)})")
        t = tensors[rule.key]
        if rule.kind == "value" and (t.numel() != b or t.is_floating_point()):
            raise ValueError(
                f"length_key={self.length_key!r} must hold one integer per sample, got "
                f"{tuple(t.shape)} {t.dtype} for {b} samples"
            )
        if rule.kind == "nonzero":
            if t.numel() != b * width:
                raise ValueError(
                    f"mask_key={self.mask_key!r} must be [L] or [L, 1] per sample (L={width}), got "
                    f"{tuple(t.shape[1:])}"
                )
            # right padding: the nonzero entries form a prefix of the row
            m = t.reshape(b, width) != 0
            bad = torch.nonzero(m.to(torch.int8).cumprod(1).sum(1) != m.sum(1)).view(-1)
            if bad.numel():
                raise ValueError(
                    f"mask_key={self.mask_key!r} of sample {int(bad[0])} (of this batch) "
                    "is not right-padded "
                    "(a zero before a nonzero); pass length_key instead, or store a "
                    "right-padded mask"
                )
        lengths = torch.from_numpy(rule.lengths(t.reshape(b, -1)))
        if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > width):
            i = int(torch.nonzero((lengths < 1) | (lengths > width)).view(-1)[0])
            raise ValueError(
                f"sample {i} of this batch has length {int(lengths[i])}, outside [1, L={width}]; "
                "drop empty samples when producing the cache, or fix length_key/mask_key"
            )
        return lengths

    def _token_tensor(
        self, key: str, n: int, per_token: tuple[int, ...], dtype: torch.dtype, recycle: bool
    ) -> tuple[torch.Tensor, bool]:
        """An uninitialised ``[n, *per_token]`` tensor for token key ``key`` of a batch, and whether
        it is all zeros (a buffer new to the pool). From this
        process's pool: a buffer is handed out again only once nothing outside the pool refers to
        it (the consumer, or the DataLoader's pinning copy, dropped the batch; a batch kept is
        never overwritten). In a DataLoader worker, fresh shared memory (the batch leaves the
        process). ``recycle=False`` (a batch mostly padding): a new zeroed buffer instead of an
        idle one, whose padding is then never written."""
        where = (os.getpid(), get_worker_info() is not None)
        pools = self.__dict__.setdefault("_pools", {})
        pool = pools.get(where)
        if pool is None:
            pool = pools[where] = DestinationBuffers(shared=where[1])
        t, _, zero = pool.get_zeroed(key, n, tuple(per_token), dtype, recycle=recycle)
        return t, zero

    def __getstate__(self) -> dict[str, Any]:
        # the pools belong to the process that made them: a worker makes its own
        return {k: v for k, v in self.__dict__.items() if k != "_pools"}

    # -- collate -----------------------------------------------------------------------

    def __call__(self, features: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
        # A planned step (``BalancedBatchSampler`` through ``PlannedDataset``) keeps its
        # rows: samples arrive row by row and are packed as planned.
        rows = features.rows if isinstance(features, PlannedSamples) else None
        if rows is not None:
            features = features.batch
        batch, carried = self._batch(features)
        if self.input_key not in carried:
            raise ValueError(f"input_key={self.input_key!r} was not read (read: {sorted(carried)})")
        # the keys the packer reads whole: ids, labels and what gives the lengths
        packed_keys = [
            k
            for k in (self.input_key, self.label_key, self.length_key, self.mask_key)
            if k in carried
        ]
        tensors = batch.padded(list(dict.fromkeys(packed_keys)))
        ids = tensors[self.input_key]
        if ids.dim() != 2:
            raise ValueError(
                f"{self.input_key!r} must be [L] token ids per sample, got {tuple(ids.shape[1:])}"
            )
        b, width = ids.shape
        lengths = self._lengths(tensors, b, width, carried)

        # Real tokens of all samples, in sample order, and where each came from: [sum(lengths)]
        # (index math in numpy, on this thread; no [B, L] mask)
        src = torch.from_numpy(token_places(np.arange(b, dtype=np.int64) * width, lengths.numpy()))
        lens = lengths.tolist()
        parts: dict[str, tuple[torch.Tensor, ...]] = {
            "input_ids": torch.split(ids.reshape(-1).index_select(0, src), lens),
            _SRC: torch.split(src, lens),
        }
        if self.label_key is not None:
            if self.label_key not in tensors:
                raise ValueError(
                    f"label_key={self.label_key!r} was not read (read: {sorted(carried)})"
                )
            parts["labels"] = torch.split(
                tensors[self.label_key].reshape(-1).index_select(0, src), lens
            )
        samples = [
            dict(zip(parts, group, strict=True)) for group in zip(*parts.values(), strict=True)
        ]
        packed = self.packer(samples, rows=rows)

        consumed = {self.input_key, self.label_key, self.length_key}
        # per-sample shape of every carried key, nothing read
        shapes = {k: batch.sample_spec(k).shape for k in carried}
        if self.token_keys is not None:
            token_keys = self.token_keys
            for k in token_keys:
                if k not in shapes or not shapes[k] or shapes[k][0] != width:
                    raise ValueError(
                        f"token_keys entry {k!r} must be read and shaped [L={width}, ...] "
                        f"per sample, got {shapes.get(k, 'missing')}"
                    )
        else:
            token_keys = tuple(
                k for k, sh in shapes.items() if k not in consumed and sh and sh[0] == width
            )
        src_flat = packed.pop(_SRC).reshape(-1)  # [rows*S], -1 on padding
        is_pad = src_flat < 0
        gather = src_flat.clamp(min=0)
        thd = process_input_for_thd(
            {
                "input_ids": packed["input_ids"],
                "labels": packed["labels"],
                "position_ids": packed["position_ids"],
                "seq_lens": packed["seq_lens"],
                "seq_lens_padded": packed["seq_lens_padded"],
            },
            self.seq_lens_padding_value,
            self.pad_token_id,
            absorb_trailing_pad=self.absorb_trailing_pad,
        )
        layout = ThdLayout.from_thd(thd)
        thd[LAYOUT_KEY] = layout
        if self.cp_size > 1:
            thd = shard_thd_batch_for_cp(
                thd, self.cp_size, self.cp_rank, layout=layout, strategy=self.strategy
            )
            # Token keys (e.g. hidden states) are gathered once, straight into this
            # rank's share, instead of placed whole and then sharded.
            mine = partition_indices(
                layout.cu_seqlens_padded,
                src_flat.numel(),
                self.cp_size,
                self.cp_rank,
                layout.num_seqs,
                check=False,
                strategy=self.strategy,
            )
            gather, is_pad = gather[mine], is_pad[mine]
        if self.max_num_seqs is not None:
            # bound: the stream length (rows * seq_len), fixed with ``rows``; a row's
            # length is not enough, trailing empty rows are absorbed into the last sequence
            layout = thd[LAYOUT_KEY].padded_to(self.max_num_seqs)
            thd[LAYOUT_KEY] = layout
            thd["cu_seqlens"], thd["cu_seqlens_padded"] = (
                layout.cu_seqlens,
                layout.cu_seqlens_padded,
            )
            thd["num_seqs"], thd["max_seqlen_int"] = layout.num_seqs, layout.max_seqlen
            thd["max_seqlen"] = torch.tensor(layout.max_seqlen, dtype=torch.int32)
        # every token key placed at once, exactly this rank's real tokens (of a ragged key only the
        # blocks that hold them are read, straight into place); only the padding is filled
        real = torch.nonzero(~is_pad).view(-1)
        at = gather.index_select(0, real).numpy()
        edges = np.flatnonzero(np.diff(is_pad.numpy(), prepend=False, append=False))
        for k in token_keys:  # the padding's runs of slots filled
            spec = batch.sample_spec(k)
            value = self.pad_values.get(k, 0)
            # mostly zero padding: new zeroed memory, whose padding pages are never written
            recycle = value != 0 or 2 * at.size >= gather.numel()
            thd[k], zero = self._token_tensor(
                k, gather.numel(), spec.shape[1:], spec.dtype, recycle
            )
            if value != 0 or not zero:
                fill_rows(thd[k], edges[::2].tolist(), edges[1::2].tolist(), value)
        batch.gather_into(token_keys, at // width, at % width, real.numpy(), thd)
        out = dict(thd)
        # per-sample keys, [B_samples, ...] (a token key the caller's token_keys left out among
        # them)
        out.update(batch.padded([k for k in carried if k not in consumed and k not in token_keys]))
        out["num_samples"] = b
        out["packing_efficiency"] = packed["packing_efficiency"]
        return out
