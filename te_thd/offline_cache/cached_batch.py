"""What a batched read returns: :class:`CachedBatch`, and :class:`PendingBatch` while it is read."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch

from .copyread import PendingReads, ReadError
from .token_read import TokenRows

__all__ = ["CachedBatch", "PendingBatch"]


class CachedBatch(Sequence[dict[str, torch.Tensor]]):
    """The result of ``CachedTensorDataset.__getitems__``: a batch already stacked.

    ``tensors[key]`` is ``[B, *sample_shape]`` in the requested order, memory no
    one else uses (the reader recycles it only once every reference to it is
    gone; in shared memory inside a DataLoader worker, so sending it to the main
    process costs no copy). The object is also a sequence of ``B`` per-sample dicts
    (row views), so a collate function written for a list of samples still works;
    ``collate_cached`` and ``CachedThdCollator`` take ``tensors`` as is instead
    of unstacking and restacking.
    """

    __slots__ = ("fixed", "tokens", "_len")

    def __init__(self, tensors: dict[str, torch.Tensor], length: int, tokens: TokenRows | None = None) -> None:
        self.fixed = tensors
        self.tokens = tokens
        self._len = length

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every key, stacked: ragged keys of a token-layout cache are read here, on first access,
        zero-padded to ``[B, L, ...]`` (``fixed`` holds the others; ``tokens`` reads any tokens
        of the ragged ones without padding them first, e.g. one CP rank's share)."""
        if self.tokens is not None:
            tokens, self.tokens = self.tokens, None
            self.fixed = {**self.fixed, **tokens.padded_many(tokens.keys)}
        return self.fixed

    def __reduce__(self) -> tuple[Any, ...]:
        # another process cannot read through this one's open shards: send the tensors
        return (CachedBatch, (self.tensors, self._len))

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
        self, batch: CachedBatch, reads: PendingReads, unreadable: Callable[[str, BaseException], Exception]
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
