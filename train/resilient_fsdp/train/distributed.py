"""Device, backend and process group, from the variables a launcher sets.

``ft_launcher`` and ``torchrun`` export ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``; run without a launcher, the trainer is a world of one on a free local port.
The backend follows the device (gloo on CPU, NCCL on CUDA), so one entrypoint serves tests and pods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..checkpoint.group import open_object_group
from ..config import ConfigError, DistConfig
from ..resilience import nvrx


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; the launcher sets it") from None


def select_device(cfg: DistConfig, local_rank: int) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("dist.device=cuda but no GPU is visible; use dist.device=auto or cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but only {count} GPUs are visible: --nproc-per-node must not "
            f"exceed the GPUs per node"
        )
    return torch.device("cuda", local_rank)


def uses_nccl(cfg: DistConfig) -> bool:
    """Whether this rank's process group will be NCCL's (a GPU it will use), before it exists."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def init_distributed(cfg: DistConfig, store: Optional[dist.Store] = None, info: Optional[DistInfo] = None) -> DistInfo:
    """Join (or, without a launcher, create) the default process group.

    ``store``: under in-process restart, the attempt's own key space (each attempt needs fresh
    keys: an earlier attempt's would join a rendezvous that already happened). ``info``: this
    process's :func:`identity`, when the caller took it already.
    """
    standalone = "MASTER_ADDR" not in os.environ  # every launcher sets it
    info = info or identity(cfg)
    device = info.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=max(cfg.timeout_s, cfg.init_timeout_s))
        if standalone:
            where = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        elif store is not None:
            where = {"store": store, "rank": info.rank, "world_size": info.world_size}
        else:
            where = {}
        with nvrx.recording_group_sockets(_store_ports(store)):
            dist.init_process_group(
                backend=info.backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **where
            )
            # The checkpoint package's object collectives run on gloo (see checkpoint.group); made
            # here, with the default group, so its connections are recorded and aborted with it.
            open_object_group(timeout)
    return info


def identity(cfg: DistConfig) -> DistInfo:
    """This process's rank, world size and device as its launcher set them, known before the
    process group forms (a world of one without a launcher)."""
    if "MASTER_ADDR" not in os.environ:  # every launcher sets it
        # A world of one, so `python -m resilient_fsdp.train` works without a launcher. Its store
        # lives in memory: no port to pick, so nothing to collide with.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    local_rank = _env_int("LOCAL_RANK", 0)
    device = select_device(cfg, local_rank)
    return DistInfo(
        rank=_env_int("RANK", 0),
        local_rank=local_rank,
        world_size=_env_int("WORLD_SIZE", 1),
        device=device,
        backend=dist.get_default_backend_for_device(device),
    )


def use_steady_timeout(cfg: DistConfig) -> None:
    """Switch collectives from the start-up timeout to ``dist.timeout_s`` (after the first step)."""
    if dist.is_initialized() and cfg.timeout_s < cfg.init_timeout_s:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=cfg.timeout_s))
        objects = open_object_group()
        if objects is not None:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=cfg.timeout_s), objects)


def _store_ports(store: Optional[dist.Store]) -> list[int]:
    """Ports of the stores a rank talks to (the launcher's, in-process restart's): their
    connections are not the process group's and are never shut down with it."""
    ports = [_env_int("MASTER_PORT", -1)]
    while store is not None:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.append(port)
        store = getattr(store, "underlying_store", None)
    return [p for p in ports if p > 0]


def shard_group_size(world_size: int, requested: int) -> int:
    """The ranks each parameter is sharded over (``dist.shard_group_size``; 0 = every rank)."""
    if requested in (0, world_size):
        return world_size
    if world_size % requested:
        multiples = f"{requested}, {2 * requested}, {3 * requested}, ..."
        raise ConfigError(
            f"dist.shard_group_size={requested} does not divide the world size of {world_size} ranks: "
            f"run at a multiple of it ({multiples}), or set dist.shard_group_size to a divisor of "
            f"{world_size} (0 shards over every rank)"
        )
    return requested


def build_mesh(info: DistInfo, shard_group: int = 0) -> DeviceMesh:
    """FSDP's mesh: 1-D over every rank, or with ``shard_group`` (a divisor of the world size) the
    2-D HSDP mesh (replicas x shard group), each shard group ``shard_group`` consecutive ranks, so
    a group spans whole pods and its all-gathers stay on the pods' own links."""
    size = shard_group_size(info.world_size, shard_group)
    with nvrx.recording_group_sockets(_store_ports(None)):
        if size == info.world_size:
            return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(
            info.device.type, (info.world_size // size, size), mesh_dim_names=("dp_replicate", "dp_shard")
        )


def shutdown(clean: bool = True) -> None:
    """Destroy the process group; after a clean run, only once every rank got here, so no rank
    tears down its connections while a peer is still finishing its last collective. After a
    failure, abort it first (:func:`resilient_fsdp.resilience.nvrx.abort_process_groups`): peers
    blocked in a collective fail at once, and a pending NCCL collective cannot block the destroy."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
        dist.destroy_process_group()
        nvrx.forget_group_sockets()
    else:
        nvrx.abort_process_groups()
