"""What one resume reads at a given world size, from the rules resume follows, and the
end-of-job parameter hash's throughput on one rank, measured.

usage: python -m resilient_fsdp.bench.resume_cost [--world 1024] [--checkpoint-gb 840]
       [--metadata-mb 320] [--files-per-rank 2] [--hash-mb 512]

The model counts bytes, not seconds: verification reads every file once per process (split by
:func:`..checkpoint.integrity.share`, so the busiest rank's part is computed with it), loading
reads the data files' items once and DCP's ``.metadata`` once (rank 0; broadcast to the others),
and a download from S3 that checked its checksums is not verified again. Each rank hashes its
own rows of the parameters at the measured rate.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from ..checkpoint import integrity
from ..train.metrics import params_sha256

ROW_ELEMENTS = 8192  # a 70b-sized row (model dim 8192, fp32)


def model(world: int, checkpoint_bytes: float, files_per_rank: int, metadata_bytes: float) -> dict:
    """Bytes read by one resume of a ``checkpoint_bytes`` DCP checkpoint (``files_per_rank`` data
    files per rank plus ``.metadata``) at ``world`` ranks: a fresh process, a later attempt in the
    same process, and the load right after an S3 restore."""
    per_file = checkpoint_bytes / (world * files_per_rank)
    files = {f"__{r}_{i}.distcp": {"bytes": per_file} for r in range(world) for i in range(files_per_rank)}
    files[".metadata"] = {"bytes": metadata_bytes}
    everything = checkpoint_bytes + metadata_bytes
    rank0 = sum(files[name]["bytes"] for name in integrity.share(files, world, 0))
    load = {"load_data_bytes": checkpoint_bytes, "load_metadata_reads": 1}
    return {
        "world": world,
        "checkpoint_bytes": checkpoint_bytes,
        "metadata_bytes": metadata_bytes,
        "fresh_process": {"verify_bytes": everything, **load},
        "in_process_restart": {"verify_bytes": 0, **load},
        "after_s3_restore": {"download_check_bytes": everything, "verify_bytes": 0, **load},
        "verify_bytes_rank0": rank0,
        "metadata_bytes_read": metadata_bytes,
        "metadata_bytes_read_torch_default": world * metadata_bytes,
    }


def hash_throughput(megabytes: int) -> dict:
    """params_sha256 over one fp32 parameter of ``megabytes`` MiB in 70b-sized rows, on this
    process (the work of one rank on its shards)."""
    rows = max(1, megabytes * 2**20 // (ROW_ELEMENTS * 4))
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(rows, ROW_ELEMENTS))
    t0 = time.perf_counter()
    params_sha256(module)
    seconds = time.perf_counter() - t0
    nbytes = rows * ROW_ELEMENTS * 4
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / 1e9 / max(seconds, 1e-9)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m resilient_fsdp.bench.resume_cost", description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=1024)
    p.add_argument("--checkpoint-gb", type=float, default=840.0, help="70b: fp32 parameters + Adam's two moments")
    p.add_argument("--metadata-mb", type=float, default=320.0)
    p.add_argument("--files-per-rank", type=int, default=2)
    p.add_argument("--hash-mb", type=int, default=512)
    p.add_argument("--model-gb", type=float, default=280.0, help="the fp32 parameters params_sha256 hashes (70b)")
    args = p.parse_args(argv)
    cost = model(args.world, args.checkpoint_gb * 1e9, args.files_per_rank, args.metadata_mb * 1e6)
    rate = hash_throughput(args.hash_mb)
    cost["hash"] = {**rate, "seconds_per_rank_at_world": args.model_gb * 1e9 / args.world / 1e9 / rate["gb_per_s"]}
    print(json.dumps(cost, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
