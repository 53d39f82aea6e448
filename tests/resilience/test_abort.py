"""A failed attempt aborts its process groups before destroying them, and before it closes its
checkpointer; the node's sweeper kills a dead rank's helpers even when its pid was reused; real
processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.resilience.node import free_port
from tests.resilience.probes import HERE as PROBES
from tests.support import REPO, _env, assert_no_leftovers, run_local

HERE = Path(__file__).parent


def test_peers_blocked_on_a_failed_rank_fail_at_once_not_at_the_collective_timeout(tmp_path):
    """Three gloo ranks: rank 0 takes the failure path while the others wait for it in an
    all-reduce, then stays alive 30 s; dist.timeout_s is 60 s. Aborting shuts the group's
    connections down, so the peers fail within seconds (destroying alone would leave them waiting
    until rank 0 exits or the timeout)."""
    port = free_port()
    env = _env(None, tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", str(PROBES / "abort.py"), str(r), "3", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for r in range(3)
    ]
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


def test_a_rank_that_fails_with_a_write_in_flight_releases_its_peers_before_closing_its_checkpointer(tmp_path):
    """Rank 1 raises at step 5 while its writer spends 60 s more on step 4's checkpoint; rank 0
    waits for it in a collective with dist.timeout_s=20. Rank 1 aborts its process group first,
    so rank 0 fails on the closed connection; had rank 1 closed its checkpointer first (waiting
    for that write), rank 0 would have failed at its collective timeout. In-job restart off."""
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        timeout=240,
        extra=[
            "--max-restarts=0",
            "--max-pod-recreations=0",
            "--inject=exception@5:rank=1",
            "--inject=writer-slow@4:rank=1:for=60",
        ],
        overrides=[
            "train.steps=8",
            "checkpoint.interval_steps=4",
            "dist.timeout_s=20",
            "checkpoint.write_timeout_s=120",
            "resilience.hang_detection.learn_timeouts=false",
        ],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    (rank0,) = (run_dir / "logs" / "node0").glob("*/attempt_0/0/stderr.log")
    error = rank0.read_text()
    assert "Connection closed by peer" in error and "timed out" not in error.lower(), error[-4000:]
    assert_no_leftovers(run_dir)


def _probe(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(PROBES / "sweeper.py"), *args], capture_output=True, text=True, timeout=120
    )
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


def test_a_failed_attempts_helper_threads_are_joined_by_its_abort_and_their_group_goes(tmp_path):
    """Two gloo ranks, each with a helper thread blocked on the other in a lazily connected side
    group (a replica receiver), left to the abort. The abort shuts the connections down, so the
    helpers wake and are joined within it; once collected, nothing of either group is left: the
    process's threads and TCP connections are what they were before the groups."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", str(PROBES / "left_threads.py"), str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(None, tmp_path),
            cwd=REPO,
        )
        for r in range(2)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for report in reports:
        assert not report["helper_alive"] and report["helper_error"], report
        assert report["abort_s"] < 5, report
        assert report["after"]["threads"] == report["before"]["threads"], report
        assert report["after"]["tcp_connections"] == report["before"]["tcp_connections"], report
