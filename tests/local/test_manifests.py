"""What the local cluster reads from the rendered manifests: each kind's pods, the variables its
controller injects, and its restart rules (no processes).

The pods' commands are the chart's, byte for byte: there is no hand-written copy of the pod
command left in the package (the local cluster, the GPU check), and no local-only flag in it."""

from __future__ import annotations

import re

import pytest

from tests.local.manifest_support import rendered
from tests.support import REPO
from resilient_fsdp.local.manifests.kinds import pods_of
from resilient_fsdp.local.manifests.pytorchjob import RestartPolicy
from resilient_fsdp.local.manifests.spec import WorkloadError, expand, quantity_bytes
from resilient_fsdp.resilience import exit_codes
from resilient_fsdp.resilience.agent import RENDEZVOUS_LOST_EXIT_CODE, exit_code, rendezvous_store_lost


def test_each_pod_runs_the_rendered_container_with_the_operators_variables():
    out = rendered("nodes=3", "cpuRanksPerNode=4")
    spec = out.find("PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    workload = pods_of(out.documents())
    assert [p.hostname for p in workload.pods] == [
        "job-resilient-fsdp-master-0",
        "job-resilient-fsdp-worker-0",
        "job-resilient-fsdp-worker-1",
    ]
    for pod, role in zip(workload.pods, ["Master", "Worker", "Worker"]):
        (container,) = spec[role]["template"]["spec"]["containers"]
        assert pod.argv == container["command"] + container["args"]  # exactly what the pod runs
        assert not any("is_host" in a for a in pod.argv)
        rendered_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert {k: pod.env[k] for k in rendered_env} == {**rendered_env, "PYTHONUNBUFFERED": "1"}
        assert pod.env["NODE_NAME"] == f"local-node-{pod.hostname}"  # the downward API's spec.nodeName
        # training-operator v1.9.4 envvar.go / master.go
        assert pod.env["MASTER_ADDR"] == pod.env["PET_MASTER_ADDR"] == "job-resilient-fsdp-master-0"
        assert pod.env["MASTER_PORT"] == pod.env["PET_MASTER_PORT"] == "29400"  # the pytorchjob-port
        assert pod.env["WORLD_SIZE"] == "12" and pod.env["PET_NNODES"] == "3" and pod.env["PET_NPROC_PER_NODE"] == "4"
        assert pod.env["RANK"] == pod.env["PET_NODE_RANK"] == str(pod.index)
        assert f"{pod.hostname}.default.svc.cluster.local" in pod.aliases
        assert {m.path for m in pod.mounts} == {"/etc/resilient-fsdp", "/fsx", "/dev/shm", "/tmp"}
        assert pod.volumes["dshm"].memory and not pod.volumes["tmp"].memory
    assert workload.rendezvous == "job-resilient-fsdp-master-0:29400"
    (config_map,) = workload.config_maps  # the immutable one, named by its content
    assert config_map.startswith("job-resilient-fsdp-config-")
    assert set(workload.config_maps[config_map]) == {"config.yaml", "ft_config.yaml"}
    assert workload.restart == RestartPolicy("ExitCode", 3, None)
    assert workload.finished({"job-resilient-fsdp-master-0"}) and not workload.finished({"job-resilient-fsdp-worker-0"})


def test_no_hand_written_pod_command_is_left():
    """The agent's command line is assembled in the chart only."""
    package = REPO / "train" / "resilient_fsdp"
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert "is_host=false" not in text and "agent_command" not in text, path
        assert not re.search(r'"--rdzv-endpoint=', text), path


def test_spares_are_more_workers_whose_index_orders_them_after_the_training_pods():
    out = rendered("nodes=2", "spares=1")
    workload = pods_of(out.documents())
    assert [p.hostname for p in workload.pods] == [
        "job-resilient-fsdp-master-0",
        "job-resilient-fsdp-worker-0",
        "job-resilient-fsdp-worker-1",
    ]
    assert [p.env["PET_NODE_RANK"] for p in workload.pods] == ["0", "1", "2"]
    assert all("--nnodes=2:3" in p.argv for p in workload.pods)
    # The operator counts every replica; the explicit --nnodes is what ft_launcher follows.
    assert workload.pods[2].env["PET_NNODES"] == "3"
    assert workload.finished({"job-resilient-fsdp-master-0"})


def test_an_elastic_pytorchjob_gets_the_elastic_variables_and_succeeds_with_one_worker():
    """A manifest with an elasticPolicy (``--manifests``; the chart renders none): the operator's
    PET_RDZV_* variables instead of MASTER_*, and success once any Worker succeeds."""
    documents = rendered("nodes=2").documents()
    doc = next(d for d in documents if d["kind"] == "PyTorchJob")
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    replicas["Worker"]["replicas"] = 2
    del replicas["Master"]
    doc["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 3, "maxRestarts": 3}
    workload = pods_of(documents)
    assert [p.hostname for p in workload.pods] == ["job-resilient-fsdp-worker-0", "job-resilient-fsdp-worker-1"]
    env = workload.pods[1].env
    assert env["PET_RDZV_ENDPOINT"] == "job-resilient-fsdp-worker-0:29400" and env["PET_NNODES"] == "1:3"
    assert env["PET_MAX_RESTARTS"] == "3" and "MASTER_ADDR" not in env and "RANK" not in env
    assert workload.finished({"job-resilient-fsdp-worker-1"})


def test_a_trainjob_is_refused_until_its_runtime_is_simulated():
    with pytest.raises(
        WorkloadError, match="workload.kind=TrainJob: the local cluster runs PyTorchJob and JobSet only"
    ):
        pods_of(rendered("workload.kind=TrainJob").documents())


def test_a_jobset_runs_its_pods_with_the_job_and_jobset_restart_rules():
    """Pods as the Indexed Job names them; the Job's podFailurePolicy and backoffLimit, then the
    JobSet's failurePolicy rules and maxRestarts (each restart recreates every pod)."""
    workload = pods_of(
        rendered("workload.kind=JobSet", "nodes=2", "job.backoffLimit=1", "workload.jobSet.maxRestarts=1").documents()
    )
    first, second = workload.pods
    assert (workload.kind, first.hostname, second.hostname) == (
        "JobSet",
        "job-resilient-fsdp-node-0-0",
        "job-resilient-fsdp-node-0-1",
    )
    assert "job-resilient-fsdp-node-0-1.job-resilient-fsdp" in second.aliases
    assert second.env["JOB_COMPLETION_INDEX"] == "1" and "MASTER_ADDR" not in second.env  # JobSet injects none
    assert second.ranks == 2  # from the rendered --nproc-per-node: nothing injects PET_NPROC_PER_NODE
    assert workload.rendezvous == "job-resilient-fsdp-node-0-0.job-resilient-fsdp"
    assert "--rdzv-endpoint=job-resilient-fsdp-node-0-0.job-resilient-fsdp:29400" in first.argv
    assert workload.finished({first.hostname}) is False and workload.finished({first.hostname, second.hostname})
    policy = workload.restart
    # A pod lost with its node (DisruptionTarget) is ignored: recreated, not counted.
    assert policy.on_failure(first, 137, True, 1)[0] == "recreate" and policy.counted == {}
    # Exit 1-127: FailJob -> the Job fails (PodFailurePolicy) -> FailJobSet.
    action, why = policy.on_failure(first, 1, False, 1)
    assert action == "fail" and "PodFailurePolicy" in why and "FailJobSet" in why
    # 128-255 counts: within backoffLimit the pod is recreated, past it the JobSet restarts.
    assert policy.on_failure(second, RENDEZVOUS_LOST_EXIT_CODE, False, 1)[0] == "recreate"
    action, why = policy.on_failure(first, 137, False, 2)
    assert action == "restart" and "BackoffLimitExceeded" in why and "restart 1 of maxRestarts: 1" in why
    assert policy.counted == {}  # the new Jobs start with a fresh budget
    policy.on_failure(first, 137, False, 3)
    action, why = policy.on_failure(first, 137, False, 4)
    assert action == "fail" and "ReachedMaxRestarts" in why


def test_the_restart_policy_is_the_operators_not_the_docs():
    exit_code_policy = RestartPolicy("ExitCode", 3)
    assert exit_code_policy.retryable(137) and exit_code_policy.retryable(RENDEZVOUS_LOST_EXIT_CODE)
    assert not exit_code_policy.retryable(1) and not exit_code_policy.retryable(127)
    assert not exit_code_policy.fails_job(1000)  # v1.9.4: backoffLimit >= 1 never counts
    assert RestartPolicy("ExitCode", 0).fails_job(1)  # 0: the first failure of any code
    assert RestartPolicy("OnFailure", None).retryable(1) and not RestartPolicy("Never", None).retryable(137)


NVRX_07_LOST = [
    "2026-12-01 00:04:26,886 [ERROR] [job-worker-0] launcher.py:3750 Agent run ended with exception, "
    "e=DistNetworkError('Failed to recv, got 0 bytes.'). Agent's exit code = 1\n"
]
NVRX_041_LOST = [
    "[ERROR] [ft_launcher8012@job-worker-0] Agent run ended with exception, e=RendezvousConnectionError("
    "'The connection to the C10d store has failed. See inner exception for details.'). Agent's exit "
    "code = 1\n"
]


def test_an_agent_that_lost_the_rendezvous_store_exits_retryably():
    assert rendezvous_store_lost(1, NVRX_07_LOST) and rendezvous_store_lost(1, NVRX_041_LOST)
    assert exit_code(1, None, NVRX_07_LOST) == RENDEZVOUS_LOST_EXIT_CODE == 200
    # A rank's own network error (its peer died) is the in-job layer's: once its restarts are spent,
    # the restarts-spent code (retried by the job level), not the lost-store one.
    assert not rendezvous_store_lost(1, ["[default0]:RuntimeError: DistNetworkError: Connection reset\n"])
    assert exit_code(1, None, ["[default0]:torch.distributed.DistNetworkError: x\n"]) == exit_codes.INFRASTRUCTURE
    assert exit_code(0, None, NVRX_07_LOST) == 0 and exit_code(-9, None, NVRX_07_LOST) == 137


def test_variables_expand_as_the_kubelet_expands_them():
    env = {"A": "x", "B": "y"}
    assert expand("$(A)-$(B)/$(C)/$$(A)", env) == "x-y/$(C)/$(A)"
    assert quantity_bytes("1Gi") == 2**30 and quantity_bytes("512M") == 512 * 10**6
