"""``resilient-fsdp local``: the rendered chart's job on one machine, pods and controller included.

The job is what ``helm install`` would create (:mod:`resilient_fsdp.local.manifests` reads it);
this module plays the cluster around it: the **kubelet** (each pod's container run with its
``command``, ``env`` and volumes by a :mod:`resilient_fsdp.local.runtime`, its output prefixed on
the console and saved in ``logs/node<N>.log``), the **workload controller** (the operator's
variables and the rendered restart policy; ``max_recreations`` is a local safety cap, not an
operator feature) and the **infrastructure faults** a rank asks for (:mod:`.fault_requests`).
No orphans: the launcher is a child subreaper, and the close kills every process of every pod.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, TextIO

from ...resilience import exit_codes
from ...resilience.ledger import FaultLedger
from ...resilience.processes import become_subreaper, kill_descendants
from ..manifests.spec import PodSpec, Workload
from ..runtime.base import Runtime
from .fault_requests import FaultExecutor, requests_dir

_WORKER_PREFIX = re.compile(r"^\[(?P<role>[A-Za-z_]+)(?P<local>\d+)\]:")
DEFAULT_MAX_RECREATIONS = 10


@dataclass
class LocalJob:
    """What ``resilient-fsdp local`` runs: the rendered workload, where, and the local limits."""

    workload: Workload
    run_dir: Path
    max_recreations: int = DEFAULT_MAX_RECREATIONS
    """Local safety cap on pod recreations, all pods together. Not an operator feature: under
    ``restartPolicy: ExitCode`` a PyTorchJob's ``backoffLimit`` of 1 or more never stops them."""
    verbose: bool = False
    """Also print the agents' own log lines (always kept in ``<run_dir>/logs/node<N>.log``)."""
    fail_grace_s: float = 20.0
    """After the job failed or succeeded, how long the remaining pods get to end on their own."""
    stop_timeout_s: float = 10.0
    """Between SIGTERM and SIGKILL when stopping a pod (its termination grace, shortened)."""
    start_delays: dict[int, float] = field(default_factory=dict)
    """Pod index -> seconds its first start waits after the other pods' (``--pod-start-delay``: an
    image pull on a fresh node); recreations start at once."""
    replacement_delay_s: float = 0.0
    """Seconds between a lost pod (``node-loss``) and its replacement's start (``--replacement-delay``:
    a new node provisioned and the image pulled); a pod that exited on its own is recreated at once."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to every pod's environment by the local cluster (documented in docs/local-runs.md)."""
    notes: list[str] = field(default_factory=list)
    """Lines printed after the start line (deviations, fallbacks)."""
    nofile: Optional[tuple[int, int]] = None
    """The ``nofile`` limit (soft, hard) each container starts with; None: the runtime's default."""
    host_ports: list[int] = field(default_factory=list)
    """Ports of this machine's loopback each pod reaches at the same address (netns pods only:
    ``netns_pods.host_ports``), e.g. a local S3-API server's."""


class _Forwarder(threading.Thread):
    """Copies one pod's output in full to its log file, and to the console with a prefix and with
    the paths of the pod's volumes as this machine sees them (``to_host``)."""

    def __init__(
        self,
        node: int,
        stream: TextIO,
        log_path: Path,
        out: TextIO,
        lock: threading.Lock,
        agent_lines: bool,
        to_host: Callable[[str], str],
    ):
        super().__init__(daemon=True, name=f"forward-node{node}")
        self.node, self.stream, self.log_path, self.out, self.lock = node, stream, log_path, out, lock
        self.agent_lines, self.to_host = agent_lines, to_host

    def run(self) -> None:
        with open(self.log_path, "a") as log:
            for line in self.stream:
                log.write(line)
                log.flush()
                m = _WORKER_PREFIX.match(line)
                if m:
                    prefix = f"[node{self.node}/local{m['local']}]"
                    line = line[m.end() :]
                elif self.agent_lines:
                    prefix = f"[node{self.node}]"
                else:
                    continue
                line = self.to_host(line)
                with self.lock:
                    self.out.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
                    self.out.flush()


def find_root_cause(log_root: Path, last: bool = False) -> Optional[dict]:
    """The earliest error any rank recorded (torch elastic ``error.json`` files under ``log_root``);
    ``last``: the newest instead, for a job that ended on a failure no layer retries (its earlier
    errors were retried; the newest ended it, e.g. a non-finite loss at a step already restarted for).

    Files live at ``node<N>/<run_id>/attempt_<k>/<local_rank>/error.json``. Returns
    ``{"where", "message", "timestamp", "path"}`` or None when no rank recorded an error (a rank
    killed by a signal records nothing; the agent's log has its exit code).
    """
    found = []
    for path in log_root.glob("node*/*/attempt_*/*/error.json"):
        try:
            message = json.loads(path.read_text())["message"]
            extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
            text = message.get("message", "") if isinstance(message, dict) else str(message)
            timestamp = int(extra.get("timestamp", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        node = path.relative_to(log_root).parts[0]
        where = f"{node} local rank {path.parent.name} ({path.parent.parent.name})"
        found.append({"where": where, "message": text, "timestamp": timestamp, "path": str(path)})
    # A rank that loses a peer fails too, within the same second; prefer the error that is not
    # such a symptom, then the earliest.
    order = -1 if last else 1
    return (
        min(found, key=lambda e: (_is_peer_symptom(e["message"]), order * e["timestamp"], e["path"])) if found else None
    )


_PEER_SYMPTOMS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistNetworkError",
    "DistBackendError",
    "NCCL communicator was aborted",
    "Timed out waiting",
)


def _is_peer_symptom(message: str) -> bool:
    return any(s in message for s in _PEER_SYMPTOMS)


def free_port() -> int:
    """A currently free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_status(returncode: int) -> int:
    """A container's exit code as the kubelet reports it: 128 + the signal when killed by one."""
    return 128 - returncode if returncode < 0 else returncode


class LocalLauncher:
    """Runs a :class:`LocalJob` on a :class:`Runtime` to completion; :meth:`run` returns the job's
    exit code (0, the failing pod's code, or 130 when interrupted)."""

    def __init__(self, job: LocalJob, runtime: Runtime, out: TextIO = sys.stdout):
        self.job, self.runtime, self.out = job, runtime, out
        self.procs: dict[str, subprocess.Popen] = {}
        self.succeeded: set[str] = set()
        self.lock = threading.Lock()
        self.forwarders: list[_Forwarder] = []
        self.failures = 0
        self.recreations = 0
        self.gave_up = "the controller ended the job"  # why the job level stopped retrying
        self.lost: set[str] = set()  # pods whose processes the fault executor killed
        self.pending: dict[str, tuple[float, str]] = {}  # pods not started yet: hostname -> (when, why)
        self.started = time.monotonic()
        self.executor = FaultExecutor(job.run_dir, runtime, job.workload, self.say, self.lost)

    def say(self, message: str) -> None:
        with self.lock:
            self.out.write(f"[local] {message}\n")
            self.out.flush()

    def start_pod(self, pod: PodSpec) -> None:
        log_dir = self.job.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        extra = dict(self.job.extra_env)
        # Each rank's output prefixed "[default<local rank>]:" in the pod's log, and torch elastic's
        # error files where find_root_cause looks: torchrun flags by their PET_ variables, as
        # pods take them, so the rendered command stays as it is.
        extra.update(PET_TEE="3", PET_LOG_DIR=self.runtime.pod_path(log_dir / f"node{pod.index}"))
        # The container's termination message, as the kubelet keeps /dev/termination-log: the agent
        # writes why the node ended there, and a failed job's summary shows it.
        message = self.termination_log(pod)
        message.write_text("")
        extra[exit_codes.TERMINATION_LOG_ENV] = self.runtime.pod_path(message)
        if self.runtime.mode == "netns" and pod.security.uid:
            # The local cluster's own log directory, which a pod's user must be able to fill.
            (log_dir / f"node{pod.index}").mkdir(exist_ok=True)
            os.chown(log_dir / f"node{pod.index}", pod.security.uid, pod.security.gid or 0)
            os.chown(message, pod.security.uid, pod.security.gid or 0)
        proc = self.runtime.start(pod, extra)
        self.procs[pod.hostname] = proc
        fwd = _Forwarder(
            pod.index,
            proc.stdout,
            log_dir / f"node{pod.index}.log",
            self.out,
            self.lock,
            self.job.verbose,
            lambda line: self.runtime.to_host(pod, line),
        )
        fwd.start()
        self.forwarders.append(fwd)

    def termination_log(self, pod: PodSpec) -> Path:
        return self.job.run_dir / "logs" / f"node{pod.index}.termination-log"

    def termination_message(self, hostname: str) -> str:
        pod = next((p for p in self.job.workload.pods if p.hostname == hostname), None)
        try:
            text = self.termination_log(pod).read_text().strip() if pod is not None else ""
        except OSError:
            return ""
        return self.runtime.to_host(pod, text) if text else ""

    def run(self) -> int:
        job, workload = self.job, self.job.workload
        job.run_dir.mkdir(parents=True, exist_ok=True)
        requests_dir(job.run_dir).mkdir(parents=True, exist_ok=True)
        # Drop boxes every pod's user writes to, whatever user the pod runs as: its fault requests
        # and, one level up, the faults' once-only records (the local cluster made them, as root).
        for box in (requests_dir(job.run_dir), requests_dir(job.run_dir).parent):
            os.chmod(box, 0o1777)
        become_subreaper()
        ranks = workload.pods[0].ranks
        self.say(
            f"{len(workload.pods)} pod(s) x {ranks} rank(s): {workload.kind} {workload.name}, "
            f"{self.runtime.describe()}; rendezvous {workload.rendezvous} (pod 0's agent hosts the store); "
            f"logs in {job.run_dir / 'logs'}"
        )
        for note in job.notes:
            self.say(note)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def interrupted(signum, _frame):
            raise KeyboardInterrupt(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, interrupted)
        try:
            for pod in workload.pods:
                if pod.index not in job.start_delays:
                    self.start_pod(pod)
            now = time.monotonic()
            for pod in workload.pods:
                delay = job.start_delays.get(pod.index)
                if delay is not None:
                    self.pending[pod.hostname] = (now + delay, f"{delay:g} s after the others (--pod-start-delay)")
                    self.say(
                        f"{pod.hostname} (pod {pod.index}) starts {delay:g} s after the others "
                        "(--pod-start-delay: as an image pull on a fresh node delays it)"
                    )
            return self._watch()
        except KeyboardInterrupt as exc:
            self.say(f"interrupted ({exc or 'SIGINT'}): stopping every pod")
            return 130
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _watch(self) -> int:
        workload, restart = self.job.workload, self.job.workload.restart
        outcome: Optional[tuple[str, int]] = None  # (pod, code) of the failure that ended the job
        while True:
            self.executor.poll()
            self._start_due()
            for pod in workload.pods:
                proc = self.procs.get(pod.hostname)
                if proc is None or pod.hostname in self.succeeded or proc.poll() is None:
                    continue
                code = exit_status(proc.returncode)
                if code == 0:
                    self.succeeded.add(pod.hostname)
                    continue
                self.failures += 1
                lost = pod.hostname in self.lost
                why = "was lost (its processes were killed)" if lost else f"exited with code {code}"
                self.lost.discard(pod.hostname)
                action, reason = restart.on_failure(pod, code, lost, self.failures)
                if action != "fail" and self.recreations >= self.job.max_recreations:
                    self.gave_up = (
                        f"{self.recreations} of {self.job.max_recreations} pod recreations used, the local "
                        "safety cap --max-pod-recreations"
                    )
                    self.say(
                        f"{pod.hostname} {why}: the local safety cap of {self.job.max_recreations} pod "
                        "recreations is spent (--max-pod-recreations; not an operator feature: the "
                        f"{workload.kind} controller would go on: {reason})"
                    )
                elif action == "recreate":
                    self.recreations += 1
                    self.say(f"{pod.hostname} {why}: {reason} (recreation {self.recreations})")
                    self.runtime.kill(pod)  # whatever the old pod left, gone with it
                    delay = self.job.replacement_delay_s if lost else 0.0
                    if delay > 0:
                        del self.procs[pod.hostname]
                        self.pending[pod.hostname] = (
                            time.monotonic() + delay,
                            f"{delay:g} s after the loss (--replacement-delay: a new node and its image pull)",
                        )
                        self.say(f"{pod.hostname}'s replacement starts in {delay:g} s (--replacement-delay)")
                    else:
                        self.start_pod(pod)
                    continue
                elif action == "restart":
                    self.recreations += 1
                    self.say(f"{pod.hostname} {why}: {reason}")
                    self.restart_all()
                    break
                else:
                    self.gave_up = reason
                    self.say(f"{pod.hostname} {why}: {reason}")
                outcome = (pod.hostname, code)
                break
            if outcome is not None:
                break
            if workload.finished(self.succeeded):
                break
            deadline = restart.active_deadline_s
            if deadline is not None and time.monotonic() - self.started > deadline:
                self.say(f"the job ran past activeDeadlineSeconds: {deadline}: it fails")
                outcome = ("", 1)
                break
            time.sleep(0.2)
        if outcome is None:
            self._wait_for_others()
            self.say(
                "job finished: every pod exited 0"
                if len(self.succeeded) == len(workload.pods)
                else f"job finished: {', '.join(sorted(self.succeeded))} succeeded"
            )
            return 0
        self._wait_for_others()
        hostname, code = outcome
        self.report_failure(hostname, code)
        return code if 0 < code < 256 else 1

    def _start_due(self) -> None:
        """Start the delayed pods whose time has come."""
        now = time.monotonic()
        for hostname, (due, why) in list(self.pending.items()):
            if now >= due:
                del self.pending[hostname]
                pod = self.job.workload.pod(hostname)
                self.say(f"starting {hostname} (pod {pod.index}), {why}")
                self.start_pod(pod)

    def restart_all(self) -> None:
        """A whole-job restart: every pod deleted, and only when all are gone created again (a
        JobSet's ``BlockingRecreate``). A pod still waiting for its delayed first start keeps
        waiting."""
        for pod in self.job.workload.pods:
            self.runtime.kill(pod)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=self.job.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.succeeded.clear()
        self.lost.clear()
        for pod in self.job.workload.pods:
            if pod.hostname not in self.pending:
                self.start_pod(pod)

    def _wait_for_others(self) -> None:
        deadline = time.monotonic() + self.job.fail_grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.2)
        for hostname, proc in self.procs.items():
            if proc.poll() == 0:
                self.succeeded.add(hostname)

    def report_failure(self, hostname: str, code: int) -> None:
        job = self.job
        limits = (
            f"in-job restarts: trainer.resilience.launcher.max_restarts (ft_launcher --max-restarts); pod "
            f"recreations used: {self.recreations} (local cap --max-pod-recreations={job.max_recreations})"
        )
        retried = not 0 < code < 256 or job.workload.restart.retryable(code)
        cause = find_root_cause(job.run_dir / "logs", last=not retried)
        what = f"{hostname} exit code {code}" if hostname else "deadline"
        if cause:
            which = "first error" if retried else "the error that ended it"
            self.say(f"job FAILED ({what}); {which}, {cause['where']}: {cause['message']}")
            self.say(f"  full traceback: {cause['path']}")
        else:
            self.say(f"job FAILED: {what}; see {job.run_dir / 'logs'}")
        message = self.termination_message(hostname) if hostname else ""
        if message:
            self.say(f"  {hostname}'s termination message: {message}")
        self.say(f"  {self.spent_layers(code)}")
        faults = FaultLedger(job.run_dir).fired()
        if faults:
            last = faults[-1]
            if retried:
                self.say(
                    f"  last fault: {last['fault']} (injected after step {last['completed_step']}); restarts did "
                    f"not recover it within the limits: {limits}"
                )
            else:
                self.say(f"  last fault: {last['fault']} (injected after step {last['completed_step']})")
        else:
            self.say(f"  restart limits: {limits}")

    def spent_layers(self, code: int) -> str:
        """Which layer gave up last (:mod:`resilient_fsdp.resilience.exit_codes`)."""
        if 0 < code < 256 and not self.job.workload.restart.retryable(code):
            return f"not retried by any layer: pod exit code {exit_codes.describe_code(code)}"
        said = f"the job level gave up ({self.gave_up})"
        if code != exit_codes.INFRASTRUCTURE:
            return f"{said}: the pod exited {exit_codes.describe_code(code)}"
        return (
            f"{said}: the pod exited {code} after its node's in-process restarts (when on: "
            "trainer.resilience.in_process.max_iterations) and in-job restarts (trainer.resilience.launcher.max_restarts) "
            "were spent"
        )

    def stop_all(self) -> None:
        """What deleting the pods does: SIGTERM each container's main process, SIGKILL every
        process of the pod after the grace period, then reap stray descendants."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.job.stop_timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pod in self.job.workload.pods:
            self.runtime.kill(pod)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kill_descendants()
        for fwd in self.forwarders:
            fwd.join(timeout=5)
