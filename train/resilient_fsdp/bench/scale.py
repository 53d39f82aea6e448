"""``resilient-fsdp bench scale``: what a save's planning, a resume's metadata and load planning,
rank 0's per-save hand-off and a start's connections cost at 1,024 and 16,384 ranks, measured on
this machine with torch DCP's own planner objects in simulated ranks.

A rank is simulated with torch's fake process group (:class:`World`); what is timed is
:func:`measure_world`'s; cases above ``--max-measured-ranks`` are extrapolated from smaller
worlds (:func:`_extrapolate`). ``tests/checkpoint/probes/object_group.py`` measures the side
groups' connections with real gloo processes.
"""

from __future__ import annotations

import argparse
import math
import pickle
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from ..config.errors import UsageError
from .results import write_results

CASES = (
    {"ranks": 1024, "preset": "70b", "layout": "fsdp"},
    {"ranks": 16384, "preset": "70b", "layout": "hsdp-64"},
    {"ranks": 1024, "preset": "8b", "layout": "fsdp"},
    {"ranks": 16384, "preset": "8b", "layout": "hsdp-64"},
)
MAX_MEASURED_RANKS = 1024
# The targets the records are judged by (seconds; connections).
TARGETS = {
    "cold_save_plan_s": 5.0,
    "max_rank_blocked_s": 5.0,
    "resume_metadata_and_plan_s": 10.0,
    "rank0_training_process_python_s": 0.5,
    "extra_connections_per_rank": 8,
}


def shard_group(layout: str, ranks: int) -> int:
    """The shard group of ``layout`` (``fsdp``: every rank; ``hsdp-G``: G)."""
    if layout == "fsdp":
        return ranks
    if layout.startswith("hsdp-") and layout[5:].isdigit():
        group = int(layout[5:])
        if ranks % group:
            raise ValueError(f"layout {layout}: {group} does not divide {ranks} ranks")
        return group
    raise ValueError(f"layout {layout!r}: fsdp or hsdp-G (G ranks per shard group)")


class World:
    """A fake process group of ``ranks`` with this process as ``rank``, and the case's mesh.

    torch's fake process group stands in for the world: a rank's model (on the meta device) and
    AdamW state become DTensors on a mesh of the case's layout (FSDP: one dimension; HSDP
    ``hsdp-G``: replicas of shard groups of G), exactly as FSDP2 shards them. Every rank's save plan
    is built from rank 0's item by item with the offsets torch computes for that rank's mesh
    coordinate, and checked equal to the planner's own plan at three ranks of each case.
    """

    def __init__(self, ranks: int, group: int):
        self.ranks, self.group = ranks, group
        self.mesh_shape = (ranks,) if group == ranks else (ranks // group, group)

    def coordinate(self, rank: int) -> list[int]:
        return [rank] if self.group == self.ranks else [rank // self.group, rank % self.group]

    def placements(self) -> list:
        from torch.distributed.tensor import Replicate, Shard

        return [Shard(0)] if self.group == self.ranks else [Replicate(), Shard(0)]

    def state_dict(self, rank: int, preset: str) -> dict:
        """Rank ``rank``'s checkpoint state of ``preset``: the model and AdamW's moments as
        DTensors on the meta device, the optimizer's steps and parameter groups as the trainer
        has them."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from ..train.model import build_model

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=self.ranks)
        mesh = init_device_mesh("cpu", self.mesh_shape)
        with torch.device("meta"):
            model = build_model(preset)
        placements = self.placements()

        def sharded(p: torch.Tensor) -> DTensor:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local, _ = compute_local_shape_and_global_offset(p.shape, mesh, placements)
            return DTensor.from_local(
                torch.empty(local, device="meta", dtype=torch.float32),
                mesh,
                placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )

        names = [n for n, _ in model.named_parameters()]
        params = {n: sharded(p) for n, p in model.named_parameters()}
        state = {
            n: {"step": torch.tensor(1.0), "exp_avg": sharded(p), "exp_avg_sq": sharded(p)}
            for n, p in model.named_parameters()
        }
        groups = [
            {
                "lr": 3e-4,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "weight_decay": 0.1,
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "initial_lr": 3e-4,
                "params": names,
            }
        ]
        return {"model": params, "optim": {"state": state, "param_groups": groups}}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def local_save_plan(state: dict) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=False)
    return planner.create_local_plan()


def plan_for(template: Any, world: World, rank: int) -> Any:
    """Rank ``rank``'s save plan, from rank 0's: each shard's offsets and sizes at the rank's mesh
    coordinate, as DCP computes them for a DTensor; every other item as it is."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    coordinate, placements = world.coordinate(rank), world.placements()
    items = []
    for item in template.items:
        if item.type != WriteItemType.SHARD:
            items.append(item)
            continue
        data = item.tensor_data
        sizes, offsets = _compute_local_shape_and_global_offset(data.size, world.mesh_shape, coordinate, placements)
        sizes, offsets = torch.Size(sizes), torch.Size(offsets)
        items.append(
            WriteItem(
                index=MetadataIndex(item.index.fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=data.properties, size=data.size
                ),
            )
        )
    return dataclasses.replace(template, items=items)


def _timed(fn, *args) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def measure_world(ranks: int, preset: str, layout: str) -> dict:
    """Every phase at ``ranks``, measured.

    On the path this project's save (NVRx's ``save_state_dict_async_plan``) and resume take: a cold
    save planned alone (``checkpoint.planning: decentralized``; ``cold_save_plan_s`` is rank 0's,
    ``max_rank_blocked_s`` the slower of rank 0 and the last rank) and collectively
    (``collective_*``, DCP's fallback when the ranks' structures differ); a durable resume from the
    commit's metadata index (``metadata_file_resume_s``: from DCP's ``.metadata`` instead;
    ``collective_load_plan_s``: DCP's gather and scatter of load plans); rank 0's Python work per
    save (``rank0_training_process_python_s``, ``rank0_plan_change_python_s``); and the start's side
    groups' connections (``extra_connections_per_rank``). Transfers are not timed (bytes are).
    """
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from ..checkpoint import metadata_index
    from ..checkpoint.writer import decentralized_plan

    world = World(ranks, shard_group(layout, ranks))
    try:  # the fake group stays up for rank 0's load plan below
        # Rank 0's real plan (timed), and two more ranks' to check the built ones against.
        state = world.state_dict(0, preset)
        template, local_plan_s = _timed(local_save_plan, state)
        for rank in sorted({min(ranks - 1, ranks // 2 + 1), ranks - 1}):
            other = world.state_dict(rank, preset)
            real = local_save_plan(other)
            if real.items != plan_for(template, world, rank).items:
                raise AssertionError(f"the plan built for rank {rank} of {ranks} ({layout}) differs from DCP's own")
        # Planned alone (checkpoint.planning: decentralized), by the last rank, then by rank 0
        # (with the global metadata); each first digests the state's global structure.
        other_digest, other_digest_s = _timed(decentralized_plan.global_structure, other, ranks - 1)
        _, alone_other_s = _timed(decentralized_plan.plan_save, other, ranks - 1, ranks, False)
        del other
        state = world.state_dict(0, preset)  # rank 0 again: its plans and its load plan below
        digest, digest_s = _timed(decentralized_plan.global_structure, state, 0)
        if digest != other_digest:
            raise AssertionError(f"rank 0 and rank {ranks - 1} of {ranks} ({layout}) digest their structure apart")
        alone, alone_rank0_s = _timed(decentralized_plan.plan_save, state, 0, ranks, True)
    except BaseException:
        world.close()
        raise
    # The vote: every rank's (token, error, (plan level, digest)), gathered by every rank.
    vote_blobs = [pickle.dumps((None, None, (0, digest)), pickle.HIGHEST_PROTOCOL) for _ in range(ranks)]
    _, vote_unpickle_s = _timed(lambda: [pickle.loads(b) for b in vote_blobs])
    del vote_blobs
    alone_metadata_blob, alone_metadata_pickle_s = _timed(pickle.dumps, alone.metadata, pickle.HIGHEST_PROTOCOL)
    del alone_metadata_blob
    plans = [template] + [plan_for(template, world, r) for r in range(1, ranks)]
    blob, pickle_own_s = _timed(pickle.dumps, template, pickle.HIGHEST_PROTOCOL)
    blobs = [pickle.dumps(p, pickle.HIGHEST_PROTOCOL) for p in plans]
    del plans
    gathered, unpickle_all_s = _timed(lambda: [pickle.loads(b) for b in blobs])
    gather_bytes = sum(len(b) for b in blobs)
    del blobs
    planner = DefaultSavePlanner()
    (central, metadata), global_plan_s = _timed(planner.create_global_plan, gathered)
    del gathered
    # The plan's global metadata, as the commit job carries it to the commit process when the plan changes.
    _, metadata_pickle_s = _timed(pickle.dumps, metadata, pickle.HIGHEST_PROTOCOL)
    scattered, scatter_pickle_s = _timed(lambda: [pickle.dumps(p, pickle.HIGHEST_PROTOCOL) for p in central])
    scatter_bytes = sum(len(b) for b in scattered)
    _, unpickle_own_s = _timed(pickle.loads, scattered[0])
    del scattered
    written = sum(len(p.items) for p in central)

    # .metadata as the commit writes it: the global metadata planned alone with every written
    # item's place (the same items as the collective plan's).
    metadata = alone.metadata
    del alone
    storage = {}
    for rank, plan in enumerate(central):
        offset = 0
        for item in plan.items:
            length = 1 << 20
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += length
    metadata.storage_data = storage
    del central
    # The commit's index of it (in rank 0's commit process), which a resume reads instead.
    index_blob, index_encode_s = _timed(metadata_index.encode, metadata, storage)
    del storage
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".metadata"
        path.write_bytes(pickle.dumps(metadata, pickle.HIGHEST_PROTOCOL))
        raw, read_s = _timed(path.read_bytes)
        (Path(tmp) / metadata_index.INDEX_FILE).write_bytes(index_blob)
        del index_blob
        index_raw, read_index_s = _timed((Path(tmp) / metadata_index.INDEX_FILE).read_bytes)
    metadata_bytes, index_bytes = len(raw), len(index_raw)
    del metadata
    _, unpickle_metadata_s = _timed(pickle.loads, raw)  # DCP's .metadata: the fallback without an index
    del raw
    loaded, decode_index_s = _timed(metadata_index.decode, index_raw)
    del index_raw

    def load_plan():
        p = DefaultLoadPlanner()
        p.set_up_planner(state, loaded, is_coordinator=True)
        return p.create_local_plan()

    # A resume plans each rank's load alone (DCP's global load plan keeps the local plans as they
    # are); the gather and scatter DCP would run are timed for the record, not counted.
    load_local, load_local_s = _timed(load_plan)
    # Where each item the rank reads is, found in the index's columns as DCP's reader asks.
    _, index_lookups_s = _timed(lambda: [loaded.storage_data[i.storage_index] for i in load_local.items])
    load_blob, load_pickle_own_s = _timed(pickle.dumps, load_local, pickle.HIGHEST_PROTOCOL)
    # Every rank's load plan has as many items as rank 0's (one per chunk it reads): its bytes stand in.
    load_gathered, load_unpickle_all_s = _timed(lambda: [pickle.loads(load_blob) for _ in range(ranks)])
    load_planner = DefaultLoadPlanner()
    load_planner.set_up_planner(state, loaded, is_coordinator=True)
    load_central, load_global_s = _timed(load_planner.create_global_plan, load_gathered)
    del load_gathered
    load_scattered, load_scatter_pickle_s = _timed(
        lambda: [pickle.dumps(p, pickle.HIGHEST_PROTOCOL) for p in load_central]
    )
    _, load_unpickle_own_s = _timed(pickle.loads, load_scattered[0])
    del load_central, load_scattered, loaded
    world.close()

    # The per-save hand-off: every rank's outcome (its write results and file checksums, pickled
    # by the rank to bytes) gathered, then the commit job pickled to the commit process.
    from . import commit_scale
    from ..checkpoint.commit import CommitJob

    names = [f"t{i}" for i in range(len(template.items))]
    outcome_blobs = [
        pickle.dumps(
            pickle.dumps(
                commit_scale.rank_outcome(r, ranks, names, shard_group=world.group if world.group != ranks else 0)
            )
        )
        for r in range(ranks)
    ]
    outcomes, gather_unpickle_s = _timed(lambda: [pickle.loads(b) for b in outcome_blobs])
    del outcome_blobs
    job = CommitJob(
        step=1000,
        where="/fsx/checkpoints/step_00001000",
        gathered=outcomes,
        manifest={"world_size": ranks},
        started_unix=time.time(),
        metadata_key="plan",
    )
    _, handoff_s = _timed(pickle.dumps, job, pickle.HIGHEST_PROTOCOL)
    del outcomes

    collective_cold = unpickle_all_s + global_plan_s + scatter_pickle_s
    collective_load = (
        load_pickle_own_s + load_unpickle_all_s + load_global_s + load_scatter_pickle_s + load_unpickle_own_s
    )
    # Planned alone, a rank waits only for the vote; its plan is made on its staging thread, and
    # counted here as if the rank waited for it too (it holds the interpreter's lock meanwhile).
    cold = digest_s + vote_unpickle_s + alone_rank0_s
    blocked = max(digest_s + vote_unpickle_s + alone_rank0_s, other_digest_s + vote_unpickle_s + alone_other_s)
    resume = read_index_s + decode_index_s + load_local_s + index_lookups_s
    return {
        "items_per_rank": len(template.items),
        "items_written": written,
        "plan_gather_bytes": gather_bytes,
        "plan_scatter_bytes": scatter_bytes,
        "metadata_bytes": metadata_bytes,
        "index_bytes": index_bytes,
        "phases_s": {
            "save_local_plan": local_plan_s,
            "save_pickle_own_plan": pickle_own_s,
            "save_rank0_unpickle_every_plan": unpickle_all_s,
            "save_rank0_global_plan": global_plan_s,
            "save_rank0_pickle_every_central_plan": scatter_pickle_s,
            "save_unpickle_own_central_plan": unpickle_own_s,
            "resume_read_index": read_index_s,
            "resume_decode_index": decode_index_s,
            "resume_local_load_plan": load_local_s,
            "resume_index_lookups": index_lookups_s,
            "metadata_file_read": read_s,
            "metadata_file_unpickle": unpickle_metadata_s,
            "commit_index_encode": index_encode_s,
            "resume_pickle_own_load_plan": load_pickle_own_s,
            "resume_rank0_unpickle_every_load_plan": load_unpickle_all_s,
            "resume_rank0_global_load_plan": load_global_s,
            "resume_rank0_pickle_every_central_load_plan": load_scatter_pickle_s,
            "resume_unpickle_own_central_load_plan": load_unpickle_own_s,
            "commit_rank0_unpickle_gathered_outcomes": gather_unpickle_s,
            "commit_handoff_pickle": handoff_s,
            "commit_handoff_metadata_pickle": metadata_pickle_s,
            "alone_digest_structure": digest_s,
            "alone_vote_unpickle_every_digest": vote_unpickle_s,
            "alone_rank0_plan_and_metadata": alone_rank0_s,
            "alone_other_rank_plan": alone_other_s,
            "alone_commit_handoff_metadata_pickle": alone_metadata_pickle_s,
        },
        "cold_save_plan_s": cold,
        "max_rank_blocked_s": blocked,
        "resume_metadata_and_plan_s": resume,
        "rank0_training_process_python_s": gather_unpickle_s + handoff_s,
        "rank0_plan_change_python_s": gather_unpickle_s + handoff_s + alone_metadata_pickle_s,
        # checkpoint.planning: collective (and the fallback when the ranks' structures differ),
        # and the gather and scatter of load plans DCP would run, which a resume does without.
        "collective_cold_save_plan_s": collective_cold,
        "collective_max_rank_blocked_s": local_plan_s + pickle_own_s + collective_cold + unpickle_own_s,
        "collective_load_plan_s": collective_load,
        "metadata_file_resume_s": read_s + unpickle_metadata_s + load_local_s,
        "collective_rank0_plan_change_python_s": gather_unpickle_s + handoff_s + metadata_pickle_s,
    }


def extra_connections(ranks: int) -> dict:
    """TCP connections a start's side groups add to a rank: the lazily connected object group,
    whose collectives go along a tree of ``FANOUT`` children a rank (a rank's parent and its
    children), and the replicas' pairs (the holder and the source).
    ``tests/checkpoint/probes/object_group.py`` counts them in real gloo processes."""
    from ..checkpoint.group import FANOUT

    children = min(FANOUT, ranks - 1)
    others = min(FANOUT, max(0, ranks - 2)) + 1 if ranks > 1 else 0
    return {"rank0": children + 2, "other_ranks_at_most": others + 2, "max": max(children, others) + 2}


def judged(record: dict) -> dict:
    """Each target met or missed, by its figure."""
    out = {}
    for key, bound in TARGETS.items():
        value = record[key]["max"] if key == "extra_connections_per_rank" else record[key]
        out[key] = {"value": value, "target": bound, "met": value <= bound}
    return out


def run_case(case: dict, max_measured: int = MAX_MEASURED_RANKS, say=print) -> dict:
    with warnings.catch_warnings():
        # DCP's load planning asks the fake group for its device, which it cannot name: said per rank.
        warnings.filterwarnings("ignore", message=r".*(_get_pg_default_device|Multiple backends are registered)")
        return _run_case(case, max_measured, say)


def _run_case(case: dict, max_measured: int, say) -> dict:
    ranks, preset, layout = case["ranks"], case["preset"], case["layout"]
    record: dict = dict(case)
    if ranks <= max_measured:
        say(f"measuring {preset} {layout} at {ranks} ranks")
        record.update(measure_world(ranks, preset, layout))
    else:
        group = shard_group(layout, ranks)
        points = [w for w in (max_measured // 4, max_measured // 2, max_measured) if w >= group and w % group == 0]
        if len(points) < 2:
            raise UsageError(
                f"{layout} at {ranks} ranks: --max-measured-ranks {max_measured} leaves fewer than two "
                f"worlds of whole shard groups of {group} to extrapolate from"
            )
        measured = {}
        for w in points:
            say(f"measuring {preset} {layout} at {w} ranks (to extrapolate to {ranks})")
            measured[w] = measure_world(w, preset, layout)
        record.update(_extrapolate(measured, ranks))
        record["extrapolated_from"] = {str(w): m for w, m in measured.items()}
    record["extra_connections_per_rank"] = extra_connections(ranks)
    record["targets"] = judged(record)
    return record


def _fit(xs: list[float], ys: list[float], at: float) -> float:
    """The least-squares line through (xs, ys), at ``at``. No phase gets cheaper with more ranks:
    a falling line is measurement noise around a constant (the metadata of HSDP's shard group),
    which is then its mean."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my + max(0.0, slope) * (at - mx)


def _extrapolate(measured: dict[int, dict], ranks: int) -> dict:
    """A case above ``--max-measured-ranks`` (a 70b plan at 16,384 ranks is about 50 M planner
    objects, more than this machine's memory), from three smaller worlds of the same layout: every
    phase linear in the world size (plans per rank are constant, their number grows with the world).
    The record says so (``extrapolated_from``) and keeps the measured points.
    """
    xs = sorted(measured)
    out: dict = {"phases_s": {}}
    for phase in measured[xs[0]]["phases_s"]:
        out["phases_s"][phase] = _fit(xs, [measured[x]["phases_s"][phase] for x in xs], ranks)
    for key, value in measured[xs[0]].items():
        if key == "phases_s":
            continue
        out[key] = _fit(xs, [measured[x][key] for x in xs], ranks)
    for key in ("items_per_rank",):
        out[key] = measured[xs[-1]][key]
    return out


def table(records: list[dict]) -> str:
    rows = [
        "| ranks | preset | layout | cold save plan (rank 0) | longest rank blocked | resume metadata + plan "
        "| rank 0 per save | extra connections (rank 0 / others) | measured |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        c = r["extra_connections_per_rank"]
        how = (
            "extrapolated from " + ", ".join(sorted(r["extrapolated_from"], key=int))
            if "extrapolated_from" in r
            else "measured"
        )
        rows.append(
            f"| {r['ranks']:,} | {r['preset']} | {r['layout']} | {r['cold_save_plan_s']:.1f} s "
            f"| {r['max_rank_blocked_s']:.1f} s | {r['resume_metadata_and_plan_s']:.1f} s "
            f"| {r['rank0_training_process_python_s']:.2f} s | {c['rank0']:,} / {c['other_ranks_at_most']} "
            f"| {how} |"
        )
    return "\n".join(rows)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale",
        help="save planning, resume metadata and planning, and start-up connections at "
        "1,024 and 16,384 ranks, with torch DCP's planner objects in simulated ranks",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "--case",
        action="append",
        metavar="RANKS:PRESET:LAYOUT",
        help="a case to measure (e.g. 1024:70b:fsdp, 16384:70b:hsdp-64); repeatable; default: "
        + ", ".join(f"{c['ranks']}:{c['preset']}:{c['layout']}" for c in CASES),
    )
    p.add_argument(
        "--max-measured-ranks",
        type=int,
        default=MAX_MEASURED_RANKS,
        help="a larger case is measured at this world, its half and its quarter and extrapolated "
        f"(default {MAX_MEASURED_RANKS}: a 70b FSDP plan there is about 3 M planner objects)",
    )
    p.add_argument("--out", help="also write the records as JSON to this file")
    p.set_defaults(bench=main)


def parse_case(text: str) -> dict:
    from ..train.presets import PRESETS

    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit():
        raise ValueError(f"--case {text!r}: RANKS:PRESET:LAYOUT, e.g. 1024:70b:fsdp")
    ranks, preset, layout = int(parts[0]), parts[1], parts[2]
    if preset not in PRESETS:
        raise ValueError(f"--case {text!r}: preset {preset!r} is not one of {', '.join(PRESETS)}")
    shard_group(layout, ranks)
    return {"ranks": ranks, "preset": preset, "layout": layout}


def main(args: argparse.Namespace) -> int:
    try:
        cases = [parse_case(c) for c in args.case] if args.case else list(CASES)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    records = [run_case(c, args.max_measured_ranks) for c in cases]
    print(table(records))
    write_results(records, args.out)
    return 0
