"""Slow ranks (``resilience.stragglers``): NVRx's straggler detector, driven on real ranks (gloo),
finds a rank made slow by the ``slow`` fault, and a hot spare takes its node's place in an in-job
restart on the local cluster, at the same world size, bitwise equal to the job without the fault.
On CPU the detector times sections only (no CUDA kernels to profile: the adapter says so)."""

from __future__ import annotations

import math

import pytest

from resilient_fsdp.config import ConfigError, parse_fault
from resilient_fsdp.resilience.stragglers import NOT_REPLACED, slow_ranks
from tests.checkpoint.test_memory_tier import MEMORY
from tests.resilience.fault_jobs import STEPS, lane_run, run_with_faults
from tests.support import LANES, netns_required, read_events

DETECT = [
    "resilience.stragglers.enabled=true",
    "resilience.stragglers.report_every_steps=5",
    "resilience.stragglers.consecutive_reports=2",
]


def test_a_slow_fault_names_its_factor_and_only_slow_takes_one():
    spec = parse_fault("slow@10:rank=1:factor=2.5")
    assert (spec.kind, spec.step, spec.rank, spec.factor) == ("slow", 10, 1, 2.5)
    assert str(spec) == "slow@10:rank=1:factor=2.5" and parse_fault(str(spec)) == spec
    assert parse_fault("slow@3").factor is None  # twice as long by default
    with pytest.raises(ConfigError, match="factor=F applies to slow only"):
        parse_fault("hang@3:factor=2")
    with pytest.raises(ConfigError, match="factor= must be a number above 1"):
        parse_fault("slow@3:factor=1")


def test_a_rank_is_slow_when_its_score_is_low_and_its_part_costs_the_step_something():
    scores = {"optimizer": {0: 1.0, 1: 0.4, 2: 0.5}, "forward_backward": {0: 1.0, 1: 0.99, 2: 1.0}}
    # Seconds each rank's part takes beyond the fastest rank's: rank 2's is low-scored but tiny.
    excess = {"optimizer": {0: 0.0, 1: 0.15, 2: 0.001}, "forward_backward": {0: 0.0, 1: 0.0, 2: 0.0}}
    assert slow_ranks(scores, excess, {}, threshold=0.75, min_excess_s=0.01) == {1: ("optimizer", 0.4)}
    # Kernel scores (a GPU) are judged by the threshold alone; NaN (no kernels) never is.
    assert slow_ranks({}, {}, {0: 1.0, 3: 0.6, 4: math.nan}, 0.75, 0.01) == {3: ("kernels", 0.6)}
    # The lowest of a rank's parts is the one named.
    both = slow_ranks({"optimizer": {1: 0.5}}, {"optimizer": {1: 1.0}}, {1: 0.3}, 0.75, 0.01)
    assert both == {1: ("kernels", 0.3)}


@pytest.mark.parametrize("lane", LANES)
def test_a_slow_rank_is_reported_on_one_pod_and_training_goes_on_bitwise(tmp_path, request, reference_1x2, lane):
    """One pod of 2 ranks, no spare: the straggler is named (``action=replace`` has nothing to
    replace it with, and says so), the job never restarts, and its numbers are those of the job
    without the fault: a slow rank changes when, not what. NVRx's detector on either version."""
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["slow@10:rank=1:factor=3"],
        reference_1x2,
        nodes=1,
        nproc=2,
        overrides=[*DETECT, "resilience.stragglers.action=replace"],
        **lane_run(request, lane),
    )
    assert summary["recoveries"] == [] and sum(summary["restarts"].values()) == 0, summary["_output"]
    (found,) = summary["stragglers"]
    assert found["rank"] == 1 and found["part"] == "optimizer" and found["score"] < 0.75, found
    assert found["action"] == "reported" and found["not_replaced"] == NOT_REPLACED[2], found
    assert 10 < found["found_at_step"] <= 10 + 2 * 5 + 5, found  # two reports in a row after the fault
    assert "straggler: rank 1 (pod 0" in summary["_stdout"]
    detection = summary["straggler_detection"]
    assert detection["reports"] == STEPS // 5 and detection["kernels"] == "no GPU: section timings only"
    assert 0 < detection["report_cost_over_step"] < 0.5, detection
    reports = read_events(run_dir, "straggler_report")
    assert len(reports) == STEPS // 5 and all("1" in r["slowest"] for r in reports)
    # Before the fault no rank was slow; from two reports after it on, rank 1 always was.
    assert not reports[0]["slow"] and all(r["slow"].get("1", {}).get("part") == "optimizer" for r in reports[3:])


def test_a_straggler_is_replaced_by_the_hot_spare_within_an_in_job_restart_bitwise(tmp_path, request, reference_1x2):
    """Two training pods of one rank and one spare, memory snapshots every 2 steps with replicas:
    rank 1 is made twice as slow at step 10, found within 20 steps, and its pod leaves the job;
    the spare takes rank 1 in an in-job restart (no job-level restart), restored from the replica
    pod 0 keeps, and the job ends bitwise equal to the fault-free one at the same world size.
    The spare, made slow in turn at step 25, is reported, not replaced: NVRx's rendezvous admits
    one node left out per spare, and a second would end the job."""
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["slow@10:rank=1:factor=2", "slow@25:rank=1:factor=2"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1", *DETECT, "resilience.stragglers.action=replace"],
        extra=["--value=spares=1"],
        timeout=400,
        **lane_run(request, "image"),
    )
    out = summary["_output"]
    assert summary["restarts"]["job"] == 0 and summary["restarts"]["in_job"] == 1, out
    assert summary["recoveries"] == [], out  # a slow rank stops nothing: no fault to recover from
    found, again = summary["stragglers"]
    assert again["rank"] == 1 and again["action"] == "reported" and again["not_replaced"] == NOT_REPLACED[4], again
    assert again["pod"] == found["replaced_by"]["pod"] and 25 < again["found_at_step"] <= STEPS, again
    assert found["rank"] == 1 and found["action"] == "replaced" and found["found_at_step"] <= 10 + 20, found
    assert found["replaced_by"]["pod"] != found["pod"] and found["replaced_by"]["pod"] != 0, found
    assert 0 < found["route_around_s"] < 120 and found["resumed_from_step"] >= found["found_at_step"] - 2, found
    assert "1 rank(s) from the replica a peer keeps" in summary["_stdout"], out
    assert summary["world_size"] == 2 and {r.get("world_size") for r in read_events(run_dir, "start")} == {2}
    assert [e["rank"] for e in read_events(run_dir, "straggler_replaced")] == [1]
    # The slow pod's launcher failed its node as unhealthy, and it did not join again.
    slow_log = (run_dir / "logs" / f"node{found['pod']}.log").read_text()
    assert "asked ft_launcher to leave this node out of the next rendezvous" in slow_log


def test_a_straggler_on_the_store_hosts_pod_is_reported_not_replaced(tmp_path, request, reference_1x2):
    """Rank 0 runs on pod 0, whose agent hosts the rendezvous store: its leaving would restart the
    whole job, so a straggler there is reported with that reason, spare or not, and the job trains
    on without a restart, bitwise."""
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["slow@10:rank=0:factor=3"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1", *DETECT, "resilience.stragglers.action=replace"],
        extra=["--value=spares=1"],
        timeout=400,
        **lane_run(request, "image"),
    )
    assert sum(summary["restarts"].values()) == 0, summary["_output"]
    (found,) = summary["stragglers"]
    assert (found["rank"], found["pod"], found["action"]) == (0, 0, "reported"), found
    assert found["not_replaced"] == NOT_REPLACED[3], found


@pytest.mark.parametrize("lane", LANES)
def test_a_gpu_node_without_cuptis_library_times_sections_and_says_why(request, lane):
    """NVRx's CUPTI extension loads CUDA's profiling library when the detector starts; on a GPU node
    without it (this machine has no libcupti either) the detector falls back to section timings
    and names what did not load, on either NVRx version."""
    import subprocess
    import sys

    from tests.support import _env, lane_path

    code = (
        "from resilient_fsdp.resilience.straggler_detector import StragglerDetector\n"
        "d = StragglerDetector(cuda=True, node_name='n')\n"
        "print(repr((d.profile_cuda, d.kernels)))\n"
        "d.close()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(lane_path(request, lane))
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    profile, kernels = eval(proc.stdout.strip().splitlines()[-1])
    assert (
        profile is False
        and kernels.startswith("NVRx's CUPTI extension did not load (")
        and kernels.endswith("): section timings only")
    ), kernels
