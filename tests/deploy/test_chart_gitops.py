"""gitops.admissionPolicy: the ValidatingAdmissionPolicy that keeps a running job's values where
Argo CD and Flux apply the chart. Rendered by Helm's engine, checked against the Kubernetes
schemas, and its CEL evaluated (cel-python) on the workload objects the chart renders, as the API
server would evaluate it on an update."""

from __future__ import annotations

import copy

import celpy
import pytest

from resilient_fsdp.deploy import validate
from tests.deploy.chart_support import render

ON = "gitops.admissionPolicy.enabled=true"
LABEL = "resilient-fsdp.io/values-hash"
KINDS = {
    "PyTorchJob": ("kubeflow.org", "pytorchjobs"),
    "JobSet": ("jobset.x-k8s.io", "jobsets"),
    "TrainJob": ("trainer.kubeflow.org", "trainjobs"),
}


def admitted(policy: dict, old: dict, new: dict) -> bool:
    """Every validation of ``policy`` on an UPDATE from ``old`` to ``new``."""
    env = celpy.Environment()
    activation = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old)}
    return all(
        bool(env.program(env.compile(v["expression"])).evaluate(activation)) for v in policy["spec"]["validations"]
    )


def test_should_render_no_policy_and_no_label_by_default():
    rendered = render()
    assert not [d for d in rendered.documents() if d["kind"].startswith("ValidatingAdmissionPolicy")]
    assert LABEL not in rendered.find("PyTorchJob")["metadata"]["labels"]


@pytest.mark.parametrize("kind", KINDS)
def test_should_deny_an_update_with_other_values_and_admit_the_controllers_own(kind):
    before = render(ON, f"workload.kind={kind}", "nodes=2", namespace="ml")
    policy, binding = before.find("ValidatingAdmissionPolicy"), before.find("ValidatingAdmissionPolicyBinding")
    job = before.find(kind)
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], rule["operations"]) == (
        [KINDS[kind][0]],
        [KINDS[kind][1]],
        ["UPDATE"],
    )
    selector = policy["spec"]["matchConstraints"]["objectSelector"]["matchLabels"]
    assert selector.items() <= job["metadata"]["labels"].items()
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == "ml-resilient-fsdp-keep-values"
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ml"
    }
    # The same values rendered again (a GitOps re-sync) carry the same label: admitted.
    assert render(ON, f"workload.kind={kind}", "nodes=2", namespace="ml").find(kind) == job
    assert admitted(policy, job, job)
    # New values (here the trainer's steps, the edit Argo CD would apply): denied, with the way out.
    changed = render(ON, f"workload.kind={kind}", "nodes=2", "trainer.train.steps=999", namespace="ml").find(kind)
    assert changed["metadata"]["labels"][LABEL] != job["metadata"]["labels"][LABEL]
    assert not admitted(policy, job, changed)
    assert f"kubectl delete {kind.lower()} resilient-fsdp -n ml" in policy["spec"]["validations"][0]["message"]
    # A controller's or Kueue's update (suspend, injected node selectors, annotations) keeps the label.
    kueue = copy.deepcopy(job)
    kueue["spec"]["suspend"] = True
    kueue["metadata"].setdefault("annotations", {})["kueue.x-k8s.io/workload"] = "w"
    assert admitted(policy, job, kueue)
    stripped = copy.deepcopy(job)
    del stripped["metadata"]["labels"][LABEL]
    assert not admitted(policy, job, stripped)  # dropping the label is another set of values too
    # A job made before the policy existed (no label) is left alone.
    assert admitted(policy, stripped, changed)


def test_should_pass_the_kubernetes_schemas():
    rendered = render(ON)
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        assert validate.check_kubernetes(rendered.find(kind)) == [], kind
