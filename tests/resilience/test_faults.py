"""Every fault kind, injected into a real job (gloo, ``resilient-fsdp local``): the job recovers by
the layer meant for it and ends bitwise equal to the same job without faults. One pod of 2 ranks,
whose agent hosts the rendezvous store, on the pinned NVRx (0.4.1) and on each lane (the image's
0.7 in CI), in-process restart off and on; 2 pods x 2 ranks in the extended tier. Rank 0 (which commits checkpoints and
writes the summary) and node 0 are targets like any other. Node-level faults are executed by the
local cluster; several pods under 0.7 with node faults on the store host are
tests/local/test_four_faults_in_one_job.py."""

from __future__ import annotations

import json

import pytest

from tests.resilience.fault_jobs import (
    COMMON,
    IMAGE_NVRX,
    IN_PROCESS,
    check_landed_mid_write,
    check_recoveries,
    lane_run,
    run_with_faults,
)
from tests.support import LANES, assert_no_leftovers, netns_required, read_events, run_local

# Faults that need their own job: their recovery is asserted in detail below.
CASES = [
    # fault, the layer expected to recover it, pods (of 2 ranks)
    pytest.param("sigkill-during-save@10:rank=0", "in_job", 2, marks=pytest.mark.extended),
    # A graceful stop on the pinned lane (the image's: the one-pod tests below); one pod, whose
    # agent is the store host, so the whole job stops and restarts.
    ("sigterm@10:node=0", "job", 1),
    # node-loss@10:node=0: tests/local/test_jobset.py, as a PyTorchJob and as a JobSet.
]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("spec,layer,nodes", CASES, ids=["sigkill-during-save", "sigterm"])
def test_fault_is_recovered_bitwise(tmp_path, request, spec, layer, nodes):
    run_dir = tmp_path / "run"
    reference = request.getfixturevalue("reference_2x2" if nodes == 2 else "reference_1x2")
    summary = run_with_faults(run_dir, [spec], reference, nodes=nodes, timeout=300)
    (recovery,) = summary["recoveries"]
    assert recovery["layer"] == layer, summary["_output"]
    assert summary["restarts"][layer] >= 1
    assert recovery["recovery_s"] > 0
    if spec.startswith("sigterm"):
        # Graceful stop: the ranks stop at the first step whose loss all-reduce carries the request
        # (the fault's step, or a later one when the node's signal reaches a rank after that
        # all-reduce on a loaded machine); that step was checkpointed, so nothing was trained twice.
        (stop,) = read_events(run_dir, "stop")
        assert stop["step"] > recovery["fault_step"], stop
        assert recovery["lost_steps"] == 0 and recovery["resumed_from_step"] == stop["step"], (stop, recovery)
    else:  # sigkill-during-save
        # Rank 0 and its writer were killed while step 12's checkpoint was being written: it never
        # committed, the job resumed from step 8, and the restarted job swept the torn one.
        assert recovery["fault_step"] == 12 and recovery["resumed_from_step"] == 8
        assert recovery["lost_steps"] == 4
        check_landed_mid_write(recovery)
        assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_00000012.incomplete")]
        (swept,) = [e for e in read_events(run_dir, "checkpoint_swept") if "step_00000012.incomplete" in e["path"]]
        assert swept["kind"] == "incomplete" and swept["bytes"] >= recovery["bytes_on_disk"] > 0, swept


def test_a_kill_inside_rank_0s_commit_lands_there_and_the_torn_checkpoint_is_never_loaded(
    tmp_path, request, reference_1x2
):
    """sigkill-during-commit@10, two pods of one rank, checkpoints every 4 steps: the commit of step
    12 stops once DCP's metadata is written, and its marker names the process committing it (rank
    0's commit process between steps, or rank 0 itself when the save of step 16 finds the write
    still pending and commits on the training thread, as a loaded machine makes it); that process
    and rank 0 are killed there. The step 12 checkpoint never got its manifest: the in-job restart
    resumes from step 8 and sweeps it. The image's NVRx lane."""
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["sigkill-during-commit@10:rank=0"],
        reference_1x2,
        nodes=2,
        nproc=1,
        timeout=300,
        **lane_run(request, "image"),
    )
    check_recoveries(summary, ["in_job"])
    (killed,) = summary["recoveries"]
    assert killed["during_commit"] is True and killed["checkpoint_step"] == 12, killed
    assert killed["commit_in_own_process"] is (killed["commit_pid"] != killed["pid"]), killed
    assert killed["resumed_from_step"] == 8 and 12 <= killed["fault_step"] <= 15, killed
    (swept,) = [e for e in read_events(run_dir, "checkpoint_swept") if "step_00000012.incomplete" in e["path"]]
    assert swept["kind"] == "incomplete" and swept["bytes"] > 0, swept


def test_a_commit_fault_names_rank_0_the_only_rank_that_commits():
    from resilient_fsdp.config import ConfigError, parse_fault

    assert parse_fault("sigkill-during-commit@8").rank == 0
    for text in ("sigkill-during-commit@8:rank=1", "sigkill-during-commit@8:node=0"):
        with pytest.raises(ConfigError, match="only rank 0 commits checkpoints; give rank=0"):
            parse_fault(text)


# must be recovered by the layer named, and the job must still end bitwise equal.
MULTI = [
    # faults, extra overrides, the layer expected for each fault
    pytest.param(
        ["exception@6:rank=0", "hang@12:rank=0", "sigkill@18:rank=0"],
        [],
        ["in_job", "in_job", "in_job"],
        marks=pytest.mark.extended,
    ),
    # In-process restart on: a process-killing fault in between goes to the in-job restart, which
    # respawns every rank (new processes, whose nodes' restart counts differ), and the next fault
    # is again recovered in-process; rank 1's peers block inside the loss all-reduce.
    pytest.param(
        ["exception@6:rank=0", "sigkill@12:rank=2", "hang@18:rank=0", "hang-in-collective@22:rank=1"],
        IN_PROCESS,
        ["in_process", "in_job", "in_process", "in_process"],
        marks=pytest.mark.extended,
    ),
]


@pytest.mark.timeout(460)
@pytest.mark.parametrize("specs,extra,layers", MULTI, ids=["default", "in_process"])
def test_faults_in_one_job_are_each_recovered_by_their_layer(tmp_path, reference_2x2, specs, extra, layers):
    summary = run_with_faults(tmp_path / "run", specs, reference_2x2, overrides=extra)
    check_recoveries(summary, layers)


@pytest.mark.extended
@pytest.mark.timeout(460)
def test_new_kinds_in_one_job_with_node_faults_executed_by_the_cluster(tmp_path, reference_2x2):
    """node-loss, partition, sigkill-during-save and hang-in-collective in one job; the ranks ask the
    local cluster (RESILIENT_FSDP_FAULT_REQUESTS, set in every pod) for the node-level faults."""
    netns_required()
    run_dir = tmp_path / "run"
    specs = [
        "node-loss@6:node=1",
        "partition@8:node=0:for=0.5",
        "sigkill-during-save@13:rank=3",
        "hang-in-collective@19:rank=2",
    ]
    summary = run_with_faults(run_dir, specs, reference_2x2)
    requests = run_dir / "faults" / "requests"
    assert sorted(p.name for p in requests.iterdir()) == ["node-loss-step6-node1.done", "partition-step8-node0.done"]
    for path in requests.iterdir():
        request = json.loads(path.read_text())
        node = 1 if path.name.startswith("node-loss") else 0
        assert set(request) == {"kind", "node", "step", "for_s", "rank", "time"}
        assert request["node"] == node and request["rank"] % 2 == 0  # the node's local rank 0
        assert request["for_s"] == (0.5 if node == 0 else None)
    assert "fault node-loss at step 6: node1 (resilient-fsdp-worker-0) lost" in summary["_stdout"]
    check_recoveries(summary, ["job", "in_job", "in_job"])
    node_loss, during_save, hang = summary["recoveries"]
    assert node_loss["request"].endswith("node-loss-step6-node1.json")
    check_landed_mid_write(during_save)
    assert hang["kind"] == "hang-in-collective"
    # Half a second without a link: TCP retransmits through it, no restart follows.
    (partition,) = summary["unrecovered"]
    assert partition["fault"] == "partition@8:node=0:for=0.5" and "training went on" in partition["why"]


def test_a_partition_is_refused_before_any_process_starts_where_nothing_executes_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=1,
        overrides=COMMON,
        extra=["--inject=partition@3:node=1:for=5"],
        isolation="loopback",
        timeout=60,
    )
    assert proc.returncode == 2
    assert "partition faults need --isolation netns" in proc.stderr
    assert not (run_dir / "logs").exists()
    assert_no_leftovers(run_dir)


@pytest.mark.extended
def test_too_many_faults_fail_with_the_last_fault_named(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=2,
        overrides=COMMON,
        extra=["--inject=sigkill@10:rank=3", "--max-restarts=0", "--max-pod-recreations=0"],
        timeout=240,
    )
    assert proc.returncode != 0
    report = proc.stdout.split("job FAILED", 1)[1]
    assert "last fault: sigkill@10:rank=3 (injected after step 9)" in report
    assert "resilience.launcher.max_restarts" in report and "--max-pod-recreations" in report
    assert not (run_dir / "summary.json").exists()
    # The newest checkpoint is intact: committed, with its manifest, and the newest the job logged
    # as committed (step 8's write may still be in flight at step 10; then it is step 4's).
    committed = sorted(
        p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_") and "." not in p.name
    )
    logged = max(e["step"] for e in read_events(run_dir, "checkpoint"))
    assert logged in (4, 8) and committed[-1].name == f"step_{logged:08d}"
    assert json.loads((committed[-1] / "COMPLETE").read_text())["step"] == logged
    assert_no_leftovers(run_dir)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("lane", LANES)
def test_every_kind_in_one_pod_is_recovered_by_in_job_restart(tmp_path, request, lane, reference_1x2):
    # sigterm: 0.7's checkpoint worker installs its own SIGTERM handler (async_ckpt/core.py) that
    # exits 143; the trainer starts it with SIGTERM blocked, so the SIGTERM ft_launcher sends a
    # stopping node's ranks reaches the trainer only, and the graceful stop's checkpoint commits.
    specs = [
        "exception@3:rank=0",
        "hang@7:rank=1",
        "hang-in-collective@11:rank=0",
        "sigkill-during-save@13:rank=1",
        "sigterm@18:node=0",
    ]
    # 0.7 counts --max-restarts as rounds of the whole job (its _handle_restart_decision), not per
    # node: four in-job restarts need four.
    summary = run_with_faults(
        tmp_path / "run",
        specs,
        reference_1x2,
        nodes=1,
        extra=["--max-restarts=4"],
        timeout=600,
        **lane_run(request, lane),
    )
    check_recoveries(summary, ["in_job"] * 4 + ["job"])
    check_landed_mid_write(summary["recoveries"][3])
    # Every rank of every attempt was forked from the pod's pre-warmed server (on by default).
    pod_log = (tmp_path / "run" / "logs" / "node0.log").read_text()
    assert pod_log.count("pre-warmed server ready") == 2, pod_log[-3000:]  # one per ft_launcher run
    assert "imports its own" not in pod_log and "imports its own" not in summary["_output"], pod_log[-3000:]


@pytest.mark.timeout(660)
@pytest.mark.parametrize("lane", LANES)
def test_every_kind_in_one_pod_is_recovered_by_in_process_restart(tmp_path, request, lane, reference_1x2):
    # nan-loss: a suspected bad GPU skips in-process restart (same processes, same CUDA state) for
    # the in-job one, once; the loss curve after it is the fault-free one.
    specs = [
        "exception@3:rank=0",
        "hang@6:rank=1",
        "nan-loss@8:rank=1",
        "hang-in-collective@10:rank=0",
        "sigkill@13:rank=1",
        "node-loss@18:node=0",
    ]
    summary = run_with_faults(
        tmp_path / "run", specs, reference_1x2, nodes=1, overrides=IN_PROCESS, timeout=600, **lane_run(request, lane)
    )
    check_recoveries(summary, ["in_process", "in_process", "in_job", "in_process", "in_job", "job"])
    (nan,) = summary["non_finite_losses"]
    assert (nan["step"], nan["outcome"], [(r["rank"], r["node"]) for r in nan["ranks"]]) == (8, "restart", [(1, 0)])
    # The in-process layer's variables do not keep its ranks from being forked pre-warmed.
    pod_log = (tmp_path / "run" / "logs" / "node0.log").read_text()
    assert "imports its own" not in pod_log and "imports its own" not in summary["_output"], pod_log[-3000:]


@pytest.mark.extended
@pytest.mark.timeout(240)
def test_two_loopback_pods_under_the_image_nvrx(tmp_path, nvrx07_lane):
    """Without namespaces too: 0.7 refuses two agents with one node address, and a loopback
    endpoint makes every agent try to host the store; distinct 127.0.0.x addresses and is_host
    per pod (the loopback deviations) make it work."""
    run_dir = tmp_path / "run"
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=1,
        overrides=["train.steps=4"],
        pythonpath=[nvrx07_lane],
        isolation="loopback",
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"NVRx {IMAGE_NVRX}" in proc.stdout
    assert_no_leftovers(run_dir)
