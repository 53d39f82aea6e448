"""``resilient-fsdp bench stragglers``: what finding slow ranks costs, how soon one is found, and
how long routing around it takes, on the local cluster (2 pods of one rank, the ``tiny`` preset).

- **Cost**: the same fault-free job with ``resilience.stragglers`` off and on (its defaults),
  alternated ``--repeats`` times: the median step of each job, and the ratio of the medians of
  the two sets; beside it, what the detector's reports cost the ranks (``report_cost_over_step``
  in ``summary.json``: a report's time spread over the steps it covers).
- **Found and routed around**: ``slow@--fault-step:rank=1:factor=--factor`` with one hot spare,
  memory snapshots every 2 steps with replicas and ``action=replace``: the steps and seconds from
  the fault to the straggler's naming, and from there to the first step trained with the spare
  (``route_around_s``), each job ending bitwise equal to the fault-free one.

Hot spares need NVRx 0.6 or newer on the path (the test lane's). Results: a table, and JSON with
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from .recovery import COMMON, fresh_dir, run_job
from .results import write_results

REPLACE = ["checkpoint.memory.interval_steps=2", "checkpoint.memory.replicas=1",
           "resilience.stragglers.action=replace"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stragglers", help="straggler detection's cost, time to find a slow rank, time to replace it",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/bench-stragglers", help="scratch directory for the jobs")
    p.add_argument("--steps", type=int, default=100, help="steps per job")
    p.add_argument("--repeats", type=int, default=3, help="jobs per setting")
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--factor", type=float, default=2.0, help="how many times as long the slow rank's steps take")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(bench=main)


def _steps(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if r.get("event") == "step"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    base = [f"train.steps={args.steps}", "checkpoint.interval_steps=20", "train.log_every=20", *COMMON,
            *args.overrides]
    results: dict = {"steps": args.steps, "repeats": args.repeats, "cpu_count": os.cpu_count(),
                     "overrides": list(args.overrides), "loadavg_start": os.getloadavg()}
    medians: dict[str, list[float]] = {"off": [], "on": []}
    report_cost: list[float] = []
    digest = None
    for i in range(args.repeats):
        for setting in ("off", "on"):
            run_dir = root / f"{setting}-{i}"
            fresh_dir(run_dir)
            flags = [f"resilience.stragglers.enabled={'true' if setting == 'on' else 'false'}"]
            if run_job(run_dir, 2, 1, base + flags, [], log) != 0:
                raise RuntimeError(f"the fault-free job with detection {setting} failed; see {log}")
            summary = _summary(run_dir)
            digest = digest or summary["params_sha256"]
            if summary["params_sha256"] != digest:
                raise RuntimeError(f"detection {setting} changed the job's parameters ({run_dir})")
            medians[setting].append(statistics.median(_steps(run_dir)[1:]))
            if setting == "on":
                report_cost.append(summary["straggler_detection"]["report_cost_over_step"])
            print(f"detection {setting:<3} job {i + 1}/{args.repeats}: median step {medians[setting][-1] * 1000:.1f} ms",
                  flush=True)
    results["cost"] = {"median_step_s_off": medians["off"], "median_step_s_on": medians["on"],
                       "step_on_over_off": statistics.median(medians["on"]) / statistics.median(medians["off"]),
                       "report_cost_over_step": statistics.median(report_cost)}
    found = []
    for i in range(args.repeats):
        run_dir = root / f"slow-{i}"
        fresh_dir(run_dir)
        fault = f"slow@{args.fault_step}:rank=1:factor={args.factor:g}"
        if run_job(run_dir, 2, 1, base + REPLACE + ["resilience.stragglers.enabled=true"],
                   [f"--inject={fault}", "--value=spares=1"], log) != 0:
            raise RuntimeError(f"the job with {fault} failed; see {log}")
        summary = _summary(run_dir)
        (straggler,) = summary["stragglers"]
        (fired,) = [json.loads(p.read_text()) for p in (run_dir / "faults").glob("slow@*.json")]
        sample = {"found_after_steps": straggler["found_at_step"] - args.fault_step,
                  "found_after_s": straggler["t_found"] - fired["t_fault"], "route_around_s": straggler["route_around_s"],
                  "replaced_by_pod": straggler["replaced_by"]["pod"], "restarts": summary["restarts"],
                  "bitwise_equal_to_fault_free": summary["params_sha256"] == digest, "score": straggler["score"]}
        found.append(sample)
        print(f"slow rank job {i + 1}/{args.repeats}: found {sample['found_after_steps']} steps "
              f"({sample['found_after_s']:.2f} s) after the fault, training with the spare "
              f"{sample['route_around_s']:.2f} s after that, bitwise {sample['bitwise_equal_to_fault_free']}",
              flush=True)
    results["slow"] = {"fault": f"slow@{args.fault_step}:rank=1:factor={args.factor:g}", "samples": found,
                       "found_after_steps_median": statistics.median(s["found_after_steps"] for s in found),
                       "found_after_s_median": statistics.median(s["found_after_s"] for s in found),
                       "route_around_s_median": statistics.median(s["route_around_s"] for s in found)}
    results["loadavg_end"] = os.getloadavg()
    c, s = results["cost"], results["slow"]
    print(f"detection cost: median step {c['step_on_over_off']:.3f}x with it on; reports "
          f"{c['report_cost_over_step']:.2%} of a step\n"
          f"slow rank: found {s['found_after_steps_median']:g} steps ({s['found_after_s_median']:.2f} s) after the "
          f"fault, training with the spare {s['route_around_s_median']:.2f} s later (medians of {args.repeats})")
    write_results(results, args.out)
    return 0 if all(x["bitwise_equal_to_fault_free"] for x in found) else 1
