"""The PyTorchJob reader of the local cluster: its pods, and the restart rules of its controller.

After training-operator v1.9.4 (``kubeflow.org/v1``; ``pkg/controller.v1/pytorch/envvar.go``,
``master.go``, ``elastic.go``): pods ``<job>-master-0`` and ``<job>-worker-<i>``, a headless
Service of the same name per pod, and the variables the operator appends to every container's
``env``. A failed pod goes through :class:`RestartPolicy`: the replicas' ``restartPolicy`` and the
job's ``backoffLimit`` as that controller applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .spec import (
    PodSpec,
    Workload,
    WorkloadError,
    container_env,
    container_mounts,
    init_containers,
    local_node,
    pod_volumes,
    security_of,
    service_names,
)

PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_DEFAULT_PORT = 23456


@dataclass
class RestartPolicy:
    """What the PyTorchJob controller does when a pod fails.

    ``retryable(code)`` is asked for each failed pod: True recreates the pod (same name), False
    fails the job. ``backoff_limit`` as the controller really applies it (see ``fails_job``).
    """

    policy: str
    backoff_limit: Optional[int]
    active_deadline_s: Optional[float] = None

    def retryable(self, code: int) -> bool:
        """PyTorchJob ``restartPolicy`` (v1.9.4 ``common/pod.go``): ``ExitCode`` recreates a pod whose
        container exited 128-255 (``train_util.IsRetryableExitCode``; a pod killed by a signal or
        lost with its node counts as 128 + the signal) and fails the job on 1-127; ``OnFailure``
        and ``Always`` recreate on any failure; ``Never`` recreates nothing."""
        if self.policy == "ExitCode":
            return code >= 128
        return self.policy in ("OnFailure", "Always")

    def fails_job(self, failures: int) -> bool:
        """Whether ``failures`` pod failures so far exhaust ``backoffLimit``.

        training-operator v1.9.4 (``common/job.go`` ``ReconcileJobs``): its work queue never counts
        requeues, so only ``backoffLimit: 0`` ends the job, at the first failure of any exit code;
        the other check adds up container restarts of running pods, which stay 0 under
        ``restartPolicy: Never``, so a limit of 1 or more never stops recreations
        (kubeflow/trainer#2045).
        """
        return self.backoff_limit == 0 and failures > 0

    def on_failure(self, pod: PodSpec, code: int, lost: bool, failures: int) -> tuple[str, str]:
        """What the controller does about ``pod`` ending with ``code`` (``lost``: killed with its
        node; ``failures``: pod failures so far, this one included): ``(action, why)``, the action
        ``recreate`` (this pod, same name), ``restart`` (every pod) or ``fail`` (the job)."""
        if self.fails_job(failures):
            return (
                "fail",
                f"the job fails, as backoffLimit: {self.backoff_limit} makes it fail at the first pod failure",
            )
        if not self.retryable(code):
            return "fail", f"not retried under restartPolicy: {self.policy} (1-127 fail the job)"
        return (
            "recreate",
            f"recreating it with the same name, as the controller does under restartPolicy: {self.policy}",
        )


def _trainer_container(template: dict, name: str, where: str) -> dict:
    containers = template.get("spec", {}).get("containers") or []
    for c in containers:
        if c.get("name") == name:
            return c
    raise WorkloadError(f"{where}: no container named {name!r} (found {[c.get('name') for c in containers]})")


def _port(container: dict, port_name: str, default: int) -> int:
    for p in container.get("ports") or []:
        if p.get("name") == port_name:
            return int(p["containerPort"])
    return default


def read_pytorchjob(doc: dict) -> Workload:
    """The pods a rendered PyTorchJob's controller creates, with its restart rules."""
    name, namespace = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    spec = doc["spec"]
    replicas = spec.get("pytorchReplicaSpecs") or {}
    unknown = set(replicas) - {"Master", "Worker"}
    if unknown:
        raise WorkloadError(f"PyTorchJob {name}: replica types {sorted(unknown)}; the operator knows Master and Worker")
    elastic = spec.get("elasticPolicy")
    nproc = spec.get("nprocPerNode")
    nproc_int = int(nproc) if nproc is not None and str(nproc).isdigit() else 1
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    policies = {r.get("restartPolicy", "OnFailure") for r in replicas.values()}
    if len(policies) != 1:
        raise WorkloadError(
            f"PyTorchJob {name}: Master and Worker restart policies differ ({sorted(policies)}); "
            "the local cluster applies one"
        )
    run_policy = spec.get("runPolicy") or {}
    restart = RestartPolicy(policies.pop(), run_policy.get("backoffLimit"), run_policy.get("activeDeadlineSeconds"))
    master_port = None
    if "Master" in replicas:
        c = _trainer_container(replicas["Master"]["template"], PYTORCH_CONTAINER, f"PyTorchJob {name} Master")
        master_port = _port(c, PYTORCH_PORT_NAME, PYTORCH_DEFAULT_PORT)

    def injected(role: str, index: int) -> dict[str, str]:
        """``envvar.go`` ``setPodEnv``: appended to the container's env in this order."""
        env = {"PYTHONUNBUFFERED": "1"}
        if master_port is not None:
            addr = f"{name}-master-0"
            env.update(
                MASTER_PORT=str(master_port), PET_MASTER_PORT=str(master_port), MASTER_ADDR=addr, PET_MASTER_ADDR=addr
            )
            rank = index + 1 if role == "worker" else index
            env.update(WORLD_SIZE=str(total * nproc_int), RANK=str(rank), PET_NODE_RANK=str(rank))
        if nproc is not None:
            env["PET_NPROC_PER_NODE"] = str(nproc)
        if elastic is not None:
            worker = replicas.get("Worker")
            host = elastic.get("rdzvHost") or f"{name}-worker-0"
            port = elastic.get("rdzvPort")
            if port is None and worker is not None:
                port = _port(
                    _trainer_container(worker["template"], PYTORCH_CONTAINER, f"PyTorchJob {name} Worker"),
                    PYTORCH_PORT_NAME,
                    PYTORCH_DEFAULT_PORT,
                )
            env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
            env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
            if elastic.get("minReplicas") is None and elastic.get("maxReplicas") is None:
                env["PET_NNODES"] = str(worker.get("replicas", 1) if worker else 1)
            else:
                env["PET_NNODES"] = f"{elastic.get('minReplicas')}:{elastic.get('maxReplicas')}"
            if elastic.get("maxRestarts") is not None:
                env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
            if elastic.get("rdzvId") is not None:
                env["PET_RDZV_ID"] = str(elastic["rdzvId"])
            if elastic.get("rdzvConf"):
                env["PET_RDZV_CONF"] = ",".join(f"{kv['key']}={kv['value']}" for kv in elastic["rdzvConf"])
        else:
            env["PET_NNODES"] = str(total)
        return env

    pods = []
    for role in ("Master", "Worker"):
        if role not in replicas:
            continue
        template = replicas[role]["template"]
        c = _trainer_container(template, PYTORCH_CONTAINER, f"PyTorchJob {name} {role}")
        for i in range(int(replicas[role].get("replicas", 1))):
            hostname = f"{name}-{role.lower()}-{i}"
            # training-operator v1.9.4 pod labels (pkg/controller.v1/common/pod.go)
            fields = {
                "metadata.name": hostname,
                "metadata.namespace": namespace,
                "spec.nodeName": local_node(hostname),
                "metadata.labels['training.kubeflow.org/replica-type']": role.lower(),
                "metadata.labels['training.kubeflow.org/replica-index']": str(i),
            }
            env = container_env(c, f"PyTorchJob {name} {role}", fields)
            for key, value in injected(role.lower(), i).items():
                env.pop(key, None)  # appended: a later entry wins and takes the last place
                env[key] = value
            pods.append(
                PodSpec(
                    hostname=hostname,
                    index=len(pods),
                    role=role.lower(),
                    container=c["name"],
                    command=list(c.get("command") or []),
                    args=list(c.get("args") or []),
                    env=env,
                    mounts=container_mounts(c),
                    volumes=pod_volumes(template.get("spec", {})),
                    aliases=service_names(hostname, namespace),
                    security=security_of(template.get("spec", {}), c, f"PyTorchJob {name} {role}"),
                    init_containers=init_containers(template.get("spec", {}), f"PyTorchJob {name} {role}", fields),
                )
            )
    if not pods:
        raise WorkloadError(f"PyTorchJob {name}: no replicas")
    first = pods[0]
    rendezvous = (
        f"{first.hostname}:{master_port}"
        if master_port is not None
        else first.env.get("PET_RDZV_ENDPOINT", f"{first.hostname}:{PYTORCH_DEFAULT_PORT}")
    )
    # v1.9.4 UpdateJobStatus: with a Master, the job succeeds when the Master does; without one,
    # when every Worker has, or with an elasticPolicy when any has.
    success = "first" if "Master" in replicas else ("any" if elastic is not None else "all")
    return Workload("PyTorchJob", name, namespace, pods, {}, restart, rendezvous, success)
