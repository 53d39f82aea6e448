"""params_sha256 at one world size: one rank of it (RANK, WORLD_SIZE, MASTER_* from the test).

usage: [SHARD_GROUP=N] python params_hash.py   (N: HSDP's shard group; prints one JSON line: rank,
       digest, the digest with one bit of the largest parameter flipped, bytes allocated while hashing)

The tiny model is sharded with FSDP2 and filled from full tensors that depend only on each
parameter's name and shape, so every world size holds the same model. The bytes this rank
allocates while hashing are measured with torch's profiler (CPU allocations of every op).
"""

import json
import os
import sys
import zlib

import torch
from torch.distributed.tensor import distribute_tensor
from torch.profiler import ProfilerActivity, profile

from resilient_fsdp.config import DistConfig
from resilient_fsdp.train import distributed, parallelize
from resilient_fsdp.train.metrics import params_sha256
from resilient_fsdp.train.model import build_model


def full_value(name: str, p: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(p.shape, generator=g, dtype=p.dtype)


def main():
    info = distributed.init_distributed(DistConfig(device="cpu"))
    mesh = distributed.build_mesh(info, int(os.environ.get("SHARD_GROUP", "0")))
    with torch.device("meta"):
        model = build_model("tiny", None)
    parallelize.apply_fsdp(model, mesh, info.device)
    model.to_empty(device=info.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(full_value(name, p), p.device_mesh, p.placements))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        digest = params_sha256(model)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    # One bit of the last row of the largest parameter (on the last rank that holds rows) flipped.
    name, p = max(model.named_parameters(), key=lambda kv: kv[1].numel())
    with torch.no_grad():
        full = full_value(name, p)
        full.view(-1).view(torch.int32)[-1] ^= 1
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
    flipped = params_sha256(model)
    print(
        json.dumps(
            {
                "rank": info.rank,
                "digest": digest,
                "flipped": flipped,
                "allocated": allocated,
                "model_bytes": model_bytes,
                "largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
            }
        )
    )
    distributed.shutdown()
    # Exit as a rank does (train/process_exit.py), without the interpreter's finalization: the
    # profiler's threads torn down there can abort the process after its work is done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
