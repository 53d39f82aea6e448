"""Checkpoints that stay correct across failed attempts, dead writers, corrupted files, rewinds and
changes of world size (issue 16), in real processes (gloo on CPU), on both NVRx lanes where NVRx
is involved."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.support import (REPO, assert_no_leftovers, read_losses, read_summary, run_guarded, run_local, run_trainer,
                           write_module)

PROBES = REPO / "tests" / "checkpoint"
# NVRx 0.4.1 (constraints.txt) and the image's 0.7 (its lane): the image's in CI, the pinned one in
# the extended tier (docs/tests.md).
IMAGE_FIRST = [pytest.param("pinned", marks=pytest.mark.extended), "image"]


def lane_path(request, lane):
    return [] if lane == "pinned" else [request.getfixturevalue("nvrx_lane")]


def probe(script, run_dir, *args, pythonpath=None, timeout=240) -> dict:
    proc = run_guarded([sys.executable, str(PROBES / script), str(run_dir), *map(str, args)], run_dir,
                       pythonpath, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- 1 and 6: the engine across a failed attempt, dead writers, agreed failures, deadlines ------

@pytest.mark.parametrize("lane", IMAGE_FIRST)
def test_saves_after_a_failed_attempt_with_a_write_in_flight_all_load_bitwise(tmp_path, request, lane):
    report = probe("engine_probe.py", tmp_path, "stale", "async", pythonpath=lane_path(request, lane))
    assert report["resumed_step"] == 1
    assert report["loaded_bitwise"] == {str(s): True for s in range(2, 8)}, report
    assert_no_leftovers(tmp_path)


# Each engine once in CI (NVRx's on the image's lane, torch's on the pinned one), the rest extended.
@pytest.mark.parametrize("lane,mode", [("image", "async"), ("pinned", "torch-async"),
                                       pytest.param("pinned", "async", marks=pytest.mark.extended),
                                       pytest.param("image", "torch-async", marks=pytest.mark.extended)])
def test_a_writer_that_died_between_saves_is_replaced_and_close_does_not_wait(tmp_path, request, lane, mode):
    report = probe("engine_probe.py", tmp_path, "dead-worker", mode, pythonpath=lane_path(request, lane))
    assert report["first"] and report["after_dead_worker"] and report["close_s"] < 5, report
    assert_no_leftovers(tmp_path)


def test_waiting_for_the_previous_write_is_the_new_saves_stall_counted_once(tmp_path):
    report = probe("engine_probe.py", tmp_path, "back-to-back", "async")
    stall, previous = report["stall_s"], report["previous_s"]
    assert report["waited_s"] > 1.5, report  # the save of step 3 did wait for step 2's slow write
    assert previous["3"] > 1.0 and stall["3"] >= previous["3"], report
    assert stall["2"] < 1.0, report  # it used to carry step 3's wait as well (counted twice)
    assert previous["1"] < 0.05 and previous["2"] < 0.05, report  # nothing was in flight


# The writer is NVRx's worker on either engine; one lane in CI, the other extended.
@pytest.mark.parametrize("lane,mode", [("image", "async"), pytest.param("pinned", "torch-async", marks=pytest.mark.extended)])
def test_a_writer_whose_trainer_is_killed_mid_write_exits_by_itself_and_commits_nothing(tmp_path, request, lane, mode):
    report = probe("engine_probe.py", tmp_path, "orphan", mode, pythonpath=lane_path(request, lane))
    assert report["committed"] and report["writer_alive_before"], report
    assert report["writer_exit_s"] is not None and report["writer_exit_s"] < 10, report  # it used to stay for good
    assert report["complete_steps"] == [1], report  # the write cut short is never committed
    assert report["others_left"] == [], report


@pytest.mark.parametrize("lane", IMAGE_FIRST)
def test_a_hung_writer_fails_at_the_deadline_once_and_the_restarted_attempt_gets_a_new_one(tmp_path, request, lane):
    report = probe("engine_probe.py", tmp_path, "hung-writer", "async", pythonpath=lane_path(request, lane))
    assert report["first"], report
    assert "did not finish within checkpoint.write_timeout_s=2" in (report["late_error"] or ""), report
    assert report["close_s"] < 5, report  # the hung write is not waited for a second time
    assert report["resumed_step"] == 1 and report["replaced"] and report["after_restart"], report
    assert_no_leftovers(tmp_path)


def _in_process_importable(pythonpath) -> str:
    code = "import nvidia_resiliency_ext.inprocess"
    env = {"PYTHONPATH": ":".join(map(str, pythonpath))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, **env})
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


# Learned hang-detection timeouts are saved as JSON text that grows once they are learned. They
# are learned after 12 steps of the process: after the restart (attempt 1 fails at step 9 and
# attempt 2 resumes from step 4), between the saves of steps 8 and 12. Saves from then on have a
# non-tensor item of another size, which is what a stale write result turns into a corrupted
# checkpoint.
IN_PROCESS = ["resilience.in_process.enabled=true", "dist.timeout_s=8", "resilience.in_process.soft_timeout_s=20",
              "resilience.in_process.hard_timeout_s=40", "resilience.in_process.heartbeat_timeout_s=20",
              "resilience.in_process.barrier_timeout_s=120", "resilience.hang_detection.step_timeout_s=60",
              "resilience.hang_detection.learn_timeouts=true", "resilience.hang_detection.learn_after_steps=12"]
RUN = ["train.steps=24", "checkpoint.interval_steps=4", "checkpoint.keep_last=0", "train.log_every=4"]


@pytest.mark.parametrize("lane", IMAGE_FIRST)
def test_in_process_restart_with_a_write_in_flight_commits_only_checkpoints_that_load_bitwise(tmp_path, request, lane):
    pythonpath = lane_path(request, lane)
    missing = _in_process_importable(pythonpath)
    if missing:
        pytest.skip(f"in-process restart cannot be imported from this NVRx lane ({missing}); its lane lacks "
                    "packages NVRx 0.7's inprocess needs (httpx, grpcio, protobuf)")
    ref = run_local(tmp_path / "ref", nodes=1, nproc=2, overrides=RUN + IN_PROCESS, pythonpath=pythonpath)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    # The write of step 8 starts at the end of step 8; the fault fires at the start of step 9.
    run = run_local(tmp_path / "run", nodes=1, nproc=2, overrides=RUN + IN_PROCESS, pythonpath=pythonpath,
                    extra=["--inject=exception@9:rank=1"], timeout=300)
    out = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, out
    summary = read_summary(tmp_path / "run")
    assert [r["layer"] for r in summary["recoveries"]] == ["in_process"], out
    assert summary["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]
    assert read_losses(tmp_path / "run") == read_losses(tmp_path / "ref")
    learned = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if '"timeouts_learned"' in line]
    assert learned, "timeouts were never learned: no save had a larger non-tensor item"
    compared = probe("compare_probe.py", tmp_path / "cmp", tmp_path / "run" / "checkpoints",
                     tmp_path / "ref" / "checkpoints", pythonpath=pythonpath)
    assert compared == {str(s): True for s in range(4, 25, 4)}, compared
    assert_no_leftovers(tmp_path / "run")


def test_a_writer_error_on_one_rank_fails_every_rank_with_the_same_error(tmp_path):
    proc = run_local(tmp_path, nodes=1, nproc=2, overrides=["train.steps=12", "checkpoint.interval_steps=4"],
                     extra=["--max-restarts=0", "--max-node-restarts=0", "--inject=writer-raise@8:rank=1"], timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    expected = "checkpoint of step 8 failed (rank 1: OSError: injected writer failure"
    logs = [p.read_text() for p in sorted((tmp_path / "logs").rglob("*")) if p.is_file()]
    ranks = [log for log in logs if expected in log]
    assert len(ranks) >= 2 or out.count(expected) >= 2, out[-5000:]
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_????????")] == ["step_00000004"]
    assert_no_leftovers(tmp_path)


def test_a_write_that_never_finishes_fails_at_the_deadline_not_a_hang(tmp_path):
    # The first save hangs: a healthy write before it would have to beat the 3 s deadline too,
    # which the niced writer does not on a loaded machine.
    proc = run_trainer(tmp_path, ["train.steps=12", "checkpoint.interval_steps=4", "checkpoint.write_timeout_s=3",
                                  "resilience.inject=[writer-hang@4]"], timeout=120)
    assert proc.returncode != 0
    assert "did not finish within checkpoint.write_timeout_s=3" in proc.stderr, proc.stderr[-3000:]
    assert_no_leftovers(tmp_path)


# ---- 2: staging --------------------------------------------------------------------------------

def test_a_process_allocates_its_staging_buffers_after_its_first_step_and_only_if_it_will_save(tmp_path):
    report = probe("engine_probe.py", tmp_path, "warm", "async")
    assert report["saves_allocating"] and not report["never_allocating"], report
    assert report["committed"] and report["allocations"] == 1, report
    assert_no_leftovers(tmp_path)


# ---- 5: integrity -------------------------------------------------------------------------------

def test_a_flipped_byte_in_the_newest_checkpoint_is_caught_and_resume_ends_bitwise_equal(tmp_path):
    common = ["train.steps=12", "checkpoint.interval_steps=4"]
    reference = run_trainer(tmp_path / "ref", common)
    assert reference.returncode == 0, reference.stderr
    first = run_trainer(tmp_path, common + ["train.stop_at_step=8"])
    assert first.returncode == 0, first.stderr
    newest = tmp_path / "checkpoints" / "step_00000008"
    largest = max((p for p in newest.iterdir() if p.name != "COMPLETE"), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size, one bit
    largest.write_bytes(bytes(data))
    second = run_trainer(tmp_path, common)
    assert second.returncode == 0, second.stderr
    assert f"integrity check failed: {largest.name}: crc32c" in second.stdout, second.stdout[-3000:]
    assert "resumed from step 4" in second.stdout
    assert read_summary(tmp_path)["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]
    assert read_losses(tmp_path) == read_losses(tmp_path / "ref")
    # The corrupted commit was moved aside by the new step 8, not deleted.
    assert list((tmp_path / "checkpoints").glob("step_00000008.superseded-*"))


# ---- 3: one resume decision, resume_from at the first start only ---------------------------------

def test_resume_from_applies_to_the_jobs_first_start_and_newer_checkpoints_are_set_aside(tmp_path):
    common = ["train.steps=16", "checkpoint.interval_steps=4", "checkpoint.keep_last=0"]
    first = run_trainer(tmp_path, common + ["checkpoint.job_id=job-a"])
    assert first.returncode == 0, first.stderr
    target = tmp_path / "checkpoints" / "step_00000008"
    rewind = common + [f"checkpoint.resume_from={target}", "checkpoint.job_id=job-b"]
    second = run_trainer(tmp_path / "b", rewind + [f"checkpoint.dir={tmp_path / 'checkpoints'}", "train.stop_at_step=12"])
    assert second.returncode == 0, second.stderr
    assert "resumed from step 8" in second.stdout
    aside = sorted(p.name.split(".")[0] for p in (tmp_path / "checkpoints").glob("*.abandoned-*"))
    assert aside == ["step_00000012", "step_00000016"]
    # A restart of job b (the same job id) resumes from its own newest checkpoint, step 12, not
    # from resume_from again, and never from the abandoned timeline's step 16.
    third = run_trainer(tmp_path / "b", rewind + [f"checkpoint.dir={tmp_path / 'checkpoints'}"])
    assert third.returncode == 0, third.stderr
    assert "applied at this job's first start" in third.stdout and "resumed from step 12" in third.stdout
    assert read_summary(tmp_path / "b")["params_sha256"] == read_summary(tmp_path)["params_sha256"]
    assert len(list((tmp_path / "checkpoints").glob("*.abandoned-*"))) == 2  # never deleted


# ---- 9: every random stream, and a change of world size ------------------------------------------

RANDOM_DATA = """
import random
import numpy as np
import torch


class RandomCrops:
    # Windows at random offsets: each sample draws from Python's random and NumPy's generator.
    def __init__(self, vocab, seq_len):
        self.vocab, self.seq_len = vocab, seq_len

    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        start = random.randrange(self.vocab) + int(np.random.randint(0, 7))
        return (start + index + torch.arange(self.seq_len + 1)) % self.vocab


def build(cfg, vocab_size):
    return RandomCrops(vocab_size, cfg.seq_len)
"""


def test_python_and_numpy_random_streams_resume_exactly(tmp_path, plugin_dir):
    write_module(plugin_dir, "random_data", RANDOM_DATA)
    common = ["train.steps=10", "checkpoint.interval_steps=5", "data.factory=random_data:build"]
    ref = run_trainer(tmp_path / "ref", common, pythonpath=[plugin_dir])
    assert ref.returncode == 0, ref.stderr
    first = run_trainer(tmp_path, common + ["train.stop_at_step=5"], pythonpath=[plugin_dir])
    assert first.returncode == 0, first.stderr
    second = run_trainer(tmp_path, common, pythonpath=[plugin_dir])
    assert second.returncode == 0, second.stderr
    assert read_losses(tmp_path) == read_losses(tmp_path / "ref")
    assert read_summary(tmp_path)["params_sha256"] == read_summary(tmp_path / "ref")["params_sha256"]


def test_another_world_size_keeps_the_global_batch_or_refuses_naming_the_keys(tmp_path):
    two = run_local(tmp_path, nodes=1, nproc=2, overrides=["train.steps=8", "train.stop_at_step=4",
                                                           "data.micro_batch_size=3"])
    assert two.returncode == 0, two.stdout + two.stderr
    refused = run_trainer(tmp_path, ["train.steps=8", "data.micro_batch_size=4"])
    assert refused.returncode == 2
    assert ("global batch" in refused.stderr and "train.grad_accum_steps" in refused.stderr
            and "data.micro_batch_size" in refused.stderr), refused.stderr[-2000:]
    one = run_trainer(tmp_path, ["train.steps=8", "data.micro_batch_size=3"])
    assert one.returncode == 0, one.stderr
    assert "resharded from world size 2 to 1; RNG streams start fresh" in one.stdout
    assert "train.grad_accum_steps=2 instead of 1" in one.stdout
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    assert {s["tokens"] for s in steps} == {2 * 3 * 64}  # the same tokens per step at both world sizes
    assert read_summary(tmp_path)["tokens_seen"] == 8 * 2 * 3 * 64
    assert_no_leftovers(tmp_path)


# ---- 4: one job per checkpoint.dir ---------------------------------------------------------------

def test_a_second_job_on_the_same_checkpoint_dir_is_refused_naming_the_first(tmp_path):
    shared = tmp_path / "shared"
    first = run_trainer(tmp_path / "a", ["train.steps=2", f"checkpoint.dir={shared}", "checkpoint.job_id=job-a"])
    assert first.returncode == 0, first.stderr
    # job-a ended cleanly and released the lease; pretend it is still running by holding it here.
    from resilient_fsdp.checkpoint.lease import Lease

    holder = Lease(shared, "job-a", print)
    holder.acquire()
    try:
        second = run_trainer(tmp_path / "b", ["train.steps=2", f"checkpoint.dir={shared}", "checkpoint.job_id=job-b"])
    finally:
        holder.release()
    assert second.returncode == 2
    assert f"checkpoint.dir='{shared}' is in use by job 'job-a'" in second.stderr, second.stderr[-2000:]
    third = run_trainer(tmp_path / "b", ["train.steps=2", f"checkpoint.dir={shared}", "checkpoint.job_id=job-b"])
    assert third.returncode == 0, third.stderr
    shutil.rmtree(shared)
