"""The ranks a checkpoint is written and loaded by, and the collectives the checkpointer uses.

:class:`RankGroup` is all the checkpoint package knows of the process group: this rank, the world
size and the device the job's backend moves tensors on. Resume and the S3 restore take one and
return their results; nothing of the checkpointer is handed to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankGroup:
    """This rank of the job's default process group. Every method is collective."""

    rank: int
    world_size: int
    device: torch.device

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

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> Optional[list]:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> list:
        """Every rank's ``obj`` on every rank."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def store(self) -> dist.Store:
        """The process group's key-value store (waits there are not bound by the collective timeout)."""
        return dist.distributed_c10d._get_default_store()
