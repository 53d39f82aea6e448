"""Run by tests/resilience/test_agent.py: a node wrapper's view of a rank that dies and leaves helpers.

Tree: this process (subreaper) -> "launcher" -> "rank" (session leader) -> "helper" (ignores
SIGTERM) and a detached "monitor" (double fork + setsid, as NVRx's in-process monitor does).
The launcher SIGKILLs the rank; the sweeper must then kill the helper and leave the monitor.
Prints one JSON line: the pids and which of them are alive after sweeping.

``reuse``: after the dead rank's helper is gone, a process detaches into a session of its own
under the dead rank's pid (set through ``/proc/sys/kernel/ns_last_pid``, as root; the kernel
reuses a pid only once no session holds it) and leaves a child there, as NVRx's in-process monitor
does: the sweeper must have forgotten the rank and leave that child alone.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from resilient_fsdp.resilience.agent import RankHelperSweeper
from resilient_fsdp.resilience.processes import become_subreaper

RANK = r"""
import os, signal, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
if os.fork() == 0:            # the detached monitor: fork, setsid, fork again
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
print(helper.pid, flush=True)
time.sleep(120)
"""

LAUNCHER = r"""
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE, text=True)
helper = int(rank.stdout.readline())
print(rank.pid, helper, flush=True)
sys.stdin.readline()          # wait until the wrapper has seen the rank
os.kill(rank.pid, signal.SIGKILL)
rank.wait()
time.sleep(120)
"""


RANK_PLAIN = r"""
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); time.sleep(120)"])
print(helper.pid, flush=True)
time.sleep(120)
"""

DETACHED = r"""
import os, sys, time
sys.stdin.readline()          # started in a session of its own: wait until the launcher keeps this one
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
"""

LAUNCHER_REUSE = r"""
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE, text=True)
helper = int(rank.stdout.readline())
print(rank.pid, helper, flush=True)
sys.stdin.readline()          # the wrapper has seen the rank
old = rank.pid
os.kill(old, signal.SIGKILL)
rank.wait()
sys.stdin.readline()          # the wrapper has killed the helper: the pid is free
found = None
for _ in range(300):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(old - 1))
    candidate = subprocess.Popen([sys.executable, "-c", sys.argv[2]], start_new_session=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if candidate.pid == old:
        found = candidate
        break
    candidate.kill()
    candidate.wait()
if found is None:
    print(-1, flush=True)
else:
    found.stdin.write("go\n")
    found.stdin.flush()
    print(int(found.stdout.readline()), flush=True)
    found.wait()
time.sleep(120)
"""


def kill_rank_and_sweep(launcher: subprocess.Popen, sweeper: RankHelperSweeper, helper: int) -> tuple[list[int], float]:
    """Let the sweeper learn the rank while it is alive, tell the launcher to kill it, and sweep
    until the rank's helper is killed (at most 20 s): (the pids killed, that deadline)."""
    sweeper.sweep()
    launcher.stdin.write("go\n")
    launcher.stdin.flush()
    killed: list[int] = []
    deadline = time.time() + 20
    while time.time() < deadline and helper not in killed:
        time.sleep(0.2)
        killed += sweeper.sweep()
    return killed, deadline


def reuse() -> None:
    become_subreaper()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_REUSE, RANK_PLAIN, DETACHED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rank, helper = (int(x) for x in launcher.stdout.readline().split())
    sweeper = RankHelperSweeper(launcher.pid)
    killed, deadline = kill_rank_and_sweep(launcher, sweeper, helper)
    while psutil.pid_exists(helper) and time.time() < deadline:
        time.sleep(0.1)
        sweeper.sweep()  # reaps it
    sweeper.sweep()
    helper_alive = psutil.pid_exists(helper)  # before its pid may be reused below
    launcher.stdin.write("go\n")
    launcher.stdin.flush()
    detached = int(launcher.stdout.readline())
    for _ in range(5):
        time.sleep(0.3)
        killed += sweeper.sweep()

    def alive(pid: int) -> bool:
        return pid > 0 and psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE

    session = os.getsid(detached) if alive(detached) else None
    print(
        json.dumps(
            {
                "rank": rank,
                "helper": helper,
                "detached": detached,
                "detached_session": session,
                "killed": killed,
                "alive": {"helper": helper_alive, "detached": alive(detached)},
            }
        ),
        flush=True,
    )
    if alive(detached):
        os.kill(detached, signal.SIGKILL)
    launcher.kill()


def main() -> None:
    if sys.argv[1:] == ["reuse"]:
        return reuse()
    become_subreaper()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    rank, helper = (int(x) for x in launcher.stdout.readline().split())
    sweeper = RankHelperSweeper(launcher.pid)
    killed, deadline = kill_rank_and_sweep(launcher, sweeper, helper)
    for _ in range(3):  # the next sweeps reap the killed helper
        time.sleep(0.3)
        sweeper.sweep()
    monitors = [p.pid for p in psutil.Process().children() if p.pid not in (launcher.pid, helper)]
    alive = {
        pid: psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        for pid in [helper, *monitors]
    }
    print(
        json.dumps(
            {
                "rank": rank,
                "helper": helper,
                "monitors": monitors,
                "killed": killed,
                "alive": {str(k): v for k, v in alive.items()},
                "forgotten": rank not in sweeper.ranks,
            }
        ),
        flush=True,
    )
    for pid in monitors:
        os.kill(pid, signal.SIGKILL)
    launcher.kill()


if __name__ == "__main__":
    main()
