"""In-process restart with every part of the memory tier on (snapshots every 2 steps, replicas on
the other pod): ten faults, ten restarts in the same processes. What an aborted attempt opened
(the replicas' gloo group and its connections, their helper threads) must go with it: each rank's
threads, open descriptors, TCP connections and child processes at the tenth restart's start are
what they were at the first's, and the job ends bitwise equal to the job without faults.

One thing can outlive an abort, and the rank counts it: a replica helper blocked on a message
gloo never completes (posted before the abort, on a pair its shutdown did not reach), holding its
side group until the group's timeout. On a loaded machine that happens at about one abort in
forty; such a rank's other figures then carry that group, so they are compared on the ranks that
hold none, and no rank may hold more than one."""

from __future__ import annotations

import pytest

from resilient_fsdp.goodput.advise import coverage_from_run

from tests.resilience.fault_jobs import IN_PROCESS, run_with_faults
from tests.support import read_events

RESTARTS = 10


@pytest.mark.timeout(900)
def test_ten_in_process_restarts_with_the_memory_tier_leave_nothing_behind(tmp_path, reference_1x2):
    specs = [f"exception@{3 * (i + 1)}:rank={i % 2}" for i in range(RESTARTS)]
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        specs,
        reference_1x2,
        nodes=2,
        nproc=1,
        timeout=800,
        overrides=[
            *IN_PROCESS,
            f"resilience.in_process.max_iterations={RESTARTS + 2}",
            "checkpoint.memory.interval_steps=2",
            "checkpoint.memory.replicas=1",
        ],
    )
    assert [r["layer"] for r in summary["recoveries"]] == ["in_process"] * RESTARTS, summary["_output"]
    # Each from the newest snapshot: memory every 2 steps, a durable checkpoint (committed a step or
    # two later) every 4.
    assert all(r["lost_steps"] <= 3 for r in summary["recoveries"]), summary["recoveries"]
    starts = [e for e in read_events(run_dir, "start") if e["layer"] == "in_process"]
    assert [e["attempt"] for e in starts] == list(range(1, RESTARTS + 1)), starts
    first, last = starts[0]["footprint"], starts[-1]["footprint"]
    figures = [e["footprint"] for e in starts]
    assert all(n <= 1 for f in figures for n in f["helpers_blocked"]), figures
    assert last["child_processes"] == first["child_processes"], figures
    clean = [r for r, n in enumerate(last["helpers_blocked"]) if n == 0]
    assert clean, figures
    for name in ("threads", "open_files", "tcp_connections"):
        assert [last[name][r] for r in clean] == [first[name][r] for r in clean], (name, figures)
    # Every restart restored from the pods' memory, the replicas' group working each time.
    assert summary["_stdout"].count("resumed from memory") >= RESTARTS, summary["_output"]
    # ... which is the memory tier's coverage as the advisor measures it from the run.
    assert coverage_from_run(run_dir) == (1.0, RESTARTS)
    # Replication never stopped: no record says so.
    assert not [e for e in read_events(run_dir, "memory_replication") if e["stopped_ranks"]]
