"""Where the local cluster's pods run: as network namespaces (``netns``) or as processes on loopback.

Both start a pod's container as rendered (:class:`~resilient_fsdp.local.workload.Pod`), kill every
process of a pod at once, and give each pod what its volumes promise:

============================  =====================================  ===============================
rendered                      ``netns`` (root)                       ``loopback`` (anyone)
============================  =====================================  ===============================
pod hostname, Service names   UTS hostname; hosts file in every pod  mapped to 127.0.0.<index+1> in
                                                                     args and env (``PET_LOCAL_ADDR``)
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
============================  =====================================  ===============================

The image is this machine's Python environment: ``python`` is this interpreter, ``PYTHONPATH``
is kept, and PYTHONPATH entries a pod volume would hide (``/tmp``) are bound read-only at the same
path. Resources, security contexts and probes are not applied.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

from .paths import IN_TEXT, replace_paths
from .workload import Mount, Pod, Workload, WorkloadError, quantity_bytes

POD_MARK_ENV = "RESILIENT_FSDP_LOCAL_POD"
"""Set in every local pod's environment (``<run id>/<hostname>``): how loopback mode finds a
pod's processes, re-parented ones included."""

class Runtime:
    """What both isolation modes share: the volumes' host side and the pod's environment."""

    mode = ""

    def __init__(self, workload: Workload, run_dir: Path, run_id: str, env: dict[str, str]):
        self.workload, self.run_dir, self.run_id = workload, run_dir, run_id
        self.base_env = dict(env)
        self.cluster_dir = run_dir / "cluster"
        self.scratch: Optional[Path] = None  # per-pod emptyDir directories
        self.starts: dict[str, int] = {}

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
                        raise WorkloadError(f"volume {volume.name}: ConfigMap {volume.source['name']} has no key "
                                            f"{item['key']!r}")
                    path = target / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(transform(data[item["key"]]))

    def volume_source(self, pod: Pod, mount: Mount) -> tuple[str, str]:
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
                return "tmpfs", ",".join(["mode=1777"] + ([f"size={quantity_bytes(size)}"] if size else []))
            host = self.scratch / pod.hostname / volume.name
        else:
            raise WorkloadError(f"pod {pod.hostname}: volume {volume.name} is a {volume.kind}, which the local "
                                "cluster does not provide (configMap, persistentVolumeClaim, emptyDir, hostPath)")
        if mount.sub_path:
            host = host / mount.sub_path
        return "bind", str(host)

    def mounted_paths(self, pod: Pod) -> list[tuple[str, str]]:
        """(mount path, host path) of the shared claim and the ConfigMaps, where they differ."""
        found = [(m.path.rstrip("/"), self.volume_source(pod, m)[1]) for m in pod.mounts
                 if pod.volumes[m.volume].kind != "emptyDir"]
        return [(path, host) for path, host in sorted(found, key=lambda x: -len(x[0])) if path != host]

    def to_host(self, pod: Pod, text: str) -> str:
        """A line ``pod`` printed, its volumes' paths as this machine sees them (for the console)."""
        return replace_paths(text, self.mounted_paths(pod), IN_TEXT)

    def fresh_empty_dirs(self, pod: Pod) -> None:
        """A recreated pod gets new emptyDir volumes, as on a cluster."""
        base = self.scratch / pod.hostname
        shutil.rmtree(base, ignore_errors=True)
        for volume in pod.volumes.values():
            if volume.kind == "emptyDir":
                (base / volume.name).mkdir(parents=True, mode=0o1777)
                os.chmod(base / volume.name, 0o1777)

    # -- environment -----------------------------------------------------------------------------

    def environment(self, pod: Pod, extra: dict[str, str]) -> dict[str, str]:
        """The image's environment (this machine's, with ``python`` this interpreter), then the
        container's rendered and injected ``env``, then the local cluster's own additions."""
        env = dict(self.base_env)
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", os.defpath).split(os.pathsep)
                                                   if p and p != bin_dir])
        env.update(pod.env)
        env.update(extra)
        env[POD_MARK_ENV] = f"{self.run_id}/{pod.hostname}"
        return env

    def image_paths(self) -> list[str]:
        """What a pod needs of this machine to run ``python -m resilient_fsdp...``: the interpreter,
        its environment, this process's import path (an editable checkout) and ``PYTHONPATH``."""
        paths = [p for p in self.base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths += [p for p in sys.path if p]
        paths += [sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
                  os.path.dirname(os.path.realpath(sys.executable))]
        return [os.path.abspath(p) for p in paths if os.path.isdir(p)]

    # -- the interface the launcher uses ---------------------------------------------------------

    def describe(self) -> str:
        raise NotImplementedError

    def pod_path(self, host_path: Path) -> str:
        """Where a pod sees ``host_path`` of the run directory."""
        raise NotImplementedError

    def start(self, pod: Pod, extra_env: dict[str, str]) -> subprocess.Popen:
        raise NotImplementedError

    def kill(self, pod: Pod) -> list[int]:
        raise NotImplementedError

    def partition(self, pod: Pod, seconds: Optional[float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NetnsRuntime(Runtime):
    """Each pod a network namespace on a bridge (:class:`~resilient_fsdp.local.pods.PodNetwork`)."""

    mode = "netns"

    def __init__(self, workload: Workload, run_dir: Path, run_id: Optional[str], env: dict[str, str],
                 shared_mount: str):
        from .pods import PodNetwork

        self.network = PodNetwork(run_id)
        super().__init__(workload, run_dir, self.network.run_id, env)
        self.shared_mount = shared_mount
        try:
            self.scratch = self.network.dir / "volumes"
            self.scratch.mkdir()
            for pod in workload.pods:
                self.network.add_pod(pod.hostname, aliases=pod.aliases)
            self.write_config_maps()
        except BaseException:
            self.network.close()
            raise

    def describe(self) -> str:
        return (f"pods as network namespaces (run {self.run_id}, {self.network.subnet}; "
                + ", ".join(f"{p.hostname}={self.network.pods[p.hostname].ip}" for p in self.workload.pods) + ")")

    def pod_path(self, host_path: Path) -> str:
        return str(Path(self.shared_mount) / Path(host_path).relative_to(self.run_dir))

    def start(self, pod: Pod, extra_env: dict[str, str]) -> subprocess.Popen:
        self.fresh_empty_dirs(pod)
        binds: dict[str, str] = {}
        read_only: dict[str, str] = {}
        tmpfs: dict[str, str] = {}
        for mount in pod.mounts:
            how, what = self.volume_source(pod, mount)
            if how == "tmpfs":
                tmpfs[mount.path] = what
            elif mount.read_only or pod.volumes[mount.volume].kind == "configMap":
                read_only[what] = mount.path
            else:
                binds[what] = mount.path
        # The image's code where a volume would hide it (a checkout or a test's folder under /tmp).
        for top, target in hidden_image_paths(self.image_paths(), [m.path for m in pod.mounts]):
            host_target = next((h for h, p in binds.items() if p == target), None)
            if host_target is not None:  # an emptyDir of ours: make the mount point there
                Path(host_target, os.path.relpath(top, target)).mkdir(parents=True, exist_ok=True)
            read_only.setdefault(top, top)
        return self.network.pods[pod.hostname].spawn(
            pod.argv, env=self.environment(pod, extra_env), cwd="/", mounts=binds, ro_mounts=read_only, tmpfs=tmpfs,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def kill(self, pod: Pod) -> list[int]:
        return self.network.pods[pod.hostname].kill_all()

    def partition(self, pod: Pod, seconds: Optional[float]) -> None:
        handle = self.network.pods[pod.hostname]
        if seconds:
            handle.partition_for(seconds)
        else:
            handle.partition(True)

    def close(self) -> None:
        self.network.close()


class LoopbackRuntime(Runtime):
    """Pods as plain processes on this machine's loopback: no root needed, fewer guarantees.

    Deviations from the rendered pod, each needed without namespaces: host names become
    127.0.0.<index+1> in args and env, and each agent gets that address as ``PET_LOCAL_ADDR``
    (NVRx 0.7 refuses two agents with one node address); paths of mounts other than the shared
    volume are rewritten to their host directories; ``--rdzv-conf`` gains ``is_host`` (every
    agent would take a loopback endpoint for its own and race to host the store); ``/tmp`` is
    ``TMPDIR``; ``/dev/shm`` is the host's.
    """

    mode = "loopback"

    def __init__(self, workload: Workload, run_dir: Path, run_id: str, env: dict[str, str]):
        super().__init__(workload, run_dir, run_id, env)
        # Short: ft_launcher's Unix sockets live in TMPDIR and a socket path has 107 bytes at most.
        self.scratch = Path(tempfile.mkdtemp(prefix=f"rfsdp-{run_id}-"))
        self.addresses = {pod.hostname: f"127.0.0.{pod.index + 1}" for pod in workload.pods}
        names = []
        for pod in workload.pods:
            names += [(name, self.addresses[pod.hostname]) for name in [pod.hostname, *pod.aliases]]
        names.sort(key=lambda n: -len(n[0]))  # the longest first: a full name before its prefix
        self.names = [(re.compile(rf"(?<![A-Za-z0-9.-]){re.escape(n)}(?![A-Za-z0-9-])"), a) for n, a in names]
        # The files the pods read name the shared volume and ConfigMaps by their mount paths too.
        shared = self.mounted_paths(workload.pods[0])
        self.write_config_maps(lambda text: self._rewrite_text(text, shared))

    def describe(self) -> str:
        return ("pods as processes on loopback (" + ", ".join(f"{h}={a}" for h, a in self.addresses.items())
                + "; host names and mount paths rewritten in each command)")

    def pod_path(self, host_path: Path) -> str:
        return str(host_path)  # the shared volume is rendered at the run directory itself

    def _rewrite_text(self, text: str, paths: list[tuple[str, str]]) -> str:
        """A file's host names and mount paths (``/fsx/x`` or ``/fsx`` alone)."""
        return self._rewrite(text, paths, IN_TEXT)

    def _rewrite(self, text: str, paths: list[tuple[str, str]], before: str = r"(?:^|(?<==))") -> str:
        """Host names to addresses, then mount paths to host paths: an argument or value that is a
        mount path or starts with one (``--config=/etc/x/config.yaml``), in one pass, so a host path
        is never rewritten again."""
        for pattern, address in self.names:
            text = pattern.sub(address, text)
        return replace_paths(text, paths, before)

    def start(self, pod: Pod, extra_env: dict[str, str]) -> subprocess.Popen:
        self.fresh_empty_dirs(pod)
        argv, env = self.command(pod, extra_env)
        return subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)

    def command(self, pod: Pod, extra_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """``pod``'s command line and environment with the loopback deviations applied."""
        paths = []
        tmp = None
        for mount in pod.mounts:
            _, host = self.volume_source(pod, mount)
            if mount.path == "/dev/shm":
                continue
            if mount.path == "/tmp":
                tmp = host
            if host != mount.path:
                paths.append((mount.path.rstrip("/"), host))
        paths.sort(key=lambda p: -len(p[0]))
        argv = [self._rewrite(a, paths) for a in pod.argv]
        argv = _with_is_host(argv, pod.index == 0)
        # Only what the pod's spec and the cluster set is rewritten: this machine's own variables
        # (PATH, PYTHONPATH: the image) are host paths already, and a checkout under /tmp, a
        # mount path, must stay where it is.
        rendered = set(pod.env) | set(extra_env)
        env = {k: self._rewrite(v, paths) if k in rendered else v for k, v in self.environment(pod, extra_env).items()}
        env["PET_LOCAL_ADDR"] = self.addresses[pod.hostname]
        if tmp:
            env["TMPDIR"] = tmp
        return argv, env

    def processes(self, pod: Pod) -> list[psutil.Process]:
        mark = f"{self.run_id}/{pod.hostname}"
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get(POD_MARK_ENV) == mark:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def kill(self, pod: Pod, timeout: float = 5.0) -> list[int]:
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while True:
            procs = [p for p in self.processes(pod) if _alive(p)]
            if not procs or time.monotonic() > deadline:
                return sorted(killed)
            for proc in procs:  # stop first, so none reacts to another's death, then kill
                _signal(proc, signal.SIGSTOP)
            for proc in procs:
                _signal(proc, signal.SIGKILL)
                killed.add(proc.pid)
            time.sleep(0.01)

    def partition(self, pod: Pod, seconds: Optional[float]) -> None:
        raise WorkloadError("a partition needs --isolation netns: on loopback no pod has a network link of its own")

    def close(self) -> None:
        for pod in self.workload.pods:
            self.kill(pod)
        shutil.rmtree(self.scratch, ignore_errors=True)


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
                top = base + "/" + path[len(base) + 1:].split("/", 1)[0]
                found.setdefault(top, base)
    return sorted(found.items())


def _with_is_host(argv: list[str], host: bool) -> list[str]:
    flag = f"is_host={'true' if host else 'false'}"
    out, done = [], False
    for arg in argv:
        if arg.startswith("--rdzv-conf=") and not done:
            arg, done = f"{arg},{flag}", True
        out.append(arg)
    if not done:
        try:
            at = out.index("-m", out.index("-m") + 1) if out.count("-m") > 1 else len(out)
        except ValueError:
            at = len(out)
        out.insert(at, f"--rdzv-conf={flag}")
    return out


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
