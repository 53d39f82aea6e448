"""Hang detection never undercuts what is configured: learned timeouts are floored by the
configured ones, a final save slower than the learned timeouts would allow finishes (in-process
restart on and off), and timeouts restored from a checkpoint are raised to what the restarted job
configures. Real jobs under ft_launcher (gloo on CPU), but the first test."""

from __future__ import annotations

import pytest

from tests.support import assert_no_leftovers, read_events, read_summary, run_local

# Timeouts are learned after 4 steps from millisecond gaps: before configured values were floors,
# max(5 x observed, min_learned_timeout_s=1) gave about 1 s for checkpoint and out-of-section time.
LEARN = [
    "train.log_every=4",
    "checkpoint.interval_steps=4",
    "resilience.hang_detection.learn_timeouts=true",
    "resilience.hang_detection.learn_after_steps=4",
    "resilience.hang_detection.min_learned_timeout_s=1",
    "resilience.hang_detection.workload_check_interval_s=0.5",
]
CONFIGURED = [
    "resilience.hang_detection.step_timeout_s=60",
    "resilience.hang_detection.checkpoint_timeout_s=60",
    "resilience.hang_detection.out_of_section_timeout_s=60",
]
IN_PROCESS = [
    "resilience.in_process.enabled=true",
    "dist.timeout_s=8",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
]


def slow_final_write(seconds: float, step: int, ranks: int = 2) -> list[str]:
    """Every rank's writer takes ``seconds`` longer for the checkpoint of ``step`` (the last one)."""
    return [f"--inject=writer-slow@{step}:rank={r}:for={seconds:g}" for r in range(ranks)]


def assert_at_least(timeouts: dict, floor: float) -> None:
    sections = timeouts["sections"]
    assert sections["step"] >= floor and sections["checkpoint"] >= floor and timeouts["out_of_section"] >= floor, (
        timeouts
    )
    assert sections["drain"] == sections["checkpoint"] or sections["drain"] >= floor


def test_a_slow_final_save_finishes_and_restored_timeouts_keep_the_configured_floor(tmp_path):
    run_dir = tmp_path / "run"
    first = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        overrides=LEARN + CONFIGURED + ["train.steps=8"],
        extra=slow_final_write(8, 8),
        timeout=300,
    )
    out = first.stdout[-4000:] + first.stderr[-2000:]
    assert first.returncode == 0, out
    (learned,) = read_events(run_dir, "timeouts_learned")
    assert_at_least(learned, 60)
    assert read_summary(run_dir)["restarts"] == {"in_process": 0, "in_job": 0, "job": 0}
    # The job is resumed with higher timeouts: the values restored from its checkpoint are raised.
    second = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        timeout=300,
        overrides=LEARN
        + [
            "train.steps=10",
            "resilience.hang_detection.step_timeout_s=90",
            "resilience.hang_detection.checkpoint_timeout_s=90",
            "resilience.hang_detection.out_of_section_timeout_s=90",
        ],
    )
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["resumed_from_step"] == 8
    assert_at_least(summary["hang_timeouts"], 90)
    assert_no_leftovers(run_dir)


@pytest.mark.extended
def test_a_slow_final_save_finishes_under_in_process_restart(tmp_path):
    """The final wait is longer than in-process restart's soft timeout (20 s): its watchdog is
    pinged while the rank waits, so nothing restarts."""
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        overrides=LEARN + CONFIGURED + IN_PROCESS + ["train.steps=8"],
        extra=slow_final_write(26, 8),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["restarts"] == {"in_process": 0, "in_job": 0, "job": 0}
    assert summary["checkpoints"][-1]["step"] == 8 and summary["checkpoints"][-1]["write_s"] > 26
    assert_at_least(summary["hang_timeouts"], 60)
    assert_no_leftovers(run_dir)


def test_learned_timeouts_never_go_below_the_configured_ones():
    from resilient_fsdp.resilience.rank_monitor import with_floors

    configured = {"init": 900.0, "step": 600.0, "checkpoint": 610.0, "drain": 610.0}
    # NVRx learned 5 x a few milliseconds for step and checkpoint, and for out-of-section time.
    learned = {"init": 900.0, "step": 0.4, "checkpoint": 0.6, "drain": 610.0}
    section, oos = with_floors(learned, 0.2, {"step", "checkpoint"}, True, configured, 300.0, 60.0)
    assert section == configured and oos == 300.0
    # A step that really takes long raises its timeout above the configured one.
    section, _ = with_floors({**learned, "step": 1500.0}, 0.2, {"step", "checkpoint"}, True, configured, 300.0, 60.0)
    assert section["step"] == 1500.0 and section["checkpoint"] == 610.0
    # Values restored from an older checkpoint: a missing section gets its configured value, a
    # section configured without a limit stays without one, and a short configured value still
    # gets the minimum when learned.
    section, oos = with_floors(
        {"step": 2.0, "checkpoint": 3.0},
        1.0,
        {"step", "checkpoint"},
        True,
        {**configured, "step": 30.0, "checkpoint": None},
        None,
        60.0,
    )
    assert section == {"init": 900.0, "step": 60.0, "checkpoint": None, "drain": 610.0} and oos is None
