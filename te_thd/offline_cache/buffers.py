"""Destination tensors for batch reads: fresh to the consumer, recycled once it lets go.

:class:`DestinationBuffers` hands out the tensors a batch is read into:

* fresh (default) -- memory no one else uses; a buffer handed out earlier is handed
  out again only once every reference to it outside the pool is gone. Never-touched
  memory costs page faults and cache misses on every batch, a sizeable share of a
  large-sample read (docs/performance-io.md), so recycling matters.
* ``shared`` -- inside a DataLoader worker the batch is pickled to the main
  process; allocating it in shared memory up front (as ``default_collate`` does)
  saves that copy. Such a batch leaves the process, so it is never recycled.
* ``pinned`` -- when the batch goes to CUDA, reading into page-locked memory lets
  ``.to(device, non_blocking=True)`` DMA straight from it and saves the copy the
  DataLoader's pin-memory step would make.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from .copyread import tensor_memoryview
from .format import tensor_nbytes

__all__ = ["DestinationBuffers", "new_tensor"]


def new_tensor(shape: Sequence[int], dtype: torch.dtype, *, shared: bool = False, pinned: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor ``shape``/``dtype``, in shared or page-locked memory on request.

    ``shared``: storage in shared memory (a DataLoader worker's batch travels to the
    main process without a copy). ``pinned``: page-locked (torch's caching host
    allocator), for a non-blocking copy to CUDA.
    """
    shape = tuple(int(s) for s in shape)
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if not shared:
        return torch.empty(shape, dtype=dtype)
    # public API: moving a fresh tensor to shared memory costs the one copy torch's
    # worker pickling would make of a tensor that is not there yet
    return torch.empty(shape, dtype=dtype).share_memory_()


class _Buffer:
    """One pooled buffer: its bytes (a numpy array, the owner of the memory), a writable view of
    them, and the owner's reference count while no tensor uses it."""

    __slots__ = ("idle_refs", "owner", "whole")

    def __init__(self, nbytes: int) -> None:
        self.owner = np.empty(nbytes, dtype=np.uint8)
        self.whole = memoryview(self.owner)
        self.idle_refs = 0
        self.idle_refs = self.refs()

    def refs(self) -> int:
        """The owner's reference count: every tensor made over it holds one through its storage
        (``torch.frombuffer``), however many views of that tensor exist. Always measured
        through this method, so the interpreter's own temporaries count the same each time."""
        return sys.getrefcount(self.owner)

    def idle(self) -> bool:
        return self.refs() == self.idle_refs


class DestinationBuffers:
    """Destination tensors for batches: fresh to the consumer, recycled once it lets go.

    ``get(key, n, sample_shape, dtype)`` -> ``(tensor, bytes)``: an uninitialised
    ``[n, *sample_shape]`` tensor and a writable memoryview of its bytes (kept with
    a pooled buffer, so a batch does not rebuild it). What the consumer sees is always
    a tensor nobody else uses: a buffer handed out earlier is only handed out again
    once every reference to its memory outside this pool is gone (the batch, its
    views, numpy arrays over it). The pool owns each buffer's memory as a numpy array
    and hands out tensors made over it (``torch.frombuffer``), each of which keeps a
    reference to the array for as long as any view of it lives: the array's Python
    reference count says whether the consumer still holds the batch. A training loop
    that drops batch ``i`` while it reads ``i + 1`` therefore cycles between two buffer
    sets, with no lifetime rule to follow; a consumer that keeps its batches just gets
    new memory. Recycling saves the page faults and cache misses of never-touched
    memory, most when the allocator returns freed batches to the kernel.

    Args:
        shared: allocate in shared memory, never recycle (inside a DataLoader
            worker: the batch leaves the process, and the main process's
            references are invisible here).
        pinned: page-locked memory for a CUDA destination; allocated through
            torch's caching host allocator, which itself recycles a block only
            after the copies that used it have finished (this pool cannot see
            those copies, so it does not recycle pinned memory).
        max_pooled: buffers kept per key (and dtype / sample shape).
    """

    def __init__(self, *, shared: bool = False, pinned: bool = False, max_pooled: int = 4) -> None:
        if shared and pinned:
            raise ValueError("shared=True and pinned=True: a DataLoader worker's batch is pinned by the main process")
        self.shared = shared
        self.pinned = pinned
        self.max_pooled = max_pooled
        self._pool: dict[tuple[str, torch.dtype, tuple[int, ...]], list[_Buffer]] = {}

    def get(
        self, key: str, n: int, sample_shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, memoryview]:
        shape = (n, *sample_shape)
        if self.shared or self.pinned:
            t = new_tensor(shape, dtype, shared=self.shared, pinned=self.pinned)
            return t, tensor_memoryview(t)
        nbytes = tensor_nbytes(dtype, shape)
        entries = self._pool.setdefault((key, dtype, sample_shape), [])
        for buf in entries:
            if buf.owner.nbytes >= nbytes and buf.idle():
                return self._tensor(buf.owner, nbytes, dtype, shape), buf.whole[:nbytes]
        buf = _Buffer(nbytes)
        entries.append(buf)
        if len(entries) > self.max_pooled:
            entries.pop(0)  # the oldest: still held by the consumer (now only theirs) or idle
        return self._tensor(buf.owner, nbytes, dtype, shape), buf.whole

    @staticmethod
    def _tensor(owner: np.ndarray, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if nbytes == 0:  # zero-size rows: nothing to share (an empty array has no strides to view)
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(owner, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)

    def __getstate__(self) -> dict[str, object]:
        # buffers belong to the process that allocated them
        return {"shared": self.shared, "pinned": self.pinned, "max_pooled": self.max_pooled}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(**state)  # type: ignore[misc, arg-type]
