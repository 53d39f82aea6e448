"""The S3 tier in real training runs (gloo on CPU) against moto's standalone server: every rank's
upload after commit, a restore split across a fresh "cluster", a cut-off upload, and an outage
mid-training."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.support import (
    REPO,
    _env,
    assert_no_leftovers,
    processes_of,
    read_events,
    read_summary,
    run_local,
    run_trainer,
)
from resilient_fsdp.checkpoint.s3 import client as s3_client
from resilient_fsdp.checkpoint.s3 import remote as s3_remote

CKPT = ["train.steps=12", "checkpoint.interval_steps=4"]


def complete_steps(s3, prefix):
    return [r.step for r in s3_remote.list_remote(s3.client, s3_client.parse_s3_uri(s3.uri(prefix))) if r.complete]


class Background:
    """A trainer started without waiting for it, so the test can act on the S3 server meanwhile."""

    def __init__(self, run_dir, overrides, timeout=180):
        cmd = [sys.executable, "-m", "resilient_fsdp.train", "--run-dir", str(run_dir)]
        for o in ["dist.timeout_s=60"] + overrides:
            cmd += ["--set", o]
        self.run_dir, self.deadline = run_dir, time.monotonic() + timeout
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_env(None, run_dir),
            start_new_session=True,
        )

    def wait_for(self, what, condition, interval=0.05):
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                out, err = self.finish()
                pytest.fail(f"the trainer ended or timed out before {what}\n{out[-3000:]}\n{err[-3000:]}")
            time.sleep(interval)

    def finish(self):
        try:
            out, err = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in processes_of(self.run_dir):
                p.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"timed out\n{out[-3000:]}\n{err[-3000:]}")
        return out, err


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_every_rank_uploads_its_files_once_and_a_fresh_cluster_restores_it_split_across_ranks(tmp_path, s3):
    # With versioning on, a file uploaded twice would leave two versions behind.
    s3.client.put_bucket_versioning(Bucket=s3.bucket, VersioningConfiguration={"Status": "Enabled"})
    common = CKPT + s3.overrides("job") + ["checkpoint.s3.keep_last=2"]
    # The S3 server listens on this machine's loopback, which a pod in its own network namespace
    # cannot reach (its 127.0.0.1 is its own): these pods share this machine's network.
    first = run_local(tmp_path / "a", nodes=2, nproc=2, overrides=common, isolation="loopback")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    status = read_summary(tmp_path / "a")["s3"]
    assert status["uploaded"] == [4, 8, 12] and status["deleted"] == [4], status
    assert status["pending"] == [] and status["failed"] == 0 and status["last_error"] is None
    assert complete_steps(s3, "job") == [8, 12]
    local = tmp_path / "a" / "checkpoints" / "step_00000012"
    versions = s3.client.list_object_versions(Bucket=s3.bucket, Prefix="job/")
    keys = [v["Key"] for v in versions["Versions"] if "/.uploads/" not in v["Key"]]
    per_checkpoint = len(list(local.iterdir()))  # data files and the marker
    assert len(keys) == len(set(keys)) == 3 * per_checkpoint  # steps 4, 8, 12: each object written once
    # Each of the 4 ranks uploaded its own files and left a receipt (removed once the marker was up).
    receipts = {v["Key"] for v in versions["Versions"] if "/.uploads/" in v["Key"]}
    assert len(receipts) == 3 * 4 and not [k for k in s3.keys("job/") if "/.uploads/" in k]
    for f in local.iterdir():
        if f.name != "COMPLETE":
            body = s3.client.get_object(Bucket=s3.bucket, Key=f"job/step_00000012/{f.name}")["Body"].read()
            assert body == f.read_bytes()
    commits = {e["step"]: e["t"] for e in read_events(tmp_path / "a", "checkpoint")}
    uploads = read_events(tmp_path / "a", "s3_upload")
    assert [u["step"] for u in uploads] == [4, 8, 12] and all(u["t"] >= commits[u["step"]] for u in uploads)
    assert_no_leftovers(tmp_path / "a")

    # A new, smaller cluster (2 nodes x 1 rank): an empty checkpoint.dir, the same S3 prefix. Each
    # rank downloads its share and rank 0 commits; the DCP checkpoint is resharded from 4 ranks to 2.
    second = run_local(tmp_path / "b", nodes=2, nproc=1, overrides=common, isolation="loopback")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.count("restoring step 12 from s3://") == 1 and "resumed from step 12" in second.stdout
    assert "resharded from world size 4 to 2" in second.stdout
    summary = read_summary(tmp_path / "b")
    assert summary["params_sha256"] == read_summary(tmp_path / "a")["params_sha256"]
    assert summary["s3"]["restored_from"]["step"] == 12 and summary["s3"]["uploaded"] == []  # nothing new to upload
    assert_no_leftovers(tmp_path / "b")


def test_a_cut_off_upload_is_ignored_on_restore_then_completed_and_the_restored_run_is_exact(tmp_path, s3):
    job = tmp_path / "job"
    # Slow uploads (1 MB/s for ~1.8 MB checkpoints) so the server can be stopped in the middle
    # of one; a long final wait for uploads, which the test ends with SIGTERM.
    cut = Background(
        job, CKPT + s3.overrides("p") + ["checkpoint.s3.max_bandwidth_mb_s=1", "checkpoint.s3.drain_timeout_s=300"]
    )
    started = lambda: any(not k.endswith("/COMPLETE") for k in s3.keys("p/step_00000012/"))  # noqa: E731
    cut.wait_for("the upload of step 12 started", started)
    s3.pause()
    failed = lambda: any(e["step"] == 12 for e in read_events(job, "s3_error"))  # noqa: E731
    cut.wait_for("the upload of step 12 failed", failed, interval=0.2)
    cut.proc.send_signal(signal.SIGTERM)  # ends the wait for uploads; training itself had finished
    out, err = cut.finish()
    s3.resume()
    assert cut.proc.returncode == 0, out[-3000:] + err[-3000:]
    status = read_summary(job)["s3"]
    assert status["uploaded"] == [4, 8] and status["pending"] == [12] and status["failed"] >= 1, status
    assert "timeout" in status["last_error"].lower()
    assert "S3 upload of step 12 failed" in out and "the next run with this checkpoint.dir uploads them" in out
    assert "p/step_00000012/COMPLETE" not in s3.keys("p/") and complete_steps(s3, "p") == [4, 8]

    # A new cluster restores step 8: the prefix of step 12 has no marker. It trains 9-12 and
    # ends bitwise where the job did (it only restores: checkpoint.s3.upload=false).
    fresh = run_trainer(tmp_path / "fresh", CKPT + s3.overrides("p") + ["checkpoint.s3.upload=false"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "skipping s3://" in fresh.stdout and "step_00000012/: no COMPLETE marker" in fresh.stdout
    assert "restoring step 8 from s3://" in fresh.stdout and "resumed from step 8" in fresh.stdout
    summary = read_summary(tmp_path / "fresh")
    assert summary["final_step"] == 12 and summary["resumed_from_step"] == 8
    assert summary["params_sha256"] == read_summary(job)["params_sha256"]
    assert summary["s3"]["restored_from"]["step"] == 8

    # The job started again finds step 12 not uploaded and completes it.
    again = run_trainer(job, CKPT + s3.overrides("p"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_summary(job)["s3"]["uploaded"] == [12] and complete_steps(s3, "p") == [4, 8, 12]
    for run_dir in (job, tmp_path / "fresh"):
        assert_no_leftovers(run_dir)


def test_training_goes_on_while_s3_is_down_and_uploads_catch_up(tmp_path, s3):
    s3.pause()  # down from the start: uploads pile up and fail while the steps go on
    run = Background(
        tmp_path,
        [
            "train.steps=80",
            "checkpoint.interval_steps=5",
            "checkpoint.s3.restore=false",
            "checkpoint.s3.max_pending=2",
            "checkpoint.s3.drain_timeout_s=60",
        ]
        + s3.overrides("down"),
    )
    commits = lambda: read_events(tmp_path, "checkpoint") if (tmp_path / "metrics.jsonl").exists() else []  # noqa: E731
    errors = lambda: read_events(tmp_path, "s3_error") if (tmp_path / "metrics.jsonl").exists() else []  # noqa: E731
    # The outage lasts until steps and commits went on and an upload has failed (timed out): on a
    # fast machine five commits can come before the first upload attempt gives up.
    run.wait_for(
        "5 checkpoints committed and an upload failed during the outage",
        lambda: len(commits()) >= 5 and len(errors()) >= 1,
    )
    resumed_at = time.time()
    s3.resume()
    out, err = run.finish()
    assert run.proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "S3 is not reachable at start" in out and "training goes on" in out
    summary = read_summary(tmp_path)
    assert summary["final_step"] == 80
    during = [e["step"] for e in read_events(tmp_path, "checkpoint") if e["t"] < resumed_at]
    assert len(during) >= 5  # steps and commits went on with S3 stopped
    status = summary["s3"]
    assert status["failed"] >= 1 and "timeout" in status["last_error"].lower(), status
    assert status["superseded"] and status["pending"] == [] and 80 in status["uploaded"]
    # Bounded: nothing waited beyond max_pending (+1 in flight); dropped ones were never uploaded.
    assert not set(status["superseded"]) & set(status["uploaded"])
    # The newest complete checkpoints in the bucket are the uploaded ones. A marker whose PUT timed
    # out during the outage may still land once the server resumes (the request had reached it):
    # that checkpoint is whole, its files went up before its marker, and it is one given up on.
    complete, newest = complete_steps(s3, "down"), sorted(status["uploaded"])[-3:]  # the bucket keeps 3
    assert complete[-len(newest) :] == newest and complete[-1] == 80, complete
    assert set(complete) - set(status["uploaded"]) <= set(status["superseded"]), complete
    # Local retention caught up once the uploads no longer held older checkpoints.
    assert len(list((tmp_path / "checkpoints").glob("step_????????"))) == 3
    assert_no_leftovers(tmp_path)


def test_a_missing_bucket_stops_the_job_before_training_with_the_key_named(tmp_path, s3):
    proc = run_trainer(
        tmp_path,
        ["train.steps=2", f"checkpoint.s3.uri=s3://{s3.bucket}-missing/x", f"checkpoint.s3.endpoint_url={s3.endpoint}"],
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"checkpoint.s3.uri='s3://{s3.bucket}-missing/x': bucket '{s3.bucket}-missing' does not exist" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists() or not read_events(tmp_path, "step")
