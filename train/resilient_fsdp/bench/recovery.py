"""``resilient-fsdp bench recovery``: the same fault, recovered by each restart layer, in one run.

A local job (``--nodes`` x ``--nproc-per-node`` ranks, the ``tiny`` preset) gets one injected
``exception`` on the last rank at ``--fault-step``, ``--repeats`` times per layer:

- ``in_process``: ``resilience.in_process=true``: every rank re-enters training in its process;
- ``in_job``: in-process restart off: ``ft_launcher`` respawns the workers of every node;
- ``full_relaunch``: no restart allowed (``--max-restarts 0 --max-node-restarts 0``): the job
  fails and is launched again from its last checkpoint, which is what a plain torchrun job gets.

``recovery_s`` runs from the fault to the first step completed after the restore (for the
relaunch it includes the failed job's shutdown and the new job's start); ``lost_steps`` counts
steps trained again. Both come from the jobs' own ``summary.json``. Every run must also end with
the fault-free parameters. Results: a table, and JSON with ``--out``.
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

# Shared by every variant: gloo cannot abort a collective, so ranks waiting on the failed one
# wait out dist.timeout_s (after the first step; start-up keeps a long timeout). NCCL is aborted
# instead, so on GPUs this wait does not exist.
COMMON = ["resilience.workers_stop_timeout_s=2", "resilience.workload_check_interval_s=0.5",
          "resilience.learn_timeouts=false", "resilience.in_process_soft_timeout_s=20",
          "resilience.in_process_hard_timeout_s=40", "resilience.in_process_heartbeat_timeout_s=20",
          "resilience.in_process_barrier_timeout_s=120"]
LAYERS = ("in_process", "in_job", "full_relaunch")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recovery", help="recovery time of one fault by in-process, in-job and full relaunch",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/bench-recovery", help="scratch directory for the jobs")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps per job")
    p.add_argument("--fault-step", type=int, default=22, help="the step at which the exception is raised")
    p.add_argument("--interval-steps", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--timeout-s", type=float, default=2.0,
                   help="dist.timeout_s: how long gloo peers wait on the failed rank (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="runs per layer; medians are reported")
    p.add_argument("--out", help="write the results as JSON here")
    p.set_defaults(bench=main)


def run_job(run_dir: Path, nodes: int, nproc: int, overrides: list[str], flags: list[str], log: Path,
            timeout_s: float = 900) -> int:
    """``resilient-fsdp local`` as a user runs it; output appended to ``log``."""
    cmd = [sys.executable, "-m", "resilient_fsdp.cli", "local", f"--nodes={nodes}", f"--nproc-per-node={nproc}",
           f"--run-dir={run_dir}", *flags]
    for o in overrides:
        cmd += ["--set", o]
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode


def measure(layer: str, run_dir: Path, args: argparse.Namespace, log: Path) -> dict:
    spec = f"exception@{args.fault_step}:rank={args.nodes * args.nproc_per_node - 1}"
    overrides = [f"train.steps={args.steps}", f"checkpoint.interval_steps={args.interval_steps}",
                 f"dist.timeout_s={args.timeout_s}", *COMMON,
                 f"resilience.in_process={'true' if layer == 'in_process' else 'false'}"]
    flags = [f"--inject={spec}"]
    if layer == "full_relaunch":
        flags += ["--max-restarts=0", "--max-node-restarts=0"]
    code = run_job(run_dir, args.nodes, args.nproc_per_node, overrides, flags, log)
    if layer == "full_relaunch":
        if code == 0:
            raise RuntimeError(f"the job was meant to fail without restarts but finished; see {log}")
        code = run_job(run_dir, args.nodes, args.nproc_per_node, overrides, flags, log)
    if code != 0:
        raise RuntimeError(f"{layer} run failed with code {code}; see {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    return {"recovery_s": recovery["recovery_s"], "lost_steps": recovery["lost_steps"],
            "layer_seen": recovery["layer"], "params_sha256": summary["params_sha256"]}


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    reference = root / "fault-free"
    overrides = [f"train.steps={args.steps}", f"checkpoint.interval_steps={args.interval_steps}",
                 f"dist.timeout_s={args.timeout_s}", *COMMON]
    fresh_dir(reference)
    if run_job(reference, args.nodes, args.nproc_per_node, overrides, [], log) != 0:
        raise RuntimeError(f"the fault-free reference run failed; see {log}")
    expected = json.loads((reference / "summary.json").read_text())["params_sha256"]
    results: dict = {"nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "steps": args.steps,
                     "fault": f"exception@{args.fault_step}", "checkpoint_interval_steps": args.interval_steps,
                     "dist_timeout_s": args.timeout_s, "cpu_count": os.cpu_count(), "repeats": args.repeats}
    for layer in LAYERS:
        samples = []
        for i in range(args.repeats):
            run_dir = root / f"{layer}-{i}"
            fresh_dir(run_dir)
            sample = measure(layer, run_dir, args, log)
            sample["bitwise_equal_to_fault_free"] = sample.pop("params_sha256") == expected
            samples.append(sample)
            print(f"{layer:<14} run {i + 1}/{args.repeats}: recovery {sample['recovery_s']:.2f} s, lost steps "
                  f"{sample['lost_steps']}, recovered by {sample['layer_seen']}, bitwise equal "
                  f"{sample['bitwise_equal_to_fault_free']}", flush=True)
        results[layer] = {"recovery_s_median": statistics.median(s["recovery_s"] for s in samples),
                          "lost_steps_median": statistics.median(s["lost_steps"] for s in samples),
                          "samples": samples}
    results["ratios"] = {"in_process_over_full_relaunch":
                         results["in_process"]["recovery_s_median"] / results["full_relaunch"]["recovery_s_median"],
                         "in_job_over_full_relaunch":
                         results["in_job"]["recovery_s_median"] / results["full_relaunch"]["recovery_s_median"]}
    print(format_table(results))
    write_results(results, args.out)
    return 0 if all(s["bitwise_equal_to_fault_free"] for layer in LAYERS for s in results[layer]["samples"]) else 1


def format_table(results: dict) -> str:
    rows = [f"{'layer':<14} {'recovery_s (median)':>20} {'lost_steps (median)':>20}"]
    for layer in LAYERS:
        r = results[layer]
        rows.append(f"{layer:<14} {r['recovery_s_median']:>20.2f} {r['lost_steps_median']:>20}")
    ratios = results["ratios"]
    rows.append(f"in-process / full relaunch: {ratios['in_process_over_full_relaunch']:.3f}; "
                f"in-job / full relaunch: {ratios['in_job_over_full_relaunch']:.3f}")
    return "\n".join(rows)


SCRATCH_MARKER = ".resilient-fsdp-bench-scratch"


def fresh_dir(path: Path) -> None:
    """Empty ``path`` for a benchmark job. Only a directory a benchmark created (it holds the
    marker file) is ever deleted: a ``--run-dir`` pointed at anything else is refused."""
    if path.exists() and any(path.iterdir()) and not (path / SCRATCH_MARKER).exists():
        raise RuntimeError(f"{path} exists and was not created by a benchmark; refusing to delete it. "
                           f"Pass --run-dir with a new or benchmark-owned directory")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / SCRATCH_MARKER).touch()
