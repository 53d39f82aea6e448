"""The rendered workload as the local cluster runs it: pods, their containers, volumes and policy.

:func:`pods_of` reads the chart's rendered manifests and returns a :class:`Workload`: every pod the
workload controller would create, each with its hostname, the names that resolve to it, its
trainer container (``command``, ``args``, ``env`` with what the controller injects, volume mounts)
and volumes, plus the rendered ConfigMaps and the restart policy. Nothing here starts a process
(that is :mod:`resilient_fsdp.local.launcher`), and nothing depends on how pods are isolated.

One reader per workload kind, in :data:`KINDS`. PyTorchJob is implemented after training-operator
v1.9.4 (``pkg/controller.v1/pytorch/envvar.go``, ``master.go``, ``elastic.go``): pods
``<job>-master-0`` and ``<job>-worker-<i>``, a headless Service of the same name per pod, and the
variables it appends to every container's ``env``. JobSet's reader and restart rules are in
:mod:`resilient_fsdp.local.jobset` (it plugs itself in here when imported); TrainJob renders
already and is refused until its runtime's JobSet is simulated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional


class WorkloadError(ValueError):
    """A rendered workload the local cluster cannot run; the message names the field."""


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)([KMGTPE]i?)?$")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(text: str) -> int:
    """A Kubernetes quantity (``1Gi``, ``512M``, ``1000``) in bytes."""
    m = _QUANTITY.match(str(text).strip())
    if not m:
        raise WorkloadError(f"sizeLimit {text!r} is not a Kubernetes quantity such as 1Gi")
    return int(float(m[1]) * _UNITS[m[2] or ""])


@dataclass
class Mount:
    """A ``volumeMounts`` entry."""

    volume: str
    path: str
    read_only: bool = False
    sub_path: str = ""


@dataclass
class Volume:
    """A pod volume: ``kind`` is the volume source's key (``configMap``, ``emptyDir``,
    ``persistentVolumeClaim``, ``hostPath``, ...) and ``source`` its body."""

    name: str
    kind: str
    source: dict = field(default_factory=dict)

    @property
    def memory(self) -> bool:
        """An ``emptyDir`` with ``medium: Memory``: a tmpfs."""
        return self.kind == "emptyDir" and self.source.get("medium") == "Memory"


@dataclass
class Pod:
    """One pod the workload controller creates, with its trainer container."""

    hostname: str
    """The pod's name, which is also its hostname."""
    index: int
    """Its place in the job: the node rank; pod 0 hosts the rendezvous store."""
    role: str
    container: str
    command: list[str]
    args: list[str]
    env: dict[str, str]
    """The container's environment as the kubelet sets it: the rendered ``env`` in order, then
    what the controller appends (a later entry of the same name wins)."""
    mounts: list[Mount]
    volumes: dict[str, Volume]
    aliases: list[str] = field(default_factory=list)
    """Other names that resolve to this pod (its Service, with the cluster DNS suffixes)."""

    @property
    def argv(self) -> list[str]:
        """``command`` + ``args`` with ``$(VAR)`` expanded from ``env``, as the kubelet runs them."""
        return [expand(a, self.env) for a in self.command + self.args]

    @property
    def ranks(self) -> int:
        """Trainer ranks in this pod: what the operator injects (``PET_NPROC_PER_NODE``), else the
        rendered command's own ``--nproc-per-node`` (a JobSet injects nothing), else 1."""
        if "PET_NPROC_PER_NODE" in self.env:
            return int(self.env["PET_NPROC_PER_NODE"])
        flags = [a.split("=", 1)[1] for a in self.argv if a.startswith("--nproc-per-node=")]
        return int(flags[0]) if flags and flags[0].isdigit() else 1


@dataclass
class RestartPolicy:
    """What the workload controller does when a pod fails.

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

    def on_failure(self, pod: "Pod", code: int, lost: bool, failures: int) -> tuple[str, str]:
        """What the controller does about ``pod`` ending with ``code`` (``lost``: killed with its
        node; ``failures``: pod failures so far, this one included): ``(action, why)``, the action
        ``recreate`` (this pod, same name), ``restart`` (every pod) or ``fail`` (the job)."""
        if self.fails_job(failures):
            return "fail", f"the job fails, as backoffLimit: {self.backoff_limit} makes it fail at the first pod failure"
        if not self.retryable(code):
            return "fail", f"not retried under restartPolicy: {self.policy} (1-127 fail the job)"
        return "recreate", f"recreating it with the same name, as the controller does under restartPolicy: {self.policy}"


@dataclass
class Workload:
    kind: str
    name: str
    namespace: str
    pods: list[Pod]
    config_maps: dict[str, dict[str, str]]
    restart: RestartPolicy
    rendezvous: str
    """``host:port`` of the rendezvous store (pod 0's agent serves it)."""
    success: str = "first"
    """When the job has succeeded: ``first`` (pod 0 exited 0: a PyTorchJob's Master), ``all`` (every
    pod), ``any`` (one pod: an elastic PyTorchJob's workers)."""

    def finished(self, succeeded: set[str]) -> bool:
        """Whether the pods that exited 0 (``succeeded``, by hostname) complete the job."""
        if self.success == "first":
            return self.pods[0].hostname in succeeded
        if self.success == "any":
            return bool(succeeded)
        return len(succeeded) == len(self.pods)

    def pod(self, hostname: str) -> Pod:
        for pod in self.pods:
            if pod.hostname == hostname:
                return pod
        raise KeyError(hostname)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, an undefined reference
    stays as written, and ``$$`` is a literal ``$``."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def service_names(name: str, namespace: str) -> list[str]:
    """The names cluster DNS gives the headless Service ``name``: short, namespaced, full."""
    return [f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]


def _container_env(container: dict, where: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for entry in container.get("env") or []:
        if "value" not in entry and "valueFrom" in entry:
            raise WorkloadError(f"{where}.env {entry['name']}: valueFrom ({', '.join(entry['valueFrom'])}) is not "
                                "supported by the local cluster (no Secrets or downward API here); give a value")
        env[entry["name"]] = expand(str(entry.get("value", "")), env)
    if container.get("envFrom"):
        raise WorkloadError(f"{where}.envFrom is not supported by the local cluster (no Secrets or ConfigMap "
                            "references here); set pod.env values instead")
    return env


def _volumes(spec: dict) -> dict[str, Volume]:
    out = {}
    for v in spec.get("volumes") or []:
        kinds = [k for k in v if k != "name"]
        kind = kinds[0] if kinds else "emptyDir"
        out[v["name"]] = Volume(v["name"], kind, v.get(kind) or {})
    return out


def _mounts(container: dict) -> list[Mount]:
    return [Mount(m["name"], m["mountPath"], bool(m.get("readOnly", False)), m.get("subPath", ""))
            for m in container.get("volumeMounts") or []]


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


# ---- PyTorchJob (kubeflow.org/v1, training-operator v1.9.4) -------------------------------------

PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_DEFAULT_PORT = 23456


def _pytorchjob(doc: dict) -> Workload:
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
        raise WorkloadError(f"PyTorchJob {name}: Master and Worker restart policies differ ({sorted(policies)}); "
                            "the local cluster applies one")
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
            env.update(MASTER_PORT=str(master_port), PET_MASTER_PORT=str(master_port),
                       MASTER_ADDR=addr, PET_MASTER_ADDR=addr)
            rank = index + 1 if role == "worker" else index
            env.update(WORLD_SIZE=str(total * nproc_int), RANK=str(rank), PET_NODE_RANK=str(rank))
        if nproc is not None:
            env["PET_NPROC_PER_NODE"] = str(nproc)
        if elastic is not None:
            worker = replicas.get("Worker")
            host = elastic.get("rdzvHost") or f"{name}-worker-0"
            port = elastic.get("rdzvPort")
            if port is None and worker is not None:
                port = _port(_trainer_container(worker["template"], PYTORCH_CONTAINER, f"PyTorchJob {name} Worker"),
                             PYTORCH_PORT_NAME, PYTORCH_DEFAULT_PORT)
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
            env = _container_env(c, f"PyTorchJob {name} {role}")
            for key, value in injected(role.lower(), i).items():
                env.pop(key, None)  # appended: a later entry wins and takes the last place
                env[key] = value
            pods.append(Pod(hostname=hostname, index=len(pods), role=role.lower(), container=c["name"],
                            command=list(c.get("command") or []), args=list(c.get("args") or []), env=env,
                            mounts=_mounts(c), volumes=_volumes(template.get("spec", {})),
                            aliases=service_names(hostname, namespace)))
    if not pods:
        raise WorkloadError(f"PyTorchJob {name}: no replicas")
    first = pods[0]
    rendezvous = (f"{first.hostname}:{master_port}" if master_port is not None
                  else first.env.get("PET_RDZV_ENDPOINT", f"{first.hostname}:{PYTORCH_DEFAULT_PORT}"))
    # v1.9.4 UpdateJobStatus: with a Master, the job succeeds when the Master does; without one,
    # when every Worker has, or with an elasticPolicy when any has.
    success = "first" if "Master" in replicas else ("any" if elastic is not None else "all")
    return Workload("PyTorchJob", name, namespace, pods, {}, restart, rendezvous, success)


def _not_yet(kind: str) -> Callable[[dict], Workload]:
    def reader(doc: dict) -> Workload:
        raise WorkloadError(f"workload.kind={kind}: the local cluster runs PyTorchJob and JobSet only so far (a "
                            "TrainJob's pods come from its runtime's JobSet, not simulated yet); render with "
                            "workload.kind=JobSet or PyTorchJob")
    return reader


# Workload kinds by the manifest's kind: each reader returns the pods its controller creates.
KINDS: dict[str, Callable[[dict], Workload]] = {
    "PyTorchJob": _pytorchjob,
    "JobSet": _not_yet("JobSet"),  # replaced by resilient_fsdp.local.jobset's reader when it is imported
    "TrainJob": _not_yet("TrainJob"),
}


def pods_of(documents: list[dict]) -> Workload:
    """The workload among rendered ``documents`` (one PyTorchJob, JobSet or TrainJob) with the
    ConfigMaps its pods mount. Other objects (ServiceAccount, NetworkPolicy, the ``helm test``
    Pod) have no local counterpart and are left out."""
    workloads = [d for d in documents if d.get("kind") in KINDS]
    if len(workloads) != 1:
        raise WorkloadError(f"expected one workload ({', '.join(KINDS)}) in the rendered chart, found "
                            f"{[d.get('kind') for d in workloads]}")
    workload = KINDS[workloads[0]["kind"]](workloads[0])
    maps = {d["metadata"]["name"]: {k: str(v) for k, v in (d.get("data") or {}).items()}
            for d in documents if d.get("kind") == "ConfigMap"}
    for pod in workload.pods:
        for mount in pod.mounts:
            volume = pod.volumes.get(mount.volume)
            if volume is None:
                raise WorkloadError(f"pod {pod.hostname}: volumeMount {mount.volume!r} has no volume")
            if volume.kind == "configMap" and volume.source.get("name") not in maps:
                raise WorkloadError(f"pod {pod.hostname}: volume {volume.name} needs ConfigMap "
                                    f"{volume.source.get('name')!r}, which the chart did not render")
    workload.config_maps = maps
    return workload
