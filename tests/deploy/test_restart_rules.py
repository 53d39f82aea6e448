"""The rendered restart rules of each kind do what docs/faults-and-restarts.md's exit-code table says.

Each row's codes go through the rules as rendered by Helm's engine, read by the local cluster's
controllers (the Job's ``podFailurePolicy`` in order; PyTorchJob's ``restartPolicy: ExitCode``)."""

from __future__ import annotations

import pytest

from resilient_fsdp.local.manifests.jobset import read_jobset
from resilient_fsdp.local.manifests.pytorchjob import read_pytorchjob
from resilient_fsdp.resilience import exit_codes
from tests.deploy.chart_support import crds, render  # noqa: F401

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
        expected = {"fails": "FailJob", "counted": None, "stop": None}[row.budget]
        assert action == expected, (row.name, code, action)
        # The same pod lost with its node (DisruptionTarget) is never counted, whatever it exits with.
        assert policy._pod_rule(container, code, lost=True) == "Ignore"
    assert "backoffLimit" in row.jobset() or row.budget not in ("counted", "stop")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_should_treat_each_exit_code_as_the_table_says_when_the_job_is_a_pytorchjob(row):
    restart = read_pytorchjob(render("nodes=2").find("PyTorchJob")).restart
    assert restart.policy == "ExitCode"
    for code in row.codes:
        if code:
            assert restart.retryable(code) == (row.budget in ("counted", "stop")), (row.name, code)


def test_every_row_names_what_each_kind_does():
    for row in exit_codes.TABLE:
        assert row.budget in exit_codes.BUDGET and row.pytorchjob() and row.jobset()
    assert [r.name for r in exit_codes.TABLE if r.budget == "none"] == ["joined-again"]


@pytest.mark.parametrize("kind", ["PyTorchJob", "JobSet", "TrainJob"])
def test_should_bound_pod_failures_in_the_agents_only_where_the_controller_does_not(kind):
    """A PyTorchJob's operator recreates pods for ever: its agents count the failures
    (--max-pod-failures=job.backoffLimit); a JobSet's or TrainJob's Job counts them itself."""
    rendered = render(f"workload.kind={kind}", "nodes=2", "job.backoffLimit=5")
    docs = [d for d in rendered.documents() if d["kind"] in ("PyTorchJob", "JobSet", "TrainingRuntime")]
    text = str(docs)
    assert ("--max-pod-failures=5" in text) == (kind == "PyTorchJob")
    # backoffLimit 0: the operator fails the job at the first pod failure itself, with the pod's code.
    assert "--max-pod-failures" not in str(render(f"workload.kind={kind}", "nodes=2", "job.backoffLimit=0").documents())
    counted = [r for r in exit_codes.TABLE if r.budget == "counted"]
    assert all("the agents do" in r.pytorchjob() for r in counted)


def test_should_taint_an_unhealthy_node_only_when_asked_with_the_rights_it_needs(crds):
    from resilient_fsdp.deploy import validate
    from tests.deploy.chart_support import container, pod_spec

    off = render("nodes=2")
    assert not [d for d in off.documents() if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert not any(a.startswith("--taint-unhealthy-node") for a in container(off)["args"])
    assert pod_spec(off)["automountServiceAccountToken"] is False
    on = render("nodes=2", "pod.taintUnhealthyNode.enabled=true")
    role = on.find("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    binding = on.find("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "resilient-fsdp", "namespace": "default"}]
    c = container(on)
    assert "--taint-unhealthy-node=resilient-fsdp.io/unhealthy-node" in c["args"]
    assert c["args"].index("--taint-unhealthy-node=resilient-fsdp.io/unhealthy-node") < c["args"].index("--")
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
    assert pod_spec(on)["automountServiceAccountToken"] is True
    docs = on.documents()
    assert validate.validate_documents(docs, crds) + validate.pod_security_problems(docs, "baseline") == []
