"""The rendered workload as the local cluster runs it: pods, their containers, volumes and policy.

A :class:`Workload` is every pod the workload controller would create (:class:`PodSpec`), each
with its hostname, the names that resolve to it, its trainer container (``command``, ``args``,
``env`` with what the controller injects, volume mounts, security context), its init containers
and volumes, plus the rendered ConfigMaps and the kind's restart rules (:class:`RestartRules`).
Each kind's reader builds one
(:mod:`resilient_fsdp.local.manifests.kinds`) with the Kubernetes rules here that every kind
shares: ``env`` in order with ``$(VAR)`` expansion, volumes and mounts, quantities, Service names.
Nothing here starts a process, and nothing depends on how pods are isolated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Protocol

from .errors import WorkloadError  # noqa: F401  (the readers import it from here)
from .security import Security, security_of


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)([KMGTPE]i?)?$")
_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


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
class InitContainer:
    """One of the pod's ``initContainers``: run in order, each to completion, before the trainer
    container; a failing one fails the pod."""

    name: str
    argv: list[str]
    """``command`` + ``args``, ``$(VAR)`` expanded from its own ``env``."""
    env: dict[str, str]
    mounts: list[Mount]
    security: Security


@dataclass
class PodSpec:
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
    security: Security = field(default_factory=Security)
    """The trainer container's user, groups, capabilities and read-only root (:mod:`.security`)."""
    init_containers: list[InitContainer] = field(default_factory=list)
    """``initContainers``, in order."""
    fqdn: str = ""
    """For a pod with a subdomain (a JobSet's), ``<hostname>.<subdomain>.<namespace>.svc.cluster.local``:
    the name the kubelet writes beside the hostname in the pod's own /etc/hosts; empty without one."""

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


class RestartRules(Protocol):
    """What the workload controller asks of a kind's restart rules when a pod fails; each kind's
    reader builds its own (PyTorchJob: ``RestartPolicy``; JobSet: ``JobSetPolicy``)."""

    active_deadline_s: Optional[float]
    """``activeDeadlineSeconds``: past it the job fails; None: no deadline."""

    def retryable(self, code: int) -> bool:
        """Whether a pod exiting with ``code`` is recreated by its own ``restartPolicy``."""
        ...

    def on_failure(self, pod: PodSpec, code: int, lost: bool, failures: int) -> tuple[str, str]:
        """What the controller does about ``pod`` ending with ``code`` (``lost``: killed with its
        node; ``failures``: pod failures so far, this one included): ``(action, why)``, the action
        ``recreate`` (this pod, same name), ``restart`` (every pod) or ``fail`` (the job)."""
        ...


@dataclass
class Workload:
    kind: str
    name: str
    namespace: str
    pods: list[PodSpec]
    config_maps: dict[str, dict[str, str]]
    restart: RestartRules
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

    def pod(self, hostname: str) -> PodSpec:
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


def local_node(hostname: str) -> str:
    """The node a local pod "runs on" (downward API ``spec.nodeName``): each pod is a machine of
    its own on the local cluster."""
    return f"local-node-{hostname}"


def container_env(container: dict, where: str, fields: Optional[dict[str, str]] = None) -> dict[str, str]:
    """A container's rendered ``env`` in order, each value expanded from the entries before it;
    ``fields`` are the pod's downward-API values by ``fieldPath`` (``metadata.name``,
    ``metadata.labels['KEY']``) that a ``valueFrom.fieldRef`` may read; ``where`` names the
    container in errors."""
    env: dict[str, str] = {}
    fields = fields or {}
    for entry in container.get("env") or []:
        if "value" not in entry and "valueFrom" in entry:
            path = (entry["valueFrom"].get("fieldRef") or {}).get("fieldPath")
            if path is None or path not in fields:
                raise WorkloadError(
                    f"{where}.env {entry['name']}: valueFrom ({', '.join(entry['valueFrom'])}"
                    f"{' ' + path if path else ''}) is not supported by the local cluster (no "
                    "Secrets here; of the downward API only the pod's name, its node, its "
                    f"controller's labels and annotations: {', '.join(sorted(fields)) or 'none'}); give a value"
                )
            env[entry["name"]] = fields[path]
            continue
        env[entry["name"]] = expand(str(entry.get("value", "")), env)
    if container.get("envFrom"):
        raise WorkloadError(
            f"{where}.envFrom is not supported by the local cluster (no Secrets or ConfigMap "
            "references here); set pod.env values instead"
        )
    return env


def pod_volumes(spec: dict) -> dict[str, Volume]:
    """A pod template's ``spec.volumes`` by name."""
    out = {}
    for v in spec.get("volumes") or []:
        kinds = [k for k in v if k != "name"]
        kind = kinds[0] if kinds else "emptyDir"
        out[v["name"]] = Volume(v["name"], kind, v.get(kind) or {})
    return out


def container_mounts(container: dict) -> list[Mount]:
    """A container's ``volumeMounts``."""
    return [
        Mount(m["name"], m["mountPath"], bool(m.get("readOnly", False)), m.get("subPath", ""))
        for m in container.get("volumeMounts") or []
    ]


def init_containers(spec: dict, where: str, fields: Optional[dict[str, str]] = None) -> list[InitContainer]:
    """A pod template spec's ``initContainers`` (``fields``: the downward-API values, as for
    :func:`container_env`)."""
    out = []
    for c in spec.get("initContainers") or []:
        name = f"{where} initContainer {c.get('name')}"
        if c.get("restartPolicy") == "Always":
            raise WorkloadError(f"{name}: a sidecar (restartPolicy: Always) is not supported by the local cluster")
        env = container_env(c, name, fields)
        argv = [expand(a, env) for a in list(c.get("command") or []) + list(c.get("args") or [])]
        if not argv:
            raise WorkloadError(f"{name}: no command (the local cluster has no image entrypoint to fall back on)")
        out.append(InitContainer(c["name"], argv, env, container_mounts(c), security_of(spec, c, name)))
    return out
