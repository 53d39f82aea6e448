"""``resilient-fsdp local``: a multi-node job on one machine, launched the way pods launch it.

Each simulated node is what every pod runs: the node wrapper (:mod:`resilient_fsdp.resilience.agent`) around
one ``ft_launcher`` agent, which joins a c10d rendezvous on an explicit loopback endpoint, exactly
as pods join through the rendezvous Service, and starts ``--nproc-per-node`` trainer ranks. This
module forwards their output with a node and local-rank prefix, keeps a full log per node, stops
every process it started when the job ends or is interrupted, and reports the failing rank's error.

It also plays the two parts of the cluster that a laptop lacks:

- the **rendezvous host**: the launcher itself serves the rendezvous store, so losing any node
  (even the first) does not take the rendezvous with it;
- the **job-level restart**: a node that exits with a retryable code (128-255, or killed by a
  signal) is started again and rejoins, as the PyTorchJob controller recreates a pod under
  ``restartPolicy: ExitCode``, up to ``max_node_restarts`` times (its ``backoffLimit``).

No orphans: the launcher marks itself a child subreaper (Linux), so workers whose agent died are
re-parented here rather than to init, and the final sweep kills every remaining descendant.
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
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

from ..config import ConfigError, ResilienceConfig
from ..resilience.accounting import JOB_START_ENV
from ..resilience.faults import NODE_INDEX_ENV, FaultLedger
from ..resilience.ft_config import ft_launcher_flags
from ..resilience.ft_config import write_ft_config as write_ft_yaml
from ..resilience.nvrx import QUIET_WARNINGS, RDZV_STORE_IN_NODE, RDZV_STORE_OUTSIDE, agent_hosts_rendezvous_store
from ..resilience.processes import become_subreaper, kill_descendants

TRAINER_MODULE = "resilient_fsdp.train"
AGENT_MODULE = "resilient_fsdp.resilience.agent"
_WORKER_PREFIX = re.compile(r"^\[(?P<role>[A-Za-z_]+)(?P<local>\d+)\]:")


@dataclass
class LocalJob:
    """What ``resilient-fsdp local`` runs."""

    nodes: int
    nproc_per_node: int
    run_dir: Path
    trainer_args: list[str] = field(default_factory=list)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    """In-job restart and hang-detection settings (``max_restarts`` and the ft_launcher timeouts)."""
    max_node_restarts: int = 3
    """Job-level restarts: how many times a failed node is recreated (PyTorchJob ``backoffLimit``)."""
    rdzv_port: Optional[int] = None
    run_id: str = field(default_factory=lambda: f"local-{uuid.uuid4().hex[:8]}")
    verbose: bool = False
    """Also print the agents' own log lines (always kept in ``<run_dir>/logs/node<N>.log``)."""
    fail_grace_s: float = 20.0
    """After one node fails, how long the others get to notice and exit on their own."""
    stop_timeout_s: float = 10.0
    """Between SIGTERM and SIGKILL when stopping agents."""


def free_port() -> int:
    """A currently free TCP port on loopback, for the rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_ft_config(job: LocalJob) -> Path:
    """The ``fault_tolerance:`` section ``ft_launcher`` reads (``--ft-cfg-path``), from the
    ``resilience`` config: a file rather than flags because NVRx renamed its flags between
    releases while the YAML keys stayed (and unknown keys are ignored)."""
    return write_ft_yaml(job.run_dir / "ft_config.yaml", job.resilience)


def agent_command(job: LocalJob, node: int, port: int, store_in_node: bool = False) -> list[str]:
    """The command line of simulated node ``node``: the node wrapper around ``ft_launcher`` with
    the same flags a pod uses, plus ``--rdzv-conf=is_host=false`` (the rendezvous store is served
    by this launcher). That flag, and several agents on one host, are NVRx 0.4 features: 0.7
    keeps only its own rendezvous, one agent per host address, so under 0.7 a single node hosts
    the store itself (``store_in_node``) and multi-node runs need one address per pod."""
    return [
        sys.executable, "-m", AGENT_MODULE,
        f"--ft-cfg-path={job.run_dir / 'ft_config.yaml'}",
        f"--nnodes={job.nodes}",
        f"--nproc-per-node={job.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={job.run_id}",
        RDZV_STORE_IN_NODE if store_in_node else RDZV_STORE_OUTSIDE,
        *ft_launcher_flags(job.resilience),
        "--monitor-interval=0.5",
        f"--log-dir={job.run_dir / 'logs' / f'node{node}'}",
        "--tee=3",  # copy each rank's stdout/stderr to the agent's, prefixed "[default<local_rank>]:"
        "-m", TRAINER_MODULE,
        *job.trainer_args,
    ]


class _Forwarder(threading.Thread):
    """Copies one agent's output to the console with a prefix, and in full to its log file."""

    def __init__(self, node: int, stream: TextIO, log_path: Path, out: TextIO, lock: threading.Lock,
                 agent_lines: bool):
        super().__init__(daemon=True, name=f"forward-node{node}")
        self.node, self.stream, self.log_path, self.out, self.lock = node, stream, log_path, out, lock
        self.agent_lines = agent_lines

    def run(self) -> None:
        with open(self.log_path, "a") as log:
            for line in self.stream:
                log.write(line)
                log.flush()
                m = _WORKER_PREFIX.match(line)
                if m:
                    prefix = f"[node{self.node}/local{m['local']}]"
                    line = line[m.end():]
                elif self.agent_lines:
                    prefix = f"[node{self.node}]"
                else:
                    continue
                with self.lock:
                    self.out.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
                    self.out.flush()


def find_root_cause(log_root: Path) -> Optional[dict]:
    """The earliest error any rank recorded (torch elastic ``error.json`` files under ``log_root``).

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
    return min(found, key=lambda e: (_is_peer_symptom(e["message"]), e["timestamp"], e["path"])) if found else None


_PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistNetworkError",
                  "DistBackendError", "NCCL communicator was aborted", "Timed out waiting")


def _is_peer_symptom(message: str) -> bool:
    return any(s in message for s in _PEER_SYMPTOMS)


class LocalLauncher:
    """Runs a :class:`LocalJob` to completion; :meth:`run` returns the job's exit code."""

    def __init__(self, job: LocalJob, out: TextIO = sys.stdout):
        self.job, self.out = job, out
        self.agents: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.forwarders: list[_Forwarder] = []
        self.job_start = time.time()
        self.node_restarts = 0
        self.rdzv_store = None
        # NVRx 0.7's barrier rendezvous: only the agent hosting the store closes rounds.
        self.store_in_node = agent_hosts_rendezvous_store()

    def say(self, message: str) -> None:
        with self.lock:
            self.out.write(f"[local] {message}\n")
            self.out.flush()

    def _env(self, node: int) -> dict:
        env = dict(os.environ)
        env[NODE_INDEX_ENV] = str(node)  # which pod this is, for faults aimed at node=N
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), QUIET_WARNINGS) if w)
        env[JOB_START_ENV] = repr(self.job_start)
        return env

    def start_agent(self, node: int, port: int) -> subprocess.Popen:
        log_dir = self.job.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        # A new session per agent: one killpg stops the agent and the workers it spawned.
        proc = subprocess.Popen(agent_command(self.job, node, port, self.store_in_node), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                env=self._env(node), start_new_session=True)
        fwd = _Forwarder(node, proc.stdout, log_dir / f"node{node}.log", self.out, self.lock, self.job.verbose)
        fwd.start()
        self.forwarders.append(fwd)
        return proc

    def run(self) -> int:
        job = self.job
        job.run_dir.mkdir(parents=True, exist_ok=True)
        become_subreaper()
        port = job.rdzv_port or free_port()
        if self.store_in_node and job.nodes > 1:
            raise ConfigError(f"--nodes={job.nodes}: the NVRx installed here runs its barrier rendezvous, which closes "
                              "when two agents share one node address, as every simulated node does on loopback; "
                              "run one node here, or several in network namespaces (one address per pod)")
        if not self.store_in_node:
            self.rdzv_store = serve_rendezvous_store(port)
        host = "node0's agent" if self.store_in_node else "this launcher"
        self.say(f"{job.nodes} node(s) x {job.nproc_per_node} rank(s), rendezvous c10d at 127.0.0.1:{port} "
                 f"(id {job.run_id}, store hosted by {host}); logs in {job.run_dir / 'logs'}")
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def interrupted(signum, _frame):
            raise KeyboardInterrupt(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, interrupted)
        try:
            write_ft_config(job)
            self.agents = [self.start_agent(node, port) for node in range(job.nodes)]
            return self._wait(port)
        except KeyboardInterrupt as exc:
            self.say(f"interrupted ({exc or 'SIGINT'}): stopping every node")
            return 130
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wait(self, port: int) -> int:
        first_failure: Optional[tuple[int, int]] = None
        deadline = None
        while True:
            codes = [a.poll() for a in self.agents]
            if first_failure is None:
                for node, code in enumerate(codes):
                    if code in (None, 0):
                        continue
                    if retryable(code) and self.node_restarts < self.job.max_node_restarts:
                        self.node_restarts += 1
                        self.say(f"node{node} exited with code {code}: recreating it, as the PyTorchJob controller "
                                 f"recreates a failed pod (job-level restart {self.node_restarts} of "
                                 f"{self.job.max_node_restarts})")
                        self.agents[node] = self.start_agent(node, port)
                        codes[node] = None
                        continue
                    first_failure = (node, code)
                    deadline = time.monotonic() + self.job.fail_grace_s
                    self.say(f"node{node} exited with code {code}; waiting up to {self.job.fail_grace_s:.0f} s "
                             "for the other nodes to stop")
                    break
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                self.say("other nodes did not stop in time; terminating them")
                break
            time.sleep(0.2)
        if first_failure is None:
            self.say("job finished: every node exited 0")
            return 0
        node, code = first_failure
        self.report_failure(node, code)
        return code if 0 < code < 256 else 1

    def report_failure(self, node: int, code: int) -> None:
        job = self.job
        limits = (f"in-job restarts per node: {job.resilience.max_restarts} (resilience.max_restarts); "
                  f"job-level node restarts used: {self.node_restarts} of {job.max_node_restarts} "
                  "(--max-node-restarts)")
        cause = find_root_cause(job.run_dir / "logs")
        if cause:
            self.say(f"job FAILED (node{node} exit code {code}); first error, {cause['where']}: {cause['message']}")
            self.say(f"  full traceback: {cause['path']}")
        else:
            self.say(f"job FAILED: node{node} exited with code {code}; see {job.run_dir / 'logs'}")
        faults = FaultLedger(job.run_dir).fired()
        if faults:
            last = faults[-1]
            self.say(f"  last fault: {last['fault']} (injected after step {last['completed_step']}); restarts did "
                     f"not recover it within the limits: {limits}")
        else:
            self.say(f"  restart limits: {limits}")

    def stop_all(self) -> None:
        """SIGTERM every agent's session, SIGKILL what remains, then reap stray descendants."""
        for agent in self.agents:
            if agent.poll() is None:
                _signal_group(agent.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.job.stop_timeout_s
        for agent in self.agents:
            try:
                agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for agent in self.agents:
            _signal_group(agent.pid, signal.SIGKILL)
            if agent.poll() is None:
                agent.wait()
        kill_descendants()
        for fwd in self.forwarders:
            fwd.join(timeout=5)


def retryable(code: int) -> bool:
    """An exit the PyTorchJob ``ExitCode`` policy retries: 128-255, or killed by a signal."""
    return code < 0 or 128 <= code <= 255


def serve_rendezvous_store(port: int):
    """The rendezvous store, served by this process (as an external rendezvous host would be)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"cannot serve the rendezvous on 127.0.0.1:{port} ({exc}); pick another --rdzv-port "
                           "or leave it out to use a free one") from exc


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
