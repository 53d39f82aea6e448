"""Checkpoints that fail stay out of the way: a writer killed mid-save, an unreadable or full
volume, failed attempts with a write in flight, dead, hung and failing writers, in real
processes (gloo on CPU), on both NVRx lanes where NVRx is involved. Nothing incomplete is ever
loaded; every rank sees the same failure; a failed save is reported and training goes on until
checkpoint.max_consecutive_failures saves in a row failed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.probes import run_probe
from resilient_fsdp.checkpoint import integrity, store
from tests.resilience.node import attempts
from tests.support import (
    LANES,
    assert_no_leftovers,
    lane_path,
    netns_required,
    read_events,
    read_losses,
    read_summary,
    run_local,
    run_trainer,
)


def test_a_writer_killed_mid_save_is_reported_training_commits_the_next_and_the_torn_write_is_swept(tmp_path):
    proc = run_trainer(
        tmp_path, ["train.steps=12", "checkpoint.interval_steps=4", "resilience.inject=[writer-exit@8]"], timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "checkpoint of step 8 failed" in out and "exited with code 137" in out and "training goes on" in out
    failed = read_events(tmp_path, "checkpoint_failed")
    assert [(r["step"], r["cause"], r["consecutive"], r["fatal"]) for r in failed] == [(8, "writer", 1, False)]
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in sorted(ckpts.glob("step_????????"))] == ["step_00000004", "step_00000012"]
    assert [r["step"] for r in read_events(tmp_path, "checkpoint")] == [4, 12]
    # Once step 12 is committed, rank 0 sweeps the torn write of step 8 under its lease (off the
    # training thread). Step 12 is the last step, so that sweep runs at the job's end: it is said
    # and recorded before the run's last records all the same.
    swept = read_events(tmp_path, "checkpoint_swept")
    assert [(Path(e["path"]).name.split(".")[0], e["kind"]) for e in swept] == [("step_00000008", "incomplete")], swept
    assert swept[0]["bytes"] > 0 and f"removed torn checkpoint directory {swept[0]['path']}" in out
    assert not list(ckpts.glob("*.incomplete-*")) and not list(ckpts.glob("*.deleting-*"))
    assert_no_leftovers(tmp_path)


@pytest.mark.extended
def test_three_kills_during_saves_leave_at_most_one_incomplete_directory(tmp_path):
    common = ["train.steps=12", "checkpoint.interval_steps=4", "checkpoint.keep_last=2"]
    ckpts = tmp_path / "checkpoints"
    for kill in range(3):
        shutil.rmtree(tmp_path / "faults", ignore_errors=True)  # the ledger keeps a fault once per run directory
        crashed = run_trainer(tmp_path, [*common, "resilience.inject=[sigkill-during-save@8]"], timeout=300)
        assert crashed.returncode == -9, (crashed.returncode, crashed.stderr[-2000:])  # killed mid-write
        torn = list(ckpts.glob("*.incomplete-*"))
        assert len(torn) == 1, (kill, torn)  # the earlier kills' torn writes were swept at each start
    finished = run_trainer(tmp_path, common, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert [p.name for p in sorted(ckpts.iterdir()) if p.is_dir()] == ["step_00000008", "step_00000012"]


def test_unreadable_complete_checkpoint_falls_back_to_the_previous_one(tmp_path):
    first = run_trainer(tmp_path, ["train.steps=12", "train.stop_at_step=8", "checkpoint.interval_steps=4"])
    assert first.returncode == 0, first.stderr
    for f in (tmp_path / "checkpoints" / "step_00000008").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # torn data behind a valid marker
    second = run_trainer(tmp_path, ["train.steps=12", "checkpoint.interval_steps=4"])
    assert second.returncode == 0, second.stderr
    assert "cannot load" in second.stdout and "step_00000008" in second.stdout
    assert "resumed from step 4" in second.stdout


def test_saves_that_keep_failing_end_the_job_at_max_consecutive_failures_naming_the_cause(tmp_path):
    # The tiny model's checkpoint files are ~1 MB: a 256 KB file-size cap makes every write fail
    # part-way (EFBIG); the second failure in a row ends the job.
    proc = run_trainer(
        tmp_path,
        ["train.steps=12", "checkpoint.interval_steps=3", "checkpoint.max_consecutive_failures=2"],
        file_size_limit=256 * 1024,
        timeout=300,
    )
    assert proc.returncode == 2  # retried by no layer: the next attempt's saves would fail alike
    assert "checkpoint of step 3 failed" in proc.stdout and "training goes on" in proc.stdout, proc.stdout[-3000:]
    assert "2 checkpoint save(s) in a row failed (checkpoint.max_consecutive_failures=2)" in proc.stderr
    assert "checkpoint of step 6 failed" in proc.stderr and "File too large" in proc.stderr, proc.stderr[-3000:]
    failed = read_events(tmp_path, "checkpoint_failed")
    assert [(r["step"], r["consecutive"], r["fatal"]) for r in failed] == [(3, 1, False), (6, 2, True)]
    assert not list((tmp_path / "checkpoints").glob("step_????????"))
    assert len(list((tmp_path / "checkpoints").glob("step_*.incomplete-*"))) == 2
    assert_no_leftovers(tmp_path)


@pytest.mark.extended
def test_a_full_checkpoint_volume_says_so_and_keeps_the_committed_checkpoint(tmp_path):
    # A real full volume: checkpoint.dir on a tmpfs that holds one checkpoint (~1.8 MB) but not two.
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(volume)], capture_output=True, text=True
    )
    assert mounted.returncode == 0, f"this test mounts a tmpfs and needs root: {mounted.stderr}"
    try:
        proc = run_trainer(
            tmp_path / "run",
            ["train.steps=12", "checkpoint.interval_steps=4", "checkpoint.keep_last=1", f"checkpoint.dir={volume}"],
            timeout=180,
        )
        committed = [p.name for p in volume.glob("step_????????")]
        kept = store.read_manifest(volume / "step_00000004") if committed else None
    finally:
        subprocess.run(["umount", str(volume)], check=True)
    assert proc.returncode == 2  # the final save failed: retried by no layer
    err = proc.stderr
    assert "the checkpoint volume is full" in err and "MB free" in err and " bytes)" in err, err[-3000:]
    assert "a checkpoint needs about" in err and "checkpoint.keep_last (now 1" in err
    assert "Committed checkpoints are never deleted to make room" in err
    # Step 8's failure is reported and training goes on; step 12's save is the final one: it fails the job.
    assert "The checkpoint that ends this run" in err and "the newest committed checkpoint: step 4" in err
    causes = [(r["step"], r["cause"]) for r in read_events(tmp_path / "run", "checkpoint_failed")]
    assert causes == [(8, "volume_full"), (12, "volume_full")], causes
    assert committed == ["step_00000004"] and kept is not None and kept["step"] == 4
    assert_no_leftovers(tmp_path / "run")


@pytest.mark.timeout(300)
def test_a_full_volume_ends_a_two_pod_job_at_once_naming_it_and_keeps_the_committed_checkpoint(tmp_path):
    """2 pods x 2 ranks under ft_launcher, checkpoint.dir a 3 MB tmpfs that holds one checkpoint
    (2.2 MB at world size 4), not two: the saves of steps 8 and 12 fail on ENOSPC, the second ends
    the job with exit 2 on every node, with no in-job restart and no pod recreated, the message
    naming the volume, its path and free bytes; the checkpoint of step 4 stays complete."""
    netns_required()
    run_dir = tmp_path / "run"
    volume = run_dir / "checkpoints"
    volume.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(volume)], capture_output=True, text=True
    )
    assert mounted.returncode == 0, f"this test mounts a tmpfs and needs root: {mounted.stderr}"
    try:
        proc = run_local(
            run_dir,
            nodes=2,
            nproc=2,
            timeout=240,
            overrides=[
                "train.steps=16",
                "checkpoint.interval_steps=4",
                "checkpoint.max_consecutive_failures=2",
                "resilience.launcher.max_restarts=3",
            ],
        )
        kept = store.read_manifest(volume / "step_00000004")
        problems = (
            integrity.verify(volume / "step_00000004", kept["checksums"], sorted(kept["checksums"])) if kept else None
        )
        committed = sorted(p.name for p in volume.glob("step_????????"))
    finally:
        subprocess.run(["umount", str(volume)], check=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-5000:]
    assert "exited with code 2: not retried" in proc.stdout and "recreating" not in proc.stdout, out[-4000:]
    assert "2 checkpoint save(s) in a row failed (checkpoint.max_consecutive_failures=2)" in proc.stdout
    assert "the checkpoint volume is full (checkpoint.dir='/fsx/checkpoints'" in proc.stdout
    assert " bytes); a checkpoint needs about" in proc.stdout
    for node in ("node0", "node1"):
        assert attempts(run_dir / "logs" / node) == ["attempt_0"], node  # no restart at all
    causes = [(r["step"], r["cause"], r["fatal"]) for r in read_events(run_dir, "checkpoint_failed")]
    assert causes == [(8, "volume_full", False), (12, "volume_full", True)], causes
    assert committed == ["step_00000004"] and kept["step"] == 4 and problems == [], problems
    assert_no_leftovers(run_dir)


def test_unwritable_checkpoint_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = run_trainer(tmp_path / "run", ["train.steps=2", f"checkpoint.dir={blocker}/ckpts"])
    assert proc.returncode == 2
    assert f"checkpoint.dir='{blocker}/ckpts' is not writable" in proc.stderr


@pytest.mark.parametrize("lane", LANES)
def test_saves_after_a_failed_attempt_with_a_write_in_flight_all_load_bitwise(tmp_path, request, lane):
    report = run_probe("engine.py", tmp_path, "stale", "async", pythonpath=lane_path(request, lane))
    assert report["resumed_step"] == 1
    assert report["loaded_bitwise"] == {str(s): True for s in range(2, 8)}, report
    assert_no_leftovers(tmp_path)


# Each engine once in CI (NVRx's on the image's lane, torch's on the pinned one), the rest extended.
@pytest.mark.parametrize(
    "lane,mode",
    [
        ("image", "async"),
        ("pinned", "torch-async"),
        pytest.param("pinned", "async", marks=pytest.mark.extended),
        pytest.param("image", "torch-async", marks=pytest.mark.extended),
    ],
)
def test_a_writer_that_died_between_saves_is_replaced_and_close_does_not_wait(tmp_path, request, lane, mode):
    report = run_probe("engine.py", tmp_path, "dead-worker", mode, pythonpath=lane_path(request, lane))
    assert report["first"] and report["after_dead_worker"] and report["close_s"] < 5, report
    assert_no_leftovers(tmp_path)


# The writer is NVRx's worker on either engine; one lane in CI, the other extended.
@pytest.mark.parametrize(
    "lane,mode", [("image", "async"), pytest.param("pinned", "torch-async", marks=pytest.mark.extended)]
)
def test_a_writer_whose_trainer_is_killed_mid_write_exits_by_itself_and_commits_nothing(tmp_path, request, lane, mode):
    report = run_probe("engine.py", tmp_path, "orphan", mode, pythonpath=lane_path(request, lane))
    assert report["committed"] and report["writer_alive_before"], report
    assert report["writer_exit_s"] is not None and report["writer_exit_s"] < 10, report  # it does not stay
    assert report["complete_steps"] == [1], report  # the write cut short is never committed
    assert report["others_left"] == [], report


@pytest.mark.parametrize("lane", LANES)
def test_a_hung_writer_fails_at_the_deadline_once_and_the_restarted_attempt_gets_a_new_one(tmp_path, request, lane):
    report = run_probe("engine.py", tmp_path, "hung-writer", "async", pythonpath=lane_path(request, lane))
    assert report["first"], report
    assert "did not finish within checkpoint.write_timeout_s=2" in (report["late_error"] or ""), report
    assert report["close_s"] < 5, report  # the hung write is not waited for a second time
    assert report["resumed_step"] == 1 and report["replaced"] and report["after_restart"], report
    assert_no_leftovers(tmp_path)


def _in_process_importable(pythonpath) -> str:
    code = "import nvidia_resiliency_ext.inprocess"
    env = {"PYTHONPATH": ":".join(map(str, pythonpath))}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**__import__("os").environ, **env}
    )
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


# Learned hang-detection timeouts are saved as JSON text that grows once they are learned. They
# are learned after 12 steps of the process: after the restart (attempt 1 fails at step 9 and
# attempt 2 resumes from step 4), between the saves of steps 8 and 12. Saves from then on have a
# non-tensor item of another size, which is what a stale write result turns into a corrupted
# checkpoint.
IN_PROCESS = [
    "resilience.in_process.enabled=true",
    "dist.timeout_s=8",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
    "resilience.hang_detection.step_timeout_s=60",
    "resilience.hang_detection.learn_timeouts=true",
    "resilience.hang_detection.learn_after_steps=12",
]


RUN = ["train.steps=24", "checkpoint.interval_steps=4", "checkpoint.keep_last=0", "train.log_every=4"]


# Extended on both lanes: in CI, in-process restarts on 0.7 are P-in-process[image]
# (tests/resilience/test_faults.py), whose faults land between checkpoints every 4 steps.
@pytest.mark.extended
@pytest.mark.parametrize("lane", LANES)
def test_in_process_restart_with_a_write_in_flight_commits_only_checkpoints_that_load_bitwise(tmp_path, request, lane):
    pythonpath = lane_path(request, lane)
    missing = _in_process_importable(pythonpath)
    if missing:
        pytest.skip(
            f"in-process restart cannot be imported from this NVRx lane ({missing}); its lane lacks "
            "packages NVRx 0.7's inprocess needs (httpx, grpcio, protobuf)"
        )
    ref = run_local(tmp_path / "ref", nodes=1, nproc=2, overrides=RUN + IN_PROCESS, pythonpath=pythonpath)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    # The write of step 8 starts at the end of step 8; the fault fires at the start of step 9.
    run = run_local(
        tmp_path / "run",
        nodes=1,
        nproc=2,
        overrides=RUN + IN_PROCESS,
        pythonpath=pythonpath,
        extra=["--inject=exception@9:rank=1"],
        timeout=300,
    )
    out = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, out
    summary = read_summary(tmp_path / "run")
    assert [r["layer"] for r in summary["recoveries"]] == ["in_process"], out
    assert summary["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]
    assert read_losses(tmp_path / "run") == read_losses(tmp_path / "ref")
    learned = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"timeouts_learned"' in line
    ]
    assert learned, "timeouts were never learned: no save had a larger non-tensor item"
    compared = run_probe(
        "compare.py",
        tmp_path / "cmp",
        tmp_path / "run" / "checkpoints",
        tmp_path / "ref" / "checkpoints",
        pythonpath=pythonpath,
    )
    assert compared == {str(s): True for s in range(4, 25, 4)}, compared
    assert_no_leftovers(tmp_path / "run")


def test_a_writer_error_on_one_rank_is_one_failed_save_on_every_rank_and_training_goes_on(tmp_path):
    # Every rank must take the same branch: one that raised while the other went on would hang
    # the next collective, so a job that finishes with step 12 committed shows they agreed.
    proc = run_local(
        tmp_path,
        nodes=1,
        nproc=2,
        overrides=["train.steps=12", "checkpoint.interval_steps=4"],
        extra=["--max-restarts=0", "--max-pod-recreations=0", "--inject=writer-raise@8:rank=1"],
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    expected = "checkpoint of step 8 failed (rank 1: OSError: injected writer failure"
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").rglob("*")) if p.is_file())
    assert expected in out + logs, out[-5000:]
    failed = read_events(tmp_path, "checkpoint_failed")
    assert [(r["step"], r["cause"], r["consecutive"]) for r in failed] == [(8, "writer", 1)]
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_????????"))] == [
        "step_00000004",
        "step_00000012",
    ]
    assert_no_leftovers(tmp_path)


def test_a_write_that_never_finishes_fails_at_the_deadline_and_the_next_save_gets_a_new_writer(tmp_path):
    # The first save hangs and is waited for at step 8 (the next save), 3 s at most; the save of
    # step 8 goes to a new writer. Whether that one beats the 3 s deadline too depends on the
    # machine's load, so the run does not promise it (no final save, two failures allowed).
    proc = run_trainer(
        tmp_path,
        [
            "train.steps=8",
            "checkpoint.interval_steps=4",
            "checkpoint.write_timeout_s=3",
            "checkpoint.save_final=false",
            "checkpoint.max_consecutive_failures=3",
            "resilience.inject=[writer-hang@4]",
        ],
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "did not finish within checkpoint.write_timeout_s=3" in out, out[-3000:]
    failed = read_events(tmp_path, "checkpoint_failed")
    assert (failed[0]["step"], failed[0]["cause"]) == (4, "write_timeout"), failed
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()
    committed = [r["step"] for r in read_events(tmp_path, "checkpoint")]
    assert committed == [8] or [r["step"] for r in failed] == [4, 8], (committed, failed)
    assert_no_leftovers(tmp_path)


def test_a_failed_attempt_lets_rank_0s_commit_in_flight_finish_before_it_closes(tmp_path):
    report = run_probe("engine.py", tmp_path, "commit-in-flight", "async")
    assert report["in_flight"] and report["handoff_poll_s"] < 1.0, report  # the poll did not wait for it
    assert report["close_s"] > 1.0 and report["committed"] == [1], report
    assert report["commit_pid"] not in (0, report["rank_pid"]), report  # in a process of its own


def test_a_commit_process_that_dies_fails_that_save_and_the_next_commits(tmp_path):
    report = run_probe("engine.py", tmp_path, "commit-process-dies", "async")
    assert report["killed_mid_commit"], report  # the process killed was in the commit it had started
    assert (report["streak_before"], report["streak_after"]) == (0, 1), report
    assert report["committed"] == [2], report  # step 1's stays incomplete, never loaded
    assert_no_leftovers(tmp_path)


def test_a_commit_made_on_the_training_thread_is_stall_not_background_work(tmp_path):
    report = run_probe("engine.py", tmp_path, "commit-inline", "async")
    assert report["background"] is False, report
    assert report["stall_s"] >= 2.0, report  # the commit's two slowed seconds, on the training thread
    assert report["stall_s"] >= report["commit_on_thread_s"] >= 2.0, report


def test_a_commit_that_never_finishes_fails_at_the_write_timeout_and_the_next_commits_in_a_new_process(tmp_path):
    """Rank 0's commit process hangs in step 1's commit: the ranks learn a failed save (cause
    ``write_timeout``) at ``checkpoint.write_timeout_s`` (8 s) after the hand-over, not never;
    the hung process is killed, step 1 stays incomplete, and step 2 commits in a new process."""
    report = run_probe("engine.py", tmp_path, "commit-hangs", "async")
    assert report["streak"] == 0 and report["committed"] == [2], report  # step 2's commit ended the streak
    assert 7.9 < report["learned_s"] < 40, report
    assert not report["hung_alive"], report
    (failed,) = read_events(tmp_path, "checkpoint_failed")
    assert (failed["step"], failed["cause"]) == (1, "write_timeout"), failed
    assert "rank 0's commit did not finish within checkpoint.write_timeout_s=8" in failed["error"], failed
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()
    assert_no_leftovers(tmp_path)
