"""Escalation across the restart layers with limits above 0, in a real job (``resilient-fsdp local``,
one node of two ranks, gloo): each layer recovers faults until its budget is spent, then the one
below takes over; every restart is counted in ``summary.json`` and the job ends bitwise equal to
the fault-free one. With every budget spent the job fails naming the layer and the last fault."""

from __future__ import annotations

import pytest

from tests.support import assert_no_leftovers, read_losses, read_summary, run_local

STEPS = 16
COMMON = [
    f"train.steps={STEPS}",
    "checkpoint.interval_steps=2",
    "train.log_every=4",
    "resilience.hang_detection.learn_timeouts=false",
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    # In-process restart: one restart per process (the second fault spends it), then the in-job
    # restart (one per node), then the job level (one node restart).
    "resilience.in_process.enabled=true",
    "resilience.in_process.max_iterations=2",
    "resilience.launcher.max_restarts=1",
    # No fault here is a hang: long soft and hard timeouts keep a rank starved of CPU on a
    # loaded machine from spending the in-process budget before the faults do.
    "dist.timeout_s=8",
    "resilience.in_process.soft_timeout_s=60",
    "resilience.in_process.hard_timeout_s=100",
    "resilience.in_process.heartbeat_timeout_s=60",
    "resilience.in_process.barrier_timeout_s=180",
    "resilience.hang_detection.step_timeout_s=180",
]
# exception@4: in-process restart 1; exception@7: the process's in-process budget is spent, so the
# in-job restart takes it; sigkill@10: the node's in-job budget is spent, so ft_launcher gives up
# and the node exits 203, which the job level retries.
ESCALATING = ["exception@4:rank=1", "exception@7:rank=1", "sigkill@10:rank=1"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fault-free")
    proc = run_local(run_dir, nodes=1, nproc=2, overrides=COMMON, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return read_summary(run_dir), read_losses(run_dir)


# Extended tier, on both lanes: in CI, N7-in-process recovers 0.7's faults by every layer, and the
# test below spends every layer's budget on the pinned lane.
@pytest.mark.extended
@pytest.mark.parametrize("lane", ["pinned", "image"])
def test_faults_escalate_through_every_layer_and_the_job_ends_bitwise(tmp_path, request, fault_free, lane):
    """On both NVRx lanes (0.4.1 pinned, the image's 0.7: its in-process restart, ft_launcher and
    agent-hosted rendezvous store; one node, whose in-job budget is also 0.7's per-job count)."""
    baseline, losses = fault_free
    pythonpath = [request.getfixturevalue("nvrx_lane")] if lane == "image" else []
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        overrides=COMMON,
        extra=[f"--inject={s}" for s in ESCALATING] + ["--max-pod-recreations=1"],
        pythonpath=pythonpath,
        timeout=600,
    )
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "exited with code 203: recreating it" in proc.stdout, out
    summary = read_summary(run_dir)
    assert summary["nvrx_version"].startswith("0.7" if lane == "image" else "0.4"), summary["nvrx_version"]
    assert summary["restarts"] == {"in_process": 1, "in_job": 1, "job": 1}, out
    assert [r["layer"] for r in summary["recoveries"]] == ["in_process", "in_job", "job"], out
    assert summary["faults_injected"] == ESCALATING
    assert summary["final_step"] == STEPS and summary["params_sha256"] == baseline["params_sha256"]
    assert read_losses(run_dir) == losses
    assert_no_leftovers(run_dir)


def test_with_every_layer_spent_the_job_fails_naming_the_layer_and_the_last_fault(tmp_path):
    """The same faults with the job level spent at the first pod failure (a PyTorchJob with
    ``backoffLimit: 0``): the node's exit 203 ends the job."""
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        overrides=COMMON,
        extra=[f"--inject={s}" for s in ESCALATING] + ["--value=job.backoffLimit=0"],
        timeout=600,
    )
    assert proc.returncode == 203, proc.stdout[-6000:]
    report = proc.stdout.split("job FAILED", 1)[1]
    assert (
        "the job level gave up (the job fails, as backoffLimit: 0 makes it fail at the first pod failure): the "
        "pod exited 203 after its node's in-process restarts"
    ) in report, report
    assert "in-job restarts (trainer.resilience.launcher.max_restarts) were spent" in report, report
    assert "last fault: sigkill@10:rank=1 (injected after step 9)" in report
    assert not (run_dir / "summary.json").exists()
    assert_no_leftovers(run_dir)
