"""A node's main process (a pod's PID 1):
``python -m resilient_fsdp.resilience.agent [AGENT_FLAGS...] [--] FT_LAUNCHER_ARGS...``.

:class:`NodeAgent` runs ``ft_launcher`` with the given arguments and ends with the node exit code
that :data:`.exit_codes.TABLE` gives its ending, which the job-level restart policy reads. Between
runs it joins a node that is not the store host again (:mod:`.rejoin`); before the first it pins
the store host and node rank (:mod:`.node_rank`) and marks the node for its ranks. As a child
subreaper it reaps what the ranks leave behind (:class:`RankHelperSweeper`). Its own flags
(:data:`AGENT_FLAGS`) come before ``--``, ft_launcher's after it. The chart's pods run it; so does
the local cluster (:mod:`resilient_fsdp.local`).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import psutil

from . import exit_codes, metrics_endpoint, node_rank, node_reports, node_taint, nvrx, pod_failures, prewarm
from .faults import NODE_PID_ENV, NODE_START_ENV
from .graceful_stop import NODE_STOP_ENV
from .processes import become_subreaper, kill_descendants
from .rejoin import Rejoin, await_first_store, await_store
from .store_watch import StoreWatch


def ft_launcher_executable() -> list[str]:
    """``ft_launcher`` of this interpreter's NVRx, leaving the rendezvous open when this node fails
    for good (:func:`.nvrx.keep_rendezvous_open`)."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        raise FileNotFoundError("ft_launcher not found: install nvidia-resiliency-ext (pip install -e . in this repo)")
    return [sys.executable, "-m", "resilient_fsdp.resilience.nvrx"]


RENDEZVOUS_LOST_EXIT_CODE = exit_codes.RENDEZVOUS_LOST

# How ft_launcher reports a store it can no longer reach, on its own (not a rank's) error lines:
# NVRx 0.7 "Agent run ended with exception, e=DistNetworkError(...)" (its launcher.py main maps
# every agent exception to exit 1); 0.4.1 and torch elastic raise RendezvousConnectionError or
# DistNetworkError out of the rendezvous handler, or time out on the store (DistStoreError).
_STORE_LOST = re.compile(r"\b(DistNetworkError|RendezvousConnectionError|DistStoreError)\b")
_RANK_LINE = re.compile(r"^\[[A-Za-z_]+\d+\]:")  # a rank's output, tee'd: "[default0]:..."


def rendezvous_store_lost(returncode: int, agent_lines: Iterable[str]) -> bool:
    """Whether ``ft_launcher`` failed (exit 1) because the rendezvous store went away.

    The store lives in pod 0's agent. When that pod is lost, NVRx 0.7's agents on every other
    pod fail within seconds with ``DistNetworkError`` and exit 1, which ``restartPolicy:
    ExitCode`` would take for a permanent failure and end the job. The pod is healthy: its agent
    starts ``ft_launcher`` again (:mod:`.rejoin`), which joins the store of pod 0's replacement. ``agent_lines`` are ft_launcher's last stderr
    lines; a rank's own errors (prefixed ``[default<N>]:``) do not count.
    """
    if returncode != 1:
        return False
    return any(_STORE_LOST.search(line) for line in agent_lines if not _RANK_LINE.match(line))


# How ft_launcher reports that NVRx's node health checks failed: the exception's name, on its own
# lines (NVRx 0.7 "Agent .run() raised UnhealthyNodeException: ..."; 0.4.1 raises it out of the
# rendezvous handler, so its traceback names it).
_UNHEALTHY = re.compile(r"\bUnhealthyNodeException\b")


def node_unhealthy(returncode: int, agent_lines: Iterable[str]) -> bool:
    """Whether ``ft_launcher`` failed (exit 1) because NVRx found this node unhealthy (its GPU,
    NIC, storage or external node-health check, before a rendezvous). A rank's own output does
    not count."""
    if returncode != 1:
        return False
    return any(_UNHEALTHY.search(line) for line in agent_lines if not _RANK_LINE.match(line))


def unhealthy_reason(agent_lines: Iterable[str]) -> str:
    """What NVRx said of the unhealthy node (``UnhealthyNodeException: ...``), for the pod's message
    and the node's taint."""
    for line in reversed(list(agent_lines)):
        if _RANK_LINE.match(line):
            continue
        m = re.search(r"UnhealthyNodeException:?\s*(.*)", line)
        if m:
            return m[1].strip() or "NVRx node health check failed"
    return "NVRx node health check failed"


def taint_unhealthy_node(key: Optional[str], reason: str) -> Optional[str]:
    """Taint this pod's node ``key``:NoSchedule (:mod:`.node_taint`) when asked to (``key``); what
    was done, or None (not asked, or it could not be done: said, and the node exits all the same)."""
    if not key:
        return None
    try:
        return node_taint.taint_node(key, reason)
    except node_taint.TaintError as exc:
        _say(f"could not taint this node {key}:NoSchedule: {exc}")
        return None


def exit_code(
    returncode: int, stop_signal: Optional[int], agent_lines: Iterable[str] = (), config_failure: bool = False
) -> int:
    """The node's exit code (see :func:`.exit_codes.node_exit_code`)."""
    lines = list(agent_lines)
    return exit_codes.node_exit_code(
        returncode,
        stop_signal,
        config_failure,
        store_lost=rendezvous_store_lost(returncode, lines),
        unhealthy=node_unhealthy(returncode, lines),
    )


class _StderrTail(threading.Thread):
    """Passes ft_launcher's stderr through to ours, keeping its last lines."""

    def __init__(self, stream, keep: int = 200):
        super().__init__(daemon=True, name="ft-launcher-stderr")
        self.stream, self.lines = stream, collections.deque(maxlen=keep)

    def run(self) -> None:
        out = sys.stderr.buffer
        for raw in iter(self.stream.readline, b""):
            out.write(raw)
            out.flush()
            self.lines.append(raw.decode(errors="replace"))


SWEEP_INTERVAL_S = 1.0


class RankHelperSweeper:
    """Kills the helpers a dead rank leaves behind, while the node keeps running.

    A rank's helper processes (the checkpoint writer, multiprocessing's Manager) block SIGTERM
    and survive a rank that was killed; as the node's subreaper we inherit them. Every in-job
    restart would leave another set, with its memory, until the node exits. A helper is
    recognised by its session: ``ft_launcher`` starts each rank as a session leader, and helpers
    stay in their rank's session. Other orphans are left alone, in particular NVRx's in-process
    monitor, which detaches into a session of its own on purpose.

    A rank that exited is forgotten once its helpers are gone. Its pid may be reused, even by a
    new rank: a session's helpers are orphans when no process of that pid exists, or when the
    process that has it now is younger than they are (it cannot be their session leader).
    """

    def __init__(self, launcher_pid: int, prewarm_pid: Optional[int] = None):
        # Ranks are the launcher's children, or the pre-warmed server's (its forks).
        self.launcher_pid, self.prewarm_pid = launcher_pid, prewarm_pid
        self.ranks: set[int] = set()  # session ids of ranks seen, dead ones until their helpers are gone
        self.seen_ranks = False  # the launcher started ranks at some point

    def sweep(self) -> list[int]:
        """Learn the current ranks, reap dead children, kill dead ranks' helpers, forget dead
        ranks whose helpers are gone. Returns the pids killed."""
        for parent in (self.launcher_pid, self.prewarm_pid):
            try:
                for rank in psutil.Process(parent).children() if parent is not None else ():
                    if _session(rank.pid) == rank.pid:
                        self.ranks.add(rank.pid)
                        self.seen_ranks = True
            except psutil.NoSuchProcess:
                pass
        killed, helpers_left = [], set()
        for proc in psutil.Process().children():
            if proc.pid in (self.launcher_pid, self.prewarm_pid):
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(proc.pid, os.WNOHANG)
                    continue
            except (psutil.NoSuchProcess, ChildProcessError):
                continue
            leader = _session(proc.pid)
            if leader not in self.ranks or leader == proc.pid:
                continue
            if not _leader_gone(leader, proc):
                helpers_left.add(leader)
                continue
            for victim in [*_descendants(proc), proc]:
                try:
                    victim.kill()  # they block SIGTERM
                    killed.append(victim.pid)
                except psutil.NoSuchProcess:
                    pass
        for pid in killed:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        # A rank that exited and has no helper left is forgotten (its pid may come back).
        self.ranks = {r for r in self.ranks if r in helpers_left or _alive(r)}
        return killed


def _session(pid: int) -> Optional[int]:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _leader_gone(leader: int, helper: psutil.Process) -> bool:
    """Whether the session leader ``helper`` belongs to has exited (its pid may be reused)."""
    try:
        current = psutil.Process(leader)
        if current.status() == psutil.STATUS_ZOMBIE:
            return True
        return current.create_time() > helper.create_time()
    except psutil.NoSuchProcess:
        return True


def _descendants(proc: psutil.Process) -> list:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def check_launcher_args(args: list[str], nvrx_version: Optional[str] = None) -> Optional[str]:
    """A configuration error in the launcher's arguments that would fail every attempt alike;
    ``nvrx_version``: the NVRx that runs them (default: the installed one)."""
    for arg in args:
        if arg.startswith("--ft-cfg-path="):
            path = arg.split("=", 1)[1]
            if not os.path.isfile(path):
                return f"--ft-cfg-path={path}: no such file (the chart's ConfigMap writes it; is it mounted?)"
    return nvrx.hot_spares_unsupported(args, nvrx_version or nvrx.installed_version())


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _termination_message(text: str) -> None:
    """Kubernetes shows ``/dev/termination-log`` in the pod's status; it exists only in a pod."""
    path = os.environ.get(exit_codes.TERMINATION_LOG_ENV, exit_codes.TERMINATION_LOG)
    if os.path.isfile(path):
        try:
            with open(path, "w") as f:
                f.write(text[-4000:])
        except OSError:
            pass


def _say(message: str) -> None:
    print(f"[resilient-fsdp agent] {message}", file=sys.stderr, flush=True)


AGENT_FLAGS = {
    "--rejoin-timeout": "seconds a node that is not the store host keeps joining again after "
    "another node's failure (0: never; default 0)",
    "--taint-unhealthy-node": "taint key: a node NVRx finds unhealthy (exit 201) is tainted KEY=<reason>:"
    "NoSchedule before the node exits, so the job's next pod goes elsewhere "
    "(needs get and patch on nodes; default: no taint)",
    "--max-pod-failures": "the job's pod failures in a row without progress after which a node exits 2 "
    "instead of a retried code (the PyTorchJob's job.backoffLimit, which its "
    "operator does not apply; default: no bound)",
    "--metrics-port": "port of the node's Prometheus metrics endpoint (0: none; default 0)",
    "--store-timeout": "seconds the rendezvous store may accept no connection before a node that is not "
    "its host ends its launcher and joins again (a store host gone without closing "
    "its connections; 0: never; default 0)",
    "--prewarm": "true: ranks are forked from a server that has imported the trainer (resilience.prewarm; "
    "default false)",
}


def parse_agent_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The agent's own leading flags (:data:`AGENT_FLAGS`, ended by ``--``) and ft_launcher's
    arguments (the rest)."""
    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv) and argv[i].partition("=")[0] in AGENT_FLAGS:
        name, _, value = argv[i].partition("=")
        if name == "--prewarm":
            if value not in ("true", "false"):
                raise ValueError(f"{argv[i]}: give {name}=true or {name}=false")
            flags[name] = float(value == "true")
        elif name == "--max-pod-failures":
            if not value.isdigit():
                raise ValueError(f"{argv[i]}: give {name}=N, a whole number 0 or more")
            flags[name] = int(value)
        elif name == "--taint-unhealthy-node":
            if not re.fullmatch(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", value):
                raise ValueError(f"{argv[i]}: give {name}=KEY, a taint key such as resilient-fsdp.io/unhealthy-node")
            flags[name] = value
        elif name == "--metrics-port":
            if not (value.isdigit() and int(value) <= 65535):
                raise ValueError(f"{argv[i]}: give {name}=PORT, a whole number from 1 to 65535 (0: no metrics)")
            flags[name] = int(value)
        else:
            try:
                flags[name] = float(value)
            except ValueError:
                raise ValueError(f"{argv[i]}: give {name}=SECONDS, a number") from None
        i += 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    return flags, argv[i:]


def _seconds(text: Optional[str]) -> float:
    """A ``--rdzv-conf`` duration in seconds; 0 when absent or not a number."""
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0


def _nproc(args: list[str]) -> Optional[int]:
    for arg in args:
        if arg.startswith("--nproc-per-node="):
            value = arg.split("=", 1)[1]
            return int(value) if value.isdigit() else None
    return None


def main(argv: Optional[list[str]] = None) -> int:
    try:
        agent = NodeAgent.from_argv(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        _say(f"configuration error: {exc}; exiting {exit_codes.CONFIG}")
        _termination_message(str(exc))
        return exit_codes.CONFIG
    agent.prepare_environment()
    agent.install_signal_handlers()  # before the launcher starts: a SIGTERM to PID 1 in between would be lost
    return agent.run()


@dataclass
class LauncherEnding:
    """How one ``ft_launcher`` run ended, and the node exit code it reads as (:data:`.exit_codes.TABLE`)."""

    returncode: int
    lines: list[str]  # its last stderr lines
    started: bool  # it started ranks: a rendezvous of every node completed
    code: int
    config_failure: Optional[str]  # what a rank reported no restart can fix, or None


@dataclass
class NodeAgent:
    """One node's agent: its flags, ft_launcher's arguments, and what it learns while they run."""

    flags: dict[str, Any]
    args: list[str]  # ft_launcher's
    index: Optional[int]  # the pod's index in the job (None: not in an indexed job)
    env: dict[str, str] = field(default_factory=dict)  # the launcher's environment
    nproc: Optional[int] = None  # ranks per node
    store_host: bool = True
    base: str = ""  # prefix of the node's files in the temporary directory
    stop_signal: Optional[int] = None  # the first SIGTERM/SIGINT received
    last_signal: Optional[int] = None  # the latest, forwarded to a launcher that starts after it
    fatal_signalled: bool = False  # a rank signalled a configuration-type failure
    launcher: Optional[subprocess.Popen] = None
    reports: Optional[node_reports.NodeReports] = None
    trained: bool = False  # a launcher of this pod started ranks (a hot spare's may never)

    @classmethod
    def from_argv(cls, argv: list[str]) -> "NodeAgent":
        """The agent of ``argv`` (its flags, ``--``, ft_launcher's); ValueError names a bad flag."""
        flags, args = parse_agent_args(argv)
        return cls(flags, args, node_rank.node_index(os.environ))

    @property
    def stop_file(self) -> str:
        return self.base + ".stopping"

    @property
    def fatal_file(self) -> str:
        return self.base + ".fatal"

    @property
    def done_dir(self) -> Path:
        return Path(self.base + ".done")

    def prepare_environment(self) -> None:
        """Become the node's subreaper; build the launcher's environment and arguments; make the
        files the ranks report through."""
        become_subreaper()
        self.nproc = _nproc(self.args)
        env = prewarm.with_launcher_threads(node_rank.launcher_env(os.environ, self.index), self.nproc)
        env[NODE_PID_ENV] = str(os.getpid())
        env[node_rank.SPARES_ENV] = str(node_rank.spares(self.args))  # whether a straggler's node can be replaced
        env[NODE_START_ENV] = repr(time.time())
        if self.index is not None:
            self.args = node_rank.with_store_host(self.args, self.index == 0)
        self.args, env = node_rank.with_install(self.args, env)
        self.store_host = self.index in (None, 0) or node_rank.rdzv_conf(self.args).get("is_host", "").lower() in (
            "1",
            "true",
            "yes",
        )
        self.base = os.path.join(tempfile.gettempdir(), f"resilient-fsdp-node-{os.getpid()}")
        # A pod's agent is always PID 1: files left by one that was SIGKILLed (the pod's /tmp
        # survives a container restart) would make every later SIGTERM read as a graceful stop.
        self.remove_files()
        self.done_dir.mkdir()
        env[NODE_STOP_ENV] = self.stop_file
        env[exit_codes.NODE_FATAL_ENV] = self.fatal_file
        env[exit_codes.NODE_DONE_ENV] = str(self.done_dir)
        self.env = env

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_stop_signal)
        signal.signal(exit_codes.FATAL_SIGNAL, self.on_fatal_signal)

    def on_stop_signal(self, signum: int, _frame) -> None:
        if self.stop_signal is None:
            # Before the ranks see the signal: tells them this is a stop, not a worker restart.
            with open(self.stop_file, "w") as f:
                f.write(str(signum))
            self.stop_signal = signum
        self.last_signal = signum
        if self.launcher is not None:
            _send(self.launcher, signum)

    def on_fatal_signal(self, _signum: int, _frame) -> None:
        # A rank failed in a way no restart fixes: stop ft_launcher before it restarts the rank.
        self.fatal_signalled = True
        if self.launcher is not None:
            _send(self.launcher, signal.SIGTERM)

    def stopped(self) -> bool:
        return self.stop_signal is not None

    def ranks_finished(self) -> bool:
        return self.nproc is not None and exit_codes.finished_ranks(self.done_dir) >= self.nproc

    def run(self) -> int:
        """Check the arguments, then run ft_launcher (again, while :class:`.rejoin.Rejoin` says so)
        and return the node's exit code."""
        bad = check_launcher_args(self.args)
        if bad:
            _say(f"configuration error: {bad}; exiting {exit_codes.CONFIG}")
            _termination_message(bad)
            self.remove_files()
            return exit_codes.CONFIG
        try:
            self.start_reporting()
            complete = training_complete(self.args)
            if complete:
                # A pod recreated after the job's last rendezvous (its node was lost as training ended):
                # no launcher of the job will join it, so waiting for one would hold the job open.
                _say(
                    f"the job's training is already complete ({complete}): this pod started after it ended; "
                    "exiting 0 without starting ft_launcher (to train on, raise train.steps or train.stop_at_step)"
                )
                return 0
            ending = self.run_until_settled()
            if ending is None:
                return 0
        finally:
            if self.reports is not None:
                self.reports.stop()
            self.remove_files()
        return self.bound_pod_failures(self.explain(ending))

    def start_reporting(self) -> None:
        """The metrics endpoint (``--metrics-port``) and the node's reports to the run directory."""
        try:
            run_dir: Optional[Path] = metrics_endpoint.trainer_run_dir(self.args)
            unknown_run_dir = None
        except metrics_endpoint.MetricsError as exc:
            run_dir, unknown_run_dir = None, str(exc)
        silent_after_s = node_reports.silent_after(self.flags.get("--store-timeout"))
        if self.flags.get("--metrics-port"):
            start_metrics(
                int(self.flags["--metrics-port"]),
                self.args,
                run_dir,
                unknown_run_dir,
                self.index,
                self.env,
                silent_after_s,
            )
        if run_dir is not None and self.index is not None:
            self.reports = node_reports.NodeReports(
                run_dir, self.index, socket.gethostname(), self.env.get("NODE_NAME", ""), silent_after_s, _say
            )
            self.reports.start()
        if self.index is not None:
            _say(
                f"node {self.index} of the job (GROUP_RANK={self.env['GROUP_RANK']}); "
                f"{'hosts' if self.store_host else 'joins'} the rendezvous store"
            )

    def run_until_settled(self) -> Optional[LauncherEnding]:
        """Launcher runs until one ends the node: its ending, or None when the job's training is done."""
        rejoin = Rejoin(self.store_host, self.flags.get("--rejoin-timeout", 0.0))
        if not self.store_host:
            conf = node_rank.rdzv_conf(self.args)
            said = await_first_store(
                node_rank.rdzv_endpoint(self.args),
                _seconds(conf.get("store_connect_wait_seconds")) or _seconds(conf.get("join_timeout")),
                stopped=self.stopped,
            )
            if said:
                _say(said)
        while True:
            ending = self.run_once()
            self.trained = self.trained or ending.started
            if ending.config_failure is not None or self.stopped():
                return ending
            if ending.code != 0 and self.ranks_finished():
                _say(
                    f"every rank of this node finished training; ft_launcher's shutdown exited {ending.returncode} "
                    "(the store host may have gone first): exiting 0"
                )
                return None
            complete = training_complete(self.args) if ending.code in exit_codes.REJOINED_CODES else None
            if complete:
                _say(
                    f"the job's training is complete ({complete}); ft_launcher exited {ending.returncode} "
                    f"({'a standby pod; ' if not ending.started else ''}the store host went first): exiting 0"
                )
                return None
            again = rejoin.decide(ending.code, ending.started)
            if again is None:
                if not self.store_host and ending.code in exit_codes.REJOINED_CODES and rejoin.timeout_s > 0:
                    _say(rejoin.gave_up())
                return ending
            _say(again)
            _say(await_store(node_rank.rdzv_endpoint(self.args), stopped=self.stopped, window_s=rejoin.remaining_s()))
            if self.stopped():  # stopped while no launcher ran: nothing to checkpoint
                assert self.stop_signal is not None
                ending.code = 128 + self.stop_signal
                return ending

    def run_once(self) -> LauncherEnding:
        """One ``ft_launcher`` run to its end, and the node exit code it reads as."""
        endpoint = node_rank.rdzv_endpoint(self.args)
        watch = (
            StoreWatch(endpoint, self.flags["--store-timeout"])
            if not self.store_host and endpoint is not None and self.flags.get("--store-timeout")
            else None
        )
        returncode, lines, started = self.launch(
            self.base + ".prewarm.sock" if self.flags.get("--prewarm") else None, watch
        )
        reason = _read(self.fatal_file) if (self.fatal_signalled or os.path.exists(self.fatal_file)) else None
        code = exit_code(returncode, self.stop_signal, lines, reason is not None)
        if watch is not None and watch.lost and reason is None and not self.stopped():
            code = exit_codes.RENDEZVOUS_LOST
        return LauncherEnding(returncode, lines, started, code, reason)

    def launch(self, prewarm_socket: Optional[str], watch: Optional[StoreWatch]) -> tuple[int, list[str], bool]:
        """Run ``ft_launcher``: (its return code, its last stderr lines, whether it started ranks).
        With ``prewarm_socket``, beside a pre-warmed server there that forks the ranks
        (:mod:`.prewarm`), which ends with the run. With ``watch`` (a node that is not the store
        host), a store that stopped answering ends it (:mod:`.store_watch`): its ranks and the
        launcher are killed, and ``watch.lost`` says why; not once every rank of the node has
        finished training (the store host has left at the job's end, and the ranks still finish)."""
        env = self.env
        server = start_prewarm(prewarm_socket, self.args, env) if prewarm_socket else None
        if server is not None:
            env = {**env, prewarm.SOCKET_ENV: prewarm_socket}
        child = subprocess.Popen([*ft_launcher_executable(), *self.args], env=env, stderr=subprocess.PIPE)
        tail = _StderrTail(child.stderr)
        tail.start()
        self.launcher = child
        if self.last_signal is not None:
            _send(child, self.last_signal)  # arrived while the launcher was being started
        if self.fatal_signalled:
            _send(child, signal.SIGTERM)
        sweeper = RankHelperSweeper(child.pid, server.pid if server is not None else None)
        if watch is not None:
            watch.start()
        while True:
            try:
                returncode = child.wait(timeout=SWEEP_INTERVAL_S)
                break
            except subprocess.TimeoutExpired:
                sweeper.sweep()
                if watch is not None and watch.lost and self.ranks_finished():
                    watch.lost = None  # the job's end: the store host left first, as it may
                elif watch is not None and watch.lost:
                    _say(watch.lost)
                    # Its ranks wait on peers through the lost host, its store client on the host:
                    # nothing here can end on its own in time.
                    kill_descendants(timeout=5.0)
        if watch is not None:
            watch.stop()
        kill_descendants(timeout=5.0)
        tail.join(timeout=5.0)
        return returncode, list(tail.lines), sweeper.seen_ranks

    def explain(self, ending: LauncherEnding) -> int:
        """Say why the node ends (and in the pod's termination message); its exit code."""
        code, returncode = ending.code, ending.returncode
        if ending.config_failure is not None:
            _say(
                f"a rank failed with a configuration error, which no restart can fix; ft_launcher was stopped "
                f"(exited {returncode}); exiting {code}: {ending.config_failure}"
            )
            _termination_message(ending.config_failure)
        elif self.stop_signal is not None:
            _say(f"stopped by {signal.Signals(self.stop_signal).name}; ft_launcher exited {returncode}; exiting {code}")
        elif code == exit_codes.UNHEALTHY_NODE:
            why = unhealthy_reason(ending.lines)
            done = taint_unhealthy_node(self.flags.get("--taint-unhealthy-node"), why)
            _say(
                f"NVRx's node health checks found this node unhealthy ({why}); ft_launcher exited {returncode}; "
                f"exiting {exit_codes.describe_code(code)}: "
                + (
                    f"{done}, so that the recreated pod lands elsewhere"
                    if done
                    else "cordon the node (kubectl cordon) or let node auto-repair replace it, so that the recreated pod "
                    "lands elsewhere (pod.taintUnhealthyNode.enabled does it from here)"
                )
            )
            _termination_message(
                f"unhealthy node (NVRx node health check: {why}); node exit code "
                f"{exit_codes.describe_code(code)}" + (f"; {done}" if done else "")
            )
        elif code == exit_codes.RENDEZVOUS_LOST:
            _say(
                f"ft_launcher lost the rendezvous store (its host, pod 0's agent, is gone) and exited {returncode}; "
                f"exiting {exit_codes.describe_code(code)}"
            )
        elif code != 0:
            _say(f"ft_launcher exited {returncode}; exiting {exit_codes.describe_code(code)}")
            _termination_message(f"ft_launcher exited {returncode}; node exit code {exit_codes.describe_code(code)}")
        elif not self.trained:
            _say("this pod stood by as a hot spare until the job ended: its launcher started no ranks; exiting 0")
        return code

    def bound_pod_failures(self, code: int) -> int:
        """``code``, or the configuration code once the job's pod failures pass ``--max-pod-failures``."""
        if self.stop_signal is not None or code not in exit_codes.RETRIED or "--max-pod-failures" not in self.flags:
            return code
        bounded = bound_pod_failures(self.args, int(self.flags["--max-pod-failures"]), code, self.index)
        if bounded is None:
            return code
        _say(f"{bounded}; exiting {exit_codes.CONFIG}")
        _termination_message(bounded)
        return exit_codes.CONFIG

    def remove_files(self) -> None:
        for path in (self.stop_file, self.fatal_file):
            _remove(path)
        shutil.rmtree(self.done_dir, ignore_errors=True)


def bound_pod_failures(args: list[str], limit: int, code: int, index: Optional[int]) -> Optional[str]:
    """This node is about to exit ``code``, which the job level retries: count it among the job's
    pod failures (:mod:`.pod_failures`); why the job must end instead, or None."""
    try:
        run_dir = metrics_endpoint.trainer_run_dir(args)
    except metrics_endpoint.MetricsError:
        return None
    return pod_failures.judge(run_dir, limit, code, socket.gethostname(), index)


def training_complete(args: list[str]) -> Optional[str]:
    """Whether the job that ``args`` (ft_launcher's) run has trained all its steps, by its run
    directory: the last lifecycle record of ``metrics.jsonl`` is the ``finish`` that rank 0 writes once the
    final checkpoint is committed, at ``train.steps``. A hot spare, or a pod recreated after the last
    rendezvous, has no ranks of its own to tell it; it asks when its launcher lost the store (which
    the store host's pod takes with it when the job ends). The last ``start`` or ``finish`` counts:
    records of the final upload follow the finish, and a job launched again on the same run
    directory writes its ``start`` after that ``finish`` at its first attempt. Returns what was
    read, or None (not complete, or not readable). A run given ``train.stop_at_step`` below
    ``train.steps`` is complete at that step: it ends there, checkpointed, as at the end."""
    try:
        cfg = metrics_endpoint.trainer_config(args)
        path = Path(cfg.run_dir) / "metrics.jsonl"
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except (metrics_endpoint.MetricsError, OSError):
        return None
    # The last start or finish: rank 0 writes records after its finish too (the final upload,
    # S3 retention), and a torn last line is no record.
    last: dict = {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") in ("start", "finish"):
            last = record
            break
    step = last.get("step") if last.get("event") == "finish" else None
    stop = cfg.train.stop_at_step
    if isinstance(step, int) and stop is not None and stop < cfg.train.steps and step >= stop:
        return f"{path} ends with its finish at step {step} of train.stop_at_step={stop}"
    if isinstance(step, int) and step >= cfg.train.steps:
        return f"{path} ends with its finish at step {step} of train.steps={cfg.train.steps}"
    return None


_TAIL_BYTES = 1 << 16  # a finish record is the file's last line, far shorter than this


def start_metrics(
    port: int,
    args: list[str],
    run_dir: Optional[Path],
    unknown: Optional[str],
    index: Optional[int],
    env: dict[str, str],
    silent_after_s: float,
) -> None:
    """Serve the run's metrics on ``port``: on the node's address when ft_launcher is given one
    (``--local-addr``, ``PET_LOCAL_ADDR``: pods sharing a host's loopback), else on every address.
    ``unknown``: why the run directory is not known (then nothing is served)."""
    address = next((a.split("=", 1)[1] for a in args if a.startswith("--local-addr=")), env.get("PET_LOCAL_ADDR"))
    try:
        if run_dir is None:
            raise metrics_endpoint.MetricsError(unknown or "the run directory is unknown")
        where, _ = metrics_endpoint.serve(
            port, run_dir, "" if index is None else str(index), address or None, silent_after_s
        )
    except metrics_endpoint.MetricsError as exc:
        _say(f"no metrics endpoint: {exc}; training goes on without it")
        return
    _say(f"metrics of {run_dir} served at /metrics, {where}")


def start_prewarm(path: str, args: list[str], env: dict[str, str]) -> Optional[subprocess.Popen]:
    """The pre-warmed server for the ranks ``args`` (ft_launcher's) start, when they run the
    trainer (``-m resilient_fsdp.train``); None for another entrypoint."""
    try:
        at = args.index("-m")
    except ValueError:
        return None
    if at + 1 >= len(args) or args[at + 1] != prewarm.TRAINER_MODULE:
        return None
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "resilient_fsdp.resilience.prewarm", f"--socket={path}", "--", *args[at + 2 :]],
        env=env,
    )
    # Written before ft_launcher starts: its ranks wait for the server while this marker names it alive.
    with open(path + ".starting", "w") as f:
        f.write(str(server.pid))
    return server


def _send(child: subprocess.Popen, signum: int) -> None:
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip() or "a rank reported a configuration error"
    except OSError:
        return "a rank reported a configuration error"


if __name__ == "__main__":
    sys.exit(main())
