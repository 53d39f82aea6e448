"""Checkpoint round trips in real processes: each engine saves exactly the state of its step and
resumes bitwise, on both NVRx lanes; cached plans; a stopped and resumed run equals an
uninterrupted one; resharding; the save schedule and the figures reported."""

from __future__ import annotations

import json
import sys

import pytest

from tests.checkpoint.probes import HERE as PROBES_DIR, run_probe
from tests.support import (
    REPO,
    assert_no_leftovers,
    read_events,
    read_losses,
    read_summary,
    run_guarded,
    run_local,
    run_trainer,
)


MODES = ["async", "torch-async", "sync"]


def probe(run_dir, mode, pythonpath=None) -> dict:
    return run_probe("round_trip.py", run_dir, mode, pythonpath=pythonpath, timeout=180)


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_bitwise_and_holds_the_state_of_its_step(tmp_path, mode):
    report = probe(tmp_path, mode)
    assert report["live_state_changed_during_write"]  # training mutated the state after the save began
    assert report["resumed_step"] == 3
    assert report["equal"] == {k: True for k in ("model", "optim", "lr_scheduler", "trainer", "data", "rng")}


@pytest.mark.parametrize("mode", ["async", pytest.param("torch-async", marks=pytest.mark.extended)])
def test_image_nvrx_version_round_trip(tmp_path, nvrx_lane, mode):
    """The same checks against the NVRx version the image ships (constraints-image.txt)."""
    expected = (REPO / "constraints-image.txt").read_text().split("nvidia-resiliency-ext==")[1].split()[0]
    report = probe(tmp_path, mode, pythonpath=[nvrx_lane])
    assert report["nvrx_version"] == expected
    assert report["equal"] == {k: True for k in ("model", "optim", "lr_scheduler", "trainer", "data", "rng")}


@pytest.mark.parametrize("lane", [pytest.param("pinned", marks=pytest.mark.extended), "image"])
def test_a_cached_plan_writes_checkpoints_that_load_bitwise_and_a_changed_structure_invalidates_it(
    tmp_path, request, lane
):
    """The plan cache (an explicit CheckpointMetadataCache) is validated at the second save
    of a structure and skips planning from the third; an added key and a changed shape each start
    a fresh cache. The staging buffers travel to the writer once per structure, not per save."""
    pythonpath = [REPO] + ([] if lane == "pinned" else [request.getfixturevalue("nvrx_lane")])
    proc = run_guarded(
        [sys.executable, str(PROBES_DIR / "plan_cache.py"), str(tmp_path / "c")], tmp_path, pythonpath, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saves = json.loads(proc.stdout.strip().splitlines()[-1])["saves"]
    # 1-4 unchanged, 5-7 with an added key, 8-10 with a changed shape: fresh, keep, cached...
    assert [s["vote"] for s in saves] == [0, 1, 2, 2, 0, 1, 2, 0, 1, 2]
    assert all(s["bitwise"] for s in saves), saves
    assert [s["step"] for s in saves if s["buffers_sent"]] == [1, 5, 8]
    assert_no_leftovers(tmp_path)


@pytest.mark.parametrize("lane", ["pinned", "image"])
def test_a_plan_made_alone_is_validated_at_the_first_save_of_a_structure_and_loads_bitwise(tmp_path, request, lane):
    """With ``checkpoint.planning: decentralized`` the first save of every structure is planned
    by the rank alone and handed to NVRx as a validated cache: every later save of that
    structure skips planning; each save loads back bitwise with DCP's own loader."""
    pythonpath = [REPO] + ([] if lane == "pinned" else [request.getfixturevalue("nvrx_lane")])
    proc = run_guarded(
        [sys.executable, str(PROBES_DIR / "plan_cache.py"), str(tmp_path / "c")],
        tmp_path,
        pythonpath,
        timeout=240,
        env={"PROBE_PLANNING": "decentralized"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saves = json.loads(proc.stdout.strip().splitlines()[-1])["saves"]
    # 1-4 unchanged, 5-7 with an added key, 8-10 with a changed shape: planned alone, then cached
    assert [s["vote"] for s in saves] == [3, 2, 2, 2, 3, 2, 2, 3, 2, 2]
    assert all(s["bitwise"] for s in saves), saves
    assert [s["step"] for s in saves if s["buffers_sent"]] == [1, 5, 8]
    assert_no_leftovers(tmp_path)


def test_a_plan_that_cannot_be_made_alone_fails_one_save_named_and_the_rank_plans_collectively_after(tmp_path):
    """Planning alone that raises would raise again for the same state: that save fails once,
    naming why, and every later save is planned collectively and loads bitwise."""
    proc = run_guarded(
        [sys.executable, str(PROBES_DIR / "plan_cache.py"), str(tmp_path / "c")],
        tmp_path,
        [REPO],
        timeout=240,
        env={"PROBE_PLANNING": "decentralized", "PROBE_BREAK_ALONE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saves = json.loads(proc.stdout.strip().splitlines()[-1])["saves"]
    # The failed save left a fresh cache for the structure: the collective plans fill and validate it.
    assert [s["vote"] for s in saves] == [3, 1, 1, 2, 0, 1, 2, 0, 1, 2]
    first, rest = saves[0], saves[1:]
    assert "planning this save alone failed (AssertionError: a chunk this plan cannot place)" in first["error"]
    assert "plans its saves collectively from the next one" in first["error"]
    assert all(s["bitwise"] and s["error"] is None for s in rest), rest


def test_the_ranks_are_told_once_when_their_structures_differ_and_plan_collectively():
    from resilient_fsdp.checkpoint.engines import PLAN_CACHED, PLAN_DECENTRALIZED, PLAN_FRESH, AsyncEngine

    engine = AsyncEngine(0, thread_count=1)
    try:
        assert engine.agree([(PLAN_FRESH, "a"), (PLAN_FRESH, "a")]) == PLAN_DECENTRALIZED
        assert engine.agree([(PLAN_CACHED, None), (PLAN_CACHED, None)]) == PLAN_CACHED
        assert engine.take_notes() == []
        for _ in range(2):
            assert engine.agree([(PLAN_FRESH, "a"), (PLAN_FRESH, "b"), (PLAN_FRESH, "a")]) == PLAN_FRESH
        notes = engine.take_notes()
        assert len(notes) == 1 and "2 digests of 3 ranks" in notes[0] and "planned collectively" in notes[0]
        # A rank that planned alone and failed votes no digest: collective, and nothing to say.
        assert engine.agree([(PLAN_FRESH, "a"), (PLAN_FRESH, None)]) == PLAN_FRESH
    finally:
        engine.close(abort=True)


@pytest.mark.parametrize("lane", [pytest.param("pinned", marks=pytest.mark.extended), "image"])
def test_a_ranks_next_process_saves_with_the_plan_its_pod_kept_and_only_with_its_own(tmp_path, request, lane):
    """A validated plan is kept in the pod's memory for the rank's next process (an in-job
    restart), whose first save then skips planning and loads bitwise. A kept plan of another
    structure, of another rank or unreadable is not used, and the job's end removes it."""
    pythonpath = [REPO] + ([] if lane == "pinned" else [request.getfixturevalue("nvrx_lane")])
    kept = tmp_path / "shm" / "plans" / "rank-0.pickle"

    def process(name: str, rank: int, rows: str, end: str = "abort") -> dict:
        proc = run_guarded(
            [sys.executable, str(PROBES_DIR / "plan_cache.py"), str(tmp_path / name), str(kept), str(rank), rows, end],
            tmp_path,
            pythonpath,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert all(s["bitwise"] for s in report["saves"]) and not report["notes"], report
        return report

    assert [s["vote"] for s in process("first", 0, "8,8,8")["saves"]] == [0, 1, 2]  # fresh, keep, cached
    assert kept.exists()  # validated at the second save, kept for the next process (which fails)
    assert [s["vote"] for s in process("restarted", 0, "8,8")["saves"]] == [2, 2]
    assert [s["vote"] for s in process("other-rank", 1, "8")["saves"]] == [0]
    assert [s["vote"] for s in process("other-shape", 0, "10,10")["saves"]] == [0, 1]
    kept.write_bytes(kept.read_bytes()[:40])  # torn
    assert [s["vote"] for s in process("torn", 0, "8,8,8", end="end")["saves"]] == [0, 1, 2]
    assert not kept.exists() and not kept.parent.exists()  # the job ended


def _metadata(chunks: int):
    """A DCP ``Metadata`` of one tensor cut into ``chunks`` chunks."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    parts = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 4])) for i in range(chunks)]
    return Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([chunks, 4]), parts)})


@pytest.mark.parametrize("over", [False, True])
def test_a_plan_whose_global_metadata_would_hold_the_coordinator_for_seconds_is_not_kept(tmp_path, over):
    from resilient_fsdp.checkpoint.writer.dcp_plan import PlanCache

    kept = tmp_path / "rank-0.pickle"
    plans = PlanCache()
    plans.attach(kept, 0)
    cache = plans.use(("structure", 1024), keep=False)  # NVRx's own CheckpointMetadataCache
    cache.validated_cache_reuse = True
    cache.cached_global_metadata = _metadata(PlanCache.KEEP_MAX_CHUNKS + (1 if over else 0))
    note = plans.keep()
    if over:
        assert note and "not kept for the next process" in note and "100,001 chunks" in note
        assert not kept.exists() and plans.keep() is None  # said once
        return
    assert note is None and kept.exists()
    restarted = PlanCache()
    restarted.attach(kept, 0)
    assert restarted.valid_for(("structure", 1024)) and restarted.validated()


@pytest.mark.parametrize("tampered", ["others-can-write", "folder-others-can-write", "another-owner", "symlink"])
def test_a_kept_plan_another_user_could_have_written_is_not_unpickled(tmp_path, tampered):
    """Outside a pod ``/dev/shm`` is shared by every user, and unpickling runs code: a kept plan
    is taken only from a file this user owns, in a folder it owns, that no one else can write."""
    import os

    from resilient_fsdp.checkpoint.writer.dcp_plan import PlanCache

    kept = tmp_path / "plans" / "rank-0.pickle"
    plans = PlanCache()
    plans.attach(kept, 0)
    cache = plans.use(("structure", 4), keep=False)
    cache.validated_cache_reuse = True
    assert plans.keep() is None and kept.exists()
    untouched = PlanCache()
    untouched.attach(kept, 0)
    assert untouched.valid_for(("structure", 4))  # the check below is what refuses it
    if tampered == "others-can-write":
        kept.chmod(0o666)
    elif tampered == "folder-others-can-write":
        kept.parent.chmod(0o777)
    elif tampered == "another-owner":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")  # CI and this machine run as root
        os.chown(kept, 65534, 65534)
    else:
        real = kept.with_name("elsewhere.pickle")
        kept.rename(real)
        kept.symlink_to(real)
    restarted = PlanCache()
    restarted.attach(kept, 0)
    assert not restarted.valid_for(("structure", 4)) and restarted.cache is None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = run_local(run_dir, nodes=1, nproc=2, overrides=["train.steps=16", "checkpoint.interval_steps=4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


# The asynchronous NVRx engine (the default) in CI; the other engines in the extended tier.
@pytest.mark.parametrize("mode", [m if m == "async" else pytest.param(m, marks=pytest.mark.extended) for m in MODES])
def test_stopped_and_resumed_run_equals_an_uninterrupted_one(tmp_path, uninterrupted, mode):
    common = ["train.steps=16", f"checkpoint.mode={mode}"]
    first = run_local(tmp_path, nodes=1, nproc=2, overrides=common + ["train.stop_at_step=8"])
    assert first.returncode == 0, first.stdout + first.stderr
    assert read_summary(tmp_path)["final_step"] == 8
    second = run_local(tmp_path, nodes=1, nproc=2, overrides=common)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 8" in second.stdout
    assert read_losses(tmp_path) == read_losses(uninterrupted)
    assert read_summary(tmp_path)["params_sha256"] == read_summary(uninterrupted)["params_sha256"]
    assert read_summary(tmp_path)["resumed_from_step"] == 8
    assert_no_leftovers(tmp_path)


def test_checkpoint_figures_are_reported(uninterrupted):
    events = read_events(uninterrupted, "checkpoint")
    assert [e["step"] for e in events] == [4, 8, 12, 16]
    for e in events:
        # The stall lies within the save's span: the write, then the commit's manifest, rename and broadcast.
        assert e["mode"] == "async" and e["bytes"] > 100_000 and 0 < e["stall_s"] <= e["write_s"] + e["commit_s"]
        # The save call's parts (previous write, state, agreement, start) add up to the call.
        parts = e["save_call_parts_s"]
        assert set(parts) == {"previous_s", "state_s", "agree_s", "start_s"} and min(parts.values()) >= 0
        assert sum(parts.values()) == pytest.approx(e["save_call_s"], abs=1e-3)
        # The commit (gather, .metadata, manifest and rename, broadcast) is timed in parts. Made on
        # rank 0's commit process, only the training thread's parts (the gather and the broadcast)
        # are stall; made in line (a wait: the final save's), all of it.
        commit = e["commit_parts_s"]
        assert set(commit) == {"gather_s", "finalize_s", "manifest_s", "other_s", "broadcast_s"}
        assert min(commit.values()) >= 0 and commit["finalize_s"] > 0 and commit["manifest_s"] > 0
        assert sum(commit.values()) == pytest.approx(e["commit_s"], abs=1e-6)
        if e["commit_background"]:
            assert commit["gather_s"] + commit["broadcast_s"] < e["stall_s"]
            # The training thread's share: the gather, the broadcast and taking the result back.
            assert commit["gather_s"] + commit["broadcast_s"] <= e["commit_on_thread_s"] < e["stall_s"], e
        else:
            assert e["commit_s"] < e["stall_s"] and e["commit_on_thread_s"] == e["commit_s"]
    # The final save's commit is waited for. An earlier one is made in rank 0's commit process when
    # every write finished between steps, else in line by the next save's wait (charged to its own
    # stall, as checked above): which one is timing (a write here takes about as long as the four
    # steps before the next save). The hand-off itself is probed step by step in
    # test_checkpoint_failures.py (commit-in-flight).
    assert not events[-1]["commit_background"], events
    summary = read_summary(uninterrupted)
    assert [c["step"] for c in summary["checkpoints"]] == [4, 8, 12, 16]
    assert summary["checkpoint_stall_s"] == pytest.approx(sum(e["stall_s"] for e in events))
    # Retention (keep_last=3 by default) removed the oldest; every survivor is complete.
    kept = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert kept == ["RUN", "step_00000008", "step_00000012", "step_00000016"]  # RUN: the run's id


# CI reshards the default engine's checkpoints (test_resume.py, another world size).
@pytest.mark.extended
def test_dcp_checkpoints_reshard_and_torch_async_ones_refuse(tmp_path):
    for mode in ("async", "torch-async"):
        run_dir = tmp_path / mode
        two = run_local(
            run_dir, nodes=1, nproc=2, overrides=["train.steps=8", "train.stop_at_step=4", f"checkpoint.mode={mode}"]
        )
        assert two.returncode == 0, two.stdout + two.stderr
        one = run_trainer(run_dir, ["train.steps=8", f"checkpoint.mode={mode}"])
        if mode == "async":
            assert one.returncode == 0, one.stderr
            assert "resharded from world size 2 to 1" in one.stdout
            assert read_summary(run_dir)["final_step"] == 8
        else:
            assert one.returncode == 2
            assert "can only be resumed at that world size" in one.stderr


def test_a_different_model_is_refused(tmp_path):
    assert run_trainer(tmp_path, ["train.steps=2"]).returncode == 0
    proc = run_trainer(tmp_path, ["train.steps=4", "model.vocab_size=300"])
    assert proc.returncode == 2 and "holds a different model" in proc.stderr


def test_time_interval_triggers_saves(tmp_path):
    proc = run_trainer(
        tmp_path,
        ["train.steps=12", "checkpoint.interval_s=0.001", "checkpoint.save_final=false", "checkpoint.keep_last=0"],
    )
    assert proc.returncode == 0, proc.stderr
    steps = [e["step"] for e in read_events(tmp_path, "checkpoint")]
    # Every step is past the interval; a save still in flight delays the next one, never skips
    # the commit of the last one started.
    assert len(steps) >= 4 and steps == sorted(set(steps)) and steps[-1] <= 12
    assert len(list((tmp_path / "checkpoints").glob("step_????????"))) == len(steps)
