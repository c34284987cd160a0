"""What a batched read returns: :class:`CachedBatch` (read, stacked and verified) and
:class:`PendingBatch` (a batch being read, for read-ahead)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import torch

from te_thd.offline_cache.format.schema import TensorSpec
from te_thd.offline_cache.read.executor import PendingReads, ReadError
from te_thd.offline_cache.read.tokens import TokenRows

__all__ = ["CachedBatch", "PendingBatch"]


class CachedBatch(Sequence[dict[str, torch.Tensor]]):
    """The result of ``CachedTensorDataset.__getitems__``: a batch already read, stacked and
    verified.

    ``tensors[key]`` is ``[B, *sample_shape]`` (a ragged key zero-padded to ``[B, L, ...]``) in the
    requested order, memory no one else uses (recycled only once every reference to it is gone; in
    shared memory inside a DataLoader worker). Also a sequence of ``B`` per-sample dicts (row views
    of ``tensors``), so a collate function written for a list of samples still works.

    ``deferred``: the ragged keys the dataset leaves unread (``defer_keys``), in :attr:`keys` but
    not in ``tensors`` until :meth:`padded` or :meth:`gather` reads them (a CP rank's tokens only).
    ``ragged``: the keys the cache stores ragged (each sample's real tokens; zero past them).
    """

    __slots__ = ("tensors", "deferred", "ragged", "_len")

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        length: int,
        deferred: TokenRows | None = None,
        ragged: tuple[str, ...] = (),
    ) -> None:
        self.tensors = tensors
        self.deferred = deferred
        self.ragged = ragged
        self._len = length

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the batch, read or deferred."""
        later = self.deferred.specs if self.deferred is not None else ()
        return (*self.tensors, *(k for k in later if k not in self.tensors))

    def sample_spec(self, key: str) -> TensorSpec:
        """``key``'s dtype and per-sample shape (``[L, ...]`` for a token key), nothing read."""
        if key in self.tensors:
            t = self.tensors[key]
            return TensorSpec(t.dtype, tuple(t.shape[1:]))
        assert self.deferred is not None, key
        return self.deferred.specs[key]

    def padded(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """``{key: [B, *sample_shape]}`` of ``keys``; a deferred key is read now, zero-padded,
        verified, and kept in ``tensors``."""
        later = [k for k in keys if k not in self.tensors]
        if later and self.deferred is not None:
            self.tensors = {**self.tensors, **self.deferred.padded_many(later)}
        return {k: self.tensors[k] for k in keys}

    def gather(
        self, keys: Sequence[str], sample: np.ndarray, pos: np.ndarray
    ) -> dict[str, torch.Tensor]:
        """Tokens ``pos`` of batch samples ``sample`` (int64 ``[M]`` each, ``pos`` below the
        sample's ``L``) of each of the token keys ``keys``: ``{key: [M, *per_token]}``. Of a
        deferred key only the checksum blocks holding those tokens are read, now, and verified."""
        later = [k for k in keys if k not in self.tensors]
        read = (
            self.deferred.gather_many(later, sample, pos)
            if later and self.deferred is not None
            else {}
        )
        at = (torch.from_numpy(sample), torch.from_numpy(pos))
        return {k: self.tensors[k][at] if k in self.tensors else read[k] for k in keys}

    def gather_into(
        self,
        keys: Sequence[str],
        sample: np.ndarray,
        pos: np.ndarray,
        dst: np.ndarray,
        out: Mapping[str, torch.Tensor],
    ) -> None:
        """:meth:`gather`, written into rows ``dst`` (int64 ``[M]``) of ``out[key]`` (``[N,
        *per_token]``, contiguous, the key's dtype) instead of returned: of a deferred key, the
        checksum blocks holding those tokens are read now, verified, and whole blocks go straight
        into place (one copy); the other rows of ``out`` are left as they are."""
        later = [k for k in keys if k not in self.tensors]
        at = (torch.from_numpy(sample), torch.from_numpy(pos))
        rows = torch.from_numpy(dst)
        for k in keys:
            if k in self.tensors:
                out[k].index_copy_(0, rows, self.tensors[k][at])
        if later and self.deferred is not None:
            self.deferred.place_many(later, sample, pos, dst, out)

    def __reduce__(self) -> tuple[Any, ...]:
        # another process cannot read through this one's open shards: the deferred keys are read
        # first
        return (CachedBatch, (self.padded(self.keys), self._len, None, self.ragged))

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, torch.Tensor]]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        return {k: v[i] for k, v in self.tensors.items()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self[i] for i in range(self._len))


class PendingBatch:
    """A batch being read (``CachedTensorDataset.start_read``); ``result()`` waits for it."""

    def __init__(
        self,
        batch: CachedBatch,
        reads: PendingReads,
        unreadable: Callable[[str, BaseException], Exception],
    ) -> None:
        self._unreadable = unreadable  # the exception to raise for a file that could not be read
        self._batch = batch
        self._reads: PendingReads | None = reads

    def result(self) -> CachedBatch:
        """The batch, once every row is read and verified (``CacheIntegrityError`` otherwise)."""
        if self._reads is not None:
            reads, self._reads = self._reads, None
            try:
                reads.wait()
            except ReadError as exc:
                raise self._unreadable(exc.path, exc) from exc
        return self._batch

    def __del__(self) -> None:
        # Dropped unread: its buffers look free to the pool (nothing references the
        # tensors), so the helpers must be done writing into them before they can be
        # handed out again.
        reads, self._reads = getattr(self, "_reads", None), None
        if reads is not None:
            try:
                reads.wait()
            except Exception:  # noqa: BLE001 - nobody asked for this batch
                pass
