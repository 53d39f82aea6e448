"""Pods as plain processes on this machine's loopback: the ``loopback`` isolation mode (anyone may run it).

:class:`LoopbackRuntime` runs each pod's rendered command with the deviations a pod without a
namespace of its own needs (its class docstring names each); what it shares with the ``netns``
mode, and how the two differ, is in :mod:`resilient_fsdp.local.runtime.base`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

from ..manifests.spec import PodSpec, Workload, WorkloadError
from .base import POD_MARK_ENV, Runtime
from .paths import IN_TEXT, replace_paths


class LoopbackRuntime(Runtime):
    """Pods as plain processes on this machine's loopback: no root needed, fewer guarantees.

    Deviations from the rendered pod, each needed without namespaces: host names become
    127.0.0.<index+1> in args and env, and each agent gets that address as ``PET_LOCAL_ADDR``
    (NVRx 0.7 refuses two agents with one node address); paths of mounts other than the shared
    volume are rewritten to their host directories; ``/tmp`` is
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
        return (
            "pods as processes on loopback ("
            + ", ".join(f"{h}={a}" for h, a in self.addresses.items())
            + "; host names and mount paths rewritten in each command)"
        )

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

    def start(self, pod: PodSpec, extra_env: dict[str, str]) -> subprocess.Popen:
        self.fresh_empty_dirs(pod)
        argv, env = self.command(pod, extra_env)
        argv = self.after_init_containers(pod, argv)
        return subprocess.Popen(
            argv,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )

    def after_init_containers(self, pod: PodSpec, argv: list[str]) -> list[str]:
        """``argv`` behind ``pod``'s init containers, each run to completion in order with its own
        environment, as the launcher's user (loopback applies no security context); a failing
        one ends the pod with its status."""
        if not pod.init_containers:
            return argv
        paths = sorted(
            (
                (m.path.rstrip("/"), self.volume_source(pod, m)[1])
                for m in pod.mounts
                if self.volume_source(pod, m)[1] != m.path
            ),
            key=lambda p: -len(p[0]),
        )
        steps = []
        for init in pod.init_containers:
            env = [f"{k}={self._rewrite(v, paths)}" for k, v in self.environment(pod, {}, init.env).items()]
            run = shlex.join(["env", "-i", *env, *[self._rewrite(a, paths) for a in init.argv]])
            steps.append(
                f"{run} || {{ s=$?; echo {shlex.quote(f'init container {init.name} exited with status')}"
                " $s: the pod fails >&2; exit $s; }"
            )
        return ["sh", "-c", "\n".join(steps + ['exec "$@"']), "pod-init", *argv]

    def command(self, pod: PodSpec, extra_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
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
        # Only what the pod's spec and the cluster set is rewritten: this machine's own variables
        # (PATH, PYTHONPATH: the image) are host paths already, and a checkout under /tmp, a
        # mount path, must stay where it is.
        rendered = set(pod.env) | set(extra_env)
        env = {k: self._rewrite(v, paths) if k in rendered else v for k, v in self.environment(pod, extra_env).items()}
        env["PET_LOCAL_ADDR"] = self.addresses[pod.hostname]
        if tmp:
            env["TMPDIR"] = tmp
        return argv, env

    def processes(self, pod: PodSpec) -> list[psutil.Process]:
        mark = f"{self.run_id}/{pod.hostname}"
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get(POD_MARK_ENV) == mark:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def kill(self, pod: PodSpec, timeout: float = 5.0) -> list[int]:
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

    def partition(self, pod: PodSpec, seconds: Optional[float]) -> None:
        raise WorkloadError("a partition needs --isolation netns: on loopback no pod has a network link of its own")

    def freeze(self, pod: PodSpec) -> list[int]:
        raise WorkloadError("a node freeze needs --isolation netns: on loopback no pod has a network link of its own")

    def delete_frozen(self, pod: PodSpec) -> list[int]:
        raise WorkloadError("a node freeze needs --isolation netns")

    def close(self) -> None:
        for pod in self.workload.pods:
            self.kill(pod)
        shutil.rmtree(self.scratch, ignore_errors=True)


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
