"""Graceful stop on both NVRx lanes: SIGTERM to a node (the ``sigterm`` fault, as on eviction)
commits a checkpoint of the current step, the node exits 143, and the job resumes from it bitwise.

A node is the agent a pod runs, ``ft_launcher`` and two ranks (real processes, gloo), on the
pinned lane (NVRx 0.4.1) and on the image's (0.7, whose checkpoint writer installs its own SIGTERM
handler: the trainer starts it with SIGTERM blocked, so the SIGTERM ``ft_launcher`` sends each
rank's process group reaches the trainer only, and the writer finishes the final checkpoint).
"""

from __future__ import annotations

import json

import pytest

from tests.resilience.node import run_node
from tests.support import assert_no_leftovers, read_events, read_losses, read_summary

RUN = [
    "train.steps=12",
    "checkpoint.interval_steps=4",
    "train.log_every=4",
    "resilience.hang_detection.learn_timeouts=false",
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
]
# Extended tier: in CI, sigterm@10:node=0 (tests/resilience/test_faults.py, 0.4.1) and
# sigterm@18:node=0 (test_faults.py, one pod on each lane) cover a graceful stop on each lane.
pytestmark = pytest.mark.extended
LANES = ("pinned", "image")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fault-free")
    proc = run_node(run_dir, RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_summary(run_dir)["params_sha256"], read_losses(run_dir)


@pytest.mark.parametrize("lane", LANES)
def test_sigterm_commits_a_checkpoint_exits_143_and_the_job_resumes_bitwise(tmp_path, request, fault_free, lane):
    pythonpath = [request.getfixturevalue("nvrx_lane")] if lane == "image" else []
    run_dir = tmp_path / "run"
    stopped = run_node(run_dir, RUN, pythonpath=pythonpath, inject=["sigterm@6:rank=1"])
    out = stopped.stdout[-3000:] + stopped.stderr[-4000:]
    assert stopped.returncode == 143, out
    assert "stopped by SIGTERM" in stopped.stderr
    (stop,) = read_events(run_dir, "stop")
    assert stop["exit_code"] == 143 and stop["step"] >= 6
    final = run_dir / "checkpoints" / f"step_{stop['step']:08d}"
    manifest = json.loads((final / "COMPLETE").read_text())
    assert manifest["step"] == stop["step"]
    expected_nvrx = "0.7" if lane == "image" else "0.4"
    assert manifest["nvrx_version"].startswith(expected_nvrx), manifest["nvrx_version"]
    assert_no_leftovers(run_dir)

    resumed = run_node(run_dir, RUN, pythonpath=pythonpath)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = read_summary(run_dir)
    sha, losses = fault_free
    assert summary["resumed_from_step"] == stop["step"] and summary["final_step"] == 12
    assert summary["params_sha256"] == sha
    assert read_losses(run_dir) == losses
    assert_no_leftovers(run_dir)


def test_a_drain_the_chart_budget_lets_through_is_a_graceful_stop_with_a_checkpoint(tmp_path):
    """The chart's default PodDisruptionBudget admits one eviction of a running 2-pod job (none is
    unavailable before the drain); the eviction reaches the pod as the kubelet's SIGTERM (the
    ``sigterm`` fault), which commits the step it stopped at, and the job resumes from it: a drain
    before an AWS-initiated termination loses no work past that checkpoint."""
    from resilient_fsdp.deploy import chart
    from tests.support import REPO, run_local

    values = chart.load_values(
        [REPO / "values/dev-cpu.yaml"], ["nodes=2", "storage.type=existingClaim", "storage.existingClaim=local"]
    )
    budget = chart.render(values).find("PodDisruptionBudget")  # the budget resilient-fsdp local renders
    assert int(budget["spec"]["maxUnavailable"]) - 0 >= 1  # disruptionsAllowed with every pod ready
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=1, overrides=RUN, extra=["--inject", "sigterm@6:node=1"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    (recovery,) = summary["recoveries"]
    assert recovery["kind"] == "sigterm" and recovery["lost_steps"] == 0, recovery
    (stop,) = read_events(run_dir, "stop")  # the step whose loss all-reduce carried the request
    assert recovery["fault_step"] < stop["step"] == recovery["resumed_from_step"], (stop, recovery)
    assert (run_dir / "checkpoints" / f"step_{recovery['resumed_from_step']:08d}").is_dir()
    assert summary["final_step"] == 12
    assert_no_leftovers(run_dir)
