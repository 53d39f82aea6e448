"""The node agent: a dead rank's helpers swept, detached monitors left alone."""

from __future__ import annotations

import json

from tests.resilience.probes import HERE as PROBES


def test_node_wrapper_kills_a_dead_ranks_helpers_but_not_detached_monitors():
    """Real processes: a rank is SIGKILLed and leaves a helper that ignores SIGTERM, plus a
    detached monitor in its own session (as NVRx's in-process monitor is)."""
    import subprocess
    import sys

    probe = PROBES / "sweeper.py"
    proc = subprocess.run([sys.executable, "-W", "ignore", str(probe)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["killed"] == [result["helper"]]
    assert result["alive"][str(result["helper"])] is False
    assert len(result["monitors"]) == 1 and result["alive"][str(result["monitors"][0])] is True
