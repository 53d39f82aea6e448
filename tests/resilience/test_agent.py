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


def test_a_node_that_is_not_the_store_host_joins_again_then_exits_when_no_store_returns(tmp_path):
    """Real processes: node 1 of a two-node job whose store host never starts. Its launcher's
    connect wait (read_timeout) ends; the agent starts it again in the pod, not counted, until the
    rejoin window ends; then the node exits retryably, so the job level counts it."""
    from tests.resilience.node import AGENT, free_port
    from tests.support import run_guarded

    cmd = [*AGENT, "--rejoin-timeout=4", "--", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=lonely",
           "--rdzv-conf=join_timeout=2,read_timeout=2,store_connect_wait_seconds=2", "--max-restarts=0",
           "-m", "resilient_fsdp.train", "--describe-config"]
    proc = run_guarded(cmd, tmp_path, None, 120, {"JOB_COMPLETION_INDEX": "1"})
    agent = [line for line in proc.stderr.splitlines() if line.startswith("[resilient-fsdp agent]")]
    assert proc.returncode == 200, proc.stderr[-3000:]
    assert agent[0] == "[resilient-fsdp agent] node 1 of the job (GROUP_RANK=1); joins the rendezvous store"
    joins = [line for line in agent if "joining again in this pod, not counted" in line]
    assert joins and "200: rendezvous-store-lost" in joins[0]
    assert any("no rendezvous completed within 4 s of the event" in line for line in agent)
