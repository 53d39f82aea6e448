"""A snapshot's non-tensor values: the state with every tensor taken out (a :class:`TensorPlace`
where each was), kept beside the slot's bytes; put back around the restored tensors; and where
each tensor was, to tell the optimizer's moments from the rest."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..staging import scalars_only


class TensorPlace:
    """Where a tensor was in a snapshot's non-tensor values (its bytes are in the slot)."""

    def __repr__(self) -> str:
        return "<tensor>"


def tensor_paths(values: Any) -> list[tuple]:
    """The path of every tensor place in ``values``, in :func:`local_tensors` order."""
    out: list[tuple] = []

    def walk(x: Any, path: tuple) -> None:
        if isinstance(x, TensorPlace):
            out.append(path)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, (*path, i))

    walk(values, ())
    return out


def without_tensors(sd: Any) -> Any:
    """``sd`` with every tensor taken out (a :class:`TensorPlace` in its place): what a snapshot
    keeps beside them."""
    if isinstance(sd, torch.Tensor):
        return TensorPlace()
    if isinstance(sd, dict):
        return {k: without_tensors(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(sd if scalars_only(sd) else (without_tensors(v) for v in sd))
    return sd


def with_values(live: Any, values: Any) -> Any:
    """``live``'s tensors (restored in place) with the snapshot's non-tensor ``values``."""
    if isinstance(live, (torch.Tensor, DTensor)):
        return live
    if isinstance(live, dict):
        return {k: with_values(v, values[k]) for k, v in live.items()}
    if isinstance(live, (list, tuple)):
        return type(live)(with_values(v, s) for v, s in zip(live, values))
    return values
