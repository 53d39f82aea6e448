"""A save plan every rank makes alone (``checkpoint.planning: decentralized``): the same items
written, each exactly once, and the same global metadata as DCP's collective planning, for FSDP,
HSDP and uneven shards; a job planned alone trains, saves and reshards exactly as one planned
collectively.

The plan comparisons simulate every rank of a world in this process with torch's fake process
group (planning is per-rank Python work; no message is exchanged). The job comparison runs real
gloo ranks through ``resilient-fsdp local``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from resilient_fsdp.checkpoint.state import per_rank_path
from resilient_fsdp.checkpoint.writer import decentralized_plan
from tests.support import assert_no_leftovers, read_events, read_losses, read_summary, run_local


def _state(rank: int, world: int, mesh_shape: tuple, hsdp: bool, rows: int = 8) -> dict:
    """Rank ``rank``'s state as the trainer's is shaped: DTensor parameters and moments (one with
    fewer rows than ranks: empty shards), a plain tensor every rank holds, objects, and values of
    this rank alone (its RNG states)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Replicate(), Shard(0)] if hsdp else [Shard(0)]

    def sharded(*shape: int) -> DTensor:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        local, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
        part = full[tuple(slice(o, o + n) for o, n in zip(offset, local))].clone()
        return DTensor.from_local(part, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())

    top, own = per_rank_path(rank)
    return {
        "model": {"w": sharded(rows, 4), "b": sharded(3), "tiny": sharded(1, 2)},
        "optim": {
            "state": {"w": {"step": torch.tensor(2.0), "exp_avg": sharded(rows, 4)}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
        "trainer": {"step": 5},
        "resilience": "{}",
        top: {own: {"cpu": torch.get_rng_state(), "python": (3, (1, 2), None)}},
    }


def _chunks(md) -> list:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


@pytest.mark.parametrize(
    "world,mesh_shape,hsdp", [(1, (1,), False), (4, (4,), False), (4, (2, 2), True), (6, (3, 2), True)]
)
def test_each_ranks_plan_made_alone_writes_what_dcps_collective_plan_writes_with_its_metadata(world, mesh_shape, hsdp):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    try:
        local_plans, alone, digests = [], [], set()
        for rank in range(world):
            sd = _state(rank, world, mesh_shape, hsdp)
            planner = DefaultSavePlanner()
            planner.set_up_planner(sd, is_coordinator=rank == 0)
            local_plans.append(planner.create_local_plan())
            alone.append(decentralized_plan.plan_save(sd, rank, world, rank == 0, per_rank_path))
            digests.add(decentralized_plan.global_structure(sd, rank, per_rank_path))
    finally:
        dist.destroy_process_group()
    central, metadata = DefaultSavePlanner().create_global_plan(local_plans)

    assert len(digests) == 1  # the RNG states' names differ by rank; the structure does not

    # Every item DCP writes is written by exactly one rank, and nothing else is.
    def written(plans):
        return sorted((i.index.fqn, tuple(i.index.offset or ())) for p in plans for i in p.items)

    assert written(p.central for p in alone) == written(central)
    assert len(set(written(p.central for p in alone))) == len(written(central))
    assert [p.central.storage_data.prefix for p in alone] == [f"__{r}_" for r in range(world)]
    assert all(p.metadata is None for p in alone[1:])
    ours = alone[0].metadata
    assert ours.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    for fqn, theirs in metadata.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(theirs), fqn
        if hasattr(theirs, "chunks"):
            assert (mine.properties, mine.size, _chunks(mine)) == (theirs.properties, theirs.size, _chunks(theirs))
    assert ours.planner_data == metadata.planner_data
    # Each written chunk's index hint points at its own chunk in the metadata.
    for plan in alone:
        for item in plan.central.items:
            if item.tensor_data is not None:
                chunk = ours.state_dict_metadata[item.index.fqn].chunks[item.index.index]
                assert tuple(chunk.offsets) == tuple(item.index.offset)
    if hsdp:  # both replicas write a share of the model, not replica 0 all of it
        replicas = world // mesh_shape[1]
        writers = {
            r // mesh_shape[1]
            for r, p in enumerate(alone)
            if any(
                i.tensor_data and i.index.fqn != "optim.state.w.step" and not i.index.fqn.startswith("rng.")
                for i in p.central.items
            )
        }
        assert writers == set(range(replicas))


def test_the_metadata_shares_one_chunk_list_per_layout_so_its_pickle_does_not_grow_with_world_x_tensors():
    world = 16
    try:
        sd = _state(0, world, (world,), False, rows=32)
        sd["model"].update({f"layer{i}": sd["model"]["w"] for i in range(50)})
        metadata = decentralized_plan.plan_save(sd, 0, world, True, per_rank_path).metadata
    finally:
        dist.destroy_process_group()
    chunk_lists = {id(m.chunks) for m in metadata.state_dict_metadata.values() if hasattr(m, "chunks")}
    tensors = sum(1 for m in metadata.state_dict_metadata.values() if hasattr(m, "chunks"))
    assert tensors > 50 and len(chunk_lists) < 10
    loaded = pickle.loads(pickle.dumps(metadata))
    assert loaded.state_dict_metadata["model.layer7"].chunks is loaded.state_dict_metadata["model.w"].chunks


def test_a_structure_that_differs_between_ranks_gives_another_digest():
    try:
        base = decentralized_plan.global_structure(_state(0, 2, (2,), False), 0, per_rank_path)
        other_rank = decentralized_plan.global_structure(_state(1, 2, (2,), False), 1, per_rank_path)
        more_rows = decentralized_plan.global_structure(_state(1, 2, (2,), False, rows=10), 1, per_rank_path)
        hsdp = decentralized_plan.global_structure(_state(0, 2, (1, 2), True), 0, per_rank_path)
        sd = _state(1, 2, (2,), False)
        sd["trainer"]["extra"] = 1
        extra = decentralized_plan.global_structure(sd, 1, per_rank_path)
    finally:
        dist.destroy_process_group()
    assert base == other_rank
    assert len({base, more_rows, hsdp, extra}) == 4


def test_an_hsdp_job_planned_alone_trains_saves_and_reshards_as_one_planned_collectively(tmp_path):
    """4 real gloo ranks in HSDP groups of 2, stopped at step 6 and resumed at 2 ranks to step 10:
    the same losses and parameters with either planning, and the same checkpoint contents."""
    import torch.distributed.checkpoint as dcp

    runs = {}
    for planning in ("decentralized", "collective"):
        run_dir = tmp_path / planning
        common = ["train.steps=10", "checkpoint.interval_steps=3", f"checkpoint.planning={planning}"]
        first = run_local(
            run_dir, nodes=1, nproc=4, overrides=common + ["dist.shard_group_size=2", "train.stop_at_step=6"]
        )
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        second = run_local(run_dir, nodes=1, nproc=2, overrides=common)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "resharded from world size 4 to 2" in second.stdout
        runs[planning] = run_dir
        assert_no_leftovers(run_dir)
    alone, collective = runs["decentralized"], runs["collective"]
    # Each process's first save is planned alone (or collectively, twice, before the cache is
    # validated); every later one uses the cached plan.
    plans = {name: [e["plan"] for e in read_events(run_dir, "checkpoint")] for name, run_dir in runs.items()}
    assert plans == {
        "decentralized": ["decentralized", "cached", "decentralized", "cached"],
        "collective": ["collective", "collective", "collective", "collective"],
    }, plans
    assert read_losses(alone) == read_losses(collective)
    assert read_summary(alone)["params_sha256"] == read_summary(collective)["params_sha256"]
    ours = dcp.FileSystemReader(str(alone / "checkpoints/step_00000006")).read_metadata()
    theirs = dcp.FileSystemReader(str(collective / "checkpoints/step_00000006")).read_metadata()
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for fqn, md in theirs.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            assert _chunks(ours.state_dict_metadata[fqn]) == _chunks(md), fqn
