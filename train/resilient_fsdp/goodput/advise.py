"""``resilient-fsdp advise``: restart settings for a cluster size, from the goodput model.

Inputs: the instance type and node count (GPUs per node from the chart's ``instanceTypes``), a
node MTBF (default: Llama 3's rate per GPU-hour), the job's length, and the checkpoint stall,
write and restart times: estimated from the model's size and the shared volume (:mod:`.costs`),
or measured (``--ckpt-stall-s``, ``--ckpt-write-s``, ``--restart-s``, ``--from-bench``).
:mod:`.settings` computes the advice and :mod:`.advice_table` prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import yaml

from . import costs as gc
from . import model as gm
from .advice_table import render_table, render_values
from .settings import (
    BACKOFF_LIMIT_MEANING,
    DEFAULT_RESTART_S,
    DEFAULT_STARTUP_S,
    JOB_RESTART_S,
    LONG_COMMIT_S,
    MEMORY_COVERAGE,
    NODE_LOSS_SHARE,
    SPARE_MISS_TARGET,
    AdviseError,
    Inputs,
    MemoryInputs,
    SpareInputs,
    advise,
)

CHART_VALUES = Path(__file__).resolve().parents[3] / "charts" / "resilient-fsdp" / "values.yaml"


def chart_storage_defaults(values_path: Path = CHART_VALUES) -> dict:
    """The chart's default shared volume: ``size``, ``deploymentType``, ``perUnitStorageThroughput``."""
    try:
        storage = yaml.safe_load(values_path.read_text())["storage"]
        return {
            "size": storage["size"],
            "deploymentType": storage["fsx"]["deploymentType"],
            "perUnitStorageThroughput": float(storage["fsx"]["perUnitStorageThroughput"]),
        }
    except (OSError, KeyError, TypeError) as exc:
        raise AdviseError(
            f"cannot read the storage defaults from {values_path} ({exc}); pass --storage-size, "
            "--deployment-type and --storage-throughput"
        ) from exc


def instance_gpus(instance: str, values_path: Path = CHART_VALUES) -> int:
    """GPUs per node of ``instance``, from the chart's ``instanceTypes`` table (one source)."""
    try:
        table = yaml.safe_load(values_path.read_text())["instanceTypes"]
    except (OSError, KeyError, TypeError) as exc:
        raise AdviseError(
            f"cannot read the instance table from {values_path} ({exc}); pass --gpus-per-node instead"
        ) from exc
    if instance not in table:
        raise AdviseError(
            f"--instance {instance!r} is not in the chart's instanceTypes "
            f"({', '.join(sorted(table))}); pass --gpus-per-node for other types"
        )
    return int(table[instance]["gpus"])


def costs_from_bench(path: Path) -> dict:
    """``ckpt_stall_s`` / ``ckpt_write_s`` from ``bench checkpoint`` JSON, ``restart_s`` from
    ``bench recovery`` JSON (its in-job median); either or both keys may be present. ``bench
    scale`` JSON gives ``scale``: its path, for the start-up a restart adds at the job's size."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdviseError(f"--from-bench {path}: cannot read it as JSON ({exc})") from exc
    if isinstance(data, list) and data and all(isinstance(r, dict) and "cold_save_plan_s" in r for r in data):
        return {"scale": path}
    if not isinstance(data, dict):
        raise AdviseError(f"--from-bench {path}: not `bench checkpoint`, `bench recovery` or `bench scale` results")
    found = {}
    if isinstance(data.get("async"), dict):
        found["ckpt_stall_s"] = float(data["async"]["stall_s"])
        found["ckpt_write_s"] = float(data["async"]["write_s"])
    if isinstance(data.get("in_job"), dict):
        found["restart_s"] = float(data["in_job"]["recovery_s_median"])
    if not found:
        raise AdviseError(
            f"--from-bench {path}: neither `bench checkpoint` (key `async`) nor `bench recovery` (key `in_job`) results"
        )
    return found


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise",
        help="checkpoint interval, timeouts and restart limits for a cluster size",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--instance", required=True, help="EC2 instance type, a key of the chart's instanceTypes")
    p.add_argument("--nodes", type=int, required=True, help="nodes (pods) in the job")
    p.add_argument("--gpus-per-node", type=int, help="default: the instance type's GPUs")
    p.add_argument(
        "--node-mtbf-hours",
        type=float,
        help="one node's mean time between failures; default: Llama 3's rate per GPU-hour x GPUs",
    )
    p.add_argument("--job-hours", type=float, default=24.0 * 14, help="planned length of the job (default 336)")
    p.add_argument(
        "--preset",
        help="the model: a built-in preset (tiny, 125m, 1b, 8b, 70b), to estimate the checkpoint costs from its state",
    )
    p.add_argument("--params", type=float, help="the model's parameter count (e.g. 70.6e9), instead of --preset")
    p.add_argument(
        "--storage-size",
        help="the shared volume's capacity as storage.size writes it (e.g. 14400Gi); default: the chart's",
    )
    p.add_argument(
        "--deployment-type",
        choices=("SCRATCH_2", "PERSISTENT_2"),
        help="the FSx deployment type (storage.fsx.deploymentType); default: the chart's",
    )
    p.add_argument(
        "--storage-throughput",
        type=float,
        metavar="MB_S_PER_TIB",
        help="FSx throughput per TiB (storage.fsx.perUnitStorageThroughput: 125, 250, 500, 1000 for "
        "PERSISTENT_2); default: the chart's (SCRATCH_2: 200)",
    )
    p.add_argument(
        "--ckpt-stall-s", type=float, help="measured training stall per checkpoint (seconds); replaces the estimate"
    )
    p.add_argument(
        "--ckpt-write-s",
        type=float,
        help="measured background write time per checkpoint (seconds); replaces the estimate",
    )
    p.add_argument(
        "--restart-s", type=float, help=f"time from a failure to training again (default {DEFAULT_RESTART_S:g})"
    )
    p.add_argument("--step-s", type=float, default=10.0, help="time of one training step (default 10)")
    p.add_argument(
        "--startup-s",
        type=float,
        default=DEFAULT_STARTUP_S,
        help=f"model build, sharding and rendezvous at start (default {DEFAULT_STARTUP_S:g})",
    )
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=0,
        metavar="GPUS",
        help="dist.shard_group_size: HSDP, each parameter sharded over this many GPUs (whole pods that "
        "divide the job) and replicated across the groups; default 0, FSDP over every GPU",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also size the memory tier (checkpoint.memory): its interval, /dev/shm, the goodput gained",
    )
    p.add_argument(
        "--memory-stall-s",
        type=float,
        help="measured stall of one memory save; default: the copy of a "
        "rank's shard at the instance's device-to-host rate",
    )
    p.add_argument(
        "--memory-restart-s",
        type=float,
        help="an in-job restart from memory (measured: bench recovery's in_job_memory row); default: --restart-s",
    )
    p.add_argument(
        "--memory-replicas",
        type=int,
        choices=(0, 1),
        default=1,
        help="checkpoint.memory.replicas: 1 (default) also keeps the next pod's snapshots, so a lost "
        "pod resumes from memory; its two slots count in shm.sizeLimit",
    )
    p.add_argument(
        "--memory-coverage",
        type=float,
        help="the share of failures the pods survive, restored from memory (default: what --from-run "
        f"measured, else {MEMORY_COVERAGE:g}, DLRover's published share)",
    )
    p.add_argument(
        "--from-run",
        type=Path,
        metavar="RUN_DIR",
        help="with --memory: take the coverage from a run with the memory tier on, the share of its "
        "restarts that resumed from memory (its metrics.jsonl start records)",
    )
    p.add_argument(
        "--spares",
        nargs="?",
        const="auto",
        metavar="S",
        help="hot spares (the chart's spares): with no number or 'auto', the fewest for which a node loss "
        f"finds none free at most {SPARE_MISS_TARGET:.0%}% of the time; with a number, that many. "
        "Shows the chance, the cost and the goodput with and without them",
    )
    p.add_argument(
        "--replacement-s",
        type=float,
        help="with --spares: until a lost pod's replacement joins as a spare (default: --job-restart-s)",
    )
    p.add_argument(
        "--job-restart-s",
        type=float,
        default=JOB_RESTART_S,
        help=f"with --spares: a node loss without a spare, a job-level restart that waits for a "
        f"replacement node (default {JOB_RESTART_S:g}, the simulation's)",
    )
    p.add_argument(
        "--node-loss-share",
        type=float,
        default=NODE_LOSS_SHARE,
        help=f"with --spares: the share of failures that take a node out (default {NODE_LOSS_SHARE:g}, "
        "the simulation's)",
    )
    p.add_argument(
        "--from-bench",
        action="append",
        default=[],
        metavar="FILE",
        help="take measured costs from `bench checkpoint` / `bench recovery` JSON (repeatable)",
    )
    p.add_argument("--values", action="store_true", help="print a values snippet for the chart instead of the table")
    p.add_argument(
        "--kind",
        choices=sorted(BACKOFF_LIMIT_MEANING),
        default="PyTorchJob",
        help="the chart's workload.kind, which decides what job.backoffLimit does (default PyTorchJob)",
    )
    p.set_defaults(run=main)


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    costs: dict = {}
    sources: dict[str, str] = {}
    for path in args.from_bench:
        found = costs_from_bench(Path(path))
        costs.update(found)
        sources.update({key: f"measured, --from-bench {path}" for key in found})
    for key in ("ckpt_stall_s", "ckpt_write_s", "restart_s"):
        if getattr(args, key) is not None:
            costs[key] = getattr(args, key)
            sources[key] = f"given, --{key.replace('_', '-')}"
    gpus = args.gpus_per_node if args.gpus_per_node is not None else instance_gpus(args.instance)
    group = _shard_group(args, gpus)
    missing = [k for k in ("ckpt_stall_s", "ckpt_write_s") if k not in costs]
    estimate = None
    if missing:
        try:
            params = gc.params_of(args.preset, args.params)
            if params is None:
                raise AdviseError(
                    "the checkpoint costs are needed: pass the model's size (--preset, or --params) to "
                    "estimate them from the state and the storage, or measured ones: "
                    + " and ".join(f"--{k.replace('_', '-')}" for k in missing)
                    + ", or --from-bench with `bench checkpoint` results"
                )
            defaults = chart_storage_defaults()
            deployment = args.deployment_type or defaults["deploymentType"]
            throughput = args.storage_throughput
            if throughput is None and args.deployment_type is None:
                throughput = defaults["perUnitStorageThroughput"]
            volume = gc.storage(args.storage_size or defaults["size"], deployment, throughput)
            estimate = gc.estimate(params, args.nodes * gpus, args.instance, volume, group)
        except gc.CostError as exc:
            raise AdviseError(str(exc)) from None
        for key, value in (("ckpt_stall_s", estimate.stall_s), ("ckpt_write_s", estimate.write_s)):
            if key in missing:
                costs[key], sources[key] = value, "estimated"
    if "restart_s" not in costs:
        sources["restart_s"] = "default"
    scale = costs.pop("scale", None)
    if scale is not None:  # what a restarted world of this size spends planning and reading metadata
        from .simulate import startup_from_bench

        if args.preset is None:
            raise AdviseError(f"--from-bench {scale}: `bench scale` results are per model: pass --preset")
        case = f"{args.preset}:{f'hsdp-{group}' if group else 'fsdp'}"
        try:
            startup = startup_from_bench(scale, case, args.nodes * gpus)
        except (ValueError, KeyError) as exc:
            raise AdviseError(f"--from-bench {scale}: {exc}") from None
        costs["restart_s"] = costs.get("restart_s", DEFAULT_RESTART_S) + startup
        sources["restart_s"] += (
            f"; + {startup:.1f} s of start-up planning and resume metadata (measured, --from-bench {scale}, {case})"
        )
    if args.node_mtbf_hours is not None:
        mtbf, source = args.node_mtbf_hours, "given (--node-mtbf-hours)"
    else:
        mtbf = gm.node_mtbf_hours(gpus)
        source = gm.LLAMA3_SOURCE.format(gpu_hours=gm.llama3_gpu_mtbf_hours())
    memory = None
    if getattr(args, "memory", False):
        memory = _memory_inputs(args, estimate, costs.get("restart_s", DEFAULT_RESTART_S), gpus, group)
    suggested = None
    if estimate is not None and not group and estimate.commit_s > LONG_COMMIT_S:
        suggested = gc.suggested_shard_group(estimate.params, estimate.gpus, gpus, args.instance)
    return Inputs(
        spares=_spare_inputs(args),
        memory=memory,
        shard_group=group,
        suggested_shard_group=suggested,
        instance=args.instance,
        nodes=args.nodes,
        gpus_per_node=gpus,
        node_mtbf_hours=mtbf,
        job_hours=args.job_hours,
        ckpt_stall_s=costs["ckpt_stall_s"],
        ckpt_write_s=costs["ckpt_write_s"],
        restart_s=costs.get("restart_s", DEFAULT_RESTART_S),
        step_s=args.step_s,
        startup_s=args.startup_s,
        mtbf_source=source,
        cost_sources=tuple((k, sources[k]) for k in ("ckpt_stall_s", "ckpt_write_s", "restart_s")),
        estimate=estimate,
    )


def _spare_inputs(args: argparse.Namespace) -> Optional[SpareInputs]:
    text = getattr(args, "spares", None)
    if text is None:
        return None
    if text != "auto" and not str(text).isdigit():
        raise AdviseError(
            f"--spares {text!r}: give a whole number of spare nodes, or 'auto' (or no value) for the advisor's"
        )
    job_restart = getattr(args, "job_restart_s", JOB_RESTART_S)
    replacement = args.replacement_s if getattr(args, "replacement_s", None) is not None else job_restart
    return SpareInputs(
        count=None if text == "auto" else int(text),
        replacement_s=replacement,
        job_restart_s=job_restart,
        node_loss_share=getattr(args, "node_loss_share", NODE_LOSS_SHARE),
    )


def _shard_group(args: argparse.Namespace, gpus_per_node: int) -> int:
    group, world = getattr(args, "shard_group_size", 0) or 0, args.nodes * gpus_per_node
    if group < 0 or (group and world % group):
        raise AdviseError(
            f"--shard-group-size {group} does not divide the job's {world} GPUs: give a divisor of "
            f"{world} (whole pods: a multiple of {gpus_per_node}), or 0 for FSDP over every GPU"
        )
    return 0 if group == world else group


def _memory_inputs(
    args: argparse.Namespace, estimate: Optional[gc.Estimate], restart_s: float, gpus: int, group: int = 0
) -> MemoryInputs:
    shard = estimate.shard_gb if estimate is not None else None
    if shard is None:
        params = gc.params_of(args.preset, args.params)
        shard = params * gc.BYTES_PER_PARAM / 1e9 / (group or args.nodes * gpus) if params else None
    stall = args.memory_stall_s
    if stall is None:
        if shard is None:
            raise AdviseError(
                "--memory needs the memory save's stall: pass --memory-stall-s, or the model's size "
                "(--preset or --params) to estimate it"
            )
        stall = gc.memory_stall_s(shard, args.instance)
    # Without a measurement, a restart from memory costs what the in-job restart does: its load is
    # a small part of it (1.4 of 18.9 s in bench recovery's in-job runs), the gain is in lost work.
    restart = args.memory_restart_s if args.memory_restart_s is not None else restart_s
    coverage, source = args.memory_coverage, "given, --memory-coverage"
    if coverage is None and getattr(args, "from_run", None) is not None:
        coverage, restarts = coverage_from_run(args.from_run)
        source = (
            f"measured, --from-run {args.from_run}: {round(coverage * restarts)} of {restarts} restarts from memory"
        )
    if coverage is None:
        coverage, source = MEMORY_COVERAGE, "DLRover's published share"
    return MemoryInputs(
        stall_s=stall,
        restart_s=restart,
        coverage=coverage,
        shard_gb=shard,
        replicas=args.memory_replicas,
        coverage_source=source,
    )


def coverage_from_run(run_dir: Path) -> tuple[float, int]:
    """The share of ``run_dir``'s restarts that resumed from the pods' memory, and how many restarts
    resumed at all: its ``start`` records of attempts a restart began (each names where it
    resumed from). Replication that stopped, a lost pod without a replica, a snapshot that failed
    its checks: each shows as a restart that resumed from the durable checkpoint."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AdviseError(
            f"--from-run {run_dir}: cannot read {path} ({exc.strerror or exc}); give the run directory "
            "of a job that ran with the memory tier on"
        ) from None
    tiers = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash
        if (
            isinstance(record, dict)
            and record.get("event") == "start"
            and record.get("layer") != "start"
            and record.get("resumed_from_tier")
        ):
            tiers.append(record["resumed_from_tier"])
    if not tiers:
        raise AdviseError(
            f"--from-run {run_dir}: no restart of that run resumed from a checkpoint, so it measured no "
            "coverage; give a run that recovered from faults, or --memory-coverage"
        )
    return tiers.count("memory") / len(tiers), len(tiers)


def main(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    try:
        advice = advise(inputs_from_args(args))
    except AdviseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = getattr(args, "kind", "PyTorchJob")
    print(render_values(advice, kind) if args.values else render_table(advice, kind), file=out)
    return 0


def parse_advise_line(line: str) -> Optional[argparse.Namespace]:
    """The arguments of a ``# advise: ...`` line in a values profile's header, else None."""
    prefix = "# advise:"
    if not line.startswith(prefix):
        return None
    parser = argparse.ArgumentParser(prog="advise", add_help=False)
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    return parser.parse_args(["advise", *line[len(prefix) :].split()])
