"""templates/jobset.yaml (and _jobset.tpl): the JobSet kind, rendered by Helm's own engine."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import render, render_error

JOBSET = "workload.kind=JobSet"


def jobset(*sets: str, **kwargs) -> dict:
    return render(JOBSET, *sets, **kwargs).find("JobSet")


def node_job(js: dict) -> dict:
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["replicas"] == 1
    return rjob["template"]


def pod(js: dict) -> dict:
    return node_job(js)["spec"]["template"]


def test_should_run_nodes_indexed_pods_that_never_restart_in_place_when_kind_is_jobset():
    js = jobset("nodes=4")
    spec = node_job(js)["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    assert pod(js)["spec"]["restartPolicy"] == "Never"
    (c,) = pod(js)["spec"]["containers"]
    assert c["name"] == "node" and c["command"] == ["python", "-m", "resilient_fsdp.resilience.agent"]


def test_should_ignore_disruptions_first_and_fail_on_exit_codes_1_to_127_when_kind_is_jobset():
    rules = node_job(jobset())["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "node", "operator": "In", "values": list(range(1, 128))},
    }
    assert len(rules) == 2  # 128-255 (143 graceful stop, 137 kill) match nothing: counted, pod replaced


def test_should_spend_backoff_limit_then_restart_the_whole_jobset_when_budget_is_set():
    js = jobset("job.backoffLimit=7", "workload.jobSet.maxRestarts=2")
    assert node_job(js)["spec"]["backoffLimit"] == 7 and "backoffLimitPerIndex" not in node_job(js)["spec"]
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 2 and policy["restartStrategy"] == "BlockingRecreate"
    assert [(r["name"], r["action"], r["onJobFailureReasons"]) for r in policy["rules"]] == [
        ("fatalExitCode", "FailJobSet", ["PodFailurePolicy"]),
        ("deadline", "FailJobSet", ["DeadlineExceeded"]),
        ("podFailureBudgetSpent", "RestartJobSet", ["BackoffLimitExceeded"]),
    ]
    assert jobset("workload.jobSet.restartStrategy=Recreate")["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"


def test_should_rendezvous_on_pod_zeros_stable_hostname_when_kind_is_jobset():
    js = jobset("nodes=3", "rendezvous.port=29410", release="run1")
    assert js["metadata"]["name"] == "run1-resilient-fsdp"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    args = pod(js)["spec"]["containers"][0]["args"]
    assert "--rdzv-endpoint=run1-resilient-fsdp-node-0-0.run1-resilient-fsdp:29410" in args
    assert "--nnodes=3" in args
    assert pod(js)["spec"]["containers"][0]["ports"][0] == {
        "name": "rendezvous",
        "containerPort": 29410,
        "protocol": "TCP",
    }


def test_should_run_spares_as_more_indexes_of_the_job_when_kind_is_jobset_and_spares_are_set():
    js = jobset("nodes=6", "spares=2")
    args = pod(js)["spec"]["containers"][0]["args"]
    assert "--nnodes=6:8" in args and "--rdzv-endpoint=resilient-fsdp-node-0-0.resilient-fsdp:29400" in args
    assert (node_job(js)["spec"]["parallelism"], node_job(js)["spec"]["completions"]) == (8, 8)


def test_should_run_the_same_pod_as_a_pytorchjob_when_kind_changes():
    from tests.deploy.chart_support import job as pytorchjob

    js_pod = pod(jobset("nodes=2"))
    pj_pod = pytorchjob(render("nodes=2"))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    for p in (js_pod, pj_pod):
        p["metadata"]["labels"].pop("app.kubernetes.io/component")
        c = p["spec"]["containers"][0]
        c.pop("name"), c.pop("ports")
        c["args"] = [a for a in c["args"] if not a.startswith("--rdzv-endpoint=")]
    # Only a PyTorchJob's agents bound the pods' failures themselves: its operator does not.
    pj_args = pj_pod["spec"]["containers"][0]["args"]
    pj_args.remove("--max-pod-failures=3")
    assert js_pod["spec"].pop("restartPolicy") == "Never"
    # Only a JobSet's pods can read their install's id (its UID label).
    js_env = js_pod["spec"]["containers"][0]["env"]
    (install,) = [e for e in js_env if e["name"] == "RESILIENT_FSDP_INSTALL_ID"]
    js_env.remove(install)
    assert js_pod == pj_pod


def test_should_pass_deadline_ttl_labels_and_queue_to_the_jobset_when_set():
    js = jobset(
        "job.activeDeadlineSeconds=86400",
        "job.ttlSecondsAfterFinished=600",
        "job.kueueQueue=team-a",
        "job.labels.team=ml",
        "job.annotations.owner=me",
    )
    assert node_job(js)["spec"]["activeDeadlineSeconds"] == 86400
    assert js["spec"]["ttlSecondsAfterFinished"] == 600
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["metadata"]["labels"]["team"] == "ml" and js["metadata"]["annotations"] == {"owner": "me"}
    assert (
        "activeDeadlineSeconds" not in node_job(jobset())["spec"] and "ttlSecondsAfterFinished" not in jobset()["spec"]
    )


def test_should_annotate_the_pod_template_for_kueue_topology_when_topology_is_required():
    js = jobset("job.kueueQueue=q", "scheduling.topology.required=topology.k8s.aws/network-node-layer-3")
    annotations = pod(js)["metadata"]["annotations"]
    assert annotations["kueue.x-k8s.io/podset-required-topology"] == "topology.k8s.aws/network-node-layer-3"
    assert "kueue.x-k8s.io/podset-group-name" not in annotations  # one PodSet: nothing to group
    js = jobset("job.kueueQueue=q", "scheduling.topology.preferred=topology.k8s.aws/network-node-layer-4")
    assert (
        pod(js)["metadata"]["annotations"]["kueue.x-k8s.io/podset-preferred-topology"]
        == "topology.k8s.aws/network-node-layer-4"
    )


def test_should_place_the_job_exclusively_in_one_domain_when_exclusive_topology_is_set():
    js = jobset("workload.jobSet.exclusiveTopology=topology.k8s.aws/network-node-layer-3")
    assert node_job(js)["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "topology.k8s.aws/network-node-layer-3"
    }
    assert "metadata" not in node_job(jobset())


@pytest.mark.parametrize(
    "sets, fragments",
    [
        (["job.restartPolicy=OnFailure"], ["job.restartPolicy=OnFailure", "PyTorchJob only", "podFailurePolicy"]),
        (["job.cleanPodPolicy=All"], ["job.cleanPodPolicy=All", "remove job.cleanPodPolicy"]),
        (["job.schedulingPolicy.minAvailable=2"], ["job.schedulingPolicy", "job.kueueQueue"]),
        (["nodes=200", "fullnameOverride=" + "a" * 48], ["too long", "200 pods", "at most 46 characters"]),
        (
            ["job.kueueQueue=q", "scheduling.topology.required=a/b", "scheduling.topology.preferred=a/c"],
            ["scheduling.topology.required=a/b", "keep one"],
        ),
        (["scheduling.topology.required=a/b"], ["job.kueueQueue is empty"]),
        (
            ["job.kueueQueue=q", "scheduling.topology.required=a/b", "workload.jobSet.exclusiveTopology=a/b"],
            ["workload.jobSet.exclusiveTopology", "keep one"],
        ),
        (
            ["workload.trainJob.clusterTrainingRuntime=torch-distributed"],
            ["workload.trainJob.clusterTrainingRuntime=torch-distributed", "set workload.kind=TrainJob"],
        ),
    ],
)
def test_should_fail_naming_the_key_when_values_do_not_fit_a_jobset(sets, fragments):
    message = render_error(JOBSET, *sets)
    for fragment in fragments:
        assert fragment in message, message


def test_should_reject_exclusive_topology_naming_the_kind_when_kind_is_pytorchjob():
    message = render_error("workload.jobSet.exclusiveTopology=topology.k8s.aws/network-node-layer-3")
    assert "workload.jobSet.exclusiveTopology" in message and "set workload.kind=JobSet" in message


def test_should_reject_an_unknown_kind_or_strategy_when_schema_checks_workload():
    assert "workload.kind" in render_error("workload.kind=MPIJob")
    assert "workload.jobSet.restartStrategy" in render_error(JOBSET, "workload.jobSet.restartStrategy=InPlaceRestart")
