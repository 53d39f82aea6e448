"""The bound a PyTorchJob lacks (resilience/pod_failures.py): its pods count the job's pod failures
in the run directory and end the job once more than job.backoffLimit came in a row without
progress. The rule on its own, then real jobs on the local cluster's PyTorchJob, whose operator
recreates failed pods as training-operator v1.9.4 does."""

from __future__ import annotations

import json

import pytest

from resilient_fsdp.resilience import exit_codes
from resilient_fsdp.resilience.pod_failures import PodFailures, judge, progress, without_progress
from tests.support import assert_no_leftovers, read_summary, run_local, write_module


def _metrics(run_dir, steps: list[int]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    records = (
        [{"event": "start", "t": 1.0}]
        + [{"event": "step", "step": s, "loss": 1.0} for s in steps]
        + [{"event": "checkpoint", "step": steps[-1] if steps else 0}]
    )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def test_progress_is_the_last_step_recorded(tmp_path):
    assert progress(tmp_path) == 0  # nothing trained yet
    _metrics(tmp_path, [1, 2, 3])
    assert progress(tmp_path) == 3


def test_a_failure_past_the_furthest_starts_a_new_row():
    def f(step, outcome="failed"):
        return {"progress": step, "outcome": outcome}

    assert without_progress([], 0) == []
    assert len(without_progress([f(2), f(2)], 2)) == 2
    assert without_progress([f(2), f(2)], 4) == []  # this failure got further
    assert len(without_progress([f(2), f(4), f(4)], 3)) == 2  # fell back behind 4: still no progress
    assert without_progress([f(2), f(2), f(2, "ended")], 2) == []  # the bound ended a job: a new count


def test_more_than_the_limit_in_a_row_ends_the_job_and_a_new_job_starts_afresh(tmp_path):
    _metrics(tmp_path, [1, 2])
    assert judge(tmp_path, 2, 203, "pod-0", 0) is None
    assert judge(tmp_path, 2, 137, "pod-1", 1) is None
    ended = judge(tmp_path, 2, 203, "pod-0", 0)
    assert ended and "3 pod failures in a row without training past step 2 (job.backoffLimit=2)" in ended
    assert "pod-0 exited 203 at step 2; pod-1 exited 137 at step 2; pod-0 exits 203 now" in ended
    assert [r["outcome"] for r in PodFailures(tmp_path).read()] == ["failed", "failed", "ended"]
    assert judge(tmp_path, 2, 203, "pod-0", 0) is None  # the job started again gets its budget back
    assert judge(tmp_path, 0, 203, "pod-0", 0)  # backoffLimit 0: the first failure ends the job


def test_an_unreadable_run_directory_leaves_the_failure_retried(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert judge(blocker, 0, 203, "pod-0", 0) is None


# ---- real jobs: 1 pod x 2 ranks as a PyTorchJob, rank 1 killed by a signal (never judged: the
# rank cannot say what it was), ft_launcher with no in-job restart left --------------------------

# Rank 1's process kills itself at its Nth forward: each attempt's Nth step after its resume.
KILLING_MODEL = """
    import os, signal
    from resilient_fsdp.train.model import build_model

    def build(cfg, at={at}):
        model = build_model("tiny")
        forward, calls = model.forward, [0]

        def killing_forward(tokens):
            calls[0] += 1
            if calls[0] == at and os.environ.get("RANK") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            return forward(tokens)

        model.forward = killing_forward
        return model
"""
JOB = [
    "resilience.launcher.max_restarts=0",
    "checkpoint.interval_steps=2",
    "checkpoint.mode=sync",
    "train.log_every=1",
    "resilience.hang_detection.learn_timeouts=false",
]


def run_killing_job(run_dir, plugin_dir, at: int):
    """6 steps, job.backoffLimit 1, rank 1 killed at its process's ``at``-th forward."""
    write_module(plugin_dir, "killing_model", KILLING_MODEL.format(at=at))
    return run_local(
        run_dir,
        nodes=1,
        nproc=2,
        pythonpath=[plugin_dir],
        timeout=240,
        overrides=JOB + ["model.factory=killing_model:build", "train.steps=6"],
        extra=["--value", "job.backoffLimit=1"],
    )


@pytest.mark.timeout(300)
def test_pods_that_keep_failing_at_the_same_step_end_a_pytorchjob_past_its_backoff_limit(tmp_path, plugin_dir):
    run_dir = tmp_path / "run"
    proc = run_killing_job(run_dir, plugin_dir, at=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == exit_codes.CONFIG, out[-5000:]
    assert proc.stdout.count("exited with code 203: recreating it") == 1, out[-4000:]
    assert "exited with code 2: not retried" in proc.stdout
    node_log = (run_dir / "logs" / "node0.log").read_text()
    assert "2 pod failures in a row without training past step 0 (job.backoffLimit=1)" in node_log, node_log[-3000:]
    assert [(r["code"], r["progress"], r["outcome"]) for r in PodFailures(run_dir).read()] == [
        (203, 0, "failed"),
        (203, 0, "ended"),
    ]
    assert_no_leftovers(run_dir)


# Extended tier: in CI the row's rule is test_a_failure_past_the_furthest_starts_a_new_row's, and the
# progress it reads (metrics.jsonl's last step) test_progress_is_the_last_step_recorded's.
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_pods_that_fail_but_train_further_each_time_are_never_ended_by_the_bound(tmp_path, plugin_dir):
    """job.backoffLimit=1, yet three pod lives: each failure comes two steps past the last, so
    each starts a new row; the job trains to its end."""
    run_dir = tmp_path / "run"
    proc = run_killing_job(run_dir, plugin_dir, at=3)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert proc.stdout.count("exited with code 203: recreating it") == 2, out[-4000:]
    assert [(r["progress"], r["outcome"]) for r in PodFailures(run_dir).read()] == [(2, "failed"), (4, "failed")]
    assert read_summary(run_dir)["final_step"] == 6
    assert_no_leftovers(run_dir)


def test_the_agent_takes_the_limit_and_refuses_one_that_is_not_a_count():
    from resilient_fsdp.resilience.agent import parse_agent_args

    assert parse_agent_args(["--max-pod-failures=3", "--"])[0] == {"--max-pod-failures": 3}
    with pytest.raises(ValueError, match="--max-pod-failures=N, a whole number 0 or more"):
        parse_agent_args(["--max-pod-failures=-1", "--"])
