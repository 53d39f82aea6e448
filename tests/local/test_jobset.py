"""Job-level restarts as a cluster runs them, on the one-machine cluster (pods as network
namespaces whose names resolve through the run's cluster DNS, NVRx 0.4.1): one event costs at most
one counted pod failure, the store host is pod 0, node ranks follow the pod index, pods that start
apart still meet, and a finished run ends 0 whatever order its nodes finish in.

``node-loss@STEP:node=0`` takes the store host's pod with every process in it. The lost pod carries
``DisruptionTarget``, so its Job's podFailurePolicy ignores it; every other pod's agent sees its
launcher lose the store and joins again in its pod (nothing exits, nothing is counted), and the
recreated pod 0 hosts a new store that they join."""

from __future__ import annotations

import re

import pytest

from tests.resilience.fault_jobs import COMMON, check_recoveries, lane_run, run_with_faults
from tests.support import assert_no_leftovers, netns_required, run_local

JOBSET = ["--value=workload.kind=JobSet"]
NODES = 4


def node_logs(run_dir) -> list[str]:
    return [(run_dir / "logs" / f"node{i}.log").read_text() for i in range(NODES)]


# Extended: the CI-sized campaign (tests/bench/test_campaign.py) loses a 4-pod JobSet's store host
# twice in CI; the late pod 0 and the node-rank checks are this test's own.
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_a_jobset_survives_two_store_host_losses_and_a_late_pod_0_counting_nothing(tmp_path, reference_2x2):
    """The JobSet of the done-when: ``job.backoffLimit=2`` and ``workload.jobSet.maxRestarts=0``, so
    three counted pod failures, or any whole-JobSet restart, would end it. Pod 0 starts 90 s after
    the others (an image pull on a fresh node): their store connect wait follows the join timeout,
    so they wait for it instead of failing. Four pods x one rank trains what 2 x 2 trains, bitwise."""
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["node-loss@10:node=0", "node-loss@26:node=0"],
        reference_2x2,
        nodes=NODES,
        nproc=1,
        timeout=540,
        extra=JOBSET
        + ["--value=job.backoffLimit=2", "--value=workload.jobSet.maxRestarts=0", "--pod-start-delay=0=90"],
    )
    out = summary["_stdout"]
    check_recoveries(summary, ["job", "job"])
    assert (
        out.count(
            "resilient-fsdp-node-0-0 was lost (its processes were killed): ignored by Job "
            "resilient-fsdp-node-0's podFailurePolicy (not counted: DisruptionTarget"
        )
        == 2
    )
    assert "counted by Job" not in out and "RestartJobSet" not in out and "recreation 3" not in out
    for index, log in enumerate(node_logs(run_dir)):
        hosts = "hosts" if index == 0 else "joins"
        # The node rank and the store host come from the pod's index, not from name matching.
        assert (
            f"[resilient-fsdp agent] node {index} of the job (GROUP_RANK={index}); {hosts} the rendezvous store" in log
        )
        ranks = set(re.findall(r"\] rank (\d+) of 4: node (\d+), local rank 0, \d+ CPU threads?, host (\S+)", log))
        assert ranks == {(str(index), str(index), f"resilient-fsdp-node-0-{index}")}, ranks
        joins = re.findall(
            r"ft_launcher ended \(200: rendezvous-store-lost\), which another node's failure causes; "
            r"joining again in this pod, not counted",
            log,
        )
        # Once per loss of the store host, never for the late start (the connect wait covered it).
        assert len(joins) == (0 if index == 0 else 2), (index, log[-3000:])


@pytest.mark.extended
@pytest.mark.timeout(360)
def test_a_pytorchjob_recovers_a_store_host_loss_with_the_other_pod_joining_again(tmp_path, reference_2x2):
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(run_dir, ["node-loss@10:node=0"], reference_2x2, timeout=300)
    out = summary["_stdout"]
    check_recoveries(summary, ["job"])
    assert "resilient-fsdp-master-0 was lost (its processes were killed): recreating it" in out
    assert "resilient-fsdp-worker-0 exited with code" not in out  # it joined again in its pod
    assert "joining again in this pod" in (run_dir / "logs" / "node1.log").read_text()


@pytest.mark.extended
@pytest.mark.timeout(240)
def test_a_jobset_whose_restart_budget_is_spent_fails_naming_the_reason(tmp_path):
    """One event, one count: a rank killed with no in-job restart left ends the store host's pod
    (203, counted: 1 > backoffLimit 0); the JobSet may not restart, so it fails."""
    netns_required()
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=1,
        overrides=COMMON[1:] + ["train.steps=6", "resilience.launcher.max_restarts=0"],
        timeout=200,
        extra=JOBSET
        + ["--value=job.backoffLimit=0", "--value=workload.jobSet.maxRestarts=0", "--inject=sigkill@3:rank=1"],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "resilient-fsdp-node-0-0 exited with code 203" in out, out[-4000:]
    assert "(BackoffLimitExceeded: 1 counted pod failures, past backoffLimit: 0)" in out, out[-4000:]
    assert (
        "JobSet failurePolicy rule podFailureBudgetSpent: RestartJobSet, but 0 of maxRestarts: 0 are spent: "
        "the JobSet fails (ReachedMaxRestarts)"
    ) in out, out[-4000:]
    assert "job FAILED" in out
    assert_no_leftovers(run_dir)


@pytest.mark.extended
@pytest.mark.timeout(900)
def test_a_node_that_finishes_after_the_store_host_is_gone_exits_0(tmp_path, request):
    """NVRx 0.7 (the image's): the store host waits for the other agents at most 300 s (torch
    elastic's exit barrier), then exits. A node whose ranks finish later (a slow final upload)
    then fails ft_launcher's own shutdown, which writes to the store; its agent sees that every
    rank of the node finished and exits 0, so the job ends done, not with a recreated pod that
    never finds a store."""
    netns_required()
    run_dir = tmp_path / "run"
    lane = lane_run(request, "image")
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=1,
        overrides=COMMON[1:] + ["train.steps=8"],
        timeout=840,
        pythonpath=lane["pythonpath"],
        extra=JOBSET + ["--inject=slow-exit@8:node=1:for=320"],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "job finished: every pod exited 0" in out
    late = (run_dir / "logs" / "node1.log").read_text()
    assert "slow-exit: exiting in 320 s" in late
    assert "every rank of this node finished training; ft_launcher's shutdown exited 1" in late, late[-3000:]
    assert_no_leftovers(run_dir)
