"""What a checkpoint holds, for one rank: :class:`CheckpointState` gathers and restores it.

Model and optimizer as FSDP2 DTensor state (``get_state_dict``), the LR schedule, the trainer's
counters, the sampler position, the learned hang-detection timeouts and the rank's RNG states
(torch, Python's ``random``, NumPy).
Restoring all of it is what makes a resumed run continue bit for bit. ``to_local`` /
``from_local`` turn DTensors into this rank's shards and back (the one-file-per-rank engine).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


# What torch's activation-checkpointing wrapper puts into the names of the parameters it wraps.
_AC_PREFIX = "_checkpoint_wrapped_module."


def canonical_name(name: str) -> str:
    """A parameter's name without the activation-checkpointing wrapper's prefix, so hashes and
    checkpoints identify the same parameter with and without activation checkpointing."""
    return name.replace(_AC_PREFIX, "")


class CheckpointState:
    """Gathers and restores everything a checkpoint holds, for one rank."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        counters: Any,
        data: Any,
        rank: int,
        resilience: Any = None,
    ):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.counters, self.data, self.rank = counters, data, rank
        self.resilience = resilience  # learned hang-detection timeouts (resilience.rank_monitor)

    def state_dict(self, with_rng: bool = True) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {
            "model": model_sd,
            "optim": optim_sd,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "trainer": self.counters.state_dict(),
            "data": self.data.state_dict(),
            # JSON text: its shape changes once timeouts are learned, and DCP loads by shape.
            "resilience": json.dumps(self.resilience.state_dict() if self.resilience else {}, sort_keys=True),
        }
        if with_rng:
            top, own = per_rank_path(self.rank)
            sd[top] = {own: rng_state()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        self.counters.load_state_dict(sd["trainer"])
        self.data.load_state_dict(sd["data"])
        if self.resilience is not None:
            self.resilience.load_state_dict(json.loads(sd["resilience"]))
        if "rng" in sd:
            top, own = per_rank_path(self.rank)
            set_rng_state(sd[top][own])

    def shape_digest(self) -> str:
        """Identifies the model's architecture: names and global shapes of every parameter."""
        h = hashlib.sha256()
        for name, p in self.model.named_parameters():
            h.update(f"{canonical_name(name)}:{tuple(p.shape)};".encode())
        return h.hexdigest()


def per_rank_path(rank: int) -> tuple[str, str]:
    """Where in the state the values of ``rank`` alone are (its RNG states): every other value is
    every rank's, or a DTensor's shard."""
    return ("rng", f"rank{rank}")


def rng_state() -> dict:
    """This rank's random streams: torch (CPU, and CUDA when present), Python's ``random`` and
    NumPy's global generator (datasets and user code draw from those)."""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "python" in state:  # checkpoints written before Python and NumPy states were saved lack them
        random.setstate(_as_tuples(state["python"]))
    if "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants tuples all the way down (a load may hand back lists)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def to_local(sd: Any) -> Any:
    """The same nested structure with every DTensor replaced by this rank's shard."""
    if isinstance(sd, DTensor):
        return sd.to_local()
    if isinstance(sd, dict):
        return {k: to_local(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [to_local(v) for v in sd]
    return sd


def from_local(loaded: Any, like: Any) -> Any:
    """Inverse of :func:`to_local`: rebuild DTensors shaped like ``like`` from local shards."""
    if isinstance(like, DTensor):
        return DTensor.from_local(
            loaded.to(like.device),
            like.device_mesh,
            like.placements,
            shape=like.shape,
            stride=like.stride(),
            run_check=False,
        )
    if isinstance(like, dict):
        return {k: from_local(loaded[k], v) if k in loaded else v for k, v in like.items()}
    return loaded
