"""Restart accounting: attempt records become restarts by layer, recoveries with their phases,
and goodput (no processes started here)."""

from __future__ import annotations

import json

import pytest

from resilient_fsdp.config import FaultSpec
from resilient_fsdp.resilience.accounting import record_recoveries, summarize
from resilient_fsdp.resilience.ledger import FaultLedger


def _write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summary_counts_restarts_by_layer_and_goodput_from_the_files(tmp_path):
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("exception", 5, 0)
    ledger.claim(
        spec, {"fault": str(spec), "key": spec.key, "kind": "exception", "t_fault": 110.0, "completed_step": 4}
    )
    new = record_recoveries(ledger, "in_process", resumed_step=2, now=113.0, attempt="112-0a1b2c3d")
    assert new == [
        {
            "fault": "exception@5:rank=0",
            "kind": "exception",
            "layer": "in_process",
            "recovery_s": 3.0,
            "fault_step": 4,
            "resumed_from_step": 2,
            "lost_steps": 2,
            "attempt": "112-0a1b2c3d",
        }
    ]
    assert record_recoveries(ledger, "in_job", resumed_step=2, now=120.0) == []  # each fault recovers once
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(
        metrics,
        [
            {"event": "start", "t": 100.0, "layer": "start"},
            {"event": "step", "step": 1, "step_time_s": 2.0},
            {"event": "step", "step": 2, "step_time_s": 2.0},
            {"event": "start", "t": 112.0, "layer": "in_process"},
            {"event": "step", "step": 3, "step_time_s": 2.0},
            {"event": "start", "t": 130.0, "layer": "job"},
            {"event": "step", "step": 4, "step_time_s": 2.0},
        ],
    )
    s = summarize(metrics, ledger, now=140.0)
    assert s["restarts"] == {"in_process": 1, "in_job": 0, "job": 1}
    assert s["faults_injected"] == ["exception@5:rank=0"]
    assert s["recoveries"][0]["layer"] == "in_process"
    assert s["productive_s"] == 8.0 and s["job_wall_s"] == 40.0 and s["goodput"] == pytest.approx(0.2)


def test_a_job_relaunched_on_a_run_directory_counts_only_its_own_steps(tmp_path, monkeypatch):
    """The earlier job's step records stay (up to the step this one resumed from) but were trained
    before this job began: they are not this job's productive time, so goodput stays within 0..1."""
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(
        metrics,
        [
            {"event": "start", "t": 100.0, "layer": "start"},
            *({"event": "step", "step": s, "step_time_s": 5.0, "t": 100.0 + 5 * s} for s in range(1, 9)),
            {"event": "start", "t": 200.0, "layer": "start"},  # the relaunch, resumed from step 8
            *({"event": "step", "step": s, "step_time_s": 5.0, "t": 200.0 + 5 * (s - 8)} for s in range(9, 13)),
        ],
    )
    monkeypatch.setenv("RESILIENT_FSDP_JOB_START", "195.0")
    s = summarize(metrics, FaultLedger(tmp_path), now=230.0)
    assert s["productive_s"] == 20.0 and s["job_wall_s"] == 35.0 and s["goodput"] == pytest.approx(20 / 35)


def test_a_recovery_says_where_its_time_went():
    from resilient_fsdp.resilience.accounting import phases

    marks = {"attempt": 105.0, "group": 105.5, "model": 106.25, "built": 106.5, "resumed": 107.0}
    # In-job or job: the new process started at 103 and spent 2 s importing before the attempt.
    assert phases(100.0, marks, now=107.25, process_start=103.0) == {
        "restart_s": 3.0,
        "process_start_s": 2.0,
        "group_s": 0.5,
        "model_s": 0.75,
        "engine_s": 0.25,
        "load_s": 0.5,
        "first_step_s": 0.25,
    }
    # In-process: the process is older than the fault, so all of it before the attempt is restart.
    p = phases(100.0, marks, now=107.25, process_start=50.0)
    assert p["restart_s"] == 5.0 and p["process_start_s"] == 0.0
    assert sum(p.values()) == pytest.approx(7.25)  # the phases add up to recovery_s
    # An attempt that failed before its model was built: the later phases are 0, the sum holds.
    early = phases(100.0, {"attempt": 105.0, "group": 106.0}, now=107.0)
    assert early["model_s"] == early["engine_s"] == early["load_s"] == 0.0 and early["first_step_s"] == 1.0


def test_the_trainers_marks_put_the_phases_in_the_recovery_record(tmp_path):
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("exception", 5, 0)
    ledger.claim(
        spec, {"fault": str(spec), "key": spec.key, "kind": "exception", "t_fault": 100.0, "completed_step": 4}
    )
    (record,) = record_recoveries(
        ledger,
        "in_process",
        resumed_step=4,
        now=107.25,
        marks={"attempt": 105.0, "group": 105.5, "model": 106.25, "built": 106.5, "resumed": 107.0},
    )
    assert record["recovery_s"] == 7.25
    assert sum(record["phases_s"].values()) == pytest.approx(record["recovery_s"])
    assert record["phases_s"]["group_s"] == 0.5 and record["phases_s"]["first_step_s"] == 0.25


def test_a_ranks_process_start_is_stamped_by_the_process_ft_launcher_started_and_kept_by_a_forked_rank(tmp_path):
    """``python -m resilient_fsdp.train`` stamps when its process began (the recovery's new-process
    phase starts there; the kernel's start time is whole seconds off). A rank forked by the
    pre-warmed server runs the same ``__main__`` with its client's environment, stamp included,
    and keeps it; a client (the server's socket in its environment) stamps its own."""
    import os
    import subprocess
    import sys
    import time

    from resilient_fsdp.resilience import accounting, prewarm

    # The trainer's process ends with os._exit after its atexit handlers: the stamp is printed by one.
    probe = (
        "import atexit, os, runpy, sys\nsys.argv = ['resilient_fsdp.train', '--describe-config']\n"
        f"atexit.register(lambda: print('stamp', os.environ.get({prewarm.PROCESS_START_ENV!r}), flush=True))\n"
        "runpy.run_module('resilient_fsdp.train', run_name='__main__')\n"
    )

    def stamp(extra: dict) -> str:
        env = {k: v for k, v in os.environ.items() if k not in (prewarm.PROCESS_START_ENV, prewarm.SOCKET_ENV)}
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("stamp ")]
        return line.split()[1]

    before = time.time()
    fresh = float(stamp({}))
    assert before <= fresh <= time.time()
    assert stamp({prewarm.PROCESS_START_ENV: "5.0"}) == "5.0"  # a forked rank keeps its client's
    client = float(stamp({prewarm.PROCESS_START_ENV: "5.0", prewarm.SOCKET_ENV: str(tmp_path / "no-server.sock")}))
    assert client > before  # a client stamps its own, whatever its parent left
    os.environ[prewarm.PROCESS_START_ENV] = "12.5"
    try:
        assert accounting._process_start() == 12.5
    finally:
        del os.environ[prewarm.PROCESS_START_ENV]
