"""Handing a staged save to the writer process without making the loop wait for it.

The staging buffers are views into one shared-memory arena (:mod:`..arena`), sent to the writer
once (:class:`Buffers`) and kept there (:func:`register`); each save then sends only references
into it (:meth:`Registry.pack`) with its small items. A new worker or a new arena gets it again.
No request carries a staging function, so NVRx's scheduler never waits for the worker to take
one. Used by :mod:`.process` and :mod:`.dcp_plan`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..arena import tensor_at


@dataclass(frozen=True)
class Ref:
    """A tensor that is a view of the registered arena, at byte ``offset``."""

    offset: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple


@dataclass
class Buffers:
    """The arena of one generation (its bytes, one shared-memory descriptor), sent to a worker once."""

    key: str
    arena: torch.Tensor


class Registry:
    """Trainer side: the arena the staged tensors lie in, and which worker already has it."""

    def __init__(self, key: str, arena: torch.Tensor):
        self.key, self.arena = key, arena
        self.base = arena.untyped_storage().data_ptr()
        self.sent_to: Optional[int] = None  # the worker process that holds it

    def payload_for(self, worker_pid: Optional[int]) -> Optional[Buffers]:
        """The arena, unless ``worker_pid`` already has it (None: not started, send it)."""
        if worker_pid is not None and worker_pid == self.sent_to:
            return None
        return Buffers(self.key, self.arena)

    def pack(self, obj: Any) -> Any:
        """``obj`` with every tensor that lies in the arena replaced by a :class:`Ref`."""
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda or obj.untyped_storage().data_ptr() != self.base:
                return obj  # not a staging buffer (a copied scalar): sent as it is
            return Ref(obj.storage_offset() * obj.element_size(), obj.dtype, tuple(obj.shape), tuple(obj.stride()))
        if isinstance(obj, dict):
            return {k: self.pack(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.pack(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.pack(v) for v in obj)
        return obj


class NotSendable(RuntimeError):
    """A request for the writer that cannot be pickled; the message names the part that cannot."""


def encode(value: Any) -> bytes:
    """``value`` pickled as the writer's queue pickles it: tensors in shared memory travel as file
    descriptors. Called on the caller's thread, not by the queue's feeder thread, which prints an
    error and drops what it cannot pickle (the save would then time out without a reason)."""
    return bytes(ForkingPickler.dumps(value))


def encode_request(fn: Callable[..., Any], args: tuple) -> bytes:
    """``(fn, args)`` as :func:`encode` pickles it; raises :class:`NotSendable` naming the first
    part that cannot be pickled."""
    try:
        return encode((fn, args))
    except Exception as exc:  # noqa: BLE001 - pickling raises many types; all mean the same here
        parts = [("its function", fn)] + [(f"its argument {i}", a) for i, a in enumerate(args)]
        raise NotSendable(
            f"the checkpoint writer cannot be sent {_name(fn)}: {_culprit(parts) or 'the request'} cannot be "
            f"pickled ({type(exc).__name__}: {exc})"
        ) from exc


def decode(data: bytes) -> Any:
    return pickle.loads(data)


def _name(fn: Any) -> str:
    fn = getattr(fn, "func", fn)  # a partial
    return getattr(fn, "__qualname__", type(fn).__qualname__)


def _culprit(parts: list[tuple[str, Any]]) -> Optional[str]:
    """The path of the innermost of ``parts`` (and their items) that does not pickle, with its
    type. Tensors are not tried: they pickle, and trying one would share it."""
    for path, value in parts:
        if isinstance(value, torch.Tensor):
            continue
        try:
            pickle.dumps(value)
            continue
        except Exception:  # noqa: BLE001
            pass
        items: list = []
        if isinstance(value, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        inner = _culprit(items) if items else None
        return inner or f"{path} (a {type(value).__module__}.{type(value).__qualname__})"
    return None


# ---- worker side: what the writer process keeps ------------------------------------------------

_REGISTERED: dict[str, tuple[torch.Tensor, np.ndarray]] = {}


def register(buffers: Optional[Buffers]) -> None:
    """Keep ``buffers`` in this (writer) process, replacing any older generation."""
    if buffers is not None and buffers.key not in _REGISTERED:
        _REGISTERED.clear()
        _REGISTERED[buffers.key] = (buffers.arena, buffers.arena.numpy())


def unpack(obj: Any, key: str) -> Any:
    """Inverse of :meth:`Registry.pack`, in the worker, against the arena registered as ``key``;
    every tensor is one over its own bytes of the arena (:func:`..arena.tensor_at`)."""
    held = _REGISTERED.get(key)
    if held is None:
        raise RuntimeError(
            f"the checkpoint writer holds no staging buffers for {key!r} (it holds "
            f"{sorted(_REGISTERED) or 'none'}); the trainer re-sends them to a new writer"
        )
    return _unpack(obj, held[1])


def _unpack(obj: Any, memory: np.ndarray) -> Any:
    if isinstance(obj, Ref):
        return tensor_at(memory, obj.offset, obj.dtype, obj.shape, obj.stride)
    if isinstance(obj, dict):
        return {k: _unpack(v, memory) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, memory) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_unpack(v, memory) for v in obj)
    return obj
