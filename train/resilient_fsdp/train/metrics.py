"""What a run reports: progress lines, ``metrics.jsonl``, ``summary.json``, parameter hashes."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Optional, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..checkpoint.state import canonical_name


@torch.no_grad()
def params_sha256(model: nn.Module) -> str:
    """SHA-256 over every full parameter in ``named_parameters`` order; the same on every rank.

    Collective: every rank must call it. Name, dtype and shape are hashed with the bytes, so two
    runs compare equal only if they hold the same parameters bit for bit, at any world size. Names
    are canonical (wrapper prefixes such as activation checkpointing's removed), as in checkpoints.
    Memory stays bounded: one parameter at a time is gathered to rank 0 alone (a dim-0 sharded
    DTensor as its shards; another layout through ``full_tensor``), hashed there, and the digest
    is broadcast.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        full = _full_on_rank0(param, rank)
        if rank == 0:
            full = full.detach().to("cpu").contiguous()
            digest.update(f"{canonical_name(name)}|{full.dtype}|{tuple(full.shape)}|".encode())
            digest.update(full.view(torch.uint8).numpy().tobytes())
        del full
    if not dist.is_initialized():
        return digest.hexdigest()
    box = [digest.hexdigest() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _full_on_rank0(param: torch.Tensor, rank: int) -> Optional[torch.Tensor]:
    """The whole of ``param`` on rank 0 (None elsewhere). Dim-0 shards (FSDP2's layout: torch.chunk
    sizes, trailing ranks possibly empty) are padded to equal size and gathered to rank 0."""
    if not isinstance(param, DTensor):
        return param if rank == 0 else None
    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),) or param.dim() == 0:
        full = param.full_tensor()
        return full if rank == 0 else None
    world, rows = mesh.size(), param.shape[0]
    chunk = -(-rows // world)
    local = param.to_local()
    padded = local.new_zeros((chunk, *param.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    group = mesh.get_group()
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, parts, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    return torch.cat([p[: max(0, min(chunk, rows - r * chunk))] for r, p in enumerate(parts)])


class MetricsLog:
    """Rank 0 appends one JSON object per step to ``metrics.jsonl`` and prints progress lines."""

    def __init__(self, run_dir: Path, enabled: bool, log_every: int, stream: TextIO = sys.stdout):
        self.enabled, self.log_every, self.stream = enabled, log_every, stream
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1) if enabled else None

    def step(self, record: dict) -> None:
        if not self._file:
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        step = record["step"]
        if step % self.log_every == 0 or step == 1:
            tok_s = record["tokens"] / record["step_time_s"] if record["step_time_s"] > 0 else 0.0
            self.info(f"step {step:>6} | loss {record['loss']:.4f} | {tok_s:,.0f} tok/s | "
                      f"step {record['step_time_s'] * 1000:.1f} ms | lr {record['lr']:.2e}")

    def event(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def info(self, message: str) -> None:
        if self.enabled:
            print(f"[resilient-fsdp] {message}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
