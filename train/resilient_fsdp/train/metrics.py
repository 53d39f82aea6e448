"""What a run reports: progress lines, ``metrics.jsonl``, ``summary.json``, parameter hashes."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TextIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .parallelize import canonical_name


@torch.no_grad()
def params_sha256(model: nn.Module) -> str:
    """SHA-256 over every full (gathered) parameter in ``named_parameters`` order.

    Collective: every rank must call it. Name, dtype and shape are hashed with the bytes, so two
    runs compare equal only if they hold the same parameters bit for bit. Names are canonical
    (wrapper prefixes such as activation checkpointing's removed), as in checkpoints.
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        name = canonical_name(name)
        full = param.full_tensor() if isinstance(param, DTensor) else param
        full = full.detach().to("cpu").contiguous()
        digest.update(f"{name}|{full.dtype}|{tuple(full.shape)}|".encode())
        digest.update(full.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
