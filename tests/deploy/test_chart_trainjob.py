"""templates/trainjob.yaml and templates/trainingruntime.yaml: the TrainJob kind (Kubeflow Trainer v2.3)."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import render, render_error

TRAINJOB = "workload.kind=TrainJob"
CTR = "workload.trainJob.clusterTrainingRuntime=torch-distributed"


def test_should_run_the_charts_training_runtime_created_first_when_kind_is_trainjob():
    rendered = render(TRAINJOB, "nodes=4", release="run1")
    tj, rt = rendered.find("TrainJob"), rendered.find("TrainingRuntime")
    assert tj["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": "run1-resilient-fsdp",
    }
    assert rt["metadata"]["name"] == tj["metadata"]["name"] == "run1-resilient-fsdp"
    # Trainer's webhook refuses a TrainJob whose runtime does not exist yet: a pre-install hook.
    assert rt["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert rt["spec"]["mlPolicy"] == {"numNodes": 4, "torch": {}}
    # An integer, never Trainer's `auto`, which ft_launcher rejects.
    assert tj["spec"]["trainer"] == {"numNodes": 4, "numProcPerNode": 8}
    assert [d["kind"] for d in rendered.documents()].count("JobSet") == 0


def test_should_template_the_jobset_with_the_names_the_torch_plugin_needs_when_kind_is_trainjob():
    rt = render(TRAINJOB, "nodes=2").find("TrainingRuntime")
    (rjob,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["replicas"] == 1
    assert rjob["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    pod = rjob["template"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["name"] == "node"
    assert "--rdzv-endpoint=resilient-fsdp-node-0-0.resilient-fsdp:29400" in c["args"]  # = Trainer's PET_MASTER_ADDR
    assert not [e for e in c["env"] if e["name"].startswith("PET_")]
    assert rjob["template"]["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]["containerName"] == "node"
    assert rt["spec"]["template"]["spec"]["failurePolicy"]["rules"][-1]["action"] == "RestartJobSet"


def test_should_keep_efa_and_hugepages_in_the_runtime_when_resources_per_node_is_not_set():
    rendered = render(TRAINJOB, "nodes=2")
    assert "resourcesPerNode" not in rendered.find("TrainJob")["spec"]["trainer"]
    (rjob,) = rendered.find("TrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"]
    requests = rjob["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["vpc.amazonaws.com/efa"] == 32 and requests["hugepages-2Mi"] == "5120Mi"
    assert requests["nvidia.com/gpu"] == 8


def test_should_label_only_the_trainjob_for_kueue_when_queue_and_topology_are_set():
    rendered = render(
        TRAINJOB, "job.kueueQueue=team-a", "scheduling.topology.required=topology.k8s.aws/network-node-layer-3"
    )
    assert rendered.find("TrainJob")["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    rt = rendered.find("TrainingRuntime")
    assert "kueue.x-k8s.io/queue-name" not in rt["metadata"]["labels"]
    (rjob,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    assert (
        rjob["template"]["spec"]["template"]["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"]
        == "topology.k8s.aws/network-node-layer-3"
    )


def test_should_set_the_deadline_on_the_trainjob_when_active_deadline_is_set():
    rendered = render(TRAINJOB, "job.activeDeadlineSeconds=3600")
    assert rendered.find("TrainJob")["spec"]["activeDeadlineSeconds"] == 3600
    (rjob,) = rendered.find("TrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"]
    assert "activeDeadlineSeconds" not in rjob["template"]["spec"]


def test_should_carry_the_pod_through_trainer_and_a_runtime_patch_when_a_cluster_runtime_is_named():
    rendered = render(
        TRAINJOB,
        CTR,
        "nodes=3",
        "job.kueueQueue=q",
        "scheduling.topology.required=topology.k8s.aws/network-node-layer-3",
    )
    assert not [d for d in rendered.documents() if d["kind"] == "TrainingRuntime"]
    spec = rendered.find("TrainJob")["spec"]
    assert spec["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    trainer = spec["trainer"]
    assert trainer["command"] == ["python", "-m", "resilient_fsdp.resilience.agent"] and "--nnodes=3" in trainer["args"]
    assert trainer["resourcesPerNode"]["limits"]["vpc.amazonaws.com/efa"] == 32
    assert {e["name"] for e in trainer["env"]} >= {"FI_PROVIDER", "NCCL_DEBUG"}
    (patch,) = spec["runtimePatches"]
    assert patch["manager"] == "resilient-fsdp/chart"
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"].endswith("layer-3")
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "resilient-fsdp"  # NetworkPolicy's selector
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"config", "shared", "dshm", "tmp"}
    assert pod["spec"]["containers"] == [
        {
            "name": "node",
            "volumeMounts": pod["spec"]["containers"][0]["volumeMounts"],
            "securityContext": pod["spec"]["containers"][0]["securityContext"],
        }
    ]
    assert "env" not in pod["spec"]["containers"][0]  # Trainer's webhook refuses env on `node` in a patch
    assert "This chart's exit-code contract applies only with its own TrainingRuntime".lower() in rendered.notes.lower()


def test_should_tell_how_to_follow_and_clean_up_when_notes_are_printed_for_a_trainjob():
    notes = render(TRAINJOB, release="r").notes
    assert "kubectl -n default get trainjob r-resilient-fsdp" in notes
    assert "jobset.sigs.k8s.io/jobset-name=r-resilient-fsdp" in notes
    assert "kubectl -n default delete trainingruntime r-resilient-fsdp" in notes


@pytest.mark.parametrize(
    "sets, fragments",
    [
        (["rendezvous.port=29500"], ["rendezvous.port=29500", "29400"]),
        (["pod.env[0].name=PET_NNODES", "pod.env[0].value=4"], ["pod.env[0] PET_NNODES", "remove it"]),
        (["job.ttlSecondsAfterFinished=60"], ["job.ttlSecondsAfterFinished", "no TTL"]),
        (["job.restartPolicy=Never"], ["job.restartPolicy=Never", "PyTorchJob only"]),
        ([CTR, "pod.envFrom[0].configMapRef.name=x"], ["pod.envFrom", "pod.env"]),
        ([CTR, "pod.priorityClassName=high"], ["pod.priorityClassName", "ClusterTrainingRuntime"]),
    ],
)
def test_should_fail_naming_the_key_when_values_do_not_fit_a_trainjob(sets, fragments):
    message = render_error(TRAINJOB, *sets)
    for fragment in fragments:
        assert fragment in message, message
