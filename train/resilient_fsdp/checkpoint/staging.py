"""Staging: a snapshot of the state in reused host buffers, taken while the loop waits."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from . import nvrx


def structure(sd: Any, key: str = "") -> tuple:
    """What the buffers depend on: every tensor's place, kind, (local) shape and dtype, and the
    shape of the containers around them."""
    if isinstance(sd, DTensor):
        local = sd.to_local()
        return ((key, "dtensor", tuple(local.shape), local.dtype, tuple(sd.shape)),)
    if isinstance(sd, torch.Tensor):
        return ((key, "tensor", tuple(sd.shape), sd.dtype),)
    if isinstance(sd, dict):
        return ((key, "dict", len(sd)),) + tuple(x for k, v in sd.items() for x in structure(v, f"{key}/{k}"))
    if isinstance(sd, (list, tuple)):
        return ((key, type(sd).__name__, len(sd)),) + tuple(x for i, v in enumerate(sd)
                                                            for x in structure(v, f"{key}/{i}"))
    return ()


class StateStager:
    """Copies state into host buffers that are allocated once and reused, so the file holds
    exactly the state of the step it is named for while the loop goes on changing the live
    tensors (NVRx 0.4 would otherwise write live CPU tensors).

    The buffers are torch's own (``_create_cpu_state_dict``): in shared memory (NVRx's worker
    receives them without a copy), pinned on GPUs (registered with CUDA, unregistered when
    released), DTensors kept as DTensor wrappers around the host buffer, so nothing is copied
    back to the device. One ``_copy_state_dict(non_blocking=True)`` per save fills them, then a
    single synchronize. Reuse is what keeps the stall small: a fresh buffer costs a page fault per
    page, about as long as a whole synchronous save on a CPU-only machine. A change of structure
    (a key, a shape, a dtype) allocates new buffers.
    """

    def __init__(self) -> None:
        self.pin = nvrx.cuda_present()
        self.buffers: Any = None
        self.key: tuple = ()

    def stage(self, sd: Any) -> Any:
        """A copy of ``sd`` whose tensors are this stager's buffers (DTensors stay DTensors)."""
        key = structure(sd)
        if self.buffers is None or key != self.key:
            self.close()
            self.buffers = _create_cpu_state_dict(sd, pin_memory=self.pin, share_memory=True)
            self.key = key
        _copy_state_dict(sd, self.buffers, non_blocking=self.pin, type_check=False)
        if self.pin:
            torch.cuda.synchronize()  # one wait for every non-blocking device-to-host copy
        return _snapshot(sd, self.buffers)

    def close(self) -> None:
        """Release the buffers (and their pinned registrations, which torch ties to them)."""
        self.buffers, self.key = None, ()


def _snapshot(live: Any, buf: Any) -> Any:
    """``live``'s structure with the staged tensors from ``buf`` and copies of everything else."""
    if isinstance(live, torch.Tensor):
        if buf is live:  # torch hands a 0-dim DTensor back as is: copy its value instead
            return live.detach().clone()
        return buf
    if isinstance(live, dict):
        return {k: _snapshot(v, buf[k]) for k, v in live.items()}
    if isinstance(live, (list, tuple)):
        return type(live)(_snapshot(v, b) for v, b in zip(live, buf))
    return copy.deepcopy(live)
