"""A container's runtime identity and limits, as the kubelet and a container runtime derive them.

:func:`security_of` merges the pod's ``securityContext`` with the container's (the container's
field wins) into a :class:`Security`: the user and groups, the capabilities kept,
``no_new_privs``, a read-only root, the ``nofile`` limit. The defaults modelled are containerd's
(runc's) for a non-privileged container, each beside its constant. Nothing here starts a
process; the netns runtime hands the result to the pod-side setup, which applies it last.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Optional

from .errors import WorkloadError

# Linux capability numbers (include/uapi/linux/capability.h).
CAPABILITIES = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "DAC_READ_SEARCH": 2,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "LINUX_IMMUTABLE": 9,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "IPC_OWNER": 15,
    "SYS_MODULE": 16,
    "SYS_RAWIO": 17,
    "SYS_CHROOT": 18,
    "SYS_PTRACE": 19,
    "SYS_PACCT": 20,
    "SYS_ADMIN": 21,
    "SYS_BOOT": 22,
    "SYS_NICE": 23,
    "SYS_RESOURCE": 24,
    "SYS_TIME": 25,
    "SYS_TTY_CONFIG": 26,
    "MKNOD": 27,
    "LEASE": 28,
    "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30,
    "SETFCAP": 31,
    "MAC_OVERRIDE": 32,
    "MAC_ADMIN": 33,
    "SYSLOG": 34,
    "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37,
    "PERFMON": 38,
    "BPF": 39,
    "CHECKPOINT_RESTORE": 40,
}
# containerd pkg/oci defaultUnixCaps: what a non-privileged container starts with.
RUNTIME_DEFAULT_CAPS = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
)
# systemd's default since v240, which containers of a containerd unit without LimitNOFILE inherit
# (containerd/containerd#8924). EKS AMIs have shipped higher limits (awslabs/amazon-eks-ami#1551),
# so a job must not rely on more than the soft 1024.
DEFAULT_NOFILE = (1024, 524288)
# Fields the local cluster applies; the others (seccompProfile, seLinuxOptions, ...) are accepted
# and not applied (docs/local-runs.md).
_POD_FIELDS = {"runAsUser", "runAsGroup", "runAsNonRoot", "supplementalGroups", "fsGroup"}
_CONTAINER_FIELDS = {
    "runAsUser",
    "runAsGroup",
    "runAsNonRoot",
    "readOnlyRootFilesystem",
    "capabilities",
    "allowPrivilegeEscalation",
    "privileged",
}


@dataclass(frozen=True)
class Security:
    """What one container's process runs as."""

    uid: Optional[int] = None
    """``runAsUser``; None: the image's user (here: the local cluster's own)."""
    gid: Optional[int] = None
    """``runAsGroup``; None: the user's primary group (0 for root, as an image without /etc/passwd
    entries gives)."""
    groups: tuple[int, ...] = ()
    """Supplementary groups: ``supplementalGroups`` then ``fsGroup``, as the kubelet adds them."""
    fs_group: Optional[int] = None
    """``fsGroup``: the group the kubelet gives the volumes it manages."""
    caps: tuple[str, ...] = RUNTIME_DEFAULT_CAPS
    """The bounding set: the runtime's default, less ``drop``, plus ``add``. Effective only for
    root: a process of another user starts with none (no ambient capabilities)."""
    no_new_privs: bool = False
    """``allowPrivilegeEscalation: false``."""
    read_only_root: bool = False
    """``readOnlyRootFilesystem``."""

    def podinit(self) -> dict:
        """The form the pod-side setup reads (standard library only there)."""
        return {
            "uid": self.uid,
            "gid": self.gid,
            "groups": list(self.groups),
            "caps": sorted(CAPABILITIES[c] for c in self.caps),
            "no_new_privs": self.no_new_privs,
            "read_only_root": self.read_only_root,
        }


def _ids(value, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WorkloadError(f"{where}: {value!r} is not a user or group id (a non-negative integer)")
    return value


def _cap_names(values, where: str) -> list[str]:
    names = []
    for v in values or []:
        name = str(v).upper().removeprefix("CAP_")
        if name != "ALL" and name not in CAPABILITIES:
            raise WorkloadError(f"{where}: unknown capability {v!r} (e.g. CHOWN, NET_RAW, ALL)")
        names.append(name)
    return names


def security_of(pod_spec: dict, container: dict, where: str) -> Security:
    """The merged security context of ``container`` in the pod template spec ``pod_spec``;
    ``where`` names the container in errors."""
    pod = pod_spec.get("securityContext") or {}
    own = container.get("securityContext") or {}
    if own.get("privileged"):
        raise WorkloadError(
            f"{where}.securityContext.privileged: true is not supported by the local cluster (the chart never needs it)"
        )
    uid = _ids(own.get("runAsUser", pod.get("runAsUser")), f"{where} runAsUser")
    gid = _ids(own.get("runAsGroup", pod.get("runAsGroup")), f"{where} runAsGroup")
    if own.get("runAsNonRoot", pod.get("runAsNonRoot")) and not uid:
        # The kubelet refuses to start it (CreateContainerConfigError), the image's user being root here.
        raise WorkloadError(f"{where}: runAsNonRoot is true but runAsUser is {uid!r} (root); set a non-zero runAsUser")
    fs_group = _ids(pod.get("fsGroup"), f"{where} fsGroup")
    groups = [_ids(g, f"{where} supplementalGroups") for g in pod.get("supplementalGroups") or []]
    if fs_group is not None and fs_group not in groups:
        groups.append(fs_group)
    caps_spec = own.get("capabilities") or {}
    drop = _cap_names(caps_spec.get("drop"), f"{where}.securityContext.capabilities.drop")
    add = _cap_names(caps_spec.get("add"), f"{where}.securityContext.capabilities.add")
    caps = [] if "ALL" in drop else [c for c in RUNTIME_DEFAULT_CAPS if c not in drop]
    caps += [c for c in (list(CAPABILITIES) if "ALL" in add else add) if c not in caps]
    return Security(
        uid=uid,
        gid=gid,
        groups=tuple(groups),
        fs_group=fs_group,
        caps=tuple(caps),
        no_new_privs=own.get("allowPrivilegeEscalation") is False,
        read_only_root=bool(own.get("readOnlyRootFilesystem")),
    )


def nofile_limit(text: Optional[str] = None) -> tuple[int, int]:
    """The ``nofile`` limit (soft, hard) for ``--nofile SOFT[:HARD]`` (None: the default). A hard
    limit above this process's own needs CAP_SYS_RESOURCE: without it the default's hard limit is
    this process's, and an explicit one above it is refused."""
    current = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    can_raise = _has_capability(CAPABILITIES["SYS_RESOURCE"])
    if text is None:
        soft, hard = DEFAULT_NOFILE
        hard = hard if can_raise or current == resource.RLIM_INFINITY else min(hard, current)
        return min(soft, hard), hard
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1 or (len(parts) == 2 and parts[0] > parts[1]):
        raise WorkloadError(
            f"--nofile {text!r}: give SOFT or SOFT:HARD, positive integers with SOFT <= HARD "
            f"(default {DEFAULT_NOFILE[0]}:{DEFAULT_NOFILE[1]})"
        )
    soft, hard = parts[0], parts[-1] if len(parts) == 2 else max(parts[0], DEFAULT_NOFILE[1])
    if len(parts) == 1 and not can_raise and current != resource.RLIM_INFINITY:
        hard = max(soft, min(hard, current))
    if hard > current and current != resource.RLIM_INFINITY and not can_raise:
        raise WorkloadError(
            f"--nofile {text!r}: the hard limit {hard} is above this process's ({current}), which "
            "only a process with CAP_SYS_RESOURCE may raise; give at most "
            f"{current} or run with that capability"
        )
    return soft, hard


def _has_capability(cap: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except OSError:
        pass
    return False
