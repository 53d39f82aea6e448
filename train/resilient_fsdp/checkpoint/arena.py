"""The staging arena: every staging buffer of a rank in one block of shared memory.

A buffer of its own per tensor would be a shared-memory file descriptor per tensor, held by the
trainer and held again by the writer process that maps it: the state of the ``8b`` preset has
1,164 tensors per rank, ``70b`` 2,892, past the soft ``nofile`` limit of 1024 that many container
runtimes set. The arena is one descriptor on each side, whatever the number of tensors, and it
reaches the writer in one transfer. Its tensors are views at aligned offsets (:class:`Slot`); the
writer rebuilds each from the same table (:func:`tensor_at`), as a tensor over exactly its own bytes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

# Every slot starts on a cache line, which is also a multiple of every element size.
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """Where one contiguous tensor lies in the arena: its byte offset, dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def plan(tensors: Iterable[torch.Tensor]) -> tuple[list[Slot], int]:
    """A slot for each of ``tensors`` (in order), and the arena's size in bytes."""
    slots, end = [], 0
    for t in tensors:
        slot = Slot(end, t.dtype, tuple(t.shape))
        slots.append(slot)
        end = _aligned(slot.offset + slot.nbytes)
    return slots, end


class Arena:
    """One block of shared memory, first touched here (a page fault per page costs as much as the
    copy itself, so the first save must not pay it) and, on GPUs, pinned (registered with CUDA as
    one range, unregistered when the arena is closed or collected)."""

    def __init__(self, nbytes: int, pin: bool = False):
        # Shared from the start: moving an ordinary tensor into shared memory copies it.
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.bytes.zero_()
        self._unpin: Optional[weakref.finalize] = None
        if pin:
            import torch.cuda._pin_memory_utils as pinning

            pinning.pin_memory(self.bytes.data_ptr(), self.bytes.numel())
            self._unpin = weakref.finalize(self, pinning.unpin_memory, self.bytes.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.bytes.numel()

    def view(self, slot: Slot) -> torch.Tensor:
        """The arena's bytes of ``slot`` as a tensor of its dtype and shape (no copy)."""
        return self.bytes[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    def close(self) -> None:
        """Unregister the pinned range; the memory itself goes with the last view of it."""
        if self._unpin is not None:
            self._unpin()


def tensor_at(memory: np.ndarray, offset: int, dtype: torch.dtype, shape: tuple, stride: tuple) -> torch.Tensor:
    """The writer's side: a tensor of ``memory`` (the arena's bytes) at byte ``offset`` whose
    storage is its own span alone, no copy. ``torch.save`` writes a tensor's whole storage, so a
    view of the arena would write every tensor's bytes into each item of the checkpoint."""
    if _numel(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    return torch.frombuffer(memory, dtype=dtype, count=extent, offset=offset).as_strided(shape, stride)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
