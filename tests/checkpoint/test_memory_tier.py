"""The memory tier in real training runs (gloo on CPU): a killed rank's in-job restart restores
every rank from its ``/dev/shm`` snapshot, a snapshot that fails its checks falls back to its
replica on the next pod, a replica that fails them to the durable checkpoint, each ending bitwise
equal to the run without a fault, and nothing is left in ``/dev/shm`` once the job ends."""

from __future__ import annotations

import json
import re
from pathlib import Path

from resilient_fsdp.checkpoint.memory.slots import job_root, remove_job
from resilient_fsdp.checkpoint.run_identity import read_run_identity
from tests.resilience.fault_jobs import lane_run, run_with_faults
from tests.support import read_events, read_losses, read_summary, run_trainer

SHM = Path("/dev/shm")
MEMORY = ["checkpoint.memory.interval_steps=2"]


def job_of(run_dir: Path) -> str:
    manifest = json.loads(next((run_dir / "checkpoints").glob("step_*/COMPLETE")).read_text())
    return manifest["job"]


def job_folder(job: str) -> Path:
    """Where every run of ``job`` keeps its slots in this machine's /dev/shm."""
    return job_root(SHM, job, "any").parent


def slots_of(run_dir: Path, job: str, owner: str = "rank-0") -> Path:
    """The slots of ``owner`` that the run in ``run_dir`` (its run id) keeps for ``job``."""
    return job_root(SHM, job, read_run_identity(run_dir / "checkpoints")) / owner


def test_a_killed_rank_0_restores_from_its_own_memory_and_a_lost_pod_0_from_its_peers_replica_bitwise(
    tmp_path, reference_1x2
):
    """Two pods of one rank, durable checkpoints every 4 steps, memory ones every 2, replicas on.
    Rank 0 killed after step 11: the in-job restart restores every rank from its own slot (step
    10: one step lost, not three). Pod 0, the store host, lost after step 19: its replacement comes
    back with an empty /dev/shm, and its rank's snapshot of step 18 comes back from pod 1, which
    kept its replica."""
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["sigkill@12:rank=0", "node-loss@20:node=0"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1"],
        timeout=400,
    )
    killed, lost = summary["recoveries"]
    assert (killed["resumed_from_step"], killed["lost_steps"]) == (10, 1), killed
    assert (lost["resumed_from_step"], lost["lost_steps"]) == (18, 1), lost
    out = summary["_stdout"]
    assert "resumed from memory: step 10 on every rank (step 10 from memory on every rank)" in out, summary["_output"]
    # The new process read its slot ahead while it built the model, and the restore took that;
    # the log says the load's CPU time beside its phases.
    assert re.search(
        r"resumed from memory: step 10 .* \(the load \d+\.\d\d s on the CPU\), read ahead beside "
        r"the build in \d",
        out,
    ), summary["_output"]
    assert (
        "resumed from memory: step 18 on every rank (step 18 from memory on every rank, 1 rank(s) from the "
        "replica a peer keeps)" in out
    ), summary["_output"]
    saved = read_events(run_dir, "memory_checkpoint")
    assert {r["step"] for r in saved} >= {2, 6, 10, 14, 18} and not {r["step"] for r in saved} & {4, 8, 12, 16}
    assert all(r["error"] is None and r["bytes"] > 0 for r in saved)
    replicated = read_events(run_dir, "memory_replica")  # rank 0's, each with the time its send took
    assert replicated and all(r["to"] == 1 and r["bytes"] > 0 and r["send_s"] > 0 for r in replicated)
    assert {r["step"] for r in replicated} <= {r["step"] for r in saved}
    assert not job_folder(job_of(run_dir)).exists()


def test_a_rank_killed_between_its_replicas_record_and_bytes_restarts_from_memory_bitwise(
    tmp_path, reference_1x2, request
):
    """sigkill-during-replication@10: rank 0's sender has sent the record of its step 10 replica to
    pod 1 and is about to send the bytes when rank 0 is killed. The send never completes (no
    replica event for step 10); every rank still holds its own snapshot of step 10, so the in-job
    restart resumes from memory there, and the job ends bitwise equal. The image's NVRx lane."""
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["sigkill-during-replication@10:rank=0"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1"],
        timeout=300,
        **lane_run(request, "image"),
    )
    (killed,) = summary["recoveries"]
    assert killed["layer"] == "in_job" and killed["during_replication"] is True, killed
    assert killed["replica_step"] == 10 and killed["resumed_from_step"] == 10, killed
    assert "resumed from memory: step 10 on every rank" in summary["_stdout"], summary["_output"]
    sent = {r["step"] for r in read_events(run_dir, "memory_replica") if r.get("error") is None}
    assert {2, 6, 14} <= sent and 10 not in sent, sent  # the durable saves' steps take no memory snapshot
    assert not job_folder(job_of(run_dir)).exists()


def test_a_rank_killed_inside_its_restore_from_memory_restores_the_same_snapshot_again(
    tmp_path, reference_1x2, request
):
    """sigkill-during-restore@6:rank=1 is armed at step 6; exception@12:rank=0 makes the in-job
    restart that restores every rank from memory at step 10, and rank 1 is killed inside that
    restore, its snapshot chosen, the live state not yet loaded. The next in-job restart restores
    the same snapshots (a restore only reads them) and the job ends bitwise equal. The attempt cut
    short never trained: one restart closes both faults, and only it counts as a restart."""
    run_dir = tmp_path / "run"
    # Listed as they fire (summary.json's order): the armed fault fires after the exception.
    summary = run_with_faults(
        run_dir,
        ["exception@12:rank=0", "sigkill-during-restore@6:rank=1"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1"],
        timeout=300,
        **lane_run(request, "image"),
    )
    by_kind = {r["kind"]: r for r in summary["recoveries"]}
    restore, exception = by_kind["sigkill-during-restore"], by_kind["exception"]
    assert restore["during_restore"] is True and restore["rank"] == 1, restore
    assert (restore["restore_tier"], restore["restore_step"], restore["resumed_from_step"]) == ("memory", 10, 10)
    assert exception["resumed_from_step"] == 10 and exception["lost_steps"] == 1, exception
    assert restore["attempt"] == exception["attempt"] and restore["layer"] == exception["layer"] == "in_job"
    assert summary["restarts"]["in_job"] == 1, summary["restarts"]
    assert "resumed from memory: step 10 on every rank" in summary["_stdout"], summary["_output"]
    assert not job_folder(job_of(run_dir)).exists()


def test_a_corrupt_snapshot_falls_back_to_the_durable_checkpoint_and_the_run_stays_exact(tmp_path):
    """A world of one, killed after step 11, its snapshot of step 10 flipped: set aside when the
    start reports, and the older snapshot (step 6) is older than the durable checkpoint of step 8
    (sync saves: committed before step 9 runs), so the run resumes from step 8."""
    common = [
        "train.steps=16",
        "checkpoint.interval_steps=4",
        "checkpoint.mode=sync",
        *MEMORY,
        "checkpoint.job_id=memory-fallback",
    ]
    reference = run_trainer(tmp_path / "reference", ["train.steps=16", "checkpoint.interval_steps=4"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    killed = run_trainer(run_dir, [*common, "resilience.inject=[sigkill@12]"])
    assert killed.returncode == -9, killed.stderr[-3000:]
    slots = slots_of(run_dir, "memory-fallback")
    try:
        (record,) = [
            json.loads(p.read_text()) for p in slots.glob("slot-*.json") if json.loads(p.read_text())["step"] == 10
        ]
        data = slots / f"slot-{record['slot']}.bin"
        flipped = bytearray(data.read_bytes())
        flipped[record["spans"][0][0]] ^= 0x10
        data.write_bytes(bytes(flipped))
        durable = [r["step"] for r in read_events(run_dir, "checkpoint")][-1]
        assert durable == 8
        resumed = run_trainer(run_dir, common)
        out = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, out[-3000:]
        assert f"slot-{record['slot']}.bin: tensor 0 fails its CRC32C (step 10); set aside" in out, out[-3000:]
        assert "memory checkpoints not used: memory holds only steps older than the durable checkpoint's (8)" in out
        assert "resumed from step 8 (" in out and "resumed from memory" not in out
        summary = read_summary(run_dir)
        assert summary["resumed_from_step"] == durable
        assert summary["params_sha256"] == read_summary(tmp_path / "reference")["params_sha256"]
        assert read_losses(run_dir) == read_losses(tmp_path / "reference")
        assert not job_folder("memory-fallback").exists()
    finally:
        remove_job(SHM, "memory-fallback")


def test_a_new_run_with_the_same_job_id_never_loads_the_snapshots_an_earlier_run_left_in_memory(tmp_path):
    """A workstation's fixed ``checkpoint.job_id``: a run with seed 1 is killed after step 11,
    leaving its snapshot of step 10 in /dev/shm. A new run of another seed, with the same job id
    in a new run directory, must train from its own start: its parameters and every loss equal
    the same run's on a clean /dev/shm, and the killed run's slots stay where they were for it."""
    job = f"memory-same-name-{tmp_path.name[-12:]}"
    common = ["train.steps=16", "checkpoint.interval_steps=8", *MEMORY, f"checkpoint.job_id={job}"]
    try:
        killed = run_trainer(tmp_path / "seed-1", [*common, "seed=1", "resilience.inject=[sigkill@12]"])
        assert killed.returncode == -9, killed.stderr[-3000:]
        earlier = slots_of(tmp_path / "seed-1", job)
        assert {json.loads(p.read_text())["step"] for p in earlier.glob("slot-*.json")} == {6, 10}
        second = run_trainer(tmp_path / "seed-2", [*common, "seed=2"])
        out = second.stdout + second.stderr
        assert second.returncode == 0, out[-3000:]
        assert "resumed from" not in out, out[-3000:]
        assert read_run_identity(tmp_path / "seed-2" / "checkpoints") != read_run_identity(
            tmp_path / "seed-1" / "checkpoints"
        )
        assert {json.loads(p.read_text())["step"] for p in earlier.glob("slot-*.json")} == {6, 10}
        # The killed run's own restart still finds its snapshot of step 10.
        resumed = run_trainer(tmp_path / "seed-1", [*common, "seed=1"])
        assert resumed.returncode == 0 and "resumed from memory: step 10" in resumed.stdout + resumed.stderr
        remove_job(SHM, job)
        clean = run_trainer(tmp_path / "clean", [*common, "seed=2"])
        assert clean.returncode == 0, clean.stderr[-3000:]
        assert read_summary(tmp_path / "seed-2")["params_sha256"] == read_summary(tmp_path / "clean")["params_sha256"]
        assert read_losses(tmp_path / "seed-2") == read_losses(tmp_path / "clean")
    finally:
        remove_job(SHM, job)


def test_a_corrupt_slot_comes_back_from_its_replica_and_a_corrupt_replica_from_the_durable_checkpoint(
    tmp_path, reference_1x2, request
):
    """Two pods of one rank on the image's NVRx lane, replicas on. After step 11, a bit of rank 0's
    snapshot of step 10 flips (its replica already on pod 1) and rank 0 is killed: the start sets
    the slot aside and restores rank 0 from the replica pod 1 keeps, rank 1 from its own slot.
    Before step 19 the replica of rank 0's step 18 flips on pod 1, and after step 19 rank 0's own
    snapshot of step 18 flips and rank 0 is killed: the replica moved back fails its checksum at
    the load, and every rank resumes from the durable checkpoint of step 16 (saved synchronously, so it is
    committed whatever the machine's speed)."""
    run_dir = tmp_path / "run"
    faults = [
        "memory-corrupt@12:rank=0",
        "sigkill@12:rank=0",
        "replica-corrupt@19:rank=1",
        "memory-corrupt@20:rank=0",
        "sigkill@20:rank=0",
    ]
    summary = run_with_faults(
        run_dir,
        faults,
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1", "checkpoint.mode=sync"],
        timeout=400,
        **lane_run(request, "image"),
    )
    from_replica, from_durable = summary["recoveries"]
    out = summary["_stdout"] + summary["_output"]
    assert (from_replica["resumed_from_step"], from_replica["lost_steps"]) == (10, 1), from_replica
    assert "rank-0/slot-" in out and "fails its CRC32C (step 10)" in out and ".invalid" in out, out[-4000:]
    assert (
        "resumed from memory: step 10 on every rank (step 10 from memory on every rank, 1 rank(s) from the "
        "replica a peer keeps)" in out
    ), out[-4000:]
    assert (from_durable["resumed_from_step"], from_durable["lost_steps"]) == (16, 3), from_durable
    assert "memory checkpoint of step 18 not loaded" in out and "resuming from the durable checkpoint" in out
    assert "resumed from memory: step 18" not in out
    assert not job_folder(job_of(run_dir)).exists()
