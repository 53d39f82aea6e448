"""A failed attempt aborts its process groups before destroying them, and the node's sweeper kills
a dead rank's helpers even when its pid was reused; real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.resilience.node import free_port
from tests.support import REPO, _env

HERE = Path(__file__).parent


def test_peers_blocked_on_a_failed_rank_fail_at_once_not_at_the_collective_timeout(tmp_path):
    """Three gloo ranks: rank 0 takes the failure path while the others wait for it in an
    all-reduce, then stays alive 30 s; dist.timeout_s is 60 s. Aborting shuts the group's
    connections down, so the peers fail within seconds (destroying alone would leave them waiting
    until rank 0 exits or the timeout)."""
    port = free_port()
    env = _env(None, tmp_path)
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", str(HERE / "abort_probe.py"), str(r), "3", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for r in range(3)]
    try:
        reports = {}
        for proc in procs[1:]:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
            report = json.loads(out.strip().splitlines()[-1])
            reports[report["rank"]] = report
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for rank in (1, 2):
        assert reports[rank]["error"] is not None, reports
        assert reports[rank]["failed_after_s"] < 15, reports


def _probe(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sweeper_probe.py"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_sweeper_forgets_a_rank_that_exited():
    result = _probe()
    assert result["killed"] == [result["helper"]] and result["forgotten"], result


def test_a_session_that_reuses_a_dead_ranks_pid_is_left_alone():
    """A forgotten rank's pid, reused as the session of a detached process (as NVRx's in-process
    monitor detaches), does not mark that session's processes as the dead rank's helpers."""
    result = _probe("reuse")
    if result["detached"] < 0:
        pytest.skip("could not start a process under the dead rank's pid (ns_last_pid needs root)")
    assert result["killed"] == [result["helper"]], result
    assert result["detached_session"] == result["rank"], result
    assert result["alive"] == {"helper": False, "detached": True}, result
