"""The ranks a checkpoint is written and loaded by, and the collectives the checkpointer uses.

:class:`RankGroup` is all the checkpoint package knows of the process group: this rank, the world
size and the device the job's backend moves tensors on. Resume and the S3 restore take one and
return their results; nothing of the checkpointer is handed to them. Objects travel on a lazily
connected CPU side group along a tree (:func:`open_object_group`, :func:`lazy_gloo_group`,
:data:`FANOUT`); small max-reductions stay on the default group (a few floats, no pickling).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..resilience import nvrx

_LAZY = "TORCH_GLOO_LAZY_INIT"  # read by ProcessGroupGloo's constructor
# Children a rank has in the object collectives' tree: its peers are these and its parent.
# Objects go along one tree of FANOUT children a rank: a gather up, a broadcast down, an all-gather
# up then down, so a rank talks to its parent and children alone (at most FANOUT + 1 peers at any
# world size, where gloo's own gather has rank 0 reach every rank); log_FANOUT(world) hops (5 at
# 1,024 ranks), each rank's objects relayed as the bytes they were pickled to.
FANOUT = 4


# (default group, its object group), weakly: the side group belongs to one default group; an
# in-process restart destroys both and makes a new default group, for which a new side group is
# opened. torch holds both until they are destroyed; a strong reference here would keep a failed
# attempt's groups (their threads and sockets) alive past its abort.
_object_group: Optional[tuple[weakref.ref, Optional[weakref.ref]]] = None


def open_object_group(timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroup]:
    """Open the CPU group object collectives run on, for the current default group. Collective
    over the default group (every rank calls it at the same point); None means the default group
    itself (it is gloo). Never NCCL: an object collective on NCCL pickles into a tensor on the GPU,
    so a commit at 1,024 ranks would move hundreds of MB of write results through rank 0's GPU."""
    global _object_group
    default = dist.distributed_c10d._get_default_group()
    if _object_group is not None and _object_group[0]() is default:
        kept = _object_group[1]
        side = kept() if kept is not None else None
        if kept is None or side is not None:
            return side
    side = None
    if dist.get_backend(default) != dist.Backend.GLOO:
        side = lazy_gloo_group(timeout)
    _object_group = (weakref.ref(default), weakref.ref(side) if side is not None else None)
    return side


def lazy_gloo_group(timeout: Optional[timedelta] = None) -> dist.ProcessGroup:
    """Collective: a new gloo group over every rank whose pairs connect on their first message
    (an eager one connects every rank to every other at every start: 16,383 sockets a rank at
    2,048 nodes x 8; a lazy one only the peers its messages reach).
    A failed attempt's abort shuts its connections down by the ports it listens on (recorded
    here): a thread blocked on a peer then wakes and lets the group, and the attempt, go."""
    before = os.environ.get(_LAZY)
    os.environ[_LAZY] = "1"
    try:
        with nvrx.recording_group_listeners():
            return dist.new_group(backend=dist.Backend.GLOO, timeout=timeout)
    finally:
        if before is None:
            os.environ.pop(_LAZY, None)
        else:
            os.environ[_LAZY] = before


def object_group() -> Optional[dist.ProcessGroup]:
    """The object group of the current default group (opened on first use if it was not)."""
    return open_object_group()


@dataclass(frozen=True)
class RankGroup:
    """This rank of the job's default process group. Every method is collective.

    ``objects``: the group object collectives use; unset, the default group's object group
    (:func:`object_group`)."""

    rank: int
    world_size: int
    device: torch.device
    objects: Optional[dist.ProcessGroup] = field(default=None, compare=False)

    def _objects(self) -> Optional[dist.ProcessGroup]:
        return self.objects if self.objects is not None else object_group()

    @property
    def is_coordinator(self) -> bool:
        """Rank 0: the one that decides, writes the metadata and commits."""
        return self.rank == 0

    def max(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def max_of(self, *values: float) -> list[float]:
        """The largest of each value over the ranks, in one collective."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def _children(self) -> range:
        first = self.rank * FANOUT + 1
        return range(first, min(first + FANOUT, self.world_size))

    def _parent(self) -> int:
        return (self.rank - 1) // FANOUT

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (down the tree)."""
        group = self._objects()
        box = [obj]
        if not self.is_coordinator:
            dist.recv_object_list(box, src=self._parent(), group=group)
        for child in self._children():
            dist.send_object_list(box, dst=child, group=group)
        return box[0]

    def gather(self, obj: Any) -> Optional[list]:
        """Every rank's ``obj`` on rank 0 (None elsewhere), up the tree."""
        group = self._objects()
        subtree = [(self.rank, obj)]
        for child in self._children():
            box: list = [None]
            dist.recv_object_list(box, src=child, group=group)
            subtree.extend(box[0])
        if not self.is_coordinator:
            dist.send_object_list([subtree], dst=self._parent(), group=group)
            return None
        out: list = [None] * self.world_size
        for rank, value in subtree:
            out[rank] = value
        return out

    def all_gather(self, obj: Any) -> list:
        """Every rank's ``obj`` on every rank: up the tree, then down."""
        return self.broadcast(self.gather(obj))

    def store(self) -> dist.Store:
        """The process group's key-value store (waits there are not bound by the collective timeout)."""
        return dist.distributed_c10d._get_default_store()
