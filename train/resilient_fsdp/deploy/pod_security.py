"""Pod Security Standards: would a namespace labelled ``pod-security.kubernetes.io/enforce`` admit these pods?

The rules of Kubernetes' pod-security-admission (``staging/src/k8s.io/pod-security-admission/policy``)
at the newest version of each check as of Kubernetes 1.34, restated so that ``validate`` can answer
without a cluster; :func:`check_pod_spec` lists the rules of each level. Linux pods only (the
Windows exemptions are not modelled). Each rule returns
:class:`~resilient_fsdp.deploy.admission.Finding` s naming the field, as the admission controller's
message does. Standard library only.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .admission import Finding

KUBERNETES_VERSION = "1.34"
LEVELS = ("privileged", "baseline", "restricted")

# policy/check_capabilities_baseline.go
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# policy/check_seLinuxOptions.go (container_engine_t from 1.31)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# policy/check_sysctls.go: the safe set as of 1.32 (tcp_rmem and tcp_wmem added there)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)
# policy/check_restrictedVolumes.go
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
_HANDLERS = ("livenessProbe", "readinessProbe", "startupProbe")


def _containers(spec: dict, path: str) -> Iterable[tuple[str, dict]]:
    for key in _CONTAINER_LISTS:
        for i, c in enumerate(spec.get(key) or []):
            yield f"{path}.{key}[{i}]", c or {}


def check_pod_spec(
    spec: dict, metadata: Optional[dict] = None, level: str = "baseline", path: str = "spec"
) -> list[Finding]:
    """Every rule of ``level`` that the pod (``spec``, and the AppArmor annotations in ``metadata``) breaks.

    ``baseline`` refuses what lets a pod escape its container: ``hostProcess``, ``hostNetwork``,
    ``hostPID``, ``hostIPC``; ``privileged`` containers; capabilities added outside
    :data:`BASELINE_CAPABILITIES`; ``hostPath`` volumes, ``hostPort`` s, probe and lifecycle handlers
    with a ``host``; AppArmor other than ``RuntimeDefault``/``Localhost``, SELinux types outside
    :data:`SELINUX_TYPES` or any SELinux user/role, ``procMount`` other than ``Default``, seccomp
    ``Unconfined``, sysctls outside :data:`SAFE_SYSCTLS`. ``restricted`` adds: only the volume types
    in :data:`RESTRICTED_VOLUMES`, ``allowPrivilegeEscalation: false``, ``runAsNonRoot: true`` and
    no ``runAsUser: 0``, seccomp ``RuntimeDefault``/``Localhost``, and capabilities ``drop: [ALL]``
    with nothing added but ``NET_BIND_SERVICE``.
    """
    if level not in LEVELS:
        raise ValueError(f"Pod Security level {level!r}: expected one of {', '.join(LEVELS)}")
    if level == "privileged":
        return []
    found = _baseline(spec or {}, metadata or {}, path)
    if level == "restricted":
        found += _restricted(spec or {}, path)
    return found


def _baseline(spec: dict, metadata: dict, path: str) -> list[Finding]:
    check = f"Pod Security baseline (Kubernetes {KUBERNETES_VERSION})"
    found: list[Finding] = []

    def bad(where: str, message: str) -> None:
        found.append(Finding(where, message, check))

    pod_sc = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            bad(f"{path}.{field}", "host namespaces are forbidden: must be false or unset")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        bad(f"{path}.securityContext.windowsOptions.hostProcess", "host processes are forbidden")
    _security_options(pod_sc, f"{path}.securityContext", bad)
    for i, volume in enumerate(spec.get("volumes") or []):
        if "hostPath" in (volume or {}):
            bad(f"{path}.volumes[{i}].hostPath", f"hostPath volumes are forbidden (volume {volume.get('name')!r})")
    for i, sysctl in enumerate(pod_sc.get("sysctls") or []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            bad(f"{path}.securityContext.sysctls[{i}].name", f"sysctl {sysctl.get('name')!r} is not in the safe set")
    meta_path = f"{path[: -len('spec')]}metadata" if path.endswith("spec") else "metadata"
    for key, value in (metadata.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            bad(
                f"{meta_path}.annotations[{key}]", f"AppArmor profile {value!r}: must be runtime/default or localhost/*"
            )
    for at, c in _containers(spec, path):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            bad(f"{at}.securityContext.privileged", "privileged containers are forbidden")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad(f"{at}.securityContext.windowsOptions.hostProcess", "host processes are forbidden")
        for j, cap in enumerate((sc.get("capabilities") or {}).get("add") or []):
            if cap not in BASELINE_CAPABILITIES:
                bad(
                    f"{at}.securityContext.capabilities.add[{j}]",
                    f"capability {cap} is not allowed (baseline allows {', '.join(sorted(BASELINE_CAPABILITIES))})",
                )
        if sc.get("procMount") not in (None, "Default"):
            bad(f"{at}.securityContext.procMount", f"procMount {sc['procMount']!r}: must be Default or unset")
        _security_options(sc, f"{at}.securityContext", bad)
        for j, port in enumerate(c.get("ports") or []):
            if port.get("hostPort"):
                bad(f"{at}.ports[{j}].hostPort", "host ports are forbidden: must be 0 or unset")
        handlers = [(h, c.get(h)) for h in _HANDLERS]
        handlers += [(f"lifecycle.{h}", (c.get("lifecycle") or {}).get(h)) for h in ("postStart", "preStop")]
        for name, handler in handlers:
            for kind in ("httpGet", "tcpSocket"):
                if ((handler or {}).get(kind) or {}).get("host"):
                    bad(f"{at}.{name}.{kind}.host", "probe and lifecycle handlers may not name a host")
    return found


def _security_options(sc: dict, at: str, bad) -> None:
    """The checks a pod-level and a container-level security context share: AppArmor, SELinux, seccomp."""
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        bad(f"{at}.appArmorProfile.type", f"AppArmor profile {apparmor!r}: must be RuntimeDefault or Localhost")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        bad(
            f"{at}.seLinuxOptions.type",
            f"SELinux type {selinux['type']!r} is not allowed "
            f"({', '.join(sorted(t for t in SELINUX_TYPES if t))} or unset)",
        )
    for field in ("user", "role"):
        if selinux.get(field):
            bad(f"{at}.seLinuxOptions.{field}", f"a custom SELinux {field} is forbidden")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        bad(f"{at}.seccompProfile.type", "seccomp Unconfined is forbidden")


def _restricted(spec: dict, path: str) -> list[Finding]:
    check = f"Pod Security restricted (Kubernetes {KUBERNETES_VERSION})"
    found: list[Finding] = []

    def bad(where: str, message: str) -> None:
        found.append(Finding(where, message, check))

    pod_sc = spec.get("securityContext") or {}
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = [k for k in (volume or {}) if k != "name"]
        for kind in kinds:
            if kind not in RESTRICTED_VOLUMES:
                bad(
                    f"{path}.volumes[{i}].{kind}",
                    f"volume type {kind} is not allowed (restricted allows {', '.join(sorted(RESTRICTED_VOLUMES))})",
                )
    if pod_sc.get("runAsUser") == 0:
        bad(f"{path}.securityContext.runAsUser", "must not be 0 (root)")
    if pod_sc.get("runAsNonRoot") is False:
        bad(f"{path}.securityContext.runAsNonRoot", "must not be false")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    containers = list(_containers(spec, path))
    for at, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            bad(f"{at}.securityContext.allowPrivilegeEscalation", "must be set to false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and pod_sc.get("runAsNonRoot") is not True):
            bad(f"{at}.securityContext.runAsNonRoot", "must be true (here or in the pod's securityContext)")
        if sc.get("runAsUser") == 0:
            bad(f"{at}.securityContext.runAsUser", "must not be 0 (root)")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad(
                f"{at}.securityContext.seccompProfile.type",
                "must be RuntimeDefault or Localhost (here or in the pod's securityContext)",
            )
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad(f"{at}.securityContext.capabilities.drop", "must include ALL")
        for j, cap in enumerate(caps.get("add") or []):
            if cap != "NET_BIND_SERVICE":
                bad(
                    f"{at}.securityContext.capabilities.add[{j}]",
                    f"capability {cap}: restricted allows only NET_BIND_SERVICE",
                )
    return found


# ---- where the pods are in each kind ---------------------------------------------------------------


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(path, pod template ``{metadata, spec}``) of every pod ``doc`` makes: a Pod itself, a Job's or a
    PodTemplate's template, a PyTorchJob's replicas, a JobSet's or (Cluster)TrainingRuntime's Jobs."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "Pod":
        return [("", {"metadata": doc.get("metadata") or {}, "spec": spec})]
    if kind == "PodTemplate":
        return [("template", doc.get("template") or {})]
    if kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
        return [("spec.template", spec.get("template") or {})]
    if kind == "PyTorchJob":
        return [
            (f"spec.pytorchReplicaSpecs.{role}.template", (r or {}).get("template") or {})
            for role, r in (spec.get("pytorchReplicaSpecs") or {}).items()
        ]
    prefix = "spec"
    if kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        spec, prefix = (spec.get("template") or {}).get("spec") or {}, "spec.template.spec"
    elif kind != "JobSet":
        return []
    return [
        (
            f"{prefix}.replicatedJobs[{i}].template.spec.template",
            ((r.get("template") or {}).get("spec") or {}).get("template") or {},
        )
        for i, r in enumerate(spec.get("replicatedJobs") or [])
    ]


def check_documents(docs: list[dict], level: str = "baseline") -> list[tuple[str, Finding]]:
    """(``Kind/name``, finding) for every pod the documents make that ``level`` refuses."""
    found = []
    for doc in docs:
        name = f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"
        for at, template in pod_templates(doc):
            spec_path = f"{at}.spec" if at else "spec"
            for finding in check_pod_spec(template.get("spec") or {}, template.get("metadata") or {}, level, spec_path):
                found.append((name, finding))
    return found
