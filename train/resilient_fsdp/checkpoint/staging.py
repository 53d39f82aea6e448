"""Staging: a snapshot of the state in reused host buffers, taken while the loop waits."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import nvrx


class StateStager:
    """Copies state into host buffers that are allocated once and reused, so the file holds
    exactly the state of the step it is named for while the loop goes on changing the live
    tensors (NVRx 0.4 would otherwise write live CPU tensors).

    Buffers live in shared memory (NVRx's worker receives them without a copy), pinned on GPUs
    for fast device-to-host copies. Reuse is what keeps the stall small: a fresh buffer costs a
    page fault per page, about as long as a whole synchronous save on a CPU-only machine.
    """

    def __init__(self) -> None:
        self.pin = nvrx.cuda_present()
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu").share_memory_()
            if self.pin:
                torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
            self.buffers[key] = buf
        return buf

    def stage(self, sd: Any) -> Any:
        """A copy of ``sd`` whose tensors live in this stager's buffers (DTensors stay DTensors)."""
        staged = self._stage(sd, "")
        if self.pin:
            torch.cuda.synchronize()  # one wait for every non-blocking device-to-host copy
        return staged

    def _stage(self, sd: Any, key: str) -> Any:
        if isinstance(sd, DTensor):
            local = self._stage(sd.to_local(), key)
            return DTensor.from_local(local, sd.device_mesh, sd.placements, shape=sd.shape, stride=sd.stride(),
                                      run_check=False)
        if isinstance(sd, torch.Tensor):
            buf = self._buffer(key, sd)
            buf.copy_(sd.detach(), non_blocking=self.pin)
            return buf
        if isinstance(sd, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in sd.items()}
        if isinstance(sd, (list, tuple)):
            return type(sd)(self._stage(v, f"{key}/{i}") for i, v in enumerate(sd))
        return copy.deepcopy(sd)

    def close(self) -> None:
        self.buffers.clear()
