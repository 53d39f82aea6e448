"""Where the pods may run and what may move them: the node-health and zone affinity, the priority
class, the PodDisruptionBudget, and the EFA/NCCL environment of the pods placed there."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import crds, env, pod_spec, render, render_error  # noqa: F401
from resilient_fsdp.deploy import validate

HEALTH = {
    "key": "sagemaker.amazonaws.com/node-health-status",
    "operator": "NotIn",
    "values": ["Unschedulable", "UnschedulablePendingReplacement", "UnschedulablePendingReboot"],
}


def required_terms(rendered, role: str = "Master") -> list[dict]:
    affinity = pod_spec(rendered, role).get("affinity", {})
    return (
        affinity.get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )


def test_should_keep_pods_off_hyperpod_unhealthy_nodes_by_default():
    rendered = render()
    for role in ("Master", "Worker"):
        assert required_terms(rendered, role) == [{"matchExpressions": [HEALTH]}]


def test_should_render_no_affinity_when_health_rule_is_off_and_nothing_else_is_set():
    assert "affinity" not in pod_spec(render("pod.avoidUnhealthyNodes=false"))
    # A default label set to null is dropped (Helm removes null keys when it merges values).
    drop = "pod.unhealthyNodeLabels.sagemaker\\.amazonaws\\.com/node-health-status=null"
    assert "affinity" not in pod_spec(render(drop))


def test_should_pin_the_zone_and_add_the_rules_to_each_of_the_users_terms_when_both_are_set():
    user_terms = [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
    ]
    rendered = render(
        "pod.zone=us-west-2b",
        "pod.unhealthyNodeLabels.example\\.com/broken={yes-broken}",
        "pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[0].matchExpressions[0].key=pool",
        "pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[0].matchExpressions[0].operator=In",
        "pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[0].matchExpressions[0].values={a}",
        "pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[1].matchFields[0].key=metadata.name",
        "pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[1].matchFields[0].operator=In",
        "pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[1].matchFields[0].values={n1}",
    )
    ours = [
        {"key": "example.com/broken", "operator": "NotIn", "values": ["yes-broken"]},
        HEALTH,
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-west-2b"]},
    ]
    terms = required_terms(rendered)
    # Terms are ORed: a rule missing from one term would let the pod through by that term.
    assert terms == [
        {"matchExpressions": user_terms[0]["matchExpressions"] + ours},
        {"matchFields": user_terms[1]["matchFields"], "matchExpressions": ours},
    ]


@pytest.mark.parametrize("kind", ["PyTorchJob", "JobSet", "TrainJob"])
def test_should_carry_affinity_and_priority_class_into_each_kind_and_validate(kind, crds):
    rendered = render(f"workload.kind={kind}", "pod.zone=us-west-2b", "pod.priorityClassName=training-high")
    docs = rendered.documents()
    assert validate.validate_documents(docs, crds) == []
    from resilient_fsdp.deploy.pod_security import pod_templates

    templates = [t for d in docs if d["kind"] != "Pod" for _, t in pod_templates(d)]
    assert templates
    for t in templates:
        assert t["spec"]["priorityClassName"] == "training-high"
        zone = t["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-west-2b"]} in zone[
            "nodeSelectorTerms"
        ][0]["matchExpressions"]


def test_should_place_the_helm_test_pod_like_the_training_pods():
    rendered = render("pod.zone=us-west-2b")
    check = rendered.find("Pod")
    assert check["spec"]["affinity"] == pod_spec(rendered)["affinity"]


@pytest.mark.parametrize(
    "bad, key",
    [
        ("pod.zone=US West", "zone"),
        ("podDisruptionBudget.maxUnavailable=-1", "maxUnavailable"),
        ("podDisruptionBudget.maxUnavailable=half", "maxUnavailable"),
    ],
)
def test_should_reject_a_bad_placement_value_naming_the_key(bad, key):
    assert key in render_error(bad)


def test_should_let_a_drain_through_one_training_pod_at_a_time_only_when_the_budget_is_on(crds):
    """One at a time: each eviction is a graceful stop with a checkpoint (the `sigterm` fault's jobs),
    and a drain before an AWS-initiated termination is not held until the instance dies."""
    rendered = render()
    pdb = rendered.find("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = pdb["spec"]["selector"]
    assert selector["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["master", "worker", "node"]}
    ]
    # It selects every training pod and not the helm test pod.
    labels = lambda d: d["metadata"]["labels"]  # noqa: E731
    training = [
        job["template"]["metadata"]["labels"]
        for job in rendered.find("PyTorchJob")["spec"]["pytorchReplicaSpecs"].values()
    ]
    selected = lambda ls: (
        all(ls.get(k) == v for k, v in selector["matchLabels"].items())  # noqa: E731
        and ls.get("app.kubernetes.io/component") in selector["matchExpressions"][0]["values"]
    )
    assert all(selected(ls) for ls in training) and not selected(labels(rendered.find("Pod")))
    assert validate.validate_documents([pdb], crds) == []
    assert (
        render("podDisruptionBudget.maxUnavailable=25%").find("PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"
    )
    assert render("podDisruptionBudget.maxUnavailable=0").find("PodDisruptionBudget")["spec"]["maxUnavailable"] == 0
    assert "PodDisruptionBudget" not in {d["kind"] for d in render("podDisruptionBudget.enabled=false").documents()}


def test_should_set_the_aws_sample_efa_environment_and_let_the_tuner_be_turned_off():
    e = env(render("instanceType=p5.48xlarge"))
    assert e["RDMAV_FORK_SAFE"] == "1" and e["FI_EFA_FORK_SAFE"] == "1"
    assert e["NCCL_TUNER_PLUGIN"] == "/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so"
    assert "NCCL_TUNER_PLUGIN" not in env(render("instanceType=p5.48xlarge", "efa.ncclTunerPlugin="))
    # Without EFA (one pod) none of it.
    single = env(render("instanceType=p5.48xlarge", "nodes=1"))
    assert "RDMAV_FORK_SAFE" not in single and "NCCL_TUNER_PLUGIN" not in single


def test_should_check_memlock_in_helm_test_only_where_the_pods_use_efa():
    assert "--memlock" in render().find("Pod")["spec"]["containers"][0]["args"]
    assert "--memlock" not in render("efa.enabled=false").find("Pod")["spec"]["containers"][0]["args"]
