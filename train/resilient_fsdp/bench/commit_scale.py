"""``python -m resilient_fsdp.bench.commit_scale``: what a checkpoint commit costs rank 0 at a
world of many ranks, measured without the ranks.

The commit gathers every rank's outcome (its DCP write results and file checksums) to rank 0,
which writes DCP's ``.metadata`` from all of them; both grow with the world, since every rank
writes a shard of every tensor. :func:`measure` builds the outcomes synthetically and times them,
with ``--shard-group N`` for HSDP.
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..checkpoint import integrity
from ..checkpoint.engines import LocalOutcome
from ..checkpoint.writer import dcp_plan

# A Llama-2-70b-like layout: 80 layers of 9 tensors (4 attention, 3 MLP, 2 norms), plus the
# embedding, the output head and the final norm; AdamW keeps two moments of each.
LAYERS, PER_LAYER, EXTRA = 80, 9, 3
STATES_PER_PARAM = 3
WRITER_THREADS = 2


def fqns(layers: int = LAYERS) -> list[str]:
    names = [f"model.layers.{i}.t{j}" for i in range(layers) for j in range(PER_LAYER)]
    names += [f"model.extra{k}" for k in range(EXTRA)]
    return [f"{kind}.{n}" for n in names for kind in ("model", "optim.exp_avg", "optim.exp_avg_sq")]


def rank_outcome(rank: int, world: int, names: list[str], shard_rows: int = 1024, shard_group: int = 0) -> LocalOutcome:
    """One rank's outcome: a write result per tensor shard it wrote, spread over its files. With
    ``shard_group`` (HSDP), rank r holds shard r % group of every tensor and writes it only for
    the tensors its replica r // group is given (one replica in world / group writes each)."""
    group = shard_group or world
    position, replica, replicas = rank % group, rank // group, world // group
    files = [f"__{rank}_{t}.distcp" for t in range(WRITER_THREADS)]
    offsets = [0] * WRITER_THREADS
    results = []
    length = shard_rows * 8192 * 2  # bf16 rows of 8192
    mine = [fqn for i, fqn in enumerate(names) if i % replicas == replica]
    for i, fqn in enumerate(mine):
        t = i % WRITER_THREADS
        results.append(
            WriteResult(
                index=MetadataIndex(fqn, torch.Size([position * shard_rows, 0])),
                size_in_bytes=length,
                storage_data=_StorageInfo(files[t], offsets[t], length),
            )
        )
        offsets[t] += length
    checksums = {f: {"bytes": offsets[t], "crc32c": f"{rank:08x}"} for t, f in enumerate(files)}
    return LocalOutcome(rank=rank, results=results, checksums=checksums)


def global_metadata(shards: int, names: list[str], shard_rows: int = 1024) -> Metadata:
    """The plan's metadata: every tensor in ``shards`` row shards (what FSDP's DCP plan holds;
    HSDP's holds its shard group's)."""
    props = TensorProperties(dtype=torch.bfloat16)
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size([r * shard_rows, 0]), sizes=torch.Size([shard_rows, 8192]))
        for r in range(shards)
    ]
    md = {
        n: TensorStorageMetadata(properties=props, size=torch.Size([shards * shard_rows, 8192]), chunks=chunks)
        for n in names
    }
    return Metadata(state_dict_metadata=md)


def measure(world: int, layers: int = LAYERS, shard_group: int = 0) -> dict:
    """The outcomes are built for a 70b-like state (each rank a shard of about 720 parameters, plus
    AdamW's two moments; one file per writer thread): the pickled size of the gather, rank 0's
    ``.metadata`` written by the engine's code, and ``integrity.share`` at that world. With
    ``shard_group`` N (HSDP), each tensor has N shards written once each, so the results and
    ``.metadata`` are (tensors x N) while the file checksums stay (world).
    """
    if shard_group and world % shard_group:
        raise SystemExit(f"--shard-group {shard_group} does not divide --world {world}")
    names = fqns(layers)
    outcomes = [rank_outcome(r, world, names, shard_group=shard_group) for r in range(world)]
    # Each rank pickles its own outcome (in parallel); rank 0 unpickles all of them (in turn).
    t = time.perf_counter()
    blobs = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in outcomes]
    pickle_s = (time.perf_counter() - t) / world
    t = time.perf_counter()
    outcomes = [pickle.loads(b) for b in blobs]
    unpickle_s = time.perf_counter() - t
    per_rank = [len(b) for b in blobs]
    del blobs
    with tempfile.TemporaryDirectory() as tmp:
        metadata = global_metadata(shard_group or world, names)
        t = time.perf_counter()
        dcp_plan.write_metadata(Path(tmp), metadata, [o.results for o in outcomes])
        finalize_s = time.perf_counter() - t
        metadata_bytes = (Path(tmp) / ".metadata").stat().st_size
    files = {n: e for o in outcomes for n, e in o.checksums.items()}
    t = time.perf_counter()
    integrity.share(files, world, 0)
    share_s = time.perf_counter() - t
    return {
        "world_size": world,
        "shard_group": shard_group or world,
        "tensors": len(names),
        "gather_bytes": sum(per_rank),
        "gather_bytes_per_rank": sum(per_rank) / world,
        "rank_pickle_s": pickle_s,
        "rank0_unpickle_s": unpickle_s,
        "metadata_bytes": metadata_bytes,
        "finalize_s": finalize_s,
        "rank0_s": unpickle_s + finalize_s,
        "rank0_mb_s": (sum(per_rank) + metadata_bytes) / 1e6 / max(unpickle_s + finalize_s, 1e-9),
        "files": len(files),
        "share_s": share_s,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m resilient_fsdp.bench.commit_scale", description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1024], help="world sizes to measure")
    p.add_argument("--layers", type=int, default=LAYERS, help="transformer layers of the state (70b: 80)")
    p.add_argument(
        "--shard-group",
        type=int,
        default=0,
        help="HSDP's shard group (dist.shard_group_size); default: every rank (FSDP)",
    )
    args = p.parse_args(argv)
    for world in args.world:
        print(json.dumps(measure(world, args.layers, args.shard_group)))


if __name__ == "__main__":
    main()
