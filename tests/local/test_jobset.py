"""The same faulted job as a PyTorchJob and as a JobSet, on the one-machine cluster (pods as network
namespaces, NVRx 0.4.1), each ending bitwise equal to the fault-free run; and a JobSet whose
restart budget is spent fails, naming the reason.

``node-loss@10:node=0`` takes the store host's pod with every process in it. As a PyTorchJob
(``restartPolicy: ExitCode``) the lost pod and the other pod, whose agent lost the store and exits
200, are each recreated. As a JobSet with ``job.backoffLimit=0`` the lost pod is ignored by the
Job's podFailurePolicy (DisruptionTarget) and recreated, the other pod's exit is counted, which
fails the Job (BackoffLimitExceeded), and the JobSet's rule restarts it: every pod recreated."""

from __future__ import annotations

import pytest

from tests.resilience.fault_jobs import COMMON, check_recoveries, run_with_faults
from tests.support import assert_no_leftovers, netns_required, run_local

JOBSET = ["--value=workload.kind=JobSet", "--value=job.backoffLimit=0"]


@pytest.mark.timeout(360)
# A PyTorchJob's store-host loss is also node-loss@12:node=0 of the field faults (in CI under 0.7).
@pytest.mark.parametrize("kind", [pytest.param("PyTorchJob", marks=pytest.mark.extended), "JobSet"])
def test_node_loss_of_the_store_host_is_recovered_bitwise_by_each_kinds_controller(tmp_path, reference_2x2, kind):
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(run_dir, ["node-loss@10:node=0"], reference_2x2, timeout=300,
                              extra=JOBSET if kind == "JobSet" else [])
    out = summary["_stdout"]
    # One recovery, by the job level, from step 8's checkpoint (or step 4's when step 8's
    # asynchronous write had not committed yet), the steps after it trained again.
    check_recoveries(summary, ["job"])
    assert f"pod(s) x 2 rank(s): {kind} resilient-fsdp" in out
    if kind == "PyTorchJob":
        assert "resilient-fsdp-master-0 was lost (its processes were killed): recreating it" in out
    else:
        assert ("resilient-fsdp-node-0-0 was lost (its processes were killed): ignored by Job resilient-fsdp-node-0's "
                "podFailurePolicy (not counted: DisruptionTarget") in out
        assert ("failed (BackoffLimitExceeded: 1 counted pod failures, past backoffLimit: 0); JobSet failurePolicy "
                "rule podFailureBudgetSpent: RestartJobSet: every pod of every Job is deleted and created again "
                "(restart 1 of maxRestarts: 1)") in out


@pytest.mark.extended
@pytest.mark.timeout(240)
def test_a_jobset_whose_restart_budget_is_spent_fails_naming_the_reason(tmp_path):
    netns_required()
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=1, overrides=COMMON[1:] + ["train.steps=6"], timeout=200,
                     extra=JOBSET + ["--value=workload.jobSet.maxRestarts=0", "--inject=node-loss@3:node=0"])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert ("JobSet failurePolicy rule podFailureBudgetSpent: RestartJobSet, but 0 of maxRestarts: 0 are spent: "
            "the JobSet fails (ReachedMaxRestarts)") in out, out[-4000:]
    assert "job FAILED" in out
    assert_no_leftovers(run_dir)
