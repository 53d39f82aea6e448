"""Handing a staged save to the writer process without making the loop wait for it.

The staging buffers live in shared memory and are reused from save to save. They are sent to the
writer process once (:class:`Buffers`: the tensors, under the stager's generation); the worker
keeps them (:func:`register`), and each save then sends only references into them
(:func:`pack`: a :class:`Ref` is an index, offset, shape and stride) together with its small
items. A new worker (its process id changed) or new buffers (a new generation) get them again.
No request carries a staging function, so NVRx's scheduler never waits for the worker to take
one (its ``preload_fn`` hand-shake); the worker may pick a request up whenever it is ready.

A save's write results come back through its own report (:class:`.report.SaveReport`), not
through a process-wide queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Ref:
    """A tensor that is a view of registered buffer ``index``."""

    index: int
    offset: int
    shape: tuple
    stride: tuple


@dataclass
class Buffers:
    """The staging buffers of one generation, sent to a worker once."""

    key: str
    tensors: list


class Registry:
    """Trainer side: which storage belongs to which buffer, and which worker already has them."""

    def __init__(self, key: str, tensors: list[torch.Tensor]):
        self.key, self.tensors = key, tensors
        self.by_storage = {t.untyped_storage().data_ptr(): i for i, t in enumerate(tensors)}
        self.sent_to: Optional[int] = None  # the worker process that holds them

    def payload_for(self, worker_pid: Optional[int]) -> Optional[Buffers]:
        """The buffers, unless ``worker_pid`` already has them (None: not started, send them)."""
        if worker_pid is not None and worker_pid == self.sent_to:
            return None
        return Buffers(self.key, self.tensors)

    def pack(self, obj: Any) -> Any:
        """``obj`` with every tensor that lies in a registered buffer replaced by a :class:`Ref`."""
        if isinstance(obj, torch.Tensor):
            i = self.by_storage.get(obj.untyped_storage().data_ptr())
            if i is None or obj.dtype != self.tensors[i].dtype or obj.is_cuda:
                return obj  # not a staging buffer (a copied scalar): sent as it is
            return Ref(i, obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()))
        if isinstance(obj, dict):
            return {k: self.pack(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.pack(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.pack(v) for v in obj)
        return obj


# ---- worker side: what the writer process keeps ------------------------------------------------

_REGISTERED: dict[str, list] = {}


def register(buffers: Optional[Buffers]) -> None:
    """Keep ``buffers`` in this (writer) process, replacing any older generation."""
    if buffers is not None and buffers.key not in _REGISTERED:
        _REGISTERED.clear()
        _REGISTERED[buffers.key] = buffers.tensors


def unpack(obj: Any, key: str) -> Any:
    """Inverse of :meth:`Registry.pack`, in the worker, against the buffers registered as ``key``."""
    tensors = _REGISTERED.get(key)
    if tensors is None:
        raise RuntimeError(f"the checkpoint writer holds no staging buffers for {key!r} (it holds "
                           f"{sorted(_REGISTERED) or 'none'}); the trainer re-sends them to a new writer")
    return _unpack(obj, tensors)


def _unpack(obj: Any, tensors: list) -> Any:
    if isinstance(obj, Ref):
        return tensors[obj.index].as_strided(obj.shape, obj.stride, obj.offset)
    if isinstance(obj, dict):
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_unpack(v, tensors) for v in obj)
    return obj
