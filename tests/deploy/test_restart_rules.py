"""The rendered restart rules of each kind do what docs/faults-and-restarts.md's exit-code table says.

Each row's codes go through the rules as rendered by Helm's engine, read by the local cluster's
controllers (the Job's ``podFailurePolicy`` in order; PyTorchJob's ``restartPolicy: ExitCode``)."""

from __future__ import annotations

import pytest

from resilient_fsdp.local.manifests.jobset import read_jobset
from resilient_fsdp.local.manifests.pytorchjob import read_pytorchjob
from resilient_fsdp.resilience import exit_codes
from tests.deploy.chart_support import render

ROWS = [r for r in exit_codes.TABLE if r.codes]


def jobset_policy(kind: str):
    rendered = render(f"workload.kind={kind}", "nodes=2")
    if kind == "JobSet":
        doc = rendered.find("JobSet")
    else:  # a TrainJob's pods come from its runtime's JobSet template
        runtime = rendered.find("TrainingRuntime")
        doc = {"metadata": runtime["metadata"], "spec": runtime["spec"]["template"]["spec"]}
    workload = read_jobset(doc)
    return workload.restart, workload.pods[0].container


@pytest.mark.parametrize("kind", ["JobSet", "TrainJob"])
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_should_treat_each_exit_code_as_the_table_says_when_the_pod_failure_policy_is_rendered(kind, row):
    policy, container = jobset_policy(kind)
    for code in row.codes:
        if code == 0:
            continue  # a pod that exits 0 succeeds; no failure rule applies
        action = policy._pod_rule(container, code, lost=False)
        expected = {"fails": "FailJob", "counted": None}[row.budget]
        assert action == expected, (row.name, code, action)
        # The same pod lost with its node (DisruptionTarget) is never counted, whatever it exits with.
        assert policy._pod_rule(container, code, lost=True) == "Ignore"
    assert "backoffLimit" in row.jobset() or row.budget != "counted"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_should_treat_each_exit_code_as_the_table_says_when_the_job_is_a_pytorchjob(row):
    restart = read_pytorchjob(render("nodes=2").find("PyTorchJob")).restart
    assert restart.policy == "ExitCode"
    for code in row.codes:
        if code:
            assert restart.retryable(code) == (row.budget == "counted"), (row.name, code)


def test_every_row_names_what_each_kind_does():
    for row in exit_codes.TABLE:
        assert row.budget in exit_codes.BUDGET and row.pytorchjob() and row.jobset()
    assert [r.name for r in exit_codes.TABLE if r.budget == "none"] == ["joined-again"]
