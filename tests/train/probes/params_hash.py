"""params_sha256 at one world size: one rank of it (RANK, WORLD_SIZE, MASTER_* from the test).

usage: python params_hash.py   (prints one JSON line: rank, digest, bytes allocated while hashing)

The tiny model is sharded with FSDP2 and filled from full tensors that depend only on each
parameter's name and shape, so every world size holds the same model. The bytes this rank
allocates while hashing are measured with torch's profiler (CPU allocations of every op).
"""

import json
import zlib

import torch
from torch.distributed.tensor import distribute_tensor
from torch.profiler import ProfilerActivity, profile

from resilient_fsdp.config import DistConfig
from resilient_fsdp.train import distributed, parallelize
from resilient_fsdp.train.metrics import params_sha256
from resilient_fsdp.train.model import build_model


def main():
    info = distributed.init_distributed(DistConfig(device="cpu"))
    mesh = distributed.build_mesh(info)
    with torch.device("meta"):
        model = build_model("tiny", None)
    parallelize.apply_fsdp(model, mesh, info.device)
    model.to_empty(device=info.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        digest = params_sha256(model)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    print(json.dumps({"rank": info.rank, "digest": digest, "allocated": allocated, "model_bytes": model_bytes,
                      "largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters())}))
    distributed.shutdown()


if __name__ == "__main__":
    main()
