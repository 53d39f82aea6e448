"""``resilient-fsdp bench soak``: a fault every minute for ten minutes, kinds mixed.

1. A short fault-free calibration run measures the step rate of the job on this machine.
2. The soak job: enough steps for ``--duration-s`` of training (in-process restart on with
   ``--in-process``) and one fault in every ``--fault-every-s`` window, at a moment of it drawn with
   ``--seed`` (between a tenth and nine tenths of the window, at the step the rate predicts), cycling
   through ``--kinds`` on the non-zero ranks. Faults at a fixed point of each window would meet every
   checkpoint interval that divides the window at the same phase each time (the worst, or the best).
3. The same job without faults.

Reported: the soak job's goodput (``summary.json``: time in steps that count / wall time since
launch), every fault with the layer that recovered it and its recovery time, and whether the final
parameters equal the fault-free run's bit for bit, and the restarts restored from the pods' memory.

Both jobs checkpoint as the chart's defaults do, at intervals for a fault a minute: the memory tier
on with replicas, a snapshot every ``--memory-interval-steps`` (8: about Daly's interval for the
few milliseconds a memory save costs the training thread, its stall and taking the state, at a
60 s MTBF: sqrt(2 x 0.006 x 60) = 0.85 s, 8 steps at ~9 steps/s), and a durable checkpoint every
``--checkpoint-interval-s``; ``--memory-interval-steps 0`` measures the durable checkpoints alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

from .results import write_results
from .recovery import fresh_dir, run_job

DEFAULT_KINDS = "exception,sigkill,hang,exception,sigkill-during-save,hang,exception,node-loss,exception,sigterm"
# ``--in-process`` adds in-process restart (for exceptions and hangs) to the in-job and job-level
# restarts that are always on.
COMMON = ["resilience.launcher.max_restarts=100", "resilience.launcher.workers_stop_timeout_s=2", "resilience.hang_detection.workload_check_interval_s=0.5",
          "resilience.hang_detection.step_timeout_s=10", "resilience.hang_detection.learn_timeouts=false", "train.log_every=500"]
IN_PROCESS = ["resilience.in_process.enabled=true", "resilience.hang_detection.step_timeout_s=60", "resilience.in_process.soft_timeout_s=20",
              "resilience.in_process.hard_timeout_s=40", "resilience.in_process.heartbeat_timeout_s=20",
              "resilience.in_process.barrier_timeout_s=120"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="a fault every minute for ten minutes: goodput and exactness",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/bench-soak", help="scratch directory for the jobs")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=600.0, help="training time to soak (default 600)")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="one fault this often (default 60)")
    p.add_argument("--kinds", default=DEFAULT_KINDS, help="comma-separated fault kinds, used in turn")
    p.add_argument("--seed", type=int, default=0, help="draws each fault's moment within its window (default 0)")
    p.add_argument("--checkpoint-interval-s", type=float, default=5.0, help="checkpoint.interval_s")
    p.add_argument("--checkpoint-interval-steps", type=int, default=0,
                   help="checkpoint.interval_steps (default 0: the durable checkpoints follow --checkpoint-interval-s "
                        "alone, not the dev-cpu values' 20 steps)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="dist.timeout_s (see bench recovery)")
    p.add_argument("--in-process", action="store_true", help="also turn in-process restart on")
    p.add_argument("--memory-interval-steps", type=int, default=8,
                   help="checkpoint.memory.interval_steps: the memory tier's interval (default 8; 0: off)")
    p.add_argument("--memory-replicas", type=int, default=1, choices=(0, 1),
                   help="checkpoint.memory.replicas (default 1)")
    p.add_argument("--out", help="write the results as JSON here")
    p.set_defaults(bench=main)


def step_rate(run_dir: Path) -> float:
    """Steps per second of wall time over a run's steady state (past its first ten steps)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("event") == "step"][10:]
    return (len(steps) - 1) / (steps[-1]["t"] - steps[0]["t"])


def restores_from_memory(run_dir: Path) -> int:
    """Restarts whose ranks loaded the pods' memory snapshots: rank 0 says each in its node's log."""
    return sum(log.read_text(errors="replace").count("] resumed from memory: ")
               for log in (run_dir / "logs").glob("node*.log"))


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    memory = [f"checkpoint.memory.interval_steps={args.memory_interval_steps}",
              f"checkpoint.memory.replicas={args.memory_replicas}"]
    base = [f"dist.timeout_s={args.timeout_s}", f"checkpoint.interval_s={args.checkpoint_interval_s}",
            f"checkpoint.interval_steps={args.checkpoint_interval_steps}", *COMMON,
            *(IN_PROCESS if args.in_process else []), *memory]
    world = args.nodes * args.nproc_per_node

    calibration = root / "calibration"
    fresh_dir(calibration)
    if run_job(calibration, args.nodes, args.nproc_per_node, base + ["train.steps=120"], [], log) != 0:
        raise RuntimeError(f"calibration run failed; see {log}")
    rate = step_rate(calibration)
    steps = int(args.duration_s * rate)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    n_faults = int(args.duration_s // args.fault_every_s)
    draw = random.Random(args.seed)
    faults = [f"{kinds[i % len(kinds)]}@{int((i + draw.uniform(0.1, 0.9)) * args.fault_every_s * rate)}"
              f":rank={1 + i % (world - 1)}" for i in range(n_faults)]
    print(f"step rate {rate:.2f} steps/s -> {steps} steps; faults: {', '.join(faults)}", flush=True)

    soak = root / "soak"
    fresh_dir(soak)
    # Restart limits sized for a fault a minute: this run measures recovery, not the limits.
    code = run_job(soak, args.nodes, args.nproc_per_node, base + [f"train.steps={steps}"],
                   [f"--inject={f}" for f in faults] + ["--max-node-restarts=100"], log,
                   timeout_s=args.duration_s * 4)
    if code != 0:
        raise RuntimeError(f"the soak job failed with code {code}; see {log}")
    fault_free = root / "fault-free"
    fresh_dir(fault_free)
    if run_job(fault_free, args.nodes, args.nproc_per_node, base + [f"train.steps={steps}"], [], log,
               timeout_s=args.duration_s * 3) != 0:
        raise RuntimeError(f"the fault-free job failed; see {log}")

    summary = json.loads((soak / "summary.json").read_text())
    reference = json.loads((fault_free / "summary.json").read_text())
    by_kind: dict[str, list[float]] = {}
    for r in summary["recoveries"]:
        by_kind.setdefault(f"{r['kind']} ({r['layer']})", []).append(r["recovery_s"])
    results = {
        "nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "cpu_count": os.cpu_count(),
        "steps": steps, "step_rate_per_s": rate, "faults": faults, "seed": args.seed,
        "faults_recovered": len(summary["recoveries"]), "restarts": summary["restarts"],
        "goodput": summary["goodput"], "fault_free_goodput": reference["goodput"],
        "job_wall_s": summary["job_wall_s"], "fault_free_wall_s": reference["job_wall_s"],
        "recovery_s_median_by_kind": {k: statistics.median(v) for k, v in sorted(by_kind.items())},
        "lost_steps_total": sum(r["lost_steps"] for r in summary["recoveries"]),
        "bitwise_equal_to_fault_free": summary["params_sha256"] == reference["params_sha256"],
        "checkpoint_interval_s": args.checkpoint_interval_s,
        "checkpoint_interval_steps": args.checkpoint_interval_steps, "dist_timeout_s": args.timeout_s,
        "in_process": args.in_process, "memory_interval_steps": args.memory_interval_steps,
        "memory_replicas": args.memory_replicas, "restores_from_memory": restores_from_memory(soak),
    }
    print(f"goodput {results['goodput']:.3f} (fault-free run: {results['fault_free_goodput']:.3f}) over "
          f"{results['job_wall_s']:.0f} s; {results['faults_recovered']}/{len(faults)} faults recovered; "
          f"restarts {results['restarts']}; bitwise equal to fault-free: {results['bitwise_equal_to_fault_free']}")
    for kind, value in results["recovery_s_median_by_kind"].items():
        print(f"  {kind:<36} median recovery {value:.2f} s")
    write_results(results, args.out)
    ok = results["faults_recovered"] == len(faults) and results["bitwise_equal_to_fault_free"]
    return 0 if ok else 1
