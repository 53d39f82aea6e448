"""``resilient-fsdp bench slow-and-silent``: what finding slow ranks and silent corruption costs,
how soon each is found, and how long routing around it takes, on the local cluster (the ``tiny``
preset).

Two parts, each a cost and a found-and-recovered measurement: slow ranks (:func:`stragglers`)
and silent corruption (:func:`silent_corruption`). Hot spares need NVRx 0.6 or newer on the path
(the test lane's). Results: a table, and JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

from ..config.sections import StragglersConfig
from .recovery import COMMON, fresh_dir, run_job
from .results import write_results

# A report every 10 steps for the fault (a job of these steps lasts seconds, the default cadence a
# minute): the time to find one is then 2 reports' steps.
REPLACE = [
    "checkpoint.memory.interval_steps=2",
    "checkpoint.memory.replicas=1",
    "resilience.stragglers.action=replace",
    "resilience.stragglers.report_every_steps=10",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "slow-and-silent",
        help="what finding slow ranks and silent corruption costs, how soon "
        "each is found, how long routing around it takes",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--run-dir", default="runs/bench-slow-and-silent", help="scratch directory for the jobs")
    p.add_argument("--steps", type=int, default=100, help="steps per job")
    p.add_argument("--repeats", type=int, default=3, help="jobs per setting")
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--factor", type=float, default=2.0, help="how many times as long the slow rank's steps take")
    p.add_argument("--sdc-interval", type=int, default=10, help="steps between replica checks")
    p.add_argument("--flip-step", type=int, default=12)
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(bench=main)


def _steps(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if r.get("event") == "step"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _paired_cost(
    root: Path, name: str, args: argparse.Namespace, nodes: int, nproc: int, base: list[str], on: list[str], log: Path
) -> tuple[dict, list[dict]]:
    """Fault-free jobs with ``on`` off and on, alternated ``--repeats`` times: the medians of their
    steps, the ratio of the medians, and each job's summary (all must end with one digest)."""
    medians: dict[str, list[float]] = {"off": [], "on": []}
    summaries: list[dict] = []
    for i in range(args.repeats):
        for setting in ("off", "on"):
            run_dir = root / f"{name}-{setting}-{i}"
            fresh_dir(run_dir)
            if run_job(run_dir, nodes, nproc, base + (on if setting == "on" else []), [], log) != 0:
                raise RuntimeError(f"the fault-free {name} job ({setting}) failed; see {log}")
            summary = _summary(run_dir)
            if summaries and summary["params_sha256"] != summaries[0]["params_sha256"]:
                raise RuntimeError(f"{name} {setting} changed the job's parameters ({run_dir})")
            summaries.append(summary)
            medians[setting].append(statistics.median(_steps(run_dir)[1:]))
            print(
                f"{name} {setting:<3} job {i + 1}/{args.repeats}: median step {medians[setting][-1] * 1000:.1f} ms",
                flush=True,
            )
    return {
        "median_step_s_off": medians["off"],
        "median_step_s_on": medians["on"],
        "step_on_over_off": statistics.median(medians["on"]) / statistics.median(medians["off"]),
    }, summaries


def _faulty_runs(
    root: Path,
    name: str,
    args: argparse.Namespace,
    nodes: int,
    nproc: int,
    overrides: list[str],
    flags: list[str],
    log: Path,
    digest: str,
    sample_of,
) -> list[dict]:
    """``--repeats`` jobs with ``flags`` (the fault); ``sample_of(run_dir, summary)`` reads each."""
    samples = []
    for i in range(args.repeats):
        run_dir = root / f"{name}-{i}"
        fresh_dir(run_dir)
        if run_job(run_dir, nodes, nproc, overrides, flags, log) != 0:
            raise RuntimeError(f"the job with {' '.join(flags)} failed; see {log}")
        summary = _summary(run_dir)
        sample = {
            **sample_of(run_dir, summary),
            "restarts": summary["restarts"],
            "bitwise_equal_to_fault_free": summary["params_sha256"] == digest,
        }
        samples.append(sample)
        print(f"{name} job {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v}" for k, v in sample.items()), flush=True)
    return samples


def _first_step_after(run_dir: Path, t: float) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return min(r["t"] for r in records if r.get("event") == "step" and r.get("t", 0) > t)


def stragglers(root: Path, args: argparse.Namespace, log: Path) -> dict:
    """2 pods of one rank. Cost: the fault-free job with ``resilience.stragglers`` off and on,
    alternated ``--repeats`` times (the ratio of median steps), and a report's time over its cadence.
    Found and routed around: ``slow@--fault-step:rank=1`` with one hot spare, memory snapshots with
    replicas and ``action=replace``: the time to the straggler's naming, and from there to the first
    step trained with the spare (``route_around_s``), each job bitwise equal to the fault-free one.
    """
    base = [f"train.steps={args.steps}", "checkpoint.interval_steps=20", "train.log_every=20", *COMMON, *args.overrides]
    cost, summaries = _paired_cost(root, "stragglers", args, 2, 1, base, ["resilience.stragglers.enabled=true"], log)
    # The default cadence is in seconds: a report's share of the training time is its time over it.
    cost["report_s_median"] = statistics.median(
        x["straggler_detection"]["report_s_median"] for x in summaries if x.get("straggler_detection")
    )
    cost["report_every_s"] = StragglersConfig().report_every_s
    cost["report_cost_over_step"] = cost["report_s_median"] / cost["report_every_s"]
    fault = f"slow@{args.fault_step}:rank=1:factor={args.factor:g}"

    def sample_of(run_dir: Path, summary: dict) -> dict:
        (straggler,) = summary["stragglers"]
        (fired,) = [json.loads(p.read_text()) for p in (run_dir / "faults").glob("slow@*.json")]
        return {
            "found_after_steps": straggler["found_at_step"] - args.fault_step,
            "found_after_s": straggler["t_found"] - fired["t_fault"],
            "route_around_s": straggler["route_around_s"],
            "replaced_by_pod": straggler["replaced_by"]["pod"],
            "score": straggler["score"],
        }

    found = _faulty_runs(
        root,
        "slow",
        args,
        2,
        1,
        base + REPLACE + ["resilience.stragglers.enabled=true"],
        [f"--inject={fault}", "--value=spares=1"],
        log,
        summaries[0]["params_sha256"],
        sample_of,
    )
    return {
        "cost": cost,
        "fault": fault,
        "samples": found,
        "found_after_steps_median": statistics.median(s["found_after_steps"] for s in found),
        "found_after_s_median": statistics.median(s["found_after_s"] for s in found),
        "route_around_s_median": statistics.median(s["route_around_s"] for s in found),
    }


def silent_corruption(root: Path, args: argparse.Namespace, log: Path) -> dict:
    """1 pod of 4 ranks, HSDP in shard groups of 2. Cost: the fault-free job with replica checks off
    and on (every ``--sdc-interval`` steps), the ratio of median steps and the checks' own time.
    Found and rolled back: ``bitflip@--flip-step:rank=1``: the time to the mismatch, and from there
    to the first step trained again, each job bitwise equal to the fault-free one.
    """
    base = [
        f"train.steps={args.steps}",
        "checkpoint.interval_steps=20",
        "train.log_every=20",
        "dist.shard_group_size=2",
        "checkpoint.memory.interval_steps=2",
        *COMMON,
        *args.overrides,
    ]
    checks = [f"resilience.sdc.interval_steps={args.sdc_interval}"]
    cost, summaries = _paired_cost(root, "sdc", args, 1, 4, base, checks, log)
    on = [x["replica_checks"] for x in summaries if x.get("replica_checks")]
    step_on = statistics.median(cost["median_step_s_on"])
    cost["check_s_median"] = statistics.median(x["check_s_median"] for x in on)
    cost["check_cost_over_step"] = cost["check_s_median"] / args.sdc_interval / step_on

    def sample_of(run_dir: Path, summary: dict) -> dict:
        (mismatch,) = summary["silent_corruption"]
        (fired,) = [json.loads(p.read_text()) for p in (run_dir / "faults").glob("bitflip@*.json")]
        return {
            "found_after_steps": mismatch["step"] - args.flip_step,
            "found_after_s": mismatch["t_detected"] - fired["t_fault"],
            "rolled_back_to_step": mismatch["last_pass_step"],
            "training_again_after_s": _first_step_after(run_dir, mismatch["t_detected"]) - mismatch["t_detected"],
        }

    found = _faulty_runs(
        root,
        "flip",
        args,
        1,
        4,
        base + checks,
        [f"--inject=bitflip@{args.flip_step}:rank=1"],
        log,
        summaries[0]["params_sha256"],
        sample_of,
    )
    return {
        "cost": cost,
        "fault": f"bitflip@{args.flip_step}:rank=1",
        "interval_steps": args.sdc_interval,
        "samples": found,
        "found_after_steps_median": statistics.median(s["found_after_steps"] for s in found),
        "found_after_s_median": statistics.median(s["found_after_s"] for s in found),
        "training_again_after_s_median": statistics.median(s["training_again_after_s"] for s in found),
    }


def refused(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the flags, named with the fix; None when they can run."""
    if args.repeats < 1:
        return f"--repeats {args.repeats}: give 1 or more jobs per setting"
    if not args.factor > 1:
        return f"--factor {args.factor:g}: give a number above 1 (2: the slow rank's steps take twice as long)"
    if args.sdc_interval < 1:
        return f"--sdc-interval {args.sdc_interval}: give 1 or more steps between replica checks"
    last = max(args.fault_step + 30, args.flip_step + 2 * args.sdc_interval)
    if args.fault_step < 1 or args.flip_step < 1 or args.steps < last:
        return (
            f"--steps {args.steps} leaves no room to find the faults: give at least {last} (the slow rank needs "
            "3 reports of 10 steps after --fault-step, the flip 2 checks after --flip-step), or earlier steps"
        )
    return None


def main(args: argparse.Namespace) -> int:
    problem = refused(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    results: dict = {
        "steps": args.steps,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "overrides": list(args.overrides),
        "loadavg_start": os.getloadavg(),
    }
    results["stragglers"] = stragglers(root, args, log)
    results["silent_corruption"] = silent_corruption(root, args, log)
    results["loadavg_end"] = os.getloadavg()
    s, c = results["stragglers"], results["silent_corruption"]
    print(
        f"straggler detection: median step {s['cost']['step_on_over_off']:.3f}x with it on; reports "
        f"{s['cost']['report_cost_over_step']:.2%} of a step; a slow rank found "
        f"{s['found_after_steps_median']:g} steps ({s['found_after_s_median']:.2f} s) after the fault, training with "
        f"the spare {s['route_around_s_median']:.2f} s later\n"
        f"replica checks every {c['interval_steps']} steps: median step {c['cost']['step_on_over_off']:.3f}x with "
        f"them on; checks {c['cost']['check_cost_over_step']:.2%} of a step; a flipped bit found "
        f"{c['found_after_steps_median']:g} steps ({c['found_after_s_median']:.2f} s) after it, training again "
        f"{c['training_again_after_s_median']:.2f} s later (medians of {args.repeats})"
    )
    write_results(results, args.out)
    samples = s["samples"] + c["samples"]
    return 0 if all(x["bitwise_equal_to_fault_free"] for x in samples) else 1
