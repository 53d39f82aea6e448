"""``python -m resilient_fsdp.resilience.agent FT_LAUNCHER_ARGS...``: a node's main process (a pod's PID 1).

It runs ``ft_launcher`` with the given arguments and turns its ending into an exit code the
job-level restart policy reads correctly (PyTorchJob ``restartPolicy: ExitCode`` retries 128-255
and fails the job on 1-127):

- stopped by the orchestrator (SIGTERM/SIGINT: eviction, spot reclaim, scale-down): the ranks
  checkpoint and exit; ``ft_launcher`` then reports 1, which would read as a permanent failure.
  This wrapper exits 128 + the signal instead, so the pod is recreated and the job resumes;
- ``ft_launcher`` killed by a signal: 128 + the signal (what a shell reports);
- otherwise ``ft_launcher``'s own code: 0 when training finished, 1 when the in-job restarts
  are exhausted or a rank failed for good.

It also marks the node for the ranks (``RESILIENT_FSDP_NODE_PID`` / ``_START``: which process is
the node, and since when) and, as a child subreaper, reaps whatever the node leaves behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

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


def exit_code(returncode: int, stop_signal: Optional[int]) -> int:
    """The node's exit code from ``ft_launcher``'s return code and the stop signal received, if any."""
    if returncode < 0:
        return 128 + (-returncode)
    if stop_signal is not None and returncode != 0:
        return 128 + stop_signal
    return returncode


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
    child = subprocess.Popen([*ft_launcher_executable(), *args], env=env)
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
    if os.path.exists(stop_file):
        os.unlink(stop_file)
    code = exit_code(returncode, received[0] if received else None)
    if received:
        print(f"[resilient-fsdp agent] stopped by {signal.Signals(received[0]).name}; ft_launcher exited "
              f"{returncode}; exiting {code}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
