"""Run by tests/resilience/test_resilience.py: a node wrapper's view of a rank that dies and leaves helpers.

Tree: this process (subreaper) -> "launcher" -> "rank" (session leader) -> "helper" (ignores
SIGTERM) and a detached "monitor" (double fork + setsid, as NVRx's in-process monitor does).
The launcher SIGKILLs the rank; the sweeper must then kill the helper and leave the monitor.
Prints one JSON line: the pids and which of them are alive after sweeping.
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

RANK = r'''
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
'''

LAUNCHER = r'''
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE, text=True)
helper = int(rank.stdout.readline())
print(rank.pid, helper, flush=True)
sys.stdin.readline()          # wait until the wrapper has seen the rank
os.kill(rank.pid, signal.SIGKILL)
rank.wait()
time.sleep(120)
'''


def main() -> None:
    become_subreaper()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    rank, helper = (int(x) for x in launcher.stdout.readline().split())
    sweeper = RankHelperSweeper(launcher.pid)
    sweeper.sweep()  # learns the rank while it is alive
    launcher.stdin.write("go\n")
    launcher.stdin.flush()
    killed: list[int] = []
    deadline = time.time() + 20
    while time.time() < deadline and helper not in killed:
        time.sleep(0.2)
        killed += sweeper.sweep()
    for _ in range(3):  # the next sweeps reap the killed helper
        time.sleep(0.3)
        sweeper.sweep()
    monitors = [p.pid for p in psutil.Process().children() if p.pid not in (launcher.pid, helper)]
    alive = {pid: psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
             for pid in [helper, *monitors]}
    print(json.dumps({"rank": rank, "helper": helper, "monitors": monitors, "killed": killed,
                      "alive": {str(k): v for k, v in alive.items()}}), flush=True)
    for pid in monitors:
        os.kill(pid, signal.SIGKILL)
    launcher.kill()


if __name__ == "__main__":
    main()
