"""``resilient-fsdp bench soak``: a fault every minute for ten minutes, kinds mixed.

A fault-free calibration run measures the step rate; the soak job trains for ``--duration-s``
with one fault in every ``--fault-every-s`` window (:func:`draw_faults`), cycling through
``--kinds`` on the non-zero ranks; the same job without faults is the reference. Reported: the
soak job's goodput, every fault with the layer that recovered it and its recovery time, whether
the final parameters equal the fault-free run's bit for bit, and the restores from memory. Both
jobs checkpoint as the chart's defaults do; the memory tier's default 8 steps is about Daly's
interval for its few-millisecond save at a 60 s MTBF (sqrt(2 x 0.006 x 60) = 0.85 s).
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
COMMON = [
    "resilience.launcher.max_restarts=100",
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    "resilience.hang_detection.step_timeout_s=10",
    "resilience.hang_detection.learn_timeouts=false",
    "train.log_every=500",
]
IN_PROCESS = [
    "resilience.in_process.enabled=true",
    "resilience.hang_detection.step_timeout_s=60",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..config import FAULT_KINDS

    def fault_kinds(text: str) -> str:  # refused at parse time: a bad kind would fail the job minutes in
        unknown = [k.strip() for k in text.split(",") if k.strip() and k.strip() not in FAULT_KINDS]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, unknown))} is not a fault kind; the kinds are {', '.join(FAULT_KINDS)}"
            )
        return text

    def seed_list(text: str) -> str:
        try:
            parse_seeds(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, as 0,1,2 or 0-4") from None
        return text

    p = sub.add_parser(
        "soak", help="a fault every minute for ten minutes: goodput and exactness", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--run-dir", default="runs/bench-soak", help="scratch directory for the jobs")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=600.0, help="training time to soak (default 600)")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="one fault this often (default 60)")
    p.add_argument("--kinds", default=DEFAULT_KINDS, type=fault_kinds, help="comma-separated fault kinds, used in turn")
    p.add_argument("--seed", type=int, default=0, help="draws each fault's moment within its window (default 0)")
    p.add_argument(
        "--seeds",
        type=seed_list,
        help="several seeds, as 0,1,2 or 0-4: one soak job each, one calibration and one "
        "fault-free reference for all (the same steps); reports each and the lowest",
    )
    p.add_argument("--checkpoint-interval-s", type=float, default=5.0, help="checkpoint.interval_s")
    p.add_argument(
        "--checkpoint-interval-steps",
        type=int,
        default=0,
        help="checkpoint.interval_steps (default 0: the durable checkpoints follow --checkpoint-interval-s "
        "alone, not the dev-cpu values' 20 steps)",
    )
    p.add_argument("--timeout-s", type=float, default=2.0, help="dist.timeout_s (see bench recovery)")
    p.add_argument("--in-process", action="store_true", help="also turn in-process restart on")
    p.add_argument(
        "--memory-interval-steps",
        type=int,
        default=8,
        help="checkpoint.memory.interval_steps: the memory tier's interval (default 8; 0: off)",
    )
    p.add_argument(
        "--memory-replicas", type=int, default=1, choices=(0, 1), help="checkpoint.memory.replicas (default 1)"
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.set_defaults(bench=main)


def step_rate(run_dir: Path) -> float:
    """Steps per second of wall time over a run's steady state (past its first ten steps)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("event") == "step"][10:]
    return (len(steps) - 1) / (steps[-1]["t"] - steps[0]["t"])


def restores_from_memory(run_dir: Path) -> int:
    """Restarts whose ranks loaded the pods' memory snapshots: rank 0 says each in its node's log."""
    return sum(
        log.read_text(errors="replace").count("] resumed from memory: ") for log in (run_dir / "logs").glob("node*.log")
    )


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    memory = [
        f"checkpoint.memory.interval_steps={args.memory_interval_steps}",
        f"checkpoint.memory.replicas={args.memory_replicas}",
    ]
    base = [
        f"dist.timeout_s={args.timeout_s}",
        f"checkpoint.interval_s={args.checkpoint_interval_s}",
        f"checkpoint.interval_steps={args.checkpoint_interval_steps}",
        *COMMON,
        *(IN_PROCESS if args.in_process else []),
        *memory,
    ]

    calibration = root / "calibration"
    fresh_dir(calibration)
    if run_job(calibration, args.nodes, args.nproc_per_node, base + ["train.steps=120"], [], log) != 0:
        raise RuntimeError(f"calibration run failed; see {log}")
    rate = step_rate(calibration)
    steps = int(args.duration_s * rate)
    # One step count for every seed: the same job, so one fault-free run is every seed's reference.
    soaks = []
    for seed in seeds:
        faults = draw_faults(args, rate, seed)
        print(f"seed {seed}: step rate {rate:.2f} steps/s -> {steps} steps; faults: {', '.join(faults)}", flush=True)
        soak = root / ("soak" if len(seeds) == 1 else f"soak-seed-{seed}")
        fresh_dir(soak)
        # Restart limits sized for a fault a minute: this run measures recovery, not the limits.
        code = run_job(
            soak,
            args.nodes,
            args.nproc_per_node,
            base + [f"train.steps={steps}"],
            [f"--inject={f}" for f in faults] + ["--max-pod-recreations=100"],
            log,
            timeout_s=args.duration_s * 4,
        )
        if code != 0:
            raise RuntimeError(f"the soak job of seed {seed} failed with code {code}; see {log}")
        soaks.append((seed, faults, soak))
    fault_free = root / "fault-free"
    fresh_dir(fault_free)
    if (
        run_job(
            fault_free,
            args.nodes,
            args.nproc_per_node,
            base + [f"train.steps={steps}"],
            [],
            log,
            timeout_s=args.duration_s * 3,
        )
        != 0
    ):
        raise RuntimeError(f"the fault-free job failed; see {log}")
    reference = json.loads((fault_free / "summary.json").read_text())

    per_seed = [seed_results(seed, faults, soak, reference) for seed, faults, soak in soaks]
    results = {
        "nodes": args.nodes,
        "nproc_per_node": args.nproc_per_node,
        "cpu_count": os.cpu_count(),
        "steps": steps,
        "step_rate_per_s": rate,
        "fault_free_goodput": reference["goodput"],
        "fault_free_wall_s": reference["job_wall_s"],
        "checkpoint_interval_s": args.checkpoint_interval_s,
        "checkpoint_interval_steps": args.checkpoint_interval_steps,
        "dist_timeout_s": args.timeout_s,
        "in_process": args.in_process,
        "memory_interval_steps": args.memory_interval_steps,
        "memory_replicas": args.memory_replicas,
    }
    if len(per_seed) == 1:
        results.update(per_seed[0])
    else:
        results["seeds"] = per_seed
        results["goodput_min"] = min(r["goodput"] for r in per_seed)
    for r in per_seed:
        print(
            f"seed {r['seed']}: goodput {r['goodput']:.3f} (fault-free run: {reference['goodput']:.3f}) over "
            f"{r['job_wall_s']:.0f} s; {r['faults_recovered']}/{len(r['faults'])} faults recovered; "
            f"restarts {r['restarts']}; bitwise equal to fault-free: {r['bitwise_equal_to_fault_free']}"
        )
        for kind, value in r["recovery_s_median_by_kind"].items():
            print(f"  {kind:<36} median recovery {value:.2f} s")
    if len(per_seed) > 1:
        print(f"lowest goodput over seeds {', '.join(str(s) for s in seeds)}: {results['goodput_min']:.3f}")
    write_results(results, args.out)
    ok = all(r["faults_recovered"] == len(r["faults"]) and r["bitwise_equal_to_fault_free"] for r in per_seed)
    return 0 if ok else 1


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``0,1,2`` or a range ``0-4``."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            seeds += list(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give whole numbers, as 0,1,2 or 0-4") from None
    return seeds


def draw_faults(args: argparse.Namespace, rate: float, seed: int) -> list[str]:
    """One fault in each ``--fault-every-s`` window at a moment drawn with ``seed``, kinds in turn.

    Between a tenth and nine tenths of the window, at the step the rate predicts: faults at a fixed
    point of each window would meet every checkpoint interval that divides the window at the same
    phase each time (the worst, or the best).
    """
    world = args.nodes * args.nproc_per_node
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    n_faults = int(args.duration_s // args.fault_every_s)
    draw = random.Random(seed)
    return [
        f"{kinds[i % len(kinds)]}@{int((i + draw.uniform(0.1, 0.9)) * args.fault_every_s * rate)}"
        f":rank={1 + i % (world - 1)}"
        for i in range(n_faults)
    ]


def seed_results(seed: int, faults: list[str], soak: Path, reference: dict) -> dict:
    summary = json.loads((soak / "summary.json").read_text())
    by_kind: dict[str, list[float]] = {}
    for r in summary["recoveries"]:
        by_kind.setdefault(f"{r['kind']} ({r['layer']})", []).append(r["recovery_s"])
    return {
        "seed": seed,
        "faults": faults,
        "faults_recovered": len(summary["recoveries"]),
        "restarts": summary["restarts"],
        "goodput": summary["goodput"],
        "job_wall_s": summary["job_wall_s"],
        "recovery_s_median_by_kind": {k: statistics.median(v) for k, v in sorted(by_kind.items())},
        "recoveries": [
            {k: r[k] for k in ("fault", "layer", "recovery_s", "lost_steps", "resumed_from_step")}
            for r in summary["recoveries"]
        ],
        "lost_steps_total": sum(r["lost_steps"] for r in summary["recoveries"]),
        "bitwise_equal_to_fault_free": summary["params_sha256"] == reference["params_sha256"],
        "restores_from_memory": restores_from_memory(soak),
    }
