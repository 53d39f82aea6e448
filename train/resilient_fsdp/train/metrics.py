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
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..checkpoint.state import canonical_name


HASH_BLOCK_BYTES = 64 * 1024 * 1024
"""Most bytes of a parameter :func:`params_sha256` holds as a host copy at a time (rows of a
device tensor are copied to the host in blocks of about this size; CPU tensors are read in place)."""
_DIGEST_BITS = 256
_LIMB_BITS = 16  # a limb summed over 2**47 ranks still fits in int64


@torch.no_grad()
def params_sha256(model: nn.Module) -> str:
    """A SHA-256 digest of every parameter's name, dtype, shape and bytes; the same on every rank.

    Collective: every rank must call it. Two runs get the same digest exactly when they hold the
    same parameters bit for bit, at any world size (the definition does not depend on how the
    parameters are sharded). Names are canonical (wrapper prefixes such as activation
    checkpointing's removed), as in checkpoints.

    Definition: each parameter is cut into leaves by its shape alone: one leaf per dim-0 row of a
    parameter of two or more dimensions, one leaf for the whole of a 0-D or 1-D one. A leaf's
    digest is ``SHA-256(name|row|bytes)`` (``name|*|bytes`` for a whole parameter); the model's
    is ``SHA-256(SHA-256(v2 header + name|dtype|shape per parameter, in named_parameters order)
    || sum of the leaf digests mod 2**256)``. FSDP2 shards by dim-0 rows, so every rank hashes
    the rows it holds, in parallel, reading them in place (a device tensor through host copies of
    at most :data:`HASH_BLOCK_BYTES`), and one all-reduce of the sums combines them: no rank
    gathers a sharded parameter of two or more dimensions. 1-D parameters (norm weights: one
    dimension's size) are gathered whole and hashed by rank 0; so is a parameter of any other
    layout (``full_tensor``), and an unsharded one is hashed by rank 0 alone.

    A sum of digests compares runs; it is not meant to resist a collision crafted on purpose.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    header = hashlib.sha256(b"resilient-fsdp params_sha256 v2\n")
    total, device = 0, torch.device("cpu")
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        header.update(f"{name}|{param.dtype}|{tuple(param.shape)}\n".encode())
        device = param.device
        total += _leaf_sum(name, param, rank)
    if dist.is_initialized():
        total = _sum_over_ranks(total % (1 << _DIGEST_BITS), device)
    combined = header.digest() + (total % (1 << _DIGEST_BITS)).to_bytes(_DIGEST_BITS // 8, "big")
    return hashlib.sha256(combined).hexdigest()


def _leaf_sum(name: str, param: torch.Tensor, rank: int) -> int:
    """The sum of the digests of the leaves of ``param`` this rank hashes."""
    if param.dim() >= 2 and isinstance(param, DTensor):
        rows = _local_rows(param)
        if rows is not None:
            local, first = rows
            return _rows_sum(name, local, first)
    if isinstance(param, DTensor):
        param = param.full_tensor()  # collective; 1-D, or a layout other than FSDP2's dim-0 shards
    if rank != 0:
        return 0
    if param.dim() >= 2:
        return _rows_sum(name, param, 0)
    digest = hashlib.sha256(f"{name}|*|".encode())
    for block in _host_blocks(param.reshape(-1)):
        digest.update(block)
    return int.from_bytes(digest.digest(), "big")


def _local_rows(param: DTensor) -> Optional[tuple[torch.Tensor, int]]:
    """This rank's rows of a dim-0 sharded DTensor and the global index of its first (FSDP2's
    layout: ``torch.chunk`` sizes, trailing ranks possibly empty); None for another layout. On
    HSDP's 2-D mesh (replicated, then sharded) only the first replica's ranks hash their rows, so
    each row is counted once; the others hold none."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim == 1 and placements == (Shard(0),):
        world, position = mesh.size(), mesh.get_local_rank()
    elif mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        world, position = mesh.size(1), mesh.get_local_rank(1)
        if mesh.get_local_rank(0) != 0:
            return param.to_local()[:0], 0
    else:
        return None
    rows = param.shape[0]
    chunk = -(-rows // world)
    first = min(rows, position * chunk)
    local = param.to_local()
    if local.shape[0] != min(chunk, rows - first):
        return None  # not torch.chunk's split: hash the gathered parameter instead
    return local, first


def _rows_sum(name: str, rows: torch.Tensor, first: int) -> int:
    """The sum of ``SHA-256(name|row|bytes)`` over dim-0 rows, row numbers counted from ``first``."""
    count = rows.shape[0]
    row_bytes = rows[0].numel() * rows.element_size() if count else 0
    total = 0
    if row_bytes == 0:
        for i in range(count):
            total += int.from_bytes(hashlib.sha256(f"{name}|{first + i}|".encode()).digest(), "big")
        return total
    per_block = max(1, HASH_BLOCK_BYTES // row_bytes)
    for start in range(0, count, per_block):
        block = rows[start : start + per_block]
        if row_bytes <= HASH_BLOCK_BYTES:
            data = _as_bytes(block.to("cpu").contiguous())
            for j in range(block.shape[0]):
                digest = hashlib.sha256(f"{name}|{first + start + j}|".encode())
                digest.update(data[j * row_bytes : (j + 1) * row_bytes])
                total += int.from_bytes(digest.digest(), "big")
        else:  # one row larger than a block: hashed in slices of it
            digest = hashlib.sha256(f"{name}|{first + start}|".encode())
            for part in _host_blocks(block[0].reshape(-1)):
                digest.update(part)
            total += int.from_bytes(digest.digest(), "big")
    return total


def _host_blocks(flat: torch.Tensor):
    """The bytes of a 1-D tensor in host blocks of at most :data:`HASH_BLOCK_BYTES`."""
    step = max(1, HASH_BLOCK_BYTES // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        yield _as_bytes(flat[start : start + step].to("cpu").contiguous())


def _as_bytes(host: torch.Tensor) -> memoryview:
    return memoryview(host.detach().reshape(-1).view(torch.uint8).numpy())


def _sum_over_ranks(value: int, device: torch.device) -> int:
    """The sum of every rank's ``value`` (< 2**256), exactly: added as 16-bit limbs in int64."""
    limbs = _DIGEST_BITS // _LIMB_BITS
    mask = (1 << _LIMB_BITS) - 1
    t = torch.tensor([(value >> (_LIMB_BITS * k)) & mask for k in range(limbs)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return sum(int(v) << (_LIMB_BITS * k) for k, v in enumerate(t.tolist()))


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
            self.info(
                f"step {step:>6} | loss {record['loss']:.4f} | {tok_s:,.0f} tok/s | "
                f"step {record['step_time_s'] * 1000:.1f} ms | lr {record['lr']:.2e}"
            )

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
