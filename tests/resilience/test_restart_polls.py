"""NVRx 0.7's fixed one-second waits in every in-job restart, made polls in the ``ft_launcher`` the
node agent runs (``resilience.nvrx.quicken_restart_polls``), checked on NVRx 0.7's own modules
(the image's lane), and NVRx 0.4.1's rendezvous polls, each in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.resilience.probes import HERE as PROBES
from tests.support import _env


def test_the_image_nvrxs_restart_waits_end_when_their_condition_does(nvrx07_lane):
    proc = subprocess.run(
        [sys.executable, str(PROBES / "restart_polls.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env([nvrx07_lane]),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["changed"] == ["terminate_mp_processes", "_compute_step2_poll_interval", "step 0's poll"]
    # The store host's look at who joined: NVRx's floor is a second; here a tenth up to 200
    # nodes, then NVRx's growth with the nodes (capped by its segment check interval).
    assert result["step2_interval_nvrx"] == 1.0
    assert result["step2_interval"] == {"2": 0.1, "200": 0.1, "2000": 1.0, "4000": 2.0, "20000": 5.0}
    assert result["step0_look_s"] < 0.5  # the barrier's one-second look, made a tenth
    # A worker group that ends on SIGTERM is gone well inside NVRx's fixed second...
    exits = result["terminate_exits_on_term"]
    assert exits["s"] < 0.6 and exits["returncode"] == -15, exits
    # ...and one that ignores it still gets the whole second, then SIGKILL.
    ignores = result["terminate_ignores_term"]
    assert 0.95 <= ignores["s"] < 3.0 and ignores["returncode"] == result["sigkill"], ignores


def test_the_pinned_nvrxs_rendezvous_looks_at_the_store_every_tenth_of_a_second():
    """NVRx 0.4.1 (the local lane) has its copy of torch's dynamic rendezvous, which sleeps a
    second between looks at the store's state: a tenth here; its random backoff stays."""
    probe = """
import json, time
from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as dynamic, launcher
from resilient_fsdp.resilience import nvrx
before = launcher.terminate_mp_processes
changed = nvrx.quicken_restart_polls(launcher)
again = nvrx.quicken_restart_polls(launcher)
t0 = time.monotonic(); dynamic._delay(seconds=1); look = time.monotonic() - t0
t0 = time.monotonic(); dynamic._delay(seconds=0.3); other = time.monotonic() - t0
print(json.dumps({"version": nvrx.installed_version(), "changed": changed, "again": again, "look": look,
                  "other": other, "terminate_kept": launcher.terminate_mp_processes is before}))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=_env([]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == "0.4.1" and result["changed"] == ["_ft_rendezvous._delay"]
    assert result["again"] == []  # applied once
    assert result["look"] < 0.5 and 0.29 <= result["other"] < 0.8
    assert result["terminate_kept"]  # 0.4.1's terminate has no fixed wait to take out
