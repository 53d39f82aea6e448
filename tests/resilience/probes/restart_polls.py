"""NVRx 0.7's in-job restart waits, as the node agent's ft_launcher runs them: the launcher's and the
barrier rendezvous's modules after :func:`resilient_fsdp.resilience.nvrx.quicken_restart_polls`.
Run with the image's NVRx lane first on the path; prints one JSON line."""

import json
import os
import signal
import subprocess
import sys
import time

from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
from nvidia_resiliency_ext.fault_tolerance import launcher

from resilient_fsdp.resilience import nvrx

original_interval = barrier._RendezvousBarrierState._compute_step2_poll_interval(2, 5.0)
changed = nvrx.quicken_restart_polls(launcher)


def group(ignore_term: bool) -> subprocess.Popen:
    """A process group of its own (a worker's, as ft_launcher starts them) with a child in it."""
    code = (
        "import signal, subprocess, sys, time\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
        + "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        + "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    return proc


def timed_termination(ignore_term: bool) -> dict:
    proc = group(ignore_term)
    t0 = time.monotonic()
    launcher.terminate_mp_processes(allowed_pgids={os.getpgid(proc.pid)})
    took = time.monotonic() - t0
    proc.wait(timeout=10)
    return {"s": took, "returncode": proc.returncode}


t0 = time.monotonic()
barrier.time.sleep(1.0)
step0_look = time.monotonic() - t0
print(
    json.dumps(
        {
            "changed": changed,
            "step2_interval": {
                str(n): barrier._RendezvousBarrierState._compute_step2_poll_interval(n, 5.0)
                for n in (2, 200, 2000, 4000, 20000)
            },
            "step2_interval_nvrx": original_interval,
            "step0_look_s": step0_look,
            "terminate_exits_on_term": timed_termination(False),
            "terminate_ignores_term": timed_termination(True),
            "sigkill": -signal.SIGKILL,
        }
    )
)
