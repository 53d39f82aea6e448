"""Hot spares (the chart's ``spares``) in a real local job on the image's NVRx: a lost pod's place
is taken by a standby pod inside an in-job restart, at the same world size, bitwise equal to the
job without a fault; the lost pod's replacement joins as the next spare.

NVRx 0.6 and newer train at ``--nnodes``' first number and keep the other pods standby (the first
pods to join round 0 train: which of pods 1 and 2 that is depends on who arrives first, so the
fault names rank 1, whose pod it kills, not a pod index). Pods are network namespaces (root)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.checkpoint.test_memory_tier import MEMORY
from tests.resilience.fault_jobs import lane_run, run_with_faults
from tests.support import netns_required, read_events


def test_a_lost_pods_rank_goes_to_the_hot_spare_within_an_in_job_restart_and_its_replacement_stands_by(
    tmp_path, request, reference_1x2
):
    """Two training pods of one rank and one spare; memory snapshots every 2 steps with replicas.
    The pod of rank 1 is lost after step 7; its replacement takes 3 s to start (a new node). The
    spare takes rank 1 in the in-job restart (not the job level: no pod had to be recreated for the
    job to go on), restores it from the replica pod 0 keeps, and the replacement stands by until the
    job ends."""
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["node-loss@8:rank=1"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1"],
        extra=["--value=spares=1", "--replacement-delay=3"],
        timeout=400,
        **lane_run(request, "image"),
    )
    out = summary["_stdout"]
    (lost,) = summary["recoveries"]
    assert lost["layer"] == "in_job", summary["_output"]
    assert summary["restarts"]["job"] == 0 and summary["restarts"]["in_job"] == 1
    assert lost["lost_steps"] <= 3, lost  # from memory: the replica of step 6
    assert "1 rank(s) from the replica a peer keeps" in out, summary["_output"]
    # The same world before and after: two ranks, never three.
    assert summary["world_size"] == 2
    assert {r.get("world_size") for r in read_events(run_dir, "start")} == {2}
    # The pod that was lost is the one whose replacement started late and stood by.
    (done,) = [json.loads(p.read_text()) for p in (run_dir / "faults" / "requests").glob("*.done")]
    assert done["kind"] == "node-loss" and done["node"] in (1, 2)
    lost_pod = f"resilient-fsdp-worker-{done['node'] - 1}"  # the Master is pod 0, Worker i is pod i + 1
    assert f"{lost_pod}'s replacement starts in 3 s (--replacement-delay)" in out
    replacement_log = (run_dir / "logs" / f"node{done['node']}.log").read_text()
    before, _, after = replacement_log.rpartition("[resilient-fsdp agent] node ")
    assert "stood by as a hot spare until the job ended" in after, after[-3000:]
    spare = 3 - done["node"]  # the pod that was standby at the start: pod 1 or pod 2
    assert "[resilient-fsdp agent] this pod stood by" not in (run_dir / "logs" / f"node{spare}.log").read_text()


@pytest.mark.extended  # a minute of the CI tier's margin; the spare takeover above stays in that tier
def test_more_live_agents_than_max_nodes_stand_by_and_the_job_trains_on(tmp_path, request):
    """NVRx 0.6.0 closed the rendezvous for good when more agents were alive than ``--nnodes``' maximum
    (NVRx#348), which two incarnations of one pod would make. On the image's NVRx the surplus agent
    stands by: a job rendered for 2 pods (``--nnodes=2``), run with a third pod of the same spec,
    trains at a world of 2 and every pod ends with 0."""
    import argparse

    import yaml

    from resilient_fsdp.local.job import add_arguments, prepare
    from tests.support import FAST, assert_no_leftovers, read_summary, run_guarded

    netns_required()
    run_dir = tmp_path / "run"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sets = [a for o in [*FAST, "train.steps=12", "checkpoint.interval_steps=4"] for a in ("--set", o)]
    prepare(parser.parse_args(["--run-dir", str(run_dir), "--nodes=2", "--nproc-per-node=1", *sets]))
    documents = list(yaml.safe_load_all((run_dir / "cluster" / "manifests.yaml").read_text()))
    job = next(d for d in documents if d and d["kind"] == "PyTorchJob")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2  # a Master and 2 Workers: 3 agents, max 2
    surplus = tmp_path / "surplus.yaml"
    surplus.write_text(yaml.safe_dump_all([d for d in documents if d]))
    proc = run_guarded(
        [sys.executable, "-m", "resilient_fsdp.cli", "local", f"--manifests={surplus}", f"--run-dir={run_dir}"],
        run_dir,
        lane_run(request, "image")["pythonpath"],
        300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "job finished: every pod exited 0" in proc.stdout
    summary = read_summary(run_dir)
    assert summary["final_step"] == 12 and summary["world_size"] == 2
    stood_by = [
        i
        for i in range(3)
        if "stood by as a hot spare until the job ended" in (run_dir / "logs" / f"node{i}.log").read_text()
    ]
    assert len(stood_by) == 1 and stood_by != [0], stood_by  # pod 0 hosts the store and always trains
    assert_no_leftovers(run_dir)
