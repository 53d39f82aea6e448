"""The memory tier in real training runs (gloo on CPU): a killed rank's in-job restart restores
every rank from its ``/dev/shm`` snapshot, a snapshot that fails its checks falls back to the
durable checkpoint, each ending bitwise equal to the run without a fault, and nothing is left in
``/dev/shm`` once the job ends."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from resilient_fsdp.checkpoint.memory.slots import job_root
from tests.resilience.fault_jobs import run_with_faults
from tests.support import read_events, read_losses, read_summary, run_trainer

SHM = Path("/dev/shm")
MEMORY = ["checkpoint.memory.interval_steps=2"]


def job_of(run_dir: Path) -> str:
    manifest = json.loads(next((run_dir / "checkpoints").glob("step_*/COMPLETE")).read_text())
    return manifest["job"]


def test_a_killed_rank_0_restores_from_its_own_memory_and_a_lost_pod_0_from_its_peers_replica_bitwise(
        tmp_path, reference_1x2):
    """Two pods of one rank, durable checkpoints every 4 steps, memory ones every 2, replicas on.
    Rank 0 killed after step 11: the in-job restart restores every rank from its own slot (step
    10: one step lost, not three). Pod 0, the store host, lost after step 19: its replacement comes
    back with an empty /dev/shm, and its rank's snapshot of step 18 comes back from pod 1, which
    kept its replica."""
    run_dir = tmp_path / "run"
    summary = run_with_faults(run_dir, ["sigkill@12:rank=0", "node-loss@20:node=0"], reference_1x2, nodes=2, nproc=1,
                              overrides=[*MEMORY, "checkpoint.memory.replicas=1"], timeout=400)
    killed, lost = summary["recoveries"]
    assert (killed["resumed_from_step"], killed["lost_steps"]) == (10, 1), killed
    assert (lost["resumed_from_step"], lost["lost_steps"]) == (18, 1), lost
    out = summary["_stdout"]
    assert "resumed from memory: step 10 on every rank (step 10 from memory on every rank)" in out, summary["_output"]
    assert "resumed from memory: step 18 on every rank (step 18 from memory on every rank, 1 rank(s) from the " \
           "replica a peer keeps)" in out, summary["_output"]
    saved = read_events(run_dir, "memory_checkpoint")
    assert {r["step"] for r in saved} >= {2, 6, 10, 14, 18} and not {r["step"] for r in saved} & {4, 8, 12, 16}
    assert all(r["error"] is None and r["bytes"] > 0 for r in saved)
    assert not job_root(SHM, job_of(run_dir)).exists()


def test_a_corrupt_snapshot_falls_back_to_the_durable_checkpoint_and_the_run_stays_exact(tmp_path):
    common = ["train.steps=16", "checkpoint.interval_steps=4", *MEMORY, "checkpoint.job_id=memory-fallback"]
    reference = run_trainer(tmp_path / "reference", ["train.steps=16", "checkpoint.interval_steps=4"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    killed = run_trainer(run_dir, [*common, "resilience.inject=[sigkill@12]"])
    assert killed.returncode == -9, killed.stderr[-3000:]
    slots = job_root(SHM, "memory-fallback") / "rank-0"
    try:
        (record,) = [json.loads(p.read_text()) for p in slots.glob("slot-*.json") if json.loads(p.read_text())["step"] == 10]
        data = slots / f"slot-{record['slot']}.bin"
        flipped = bytearray(data.read_bytes())
        flipped[record["spans"][0][0]] ^= 0x10
        data.write_bytes(bytes(flipped))
        # The newest durable checkpoint the killed run committed (step 8's write may not have
        # committed by step 11 on a busy machine: then step 4).
        durable = [r["step"] for r in read_events(run_dir, "checkpoint")][-1]
        resumed = run_trainer(run_dir, common)
        out = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, out[-3000:]
        assert "memory checkpoint of step 10 not loaded" in out and "fails its CRC32C" in out, out[-3000:]
        assert f"resumed from step {durable} (" in out and "resumed from memory" not in out
        summary = read_summary(run_dir)
        assert summary["resumed_from_step"] == durable
        assert summary["params_sha256"] == read_summary(tmp_path / "reference")["params_sha256"]
        assert read_losses(run_dir) == read_losses(tmp_path / "reference")
        assert not job_root(SHM, "memory-fallback").exists()
    finally:
        shutil.rmtree(job_root(SHM, "memory-fallback"), ignore_errors=True)

