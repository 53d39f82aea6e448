"""Silent data corruption under HSDP (``resilience.sdc``): the replicas of each shard compare a
digest of their parameters on real ranks (gloo), a bit flipped in one rank's shard is found at the
next check, and the job rolls back to the state last seen to agree and ends bitwise equal to the
job without the fault; no checkpoint saved after the last passing check is resumed from."""

from __future__ import annotations

import pytest
import torch

from resilient_fsdp.checkpoint import store
from resilient_fsdp.resilience.sdc import digest, odd_ones
from resilient_fsdp.resilience.stragglers import NOT_REPLACED
from tests.support import assert_no_leftovers, read_events, read_losses, read_summary, run_local

HSDP = [
    "train.steps=24",
    "checkpoint.interval_steps=4",
    "train.log_every=4",
    "dist.shard_group_size=2",
    "checkpoint.memory.interval_steps=2",
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    "resilience.hang_detection.learn_timeouts=false",
]
# Synchronous saves: step 12's checkpoint is committed at step 12, before the check that finds the
# flip (an asynchronous one still in flight then is set aside by the next start: below).
CHECKED = [*HSDP, "resilience.sdc.interval_steps=5", "checkpoint.mode=sync"]


def test_a_digest_changes_with_any_one_bit_and_not_with_a_copy(monkeypatch):
    from resilient_fsdp.resilience import sdc

    tensors = [torch.randn(1000), torch.randn(7, 3), torch.randn(0)]
    base = digest(tensors)
    monkeypatch.setattr(sdc, "_CHUNK", 7)  # a large shard is digested a chunk at a time: the same sums
    assert torch.equal(digest(tensors), base)
    monkeypatch.undo()
    assert torch.equal(digest([t.clone() for t in tensors]), base)
    for tensor, index, bit in ((0, 0, 0), (0, 999, 31), (1, 20, 22)):
        flipped = [t.clone() for t in tensors]
        word = flipped[tensor].view(-1)[index : index + 1].view(torch.int32)
        word ^= 1 << bit if bit < 31 else -(1 << 31)
        assert not torch.equal(digest(flipped), base), (tensor, index, bit)
    # Two tensors swapped hold the same words: the places tell them apart.
    assert not torch.equal(digest([tensors[1], tensors[0]]), base)


def test_the_odd_replica_out_needs_a_majority():
    assert odd_ones([(1, 2), (1, 2), (3, 4)]) == [2]
    assert odd_ones([(1, 2), (1, 2), (1, 2)]) == []
    assert odd_ones([(1, 2), (3, 4)]) is None  # two replicas that differ: either may be the bad one
    assert odd_ones([(1, 2), (1, 2), (3, 4), (3, 4)]) is None


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    """1 pod x 4 ranks, 2 replicas of each shard, checks every 5 steps, no fault."""
    run_dir = tmp_path_factory.mktemp("sdc-reference") / "run"
    proc = run_local(run_dir, nodes=1, nproc=4, overrides=CHECKED, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["replica_checks"] == {
        "interval_steps": 5,
        "replicas": 2,
        "checks": 4,
        "check_s_median": summary["replica_checks"]["check_s_median"],
    }
    assert summary["silent_corruption"] == []
    return summary, read_losses(run_dir)


def test_a_bit_flipped_in_a_replica_is_found_at_the_next_check_and_rolled_back_bitwise(tmp_path, hsdp_reference):
    """rank 1's shard gets a flipped bit after step 12's optimizer step; the check at step 15 finds
    its replica group's digests differ (two replicas: both are suspects), the checkpoints saved
    after the check at step 10 (durable step 12, memory steps 12 and 14) are set aside, and the
    in-job restart resumes from step 10's memory snapshot; the check at step 15 then passes."""
    reference, losses = hsdp_reference
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=1, nproc=4, overrides=CHECKED, extra=["--inject", "bitflip@12:rank=1"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["params_sha256"] == reference["params_sha256"], proc.stdout[-4000:]
    assert read_losses(run_dir)[-24:] == losses
    assert summary["restarts"]["in_job"] == 1 and summary["restarts"]["job"] == 0
    (found,) = summary["silent_corruption"]
    assert (found["step"], found["last_pass_step"], found["replicas"]) == (15, 10, 2), found
    # Rank 1 and its replica (rank 3: the same place in the other shard group) are the suspects.
    assert sorted(s["rank"] for s in found["suspects"]) == [1, 3] and found["replaced"] == [], found
    assert found["reverified_at_step"] == 15, found
    # The durable checkpoint of step 12 (saved with the flipped bit) was set aside, never loaded.
    assert [step for step, _ in store.aside(run_dir / "checkpoints")["suspect"]] == [12]
    (start,) = [e for e in read_events(run_dir, "start") if e.get("layer") == "in_job"]
    assert start["resumed_from_step"] == 10 and start["resumed_from_tier"] == "memory", start
    assert "silent data corruption: the replicas of a shard differ at step 15" in proc.stdout
    assert_no_leftovers(run_dir)


def test_a_start_after_a_mismatch_sets_aside_what_was_committed_in_the_suspect_window(tmp_path):
    """A commit still in flight when the mismatch was found lands after rank 0 set the window's
    checkpoints aside; the next start's decision sets it aside too and resumes from before it."""
    from resilient_fsdp.checkpoint.resume import decide
    from resilient_fsdp.config import load_config

    root = tmp_path / "checkpoints"
    for step in (8, 10, 12, 14):
        partial = root / store.partial_name(step, f"t{step}")
        partial.mkdir(parents=True)
        store.commit(partial, {"step": step})
    said: list[str] = []
    cfg = load_config(None, []).checkpoint
    plan = decide(cfg, root, "job", said.append, suspect=(10, 15))
    assert plan["candidate"]["step"] == 10, plan
    assert [step for step, _ in store.aside(root)["suspect"]] == [12, 14]
    assert [c.step for c in store.scan(root)[0]] == [8, 10]  # before the window: left as it is
    assert any("saved after the replicas last agreed (step 10)" in line for line in said), said


def test_replica_checks_without_replicas_are_refused_naming_the_key(tmp_path):
    proc = run_local(
        tmp_path / "run", nodes=1, nproc=2, overrides=["train.steps=4", "resilience.sdc.interval_steps=2"], timeout=200
    )
    assert proc.returncode != 0
    assert (
        "resilience.sdc.interval_steps compares the replicas of each shard, which only HSDP has: set "
        "dist.shard_group_size" in proc.stdout + proc.stderr
    )


def test_with_three_replicas_the_odd_one_out_is_named_and_a_store_host_replica_stays(tmp_path):
    """Three replicas of every shard (1 pod x 3 ranks, shard groups of one): a bit flipped in rank
    2's copy makes it the odd one out by majority; it alone is the suspect. The job has no hot
    spare, so it stays (said in the record): the job rolls back and ends bitwise equal to the same
    job without the fault."""
    common = [
        "train.steps=16",
        "checkpoint.interval_steps=4",
        "dist.shard_group_size=1",
        "checkpoint.mode=sync",
        "checkpoint.memory.interval_steps=2",
        "resilience.sdc.interval_steps=5",
        "resilience.launcher.workers_stop_timeout_s=2",
        "resilience.hang_detection.learn_timeouts=false",
    ]
    clean = run_local(tmp_path / "clean", nodes=1, nproc=3, overrides=common, timeout=300)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=1, nproc=3, overrides=common, extra=["--inject", "bitflip@7:rank=2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["params_sha256"] == read_summary(tmp_path / "clean")["params_sha256"]
    (found,) = summary["silent_corruption"]
    assert (found["step"], found["last_pass_step"], found["replicas"]) == (10, 5, 3), found
    assert [s["rank"] for s in found["suspects"]] == [2] and found["odd_one_out"] is True, found
    assert found["replaced"] == [] and found["not_replaced"] == NOT_REPLACED[2], found
    assert summary["restarts"]["in_job"] == 1
