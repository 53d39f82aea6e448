"""Where the local cluster's pods run, as the launcher sees it: what both isolation modes share.

A pod runs as a network namespace (``netns``) or as processes on loopback. :class:`Runtime` is
the interface the launcher (:mod:`resilient_fsdp.local.cluster.launcher`) uses and the part the
two modes share; its docstring compares what each mode gives a pod. The image is this machine's
Python environment. Resources, probes and scheduling fields are not applied.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional

from ..manifests.spec import Mount, PodSpec, Workload, WorkloadError, quantity_bytes
from ..manifests.security import nofile_limit
from .paths import IN_TEXT, replace_paths

POD_MARK_ENV = "RESILIENT_FSDP_LOCAL_POD"
"""Set in every local pod's environment (``<run id>/<hostname>``): how loopback mode finds a
pod's processes, re-parented ones included."""


class Runtime:
    """What both isolation modes share: the volumes' host side and the pod's environment. Each
    mode starts a pod's container as rendered, kills every process of a pod at once, and gives
    each pod what its volumes promise:

    ============================  =====================================  ===============================
    rendered                      ``netns`` (root)                       ``loopback`` (anyone)
    ============================  =====================================  ===============================
    pod hostname, Service names   UTS hostname; the run's cluster DNS    mapped to 127.0.0.<index+1> in
                                  (resolv.conf), a kubelet's /etc/hosts  args and env (``PET_LOCAL_ADDR``)
    ConfigMap volume              files under ``<run_dir>/cluster``,     the same files; the mount path
                                  bind-mounted read-only (items,         in args and env is rewritten to
                                  subPath)                               where they are
    the shared claim (PVC)        the run directory, bind-mounted        the run directory, rendered as
                                                                         the mount path itself
    ``emptyDir``                  a fresh directory per pod start        a fresh directory per pod start
                                  (``medium: Memory``: a tmpfs)          (``/tmp``: ``TMPDIR``)
    node loss                     every process in the pod's namespace   every process carrying the
                                                                         pod's mark in its environment
    partition                     the pod's veth goes down               refused
    node freeze                   veth down, every process SIGSTOPped    refused
    ============================  =====================================  ===============================

    The image is this machine's Python environment: ``python`` is this interpreter, ``PYTHONPATH``
    is kept, and PYTHONPATH entries a pod volume would hide (``/tmp``) are bound read-only at the same
    path. In netns mode each container runs as its security context says (user, groups, fsGroup on
    the volumes the kubelet manages, read-only root, capabilities) with the container runtime's
    ``nofile`` limit, after its pod's init containers (:mod:`.netns_pods.podinit`); loopback applies
    none of that. Resources, probes and scheduling fields are not applied.
    """

    mode = ""

    def __init__(self, workload: Workload, run_dir: Path, run_id: str, env: dict[str, str]):
        self.workload, self.run_dir, self.run_id = workload, run_dir, run_id
        self.base_env = dict(env)
        if self.base_env.get("PYTHONPATH"):
            # The image's import path, as this shell gave it: a pod's processes start elsewhere (its
            # working directory is the container's), so a relative entry would name nothing there.
            self.base_env["PYTHONPATH"] = os.pathsep.join(
                os.path.abspath(p) for p in self.base_env["PYTHONPATH"].split(os.pathsep) if p
            )
        self.cluster_dir = run_dir / "cluster"
        self.scratch: Optional[Path] = None  # per-pod emptyDir directories
        self.starts: dict[str, int] = {}
        self.nofile: tuple[int, int] = nofile_limit()
        """The ``nofile`` limit (soft, hard) the container runtime gives each container (netns)."""
        self.shared_fs_group: str = "skip"
        """Whether the kubelet applies ``fsGroup`` to the shared claim: ``skip``, as for an RWX
        volume of a CSI driver whose ``fsGroupPolicy`` is ``ReadWriteOnceWithFSType`` (FSx for
        Lustre's), or ``apply``, as for a driver with ``File`` (netns)."""

    # -- volumes ---------------------------------------------------------------------------------

    def write_config_maps(self, transform=lambda text: text) -> None:
        """Each ConfigMap volume's files, once per run (every pod mounts the same copy):
        ``<run_dir>/cluster/configmaps/<volume>/``. A copy left by an earlier run in the same run
        directory is replaced: this run's rendered values win (a resumed run drops a stop step)."""
        written: set[str] = set()
        for pod in self.workload.pods:
            for volume in pod.volumes.values():
                if volume.kind != "configMap" or volume.name in written:
                    continue
                written.add(volume.name)
                target = self.cluster_dir / "configmaps" / volume.name
                if target.exists():
                    shutil.rmtree(target)
                data = self.workload.config_maps[volume.source["name"]]
                items = volume.source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] not in data:
                        raise WorkloadError(
                            f"volume {volume.name}: ConfigMap {volume.source['name']} has no key {item['key']!r}"
                        )
                    path = target / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(transform(data[item["key"]]))

    def volume_source(self, pod: PodSpec, mount: Mount) -> tuple[str, str]:
        """(``"bind"``, host path) or (``"tmpfs"``, options) for one of ``pod``'s mounts."""
        volume = pod.volumes[mount.volume]
        if volume.kind == "configMap":
            host = self.cluster_dir / "configmaps" / volume.name
        elif volume.kind == "persistentVolumeClaim":
            host = self.run_dir  # the job's one shared claim: the run directory
        elif volume.kind == "hostPath":
            host = Path(volume.source["path"])
        elif volume.kind == "emptyDir":
            if volume.memory and self.mode == "netns":
                size = volume.source.get("sizeLimit")
                group = pod.security.fs_group
                # fsGroup: the kubelet gives the volume that group and the setgid bit.
                owner = ["mode=1777"] if group is None else ["mode=3777", f"gid={group}"]
                return "tmpfs", ",".join(owner + ([f"size={quantity_bytes(size)}"] if size else []))
            host = self.scratch / pod.hostname / volume.name
        else:
            raise WorkloadError(
                f"pod {pod.hostname}: volume {volume.name} is a {volume.kind}, which the local "
                "cluster does not provide (configMap, persistentVolumeClaim, emptyDir, hostPath)"
            )
        if mount.sub_path:
            host = host / mount.sub_path
        return "bind", str(host)

    def mounted_paths(self, pod: PodSpec) -> list[tuple[str, str]]:
        """(mount path, host path) of the shared claim and the ConfigMaps, where they differ."""
        found = [
            (m.path.rstrip("/"), self.volume_source(pod, m)[1])
            for m in pod.mounts
            if pod.volumes[m.volume].kind != "emptyDir"
        ]
        return [(path, host) for path, host in sorted(found, key=lambda x: -len(x[0])) if path != host]

    def to_host(self, pod: PodSpec, text: str) -> str:
        """A line ``pod`` printed, its volumes' paths as this machine sees them (for the console)."""
        return replace_paths(text, self.mounted_paths(pod), IN_TEXT)

    def fresh_empty_dirs(self, pod: PodSpec) -> None:
        """A recreated pod gets new emptyDir volumes, as on a cluster."""
        base = self.scratch / pod.hostname
        shutil.rmtree(base, ignore_errors=True)
        for volume in pod.volumes.values():
            if volume.kind == "emptyDir":
                (base / volume.name).mkdir(parents=True, mode=0o1777)
                os.chmod(base / volume.name, 0o1777)

    def apply_fs_group(self, pod: PodSpec) -> None:
        """``fsGroup`` on the volumes the kubelet manages (emptyDir, configMap: group-owned, group
        read-write, directories setgid), and on the shared claim only under ``shared_fs_group``
        ``apply`` (a driver whose ``fsGroupPolicy`` skips RWX volumes gets no change)."""
        group = pod.security.fs_group
        if group is None or self.mode != "netns":
            return
        for volume in pod.volumes.values():
            if volume.kind == "emptyDir" and not volume.memory:
                set_group(self.scratch / pod.hostname / volume.name, group)
            elif volume.kind == "configMap":
                set_group(self.cluster_dir / "configmaps" / volume.name, group, writable=False)
            elif volume.kind == "persistentVolumeClaim" and self.shared_fs_group == "apply":
                set_group(self.run_dir, group)

    # -- environment -----------------------------------------------------------------------------

    def environment(
        self, pod: PodSpec, extra: dict[str, str], container_env: Optional[dict[str, str]] = None
    ) -> dict[str, str]:
        """The image's environment (this machine's, with ``python`` this interpreter), then the
        container's rendered and injected ``env`` (``container_env``: an init container's; default
        the trainer container's), then the local cluster's own additions."""
        env = dict(self.base_env)
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join(
            [bin_dir] + [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
        )
        env.update(pod.env if container_env is None else container_env)
        env.update(extra)
        env[POD_MARK_ENV] = f"{self.run_id}/{pod.hostname}"
        return env

    def image_paths(self) -> list[str]:
        """What a pod needs of this machine to run ``python -m resilient_fsdp...``: the interpreter,
        its environment, this process's import path (an editable checkout) and ``PYTHONPATH``."""
        paths = [p for p in self.base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths += [p for p in sys.path if p]
        paths += [
            sys.prefix,
            sys.base_prefix,
            os.path.dirname(sys.executable),
            os.path.dirname(os.path.realpath(sys.executable)),
        ]
        return [os.path.abspath(p) for p in paths if os.path.isdir(p)]

    # -- the interface the launcher uses ---------------------------------------------------------

    def describe(self) -> str:
        raise NotImplementedError

    def pod_path(self, host_path: Path) -> str:
        """Where a pod sees ``host_path`` of the run directory."""
        raise NotImplementedError

    def start(self, pod: PodSpec, extra_env: dict[str, str]) -> subprocess.Popen:
        raise NotImplementedError

    def kill(self, pod: PodSpec) -> list[int]:
        raise NotImplementedError

    def partition(self, pod: PodSpec, seconds: Optional[float]) -> None:
        raise NotImplementedError

    def freeze(self, pod: PodSpec) -> list[int]:
        """The pod's node stops reporting: link down, every process stopped; the pids."""
        raise NotImplementedError

    def delete_frozen(self, pod: PodSpec) -> list[int]:
        """The frozen pod's node is deleted: its processes killed, its link back for the pod's
        replacement (the same address, as the local cluster recreates a pod); the pids."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def set_group(root: Path, group: int, writable: bool = True) -> None:
    """The kubelet's volume ownership for ``fsGroup``: every file and directory under ``root``
    owned by ``group``, readable (``writable``: and writable) by it, directories setgid."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        st = path.stat()
        os.chown(path, -1, group)
        extra = stat.S_IRGRP | (stat.S_IWGRP if writable else 0)
        if path.is_dir():
            extra |= stat.S_IXGRP | stat.S_ISGID
        os.chmod(path, stat.S_IMODE(st.st_mode) | extra)
