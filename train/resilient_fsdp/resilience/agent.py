"""``python -m resilient_fsdp.resilience.agent FT_LAUNCHER_ARGS...``: a node's main process (a pod's PID 1).

It runs ``ft_launcher`` with the given arguments and turns its ending into an exit code the
job-level restart policy reads correctly (PyTorchJob ``restartPolicy: ExitCode`` retries 128-255
and fails the job on 1-127):

- stopped by the orchestrator (SIGTERM/SIGINT: eviction, spot reclaim, scale-down): the ranks
  checkpoint and exit; ``ft_launcher`` then reports 1, which would read as a permanent failure.
  This wrapper exits 128 + the signal instead, so the pod is recreated and the job resumes;
- ``ft_launcher`` killed by a signal: 128 + the signal (what a shell reports);
- ``ft_launcher`` lost the rendezvous store (its host, pod 0's agent, died with its pod):
  :data:`RENDEZVOUS_LOST_EXIT_CODE`, retried, so this pod is recreated and rejoins the store
  pod 0 hosts again (see :func:`rendezvous_store_lost`);
- otherwise ``ft_launcher``'s own code: 0 when training finished, 1 when the in-job restarts
  are exhausted or a rank failed for good.

It also marks the node for the ranks (``RESILIENT_FSDP_NODE_PID`` / ``_START``: which process is
the node, and since when), pins NVRx 0.7's node order to the operator's node rank
(``GROUP_RANK`` from ``PET_NODE_RANK``) and, as a child subreaper, reaps whatever the node leaves
behind. ``ft_launcher``'s stderr passes through it, so the ending can be read.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

import psutil

from .faults import NODE_PID_ENV, NODE_START_ENV
from .graceful_stop import NODE_STOP_ENV
from .processes import become_subreaper, kill_descendants


def ft_launcher_executable() -> list[str]:
    """``ft_launcher`` from this interpreter's environment, else from PATH."""
    beside = Path(sys.executable).parent / "ft_launcher"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ft_launcher")
    if found:
        return [found]
    raise FileNotFoundError("ft_launcher not found: install nvidia-resiliency-ext (pip install -e . in this repo)")


RENDEZVOUS_LOST_EXIT_CODE = 200
"""The node lost the rendezvous store: an infrastructure failure, retried by ``restartPolicy:
ExitCode`` (128-255). Outside 129-192, where 128 + a signal lives, so the two read apart."""

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
    ExitCode`` would take for a permanent failure and end the job. The pod is healthy: recreated,
    it joins the store of pod 0's replacement. ``agent_lines`` are ft_launcher's last stderr
    lines; a rank's own errors (prefixed ``[default<N>]:``) do not count.
    """
    if returncode != 1:
        return False
    return any(_STORE_LOST.search(line) for line in agent_lines if not _RANK_LINE.match(line))


def exit_code(returncode: int, stop_signal: Optional[int], agent_lines: Iterable[str] = ()) -> int:
    """The node's exit code from ``ft_launcher``'s return code, the stop signal received if any,
    and ft_launcher's last stderr lines."""
    if returncode < 0:
        return 128 + (-returncode)
    if stop_signal is not None and returncode != 0:
        return 128 + stop_signal
    if rendezvous_store_lost(returncode, agent_lines):
        return RENDEZVOUS_LOST_EXIT_CODE
    return returncode


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

    A rank's helper processes (the checkpoint writer, multiprocessing's Manager) ignore SIGTERM
    and survive a rank that was killed; as the node's subreaper we inherit them. Every in-job
    restart would leave another set, with its memory, until the node exits. A helper is
    recognised by its session: ``ft_launcher`` starts each rank as a session leader, and helpers
    stay in their rank's session. Other orphans are left alone, in particular NVRx's in-process
    monitor, which detaches into a session of its own on purpose.
    """

    def __init__(self, launcher_pid: int):
        self.launcher_pid = launcher_pid
        self.ranks: set[int] = set()

    def sweep(self) -> list[int]:
        """Learn the current ranks, reap dead children, kill dead ranks' helpers. Returns the
        pids killed."""
        try:
            for rank in psutil.Process(self.launcher_pid).children():
                if _session(rank.pid) == rank.pid:
                    self.ranks.add(rank.pid)
        except psutil.NoSuchProcess:
            pass
        killed = []
        for proc in psutil.Process().children():
            if proc.pid == self.launcher_pid:
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(proc.pid, os.WNOHANG)
                    continue
            except (psutil.NoSuchProcess, ChildProcessError):
                continue
            leader = _session(proc.pid)
            if leader in self.ranks and leader != proc.pid and not psutil.pid_exists(leader):
                for victim in [*_descendants(proc), proc]:
                    try:
                        victim.kill()  # they ignore SIGTERM
                        killed.append(victim.pid)
                    except psutil.NoSuchProcess:
                        pass
        for pid in killed:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        return killed


def _session(pid: int) -> Optional[int]:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _descendants(proc: psutil.Process) -> list:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    become_subreaper()
    env = dict(os.environ)
    env[NODE_PID_ENV] = str(os.getpid())
    env[NODE_START_ENV] = repr(time.time())
    stop_file = os.path.join(tempfile.gettempdir(), f"resilient-fsdp-node-{os.getpid()}.stopping")
    env[NODE_STOP_ENV] = stop_file
    if "PET_NODE_RANK" in env:
        # NVRx 0.7 orders nodes by infrastructure rank, from SLURM or GROUP_RANK, else by address
        # (utils.get_infrastructure_rank): the operator's node rank keeps pod N node N.
        env.setdefault("GROUP_RANK", env["PET_NODE_RANK"])
    child = subprocess.Popen([*ft_launcher_executable(), *args], env=env, stderr=subprocess.PIPE)
    tail = _StderrTail(child.stderr)
    tail.start()
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        if not received:
            # Before the ranks see the signal: tells them this is a stop, not a worker restart.
            with open(stop_file, "w") as f:
                f.write(str(signum))
        received.append(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    sweeper = RankHelperSweeper(child.pid)
    while True:
        try:
            returncode = child.wait(timeout=SWEEP_INTERVAL_S)
            break
        except subprocess.TimeoutExpired:
            sweeper.sweep()
    kill_descendants(timeout=5.0)
    tail.join(timeout=5.0)
    if os.path.exists(stop_file):
        os.unlink(stop_file)
    code = exit_code(returncode, received[0] if received else None, list(tail.lines))
    if received:
        print(f"[resilient-fsdp agent] stopped by {signal.Signals(received[0]).name}; ft_launcher exited "
              f"{returncode}; exiting {code}", file=sys.stderr, flush=True)
    elif code == RENDEZVOUS_LOST_EXIT_CODE:
        print(f"[resilient-fsdp agent] ft_launcher lost the rendezvous store (its host, pod 0's agent, is gone) and "
              f"exited {returncode}; exiting {code}, which the job-level restart retries", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
