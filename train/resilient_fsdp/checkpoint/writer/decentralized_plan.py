"""A DCP save plan that every rank makes alone, in O(its own items): no plan is gathered.

DCP's ``DefaultSavePlanner`` gathers every rank's local plan on the coordinator, which
de-duplicates, numbers chunks, builds the global ``Metadata`` and scatters plans back: minutes
at a thousand ranks (``bench scale``). That central plan follows from what every rank knows once
the ranks agree their states have the same global structure (:func:`global_structure`, a digest
the checkpointer votes on): :func:`plan_save`. The plan is handed to NVRx as a validated plan
cache (:mod:`.dcp_plan`); the files and ``.metadata`` are DCP's own format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

# A path prefix (in the nested state) whose values belong to one rank, given that rank.
PerRankPath = Callable[[int], tuple]


@dataclass
class DecentralizedPlan:
    """This rank's DCP save plan made alone: the local plan, the central plan (what this rank
    writes, numbered as DCP numbers it) and, on the coordinator, the global metadata."""

    local: SavePlan
    central: SavePlan
    metadata: Optional[Metadata]


def _flat(state_dict: dict) -> tuple[dict, dict]:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=False)
    return planner.state_dict, planner.mappings


def _per_rank(path: tuple, prefix: Optional[tuple]) -> bool:
    return prefix is not None and path[: len(prefix)] == prefix


class _Meshes:
    """A digest per device mesh (its ranks and dimension names), computed once per mesh."""

    def __init__(self) -> None:
        self._digests: dict[int, tuple] = {}

    def digest(self, mesh: Any) -> tuple:
        key = id(mesh)
        if key not in self._digests:
            ranks = hashlib.blake2b(repr(mesh.mesh.tolist()).encode(), digest_size=16).hexdigest()
            self._digests[key] = (tuple(mesh.mesh.shape), ranks, tuple(mesh.mesh_dim_names or ()))
        return self._digests[key]


def global_structure(state_dict: dict, rank: int, per_rank_path: Optional[PerRankPath] = None) -> str:
    """A digest of what a save plan of ``state_dict`` depends on beyond this rank: every value's
    name, every DTensor's global shape, dtype, mesh and placements, every plain tensor's shape and
    dtype, with this rank's own names (``per_rank_path``) as every rank's. Equal on every rank
    exactly when :func:`plan_save` gives every rank a consistent plan."""
    flat, mappings = _flat(state_dict)
    prefix = per_rank_path(rank) if per_rank_path else None
    meshes = _Meshes()
    h = hashlib.blake2b(digest_size=16)
    for fqn, value in flat.items():
        path = mappings.get(fqn, (fqn,))
        name = ("*per-rank*", path[len(prefix) :]) if _per_rank(path, prefix) else path
        if isinstance(value, DTensor):
            entry = (
                name,
                "dtensor",
                tuple(value.shape),
                str(value.dtype),
                meshes.digest(value.device_mesh),
                tuple(repr(p) for p in value.placements),
            )
        elif isinstance(value, torch.Tensor):
            entry = (name, "tensor", tuple(value.shape), str(value.dtype))
        else:
            entry = (name, "object")
        h.update(repr(entry).encode())
    return h.hexdigest()


@dataclass
class _Layout:
    """Every chunk of a DTensor of one global shape, mesh and placements: one per distinct
    offset, in the order of the lowest rank holding it, with the ranks holding each."""

    chunks: list  # ChunkStorageMetadata, shared by every tensor of this layout in the metadata
    holders: list  # the ranks holding each chunk, ascending
    mine: int  # the chunk this rank holds


def _layout(global_shape: tuple, mesh: Any, placements: tuple, rank: int) -> _Layout:
    grid = mesh.mesh
    mesh_shape = tuple(grid.shape)
    by_offsets: dict[tuple, int] = {}
    chunks, holders = [], []
    coordinates = sorted(itertools.product(*(range(n) for n in mesh_shape)), key=lambda c: int(grid[c]))
    mine = -1
    for coordinate in coordinates:
        sizes, offsets = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), placements)
        offsets = tuple(offsets)
        index = by_offsets.get(offsets)
        if index is None:
            index = by_offsets[offsets] = len(chunks)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            holders.append([])
        holders[index].append(int(grid[coordinate]))
        if int(grid[coordinate]) == rank:
            mine = index
    return _Layout(chunks, holders, mine)


def plan_save(
    state_dict: dict, rank: int, world_size: int, coordinator: bool, per_rank_path: Optional[PerRankPath] = None
) -> DecentralizedPlan:
    """This rank's save plan of ``state_dict``, made alone. Valid only when :func:`global_structure`
    is the same on every rank.

    A DTensor's chunk at every mesh coordinate follows from its global shape, mesh and placements
    (as torch computes it for the rank itself); ranks whose chunks start at the same offsets hold
    the same chunk (HSDP's replicas), and the replica with the fewest bytes to write so far writes
    it (the same choice on every rank: global shapes alone decide it). A value every rank holds
    under the same name is written by rank 0; one under this rank's own name (``per_rank_path``:
    the RNG states) by its rank. Only the coordinator builds the global ``Metadata``, sharing one
    chunk list among tensors of the same shape and layout: O(tensors + world x layouts)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=coordinator)
    local = planner.create_local_plan()
    flat, mappings = planner.state_dict, planner.mappings
    prefix = per_rank_path(rank) if per_rank_path else None
    layouts: dict[tuple, _Layout] = {}
    meshes = _Meshes()
    items = []
    metadata: dict[str, Any] = {}
    planner_data: dict[str, tuple] = dict(mappings) if coordinator else {}
    # Bytes each replica writes so far, by the number of replicas (the holders of a tensor's
    # first chunk): global figures, so every rank picks the same replica for a tensor.
    loads: dict[int, list[int]] = {}
    for item in local.items:
        fqn = item.index.fqn
        value = flat[fqn]
        path = mappings.get(fqn, (fqn,))
        if item.type == WriteItemType.SHARD:
            key = (tuple(value.shape), meshes.digest(value.device_mesh), tuple(value.placements))
            layout = layouts.get(key)
            if layout is None:
                layout = layouts[key] = _layout(tuple(value.shape), value.device_mesh, tuple(value.placements), rank)
            if tuple(item.tensor_data.chunk.offsets) != tuple(layout.chunks[layout.mine].offsets):
                raise AssertionError(f"{fqn}: DCP's chunk of rank {rank} is not the one its mesh coordinate gives")
            replicas = len(layout.holders[0])
            load = loads.setdefault(replicas, [0] * replicas)
            chosen = min(range(replicas), key=load.__getitem__)
            load[chosen] += value.numel() * value.element_size()
            holders = layout.holders[layout.mine]  # more than the replicas where the chunk is empty
            if holders[chosen % len(holders)] == rank:
                items.append(dataclasses.replace(item, index=dataclasses.replace(item.index, index=layout.mine)))
            if coordinator:
                metadata[fqn] = TensorStorageMetadata(
                    properties=item.tensor_data.properties, size=item.tensor_data.size, chunks=layout.chunks
                )
            continue
        own = _per_rank(path, prefix)
        if own or coordinator:  # this rank's own value, or one every rank holds: rank 0 writes it
            items.append(
                dataclasses.replace(item, index=dataclasses.replace(item.index, index=0))
                if item.type != WriteItemType.BYTE_IO
                else item
            )
        if not coordinator:
            continue
        entry = (
            BytesStorageMetadata()
            if item.type == WriteItemType.BYTE_IO
            else TensorStorageMetadata(
                properties=item.tensor_data.properties, size=item.tensor_data.size, chunks=[item.tensor_data.chunk]
            )
        )
        if not own:
            metadata[fqn] = entry
            continue
        for other in range(world_size):  # every rank's value under its own name
            other_path = per_rank_path(other) + path[len(prefix) :]
            other_fqn = ".".join(map(str, other_path))
            metadata[other_fqn] = entry
            planner_data[other_fqn] = other_path
    central = dataclasses.replace(local, items=items, storage_data=_StoragePrefix(f"__{rank}_"))
    global_metadata = Metadata(state_dict_metadata=metadata, planner_data=planner_data) if coordinator else None
    return DecentralizedPlan(local, central, global_metadata)
