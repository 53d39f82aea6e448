"""Pods as Linux network namespaces: the ``netns`` isolation mode (root).

:class:`NetnsRuntime` gives each pod of the workload a network namespace of its own on the run's
bridge (:mod:`resilient_fsdp.local.runtime.netns_pods`), with its hostname, a kubelet's hosts file
(its own names) and a resolv.conf naming the run's cluster DNS (every pod and alias, in the pod
spec's namespace), ports of this machine's loopback it is given at the same address in every pod
(:mod:`.netns_pods.host_ports`), and its volumes bind-mounted where the pod spec puts them; the image's code a
volume would hide is bound back (:func:`hidden_image_paths`). Each container runs as its
security context says, with the runtime's ``nofile`` limit, after the pod's init containers; for a
non-root user the way to this machine's interpreter is made searchable in the pod
(:meth:`NetnsRuntime.untraversable`). What it shares with the loopback
mode, and how the two differ, is in :mod:`resilient_fsdp.local.runtime.base`.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from ..manifests.spec import Mount, PodSpec, Workload
from .base import Runtime
from .netns_pods.network import PodNetwork


class NetnsRuntime(Runtime):
    """Each pod a network namespace on a bridge (:class:`PodNetwork`)."""

    mode = "netns"

    def __init__(
        self,
        workload: Workload,
        run_dir: Path,
        run_id: Optional[str],
        env: dict[str, str],
        shared_mount: str,
        host_ports: Sequence[int] = (),
    ):
        self.network = PodNetwork(run_id, namespace=workload.namespace)
        super().__init__(workload, run_dir, self.network.run_id, env)
        self.shared_mount = shared_mount
        try:
            self.scratch = self.network.dir / "volumes"
            self.scratch.mkdir()
            for pod in workload.pods:
                self.network.add_pod(pod.hostname, aliases=pod.aliases, fqdn=pod.fqdn or None)
            for port in host_ports:
                self.network.forward_host_port(port)
            self.write_config_maps()
        except BaseException:
            self.network.close()
            raise

    def describe(self) -> str:
        return (
            f"pods as network namespaces (run {self.run_id}, {self.network.subnet}; "
            + ", ".join(f"{p.hostname}={self.network.pods[p.hostname].ip}" for p in self.workload.pods)
            + ")"
        )

    def pod_path(self, host_path: Path) -> str:
        return str(Path(self.shared_mount) / Path(host_path).relative_to(self.run_dir))

    def start(self, pod: PodSpec, extra_env: dict[str, str]) -> subprocess.Popen:
        self.fresh_empty_dirs(pod)
        self.apply_fs_group(pod)
        inits = [
            {
                "name": init.name,
                "argv": init.argv,
                "env": self.environment(pod, {}, init.env),
                "security": init.security.podinit(),
                **self.container_mounts(pod, init.mounts),
            }
            for init in pod.init_containers
        ]
        return self.network.pods[pod.hostname].spawn(
            pod.argv,
            env=self.environment(pod, extra_env),
            cwd="/",
            **self.container_mounts(pod, pod.mounts),
            security=pod.security.podinit(),
            nofile=self.nofile,
            inits=inits,
            traverse=self.untraversable(pod),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )

    def container_mounts(self, pod: PodSpec, mounts: list[Mount]) -> dict[str, dict[str, str]]:
        """One container's ``mounts``, ``ro_mounts`` and ``tmpfs`` as ``PodHandle.spawn`` takes them."""
        binds: dict[str, str] = {}
        read_only: dict[str, str] = {}
        tmpfs: dict[str, str] = {}
        for mount in mounts:
            how, what = self.volume_source(pod, mount)
            if how == "tmpfs":
                tmpfs[mount.path] = what
            elif mount.read_only or pod.volumes[mount.volume].kind == "configMap":
                read_only[what] = mount.path
            else:
                binds[what] = mount.path
        # The image's code where a volume would hide it (a checkout or a test's folder under /tmp).
        for top, target in hidden_image_paths(self.image_paths(), [m.path for m in mounts]):
            host_target = next((h for h, p in binds.items() if p == target), None)
            if host_target is not None:  # an emptyDir of ours: make the mount point there
                Path(host_target, os.path.relpath(top, target)).mkdir(parents=True, exist_ok=True)
            read_only.setdefault(top, top)
        return {"mounts": binds, "ro_mounts": read_only, "tmpfs": tmpfs}

    def untraversable(self, pod: PodSpec) -> list[str]:
        """Directories on the way to the image's paths that a pod's non-root user could not
        search (this machine's interpreter under a 0700 /root): the pod gets search permission on
        its own copy of them, as an image has its Python readable by every user."""
        if all(not s.uid for s in [pod.security] + [i.security for i in pod.init_containers]):
            return []
        found: set[str] = set()
        for path in self.image_paths():
            current = "/"
            for part in [p for p in path.split("/") if p]:
                current = os.path.join(current, part)
                try:
                    if os.stat(current).st_mode & (stat.S_IXGRP | stat.S_IXOTH) != stat.S_IXGRP | stat.S_IXOTH:
                        found.add(current)
                except OSError:
                    break
        return sorted(found)

    def kill(self, pod: PodSpec) -> list[int]:
        return self.network.pods[pod.hostname].kill_all()

    def partition(self, pod: PodSpec, seconds: Optional[float]) -> None:
        handle = self.network.pods[pod.hostname]
        if seconds:
            handle.partition_for(seconds)
        else:
            handle.partition(True)

    def freeze(self, pod: PodSpec) -> list[int]:
        return self.network.pods[pod.hostname].freeze()

    def delete_frozen(self, pod: PodSpec) -> list[int]:
        handle = self.network.pods[pod.hostname]
        pids = handle.kill_all()
        handle.partition(False)
        return pids

    def close(self) -> None:
        self.network.close()


def hidden_image_paths(paths: list[str], mount_paths: list[str]) -> list[tuple[str, str]]:
    """(directory, mount path) for each of ``paths`` a pod mount would hide: the directory just
    below the mount path that holds it (``/tmp/clone`` for ``/tmp/clone/.venv/bin``)."""
    found: dict[str, str] = {}
    for target in mount_paths:
        base = target.rstrip("/")
        if not base:
            continue
        for path in paths:
            if path.startswith(base + "/"):
                top = base + "/" + path[len(base) + 1 :].split("/", 1)[0]
                found.setdefault(top, base)
    return sorted(found.items())
