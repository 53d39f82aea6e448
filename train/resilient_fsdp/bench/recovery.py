"""``resilient-fsdp bench recovery``: the same fault, recovered by each restart layer, in one run.

A local job (``--nodes`` x ``--nproc-per-node`` ranks, the ``tiny`` preset unless ``--set`` says
otherwise) gets one injected ``exception`` on the last rank at ``--fault-step``, ``--repeats``
times per layer of :data:`LAYERS` (the node-loss pair only when asked for by name). Per layer:
the median, min and max of the runs' recovery time and lost steps (:func:`measure`). Results: a
table, and JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from .results import write_results

# Shared by every variant. In-process restart shuts the gloo group's connections down, so ranks
# blocked on the failed one do not wait out dist.timeout_s; the in-job and relaunch layers still
# may (after the first step; start-up keeps a long timeout).
COMMON = [
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    "resilience.hang_detection.learn_timeouts=false",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
]
# in_process: every rank re-enters training in its process; in_job: ft_launcher respawns the
# workers; in_job_cold: without pre-warmed ranks; in_job_memory: restored from the pods' memory
# snapshots; full_relaunch: no restart allowed, the job launched again (what a plain torchrun job
# gets); node_loss: the last rank's pod lost, its replacement after --replacement-delay-s;
# node_loss_spare: the same with a hot spare (NVRx 0.6 or newer).
LAYERS = ("in_process", "in_job", "in_job_cold", "in_job_memory", "full_relaunch", "node_loss", "node_loss_spare")
DEFAULT_LAYERS = LAYERS[:5]  # the node-loss pair waits out the replacement delay: asked for by name


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "recovery",
        help="recovery time of one fault by in-process, in-job and full relaunch",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--run-dir", default="runs/bench-recovery", help="scratch directory for the jobs")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps per job")
    p.add_argument("--fault-step", type=int, default=22, help="the step at which the exception is raised")
    p.add_argument("--interval-steps", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=2.0,
        help="dist.timeout_s: how long gloo peers wait on the failed rank (default 2)",
    )
    p.add_argument(
        "--memory-interval-steps",
        type=int,
        default=1,
        help="checkpoint.memory.interval_steps of the in_job_memory layer (default 1)",
    )
    p.add_argument(
        "--memory-replicas",
        type=int,
        default=0,
        choices=(0, 1),
        help="checkpoint.memory.replicas of the in_job_memory layer (default 0); with 1 the replica's time is reported",
    )
    p.add_argument("--repeats", type=int, default=5, help="runs per layer; median, min and max are reported")
    p.add_argument(
        "--layers",
        nargs="+",
        default=list(DEFAULT_LAYERS),
        choices=list(LAYERS),
        help=f"layers to measure (default: {' '.join(DEFAULT_LAYERS)})",
    )
    p.add_argument(
        "--replacement-delay-s",
        type=float,
        default=30.0,
        help="node_loss and node_loss_spare: seconds from the loss to the replacement pod's start "
        "(default 30; the goodput model's job-level restart assumes 600 on a cluster)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer setting for every job (repeatable), e.g. --set model.preset=125m",
    )
    p.add_argument(
        "--value",
        dest="values",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chart value for every job (repeatable), e.g. --value shm.sizeLimit=4Gi",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.set_defaults(bench=main)


def run_job(
    run_dir: Path, nodes: int, nproc: int, overrides: list[str], flags: list[str], log: Path, timeout_s: float = 900
) -> int:
    """``resilient-fsdp local`` as a user runs it; output appended to ``log``."""
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        f"--nodes={nodes}",
        f"--nproc-per-node={nproc}",
        f"--run-dir={run_dir}",
        *flags,
    ]
    for o in overrides:
        cmd += ["--set", o]
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode


def measure(layer: str, run_dir: Path, args: argparse.Namespace, log: Path) -> dict:
    """``recovery_s`` runs from the fault to the first step completed after the restore (for
    ``full_relaunch`` it includes the failed job's shutdown and the new job's start); ``lost_steps``
    counts steps trained again; both from the job's ``summary.json``. The saves' stall after the
    restart is compared with a normal save's before the fault (``save_after_restart_over_normal``:
    at most 2 is the target), and the run must end with the fault-free parameters.
    """
    kind = "node-loss" if layer.startswith("node_loss") else "exception"
    spec = f"{kind}@{args.fault_step}:rank={args.nodes * args.nproc_per_node - 1}"
    overrides = [
        f"train.steps={args.steps}",
        f"checkpoint.interval_steps={args.interval_steps}",
        f"dist.timeout_s={args.timeout_s}",
        *COMMON,
        *getattr(args, "overrides", []),
        f"resilience.in_process.enabled={'true' if layer == 'in_process' else 'false'}",
    ]
    if layer == "in_job_cold":
        overrides.append("resilience.launcher.prewarm=false")
    if layer == "in_job_memory":
        overrides += [
            f"checkpoint.memory.interval_steps={args.memory_interval_steps}",
            f"checkpoint.memory.replicas={getattr(args, 'memory_replicas', 0)}",
        ]
    flags = [f"--inject={spec}", *(f"--value={v}" for v in getattr(args, "values", []))]
    if layer == "full_relaunch":
        flags += ["--max-restarts=0", "--max-pod-recreations=0"]
    if kind == "node-loss":
        flags.append(f"--replacement-delay={getattr(args, 'replacement_delay_s', 30.0):g}")
    if layer == "node_loss_spare":
        flags.append("--value=spares=1")
    code = run_job(run_dir, args.nodes, args.nproc_per_node, overrides, flags, log)
    if layer == "full_relaunch":
        if code == 0:
            raise RuntimeError(f"the job was meant to fail without restarts but finished; see {log}")
        code = run_job(run_dir, args.nodes, args.nproc_per_node, overrides, flags, log)
    if code != 0:
        raise RuntimeError(f"{layer} run failed with code {code}; see {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    return {
        "recovery_s": recovery["recovery_s"],
        "lost_steps": recovery["lost_steps"],
        "layer_seen": recovery["layer"],
        "params_sha256": summary["params_sha256"],
        "phases_s": recovery.get("phases_s"),
        "memory_save_stall_s": memory_stall(run_dir / "metrics.jsonl"),
        "memory_replica_s": replica_time(run_dir / "metrics.jsonl"),
        **save_stalls(run_dir / "metrics.jsonl", args.fault_step, args.steps),
    }


def memory_stall(metrics: Path) -> float | None:
    """The median stall of the run's memory saves (rank 0's records; the first, which maps and
    touches the slot, left out), or None without them."""
    events = [json.loads(line) for line in metrics.read_text().splitlines() if '"memory_checkpoint"' in line]
    stalls = [e["stall_s"] for e in events[1:] if e.get("event") == "memory_checkpoint" and not e.get("error")]
    return statistics.median(stalls) if stalls else None


def replica_time(metrics: Path) -> float | None:
    """The median time rank 0's replicas took to reach the rank on the next pod (the first, which
    maps and touches the peer's slot, left out), or None without replicas."""
    events = [json.loads(line) for line in metrics.read_text().splitlines() if '"memory_replica"' in line]
    times = [e["send_s"] for e in events if e.get("event") == "memory_replica"][1:]
    return statistics.median(times) if times else None


def save_stalls(metrics: Path, fault_step: int, final_step: int) -> dict:
    """Stall of the saves before the fault (the job's first, which allocates, left out) and after
    the restart, from the run's checkpoint records. A save's stall includes any wait for its write
    before the next save could start (the trainer charges that wait to it); the final save counts
    without its wait for its own commit, which every run has."""
    events = [json.loads(line) for line in metrics.read_text().splitlines() if '"checkpoint"' in line]
    events = sorted((e for e in events if e.get("event") == "checkpoint"), key=lambda e: e["step"])
    before = [e for e in events if e["step"] < fault_step][1:]
    after_events = [e for e in events if e["step"] > fault_step]

    def stall(e: dict) -> float:
        return e["save_call_s"] + e["staging_wait_s"] if e["step"] == final_step else e["stall_s"]

    after = [stall(e) for e in after_events]
    normal = statistics.median(stall(e) for e in before) if before else None
    return {
        "normal_save_stall_s": normal,
        "save_after_restart_stall_s": after,
        "save_after_restart_over_normal": max(after) / normal if normal and after else None,
        # Where those stalls went: the save call's parts, and the wait before optimizer.step().
        "normal_save_parts_s": [_parts(e) for e in before],
        "save_after_restart_parts_s": [_parts(e) for e in after_events],
    }


def _parts(event: dict) -> dict:
    return {**(event.get("save_call_parts_s") or {}), "staging_wait_s": event.get("staging_wait_s")}


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    reference = root / "fault-free"
    overrides = [
        f"train.steps={args.steps}",
        f"checkpoint.interval_steps={args.interval_steps}",
        f"dist.timeout_s={args.timeout_s}",
        *COMMON,
        *getattr(args, "overrides", []),
    ]
    fresh_dir(reference)
    values = [f"--value={v}" for v in getattr(args, "values", [])]
    if run_job(reference, args.nodes, args.nproc_per_node, overrides, values, log) != 0:
        raise RuntimeError(f"the fault-free reference run failed; see {log}")
    expected = json.loads((reference / "summary.json").read_text())["params_sha256"]
    results: dict = {
        "nodes": args.nodes,
        "nproc_per_node": args.nproc_per_node,
        "steps": args.steps,
        "fault": f"exception@{args.fault_step}",
        "checkpoint_interval_steps": args.interval_steps,
        "replacement_delay_s": getattr(args, "replacement_delay_s", None),
        "dist_timeout_s": args.timeout_s,
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "overrides": list(getattr(args, "overrides", [])),
        "values": list(getattr(args, "values", [])),
        "loadavg_start": os.getloadavg(),
    }
    layers = list(args.layers)
    for layer in layers:
        samples = []
        for i in range(args.repeats):
            run_dir = root / f"{layer}-{i}"
            fresh_dir(run_dir)
            sample = measure(layer, run_dir, args, log)
            sample["bitwise_equal_to_fault_free"] = sample.pop("params_sha256") == expected
            samples.append(sample)
            ratio = sample["save_after_restart_over_normal"]
            print(
                f"{layer:<14} run {i + 1}/{args.repeats}: recovery {sample['recovery_s']:.2f} s, lost steps "
                f"{sample['lost_steps']}, recovered by {sample['layer_seen']}, bitwise equal "
                f"{sample['bitwise_equal_to_fault_free']}, save after restart / normal "
                + (f"{ratio:.2f}" if ratio is not None else "n/a"),
                flush=True,
            )
        times = [s["recovery_s"] for s in samples]
        ratios = [s["save_after_restart_over_normal"] for s in samples if s["save_after_restart_over_normal"]]
        results[layer] = {
            "recovery_s_median": statistics.median(times),
            "recovery_s_min": min(times),
            "recovery_s_max": max(times),
            "lost_steps_median": statistics.median(s["lost_steps"] for s in samples),
            "save_after_restart_over_normal_max": max(ratios) if ratios else None,
            "memory_save_stall_s_median": _median_of(s["memory_save_stall_s"] for s in samples),
            "memory_replica_s_median": _median_of(s.get("memory_replica_s") for s in samples),
            "phases_s_median": median_phases(samples),
            "samples": samples,
        }
    results["layers"] = layers
    results["loadavg_end"] = os.getloadavg()
    relaunch = results.get("full_relaunch", {}).get("recovery_s_median")
    results["ratios"] = {
        f"{layer}_over_full_relaunch": results[layer]["recovery_s_median"] / relaunch
        for layer in ("in_process", "in_job", "in_job_cold", "in_job_memory")
        if layer in results and relaunch
    }
    if "node_loss" in results and "node_loss_spare" in results:
        results["ratios"]["node_loss_spare_over_node_loss"] = (
            results["node_loss_spare"]["recovery_s_median"] / results["node_loss"]["recovery_s_median"]
        )
    if "in_job" in results and "node_loss_spare" in results:
        results["ratios"]["node_loss_spare_over_in_job"] = (
            results["node_loss_spare"]["recovery_s_median"] / results["in_job"]["recovery_s_median"]
        )
    print(format_table(results))
    write_results(results, args.out)
    return 0 if all(s["bitwise_equal_to_fault_free"] for layer in layers for s in results[layer]["samples"]) else 1


def _median_of(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_phases(samples: list[dict]) -> dict:
    """Per phase of the recovery (accounting.phases), the median over the runs that report it."""
    reported = [s["phases_s"] for s in samples if s.get("phases_s")]
    keys = [k for k in (reported[0] if reported else {}) if all(k in p for p in reported)]
    return {k: statistics.median(p[k] for p in reported) for k in keys}


def format_table(results: dict) -> str:
    rows = [f"{'layer':<14} {'recovery_s median (min..max)':>30} {'lost_steps':>11} {'save after restart/normal':>26}"]
    for layer in results["layers"]:
        r = results[layer]
        ratio = r["save_after_restart_over_normal_max"]
        rows.append(
            f"{layer:<14} {r['recovery_s_median']:>12.2f} ({r['recovery_s_min']:.2f}..{r['recovery_s_max']:.2f})"
            f"{'':>5} {r['lost_steps_median']:>11} {'n/a' if ratio is None else f'{ratio:.2f} (max)':>26}"
        )
    rows.append(
        "where the time went (median s): "
        + "; ".join(
            f"{layer}: "
            + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in results[layer]["phases_s_median"].items())
            for layer in results["layers"]
        )
    )
    for layer in results["layers"]:
        stall, replica = (results[layer].get(k) for k in ("memory_save_stall_s_median", "memory_replica_s_median"))
        if stall is not None:
            rows.append(
                f"{layer}: memory save stall {stall:.3f} s (median)"
                + (f", replica to the next pod {replica:.3f} s (median)" if replica is not None else "")
            )
    rows += [f"{name.replace('_', ' ')}: {value:.3f}" for name, value in results["ratios"].items()]
    return "\n".join(rows)


SCRATCH_MARKER = ".resilient-fsdp-bench-scratch"


def fresh_dir(path: Path) -> None:
    """Empty ``path`` for a benchmark job. Only a directory a benchmark created (it holds the
    marker file) is ever deleted: a ``--run-dir`` pointed at anything else is refused."""
    if path.exists() and any(path.iterdir()) and not (path / SCRATCH_MARKER).exists():
        raise RuntimeError(
            f"{path} exists and was not created by a benchmark; refusing to delete it. "
            f"Pass --run-dir with a new or benchmark-owned directory"
        )
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / SCRATCH_MARKER).touch()
