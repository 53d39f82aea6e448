"""Rank 0's commit process (``checkpoint/commit.py``) on its own, with real processes: a commit of a
DCP checkpoint made in it loads; the plan's metadata travels once; a process that died between
commits is replaced; where none can start, the commit is made on the calling thread and says why."""

from __future__ import annotations

import os
import pickle
import time

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from resilient_fsdp.checkpoint import commit, store
from resilient_fsdp.checkpoint.engines import LocalOutcome
from resilient_fsdp.checkpoint.integrity import HashingFileSystem, Recorder


def _written(path, value: float) -> tuple[LocalOutcome, object]:
    """A one-rank DCP write of a small state into ``path`` without its ``.metadata``: this rank's
    outcome and the plan's global metadata, as the async engine leaves them for the commit."""
    recorder = Recorder()
    writer = FileSystemWriter(str(path))
    writer.fs = HashingFileSystem(recorder)
    captured = {}
    finish = writer.finish

    def keep(metadata, results):  # DCP's own finish would write .metadata: the commit does
        captured.update(metadata=metadata, results=results)

    writer.finish = keep
    dcp.save({"w": torch.full((4, 4), value)}, storage_writer=writer)  # no process group: this rank alone
    writer.finish = finish
    outcome = LocalOutcome(0, None, captured["results"][0], recorder.take())
    return outcome, captured["metadata"]


def _job(tmp_path, step: int, metadata, key: str) -> commit.CommitJob:
    where = tmp_path / store.partial_name(step, "t")
    where.mkdir(parents=True)
    outcome, planned = _written(where, float(step))
    return commit.CommitJob(
        step=step,
        where=str(where),
        gathered=[pickle.dumps(outcome)],
        manifest={"step": step, "mode": "async", "world_size": 1},
        started_unix=time.time(),
        metadata_key=key,
        metadata=metadata if metadata is not None else planned,
    )


def _loaded(path) -> float:
    state = {"w": torch.zeros(4, 4)}
    dcp.load(state, checkpoint_id=str(path))
    return float(state["w"][0, 0])


def test_commits_made_in_the_process_load_and_the_plans_metadata_travels_once(tmp_path):
    process = commit.CommitProcess()
    try:
        first = _job(tmp_path, 1, None, "plan-a")
        result = process.result(process.submit(first), timeout=120)
        assert result.error is None and result.pid not in (0, os.getpid()), result
        assert process.holds("plan-a")
        second = _job(tmp_path, 2, first.metadata, "plan-a")
        future = process.submit(second)
        assert second.metadata is None  # the process keeps the plan's metadata: only outcomes travel
        result = process.result(future, timeout=120)
        assert result.error is None, result
        assert [c.step for c in store.scan(tmp_path)[0]] == [1, 2]
        assert _loaded(tmp_path / store.committed_name(2)) == 2.0
    finally:
        process.close()


def test_a_process_that_died_between_commits_is_replaced(tmp_path):
    process = commit.CommitProcess()
    try:
        job = _job(tmp_path, 1, None, "plan-a")
        first = process.result(process.submit(job), timeout=120)
        psutil.Process(first.pid).kill()
        deadline = time.monotonic() + 30
        while process._pool is not None and not process._pool._broken and time.monotonic() < deadline:
            time.sleep(0.05)
        # The plan's metadata died with it: the next job must carry it again.
        later = _job(tmp_path, 2, job.metadata, "plan-a")
        result = process.result(process.submit(later), timeout=120)
        assert result.error is None and result.pid not in (0, first.pid), result
        assert process.unavailable is None
        assert _loaded(tmp_path / store.committed_name(2)) == 2.0
    finally:
        process.close()


def test_without_a_process_the_commit_is_made_here_and_says_why(tmp_path, monkeypatch):
    class NoProcesses:
        @staticmethod
        def get_context(method=None):
            raise OSError(24, "Too many open files")

    monkeypatch.setattr(commit, "multiprocessing", NoProcesses)
    process = commit.CommitProcess()
    result = process.result(process.submit(_job(tmp_path, 1, None, "plan-a")), timeout=5)
    assert result.error is None and result.pid == os.getpid(), result
    assert "Too many open files" in process.unavailable
    assert _loaded(tmp_path / store.committed_name(1)) == 1.0


@pytest.mark.parametrize("holder", ["someone-else", None])
def test_a_lease_taken_over_stops_the_commit_in_the_process(tmp_path, holder):
    lease = tmp_path / "lease.json"
    lease.write_text('{"holder": "someone-else", "job": "other", "host": "h"}')
    job = _job(tmp_path, 1, None, "plan-a")
    job.lease_path, job.lease_holder = str(lease), holder or "mine"
    process = commit.CommitProcess()
    try:
        result = process.result(process.submit(job), timeout=120)
    finally:
        process.close()
    if holder == "someone-else":
        assert result.lease_lost is None and [c.step for c in store.scan(tmp_path)[0]] == [1]
    else:
        assert "taken over by job 'other'" in result.lease_lost
        assert store.scan(tmp_path)[0] == []  # nothing committed
