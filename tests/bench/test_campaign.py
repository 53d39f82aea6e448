"""``resilient-fsdp bench campaign`` at CI size: one 4-pod JobSet (network-namespace pods, the
image's NVRx 0.7) through a kill during a save, a 20 s partition of pod 1, the store host's loss
(pod 0's agent) twice, a hang inside a collective, a rewind, a shrink to 2 pods, a kill of rank 0
and a regrow, with ``checkpoint.keep_last=2`` and the S3 tier on (a moto server on loopback, which
the pods reach through the local cluster's relay); ``nan-loss`` takes its slot where the kind exists.

The campaign runs once (the module's fixture); each of its checks is a test of its own, so one
failing check leaves the others reported. It replaces, in the CI tier, the 4-pod JobSet with two
store-host losses and the four-faults job (tests/local/test_four_faults_in_one_job.py) on 0.7,
both in the ``extended`` tier (docs/tests.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from resilient_fsdp.bench.campaign import CHECKS
from tests.support import netns_required, run_guarded

STEPS, INTERVAL, EVERY = 44, 4, 8
KINDS = (
    "sigkill-during-save:rank=1,partition:node=1:for=20,node-loss:node=0,hang-in-collective:rank=2,"
    "sigkill:rank=0,nan-loss:rank=0,node-loss:node=0"
)
# What the CI schedule must inject: every kind it lists.
EXPECTED_KINDS = {"sigkill-during-save", "partition", "node-loss", "hang-in-collective", "sigkill", "nan-loss"}


def run_campaign(root: Path, lane: Path, arguments: list[str], timeout: float) -> dict:
    """``bench campaign`` in ``root`` on the image's NVRx lane: its results, stdout and every
    launch's output. On a timeout every process of the campaign (marked with root) is killed,
    then the test fails."""
    out = root / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "bench",
        "campaign",
        f"--run-dir={root / 'run'}",
        "--isolation=netns",
        f"--out={out}",
        *arguments,
    ]
    proc = run_guarded(cmd, root, [lane], timeout=timeout)
    assert out.exists(), proc.stdout[-6000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    results["_stdout"] = proc.stdout
    results["_log"] = (root / "run" / "bench.log").read_text()
    return results


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, nvrx07_lane):
    netns_required()
    return run_campaign(
        tmp_path_factory.mktemp("campaign"),
        nvrx07_lane,
        [
            f"--steps={STEPS}",
            f"--interval-steps={INTERVAL}",
            f"--fault-every-steps={EVERY}",
            f"--kinds={KINDS}",
            "--leg-timeout-s=400",
        ],
        timeout=1500,
    )


@pytest.mark.timeout(1600)
def test_the_ci_campaign_runs_its_schedule(campaign):
    fired = {f["kind"] for leg in campaign["legs"] for f in leg["faults"] if not f["skipped"]}
    assert EXPECTED_KINDS <= fired, fired
    assert [leg["leg"] for leg in campaign["legs"]] == ["main", "rewind", "shrink", "regrow"], campaign["legs"]
    assert [leg["pods"] for leg in campaign["legs"]] == [4, 4, 2, 4]
    assert campaign["skipped"] == [], campaign["skipped"]  # netns pods run every kind of the schedule
    assert "where the time went" in campaign["_stdout"] and 0 < campaign["time"]["goodput"] < 1


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("check", list(CHECKS))
def test_the_ci_campaign_check_holds(campaign, check):
    result = campaign["checks"][check]
    assert result["ok"] is True, f"{check} ({CHECKS[check]}): {json.dumps(result['detail'])[:3000]}"


@pytest.mark.timeout(1600)
def test_the_ci_campaign_uploads_through_the_pods_relay(campaign):
    """Netns pods reach the loopback S3 server through the local cluster's relay, said at each
    launch: the bucket held checkpoints while the legs ran."""
    assert campaign["s3"] is True and campaign["peaks"]["bucket_bytes"] > 0, campaign["peaks"]
    assert "is this machine's loopback: each pod reaches it" in campaign["_log"]


# ---- every feature on at once ----------------------------------------------------------------------

# In-process restart, the memory tier with replicas, a hot spare, HSDP in groups of 2 and the S3
# tier, through kinds that each take another layer, repeated on rank 0 and on pod 0 (the store host).
EVERYTHING = ["--in-process", "--memory-interval-steps=2", "--memory-replicas=1", "--spares=1", "--shard-group-size=2"]
EVERYTHING_KINDS = (
    "exception:rank=0,sigkill-during-save:rank=1,hang:rank=2,node-loss:node=0,exception:rank=0,"
    "sigkill-during-commit:rank=0,memory-corrupt:rank=3,sigkill:rank=0,sigkill-during-restore:rank=1,"
    "hang-in-collective:rank=1,sigkill-during-replication:rank=2,writer-raise:rank=2,"
    "node-loss:node=0,exception:rank=3,nan-loss:rank=1"
)
# Pods x ranks: one rank a pod, and two (the replicas then go to the other pod's rank).
LAYOUTS = {"4x1": [], "2x2": ["--nodes=2", "--nproc-per-node=2"]}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def everything(request, tmp_path_factory, nvrx07_lane):
    netns_required()
    return run_campaign(
        tmp_path_factory.mktemp(f"campaign-everything-{request.param}"),
        nvrx07_lane,
        [
            "--steps=64",
            f"--interval-steps={INTERVAL}",
            "--fault-every-steps=6",
            f"--kinds={EVERYTHING_KINDS}",
            "--leg-timeout-s=600",
            *EVERYTHING,
            *LAYOUTS[request.param],
        ],
        timeout=2400,
    )


@pytest.mark.extended
@pytest.mark.timeout(2500)
@pytest.mark.parametrize("check", list(CHECKS))
def test_with_every_feature_on_the_campaign_check_holds(everything, check):
    result = everything["checks"][check]
    assert result["ok"] is True, f"{check} ({CHECKS[check]}): {json.dumps(result['detail'])[:3000]}"


@pytest.mark.extended
@pytest.mark.timeout(2500)
def test_with_every_feature_on_each_layer_recovers_and_every_fault_is_measured_after(everything):
    assert everything["spares"] == 1 and "dist.shard_group_size=2" in everything["features"]
    layers = {r["layer"] for r in everything["recoveries"]}
    assert {"in_process", "in_job", "job"} <= layers, layers
    assert len(everything["after_each_fault"]) >= len(everything["recoveries"]) - 1  # the last may end its leg
    assert all(leg["budgets"]["in_job_left"] > 0 for leg in everything["legs"]), everything["legs"]


# ---- the schedule and the checks on synthetic inputs (no processes) -------------------------------


def test_the_schedule_keeps_a_slot_for_a_kind_it_cannot_run_and_says_why():
    from resilient_fsdp.bench import campaign as c

    bounds = c.leg_bounds(44, 4)
    assert bounds == {"main": (0, 16), "rewind": (12, 28), "shrink": (28, 32), "regrow": (32, 44)}
    pods = {"main": 4, "rewind": 4, "shrink": 2, "regrow": 4}
    placed = c.place_faults(bounds, pods, ["partition:node=3:for=5", "sigkill:rank=3"], 8, "loopback")
    specs = [(f.spec, f.skipped is None) for leg in c.LEGS for f in placed[leg]]
    assert specs == [
        ("partition@2:node=3:for=5", False),
        ("sigkill@10:rank=3", True),
        ("partition@14:node=3:for=5", False),
        ("sigkill@22:rank=3", True),
        ("partition@30:node=1:for=5", False),
        ("sigkill@34:rank=3", True),
        ("partition@42:node=3:for=5", False),
    ]
    assert "network-namespace pods" in placed["main"][0].skipped
    with pytest.raises(ValueError, match="--kinds: 'no-such-kind' is not a fault kind; the kinds are"):
        c.place_faults(bounds, pods, ["sigkill:rank=1", "no-such-kind:rank=3"], 8, "netns")
    with pytest.raises(ValueError, match="--steps 12 with --interval-steps 4"):
        c.leg_bounds(12, 4)


def test_a_fault_inside_the_writer_goes_to_the_first_periodic_save_of_its_slot():
    """writer-* faults fire only while their step's checkpoint is written: at a step that is no
    save they would never fire, and the ledger check would (rightly) fail."""
    from resilient_fsdp.bench import campaign as c

    bounds = {"main": (0, 16), "rewind": (12, 28), "shrink": (28, 32), "regrow": (32, 44)}
    placed = c.place_faults(bounds, dict.fromkeys(c.LEGS, 4), ["writer-raise:rank=1"], 8, "netns", save_every=4)
    specs = [(f.spec, f.skipped) for leg in c.LEGS for f in placed[leg]]
    # Main's slot 10 is not the save at 12, the one the rewind resumes from (a failed write there
    # leaves nothing to rewind to), nor the leg's final save at 16; the rewind leg's slot 14 is
    # the save at 16.
    assert specs[:4] == [
        ("writer-raise@4:rank=1", None),
        ("writer-raise@16:rank=1", "no periodic save left in the main leg for a fault inside the writer or the commit"),
        ("writer-raise@16:rank=1", None),
        ("writer-raise@24:rank=1", None),
    ]
    assert all(int(spec.split("@")[1].split(":")[0]) % 4 == 0 for spec, _ in specs)
    shrink = [f for f in placed["shrink"]]
    assert (
        shrink
        and shrink[0].skipped == "no periodic save left in the shrink leg for a fault inside the writer or the commit"
    )


def test_the_rewind_resumes_from_the_older_kept_checkpoint_even_when_a_fault_tore_the_planned_one(tmp_path):
    from resilient_fsdp.bench.campaign import rewind_step
    from resilient_fsdp.checkpoint import store

    root = tmp_path / "checkpoints"
    assert rewind_step(root, 520) is None  # nothing to rewind to
    for step in (442, 520):  # a graceful stop's checkpoint, the leg's last
        partial = root / store.partial_name(step, "ab12")
        partial.mkdir(parents=True)
        store.commit(partial, {"step": step})
    (root / store.partial_name(480, "cd34")).mkdir()  # the planned one, torn by a kill while written
    assert rewind_step(root, 520) == 442
    assert rewind_step(root, 442) is None


def test_ranks_and_nodes_are_retargeted_within_the_legs_world():
    from resilient_fsdp.bench.campaign import retarget

    assert retarget("rank=3", 2) == "rank=1" and retarget("rank=3", 2, ranks_per_pod=2) == "rank=3"
    assert retarget("node=3:for=20", 2, ranks_per_pod=2) == "node=1:for=20"  # pods, not ranks
    assert retarget("rank=3", 1, ranks_per_pod=2) == "rank=1"  # the shrunk leg's one pod of two ranks


def test_a_graceful_stop_after_the_rewinds_checkpoint_is_skipped_in_the_main_leg():
    """A sigterm's stop checkpoints its step: after the save the rewind resumes from, retention
    (keep_last 2) would keep the stop's checkpoint and the leg's last in its place."""
    from resilient_fsdp.bench import campaign as c

    bounds = {"main": (0, 16), "rewind": (12, 28), "shrink": (28, 32), "regrow": (32, 44)}
    placed = c.place_faults(bounds, dict.fromkeys(c.LEGS, 4), ["sigterm:node=0"], 6, "netns")
    main = [(f.spec, f.skipped) for f in placed["main"]]
    assert main[:2] == [("sigterm@2:node=0", None), ("sigterm@8:node=0", None)]
    assert main[2][0] == "sigterm@14:node=0" and "graceful stop after step 12" in main[2][1]
    assert all(f.skipped is None for f in placed["rewind"])  # the rewind leg resumes from nothing older


def test_a_fault_inside_a_restore_keeps_its_slot_only_where_a_later_fault_causes_a_restart():
    from resilient_fsdp.bench import campaign as c

    bounds = {"main": (0, 16), "rewind": (12, 28), "shrink": (28, 32), "regrow": (32, 44)}
    placed = c.place_faults(
        bounds, dict.fromkeys(c.LEGS, 4), ["sigkill-during-restore:rank=1", "sigkill:rank=2"], 6, "netns"
    )
    main = [(f.spec, f.skipped) for f in placed["main"]]
    assert main == [
        ("sigkill-during-restore@2:rank=1", None),
        ("sigkill@8:rank=2", None),
        (
            "sigkill-during-restore@14:rank=1",
            "no later fault in the main leg causes the restart a fault inside a restore needs",
        ),
    ]


def test_a_rewound_step_never_repeats_a_fault_the_ledger_already_holds():
    from resilient_fsdp.bench import campaign as c

    bounds = {"main": (0, 16), "rewind": (12, 28), "shrink": (28, 32), "regrow": (32, 44)}
    placed = c.place_faults(bounds, dict.fromkeys(c.LEGS, 4), ["sigkill:rank=1"], 12, "netns")
    assert [f.spec for f in placed["main"]] == ["sigkill@2:rank=1", "sigkill@14:rank=1"]
    assert [f.spec for f in placed["rewind"]] == ["sigkill@15:rank=1", "sigkill@26:rank=1"]  # 14 is taken: 15


def test_a_restart_after_the_rewind_must_stay_on_the_rewound_line():
    from resilient_fsdp.bench.campaign import rewound_line

    def steps(a, b):
        return [{"event": "step", "step": s} for s in range(a, b)]

    good = [{"event": "start", "resumed_from_step": 12}, *steps(13, 18), {"event": "start", "resumed_from_step": 16}]
    assert rewound_line(good, 12)["ok"]
    old_line = [
        {"event": "start", "resumed_from_step": 12},
        *steps(13, 15),
        {"event": "start", "resumed_from_step": 16},
    ]
    assert not rewound_line(old_line, 12)["ok"]  # 16 was the set-aside line's checkpoint
    assert not rewound_line([{"event": "start", "resumed_from_step": 8}], 12)["ok"]
    # A later start dropped the step records past its own resume point; the recovery a restart
    # writes says how far the leg had trained when its fault hit.
    dropped = [
        {"event": "start", "resumed_from_step": 12},
        *steps(13, 15),
        {"event": "start", "resumed_from_step": 20},
        {"event": "recovery", "fault_step": 20},
        {"event": "start", "resumed_from_step": 14},
        *steps(15, 22),
    ]
    assert rewound_line(dropped, 12)["ok"]
    assert not rewound_line([*dropped[:4], {"event": "recovery", "fault_step": 18}], 12)["ok"]  # 20: the old line's
    assert not rewound_line(
        [{"event": "start", "resumed_from_step": 12}, {"event": "start", "resumed_from_step": None}], 12
    )["ok"]


def test_losses_are_compared_exactly_and_only_up_to_the_shrink():
    from resilient_fsdp.bench.campaign import compare_losses

    reference = {1: 6.0, 2: 5.5, 3: 5.0}
    records = [
        {"event": "step", "step": 1, "loss": 6.0},
        {"event": "step", "step": 2, "loss": 5.5},
        {"event": "step", "step": 2, "loss": 5.5},
        {"event": "step", "step": 3, "loss": 5.0 + 1e-7},
    ]
    assert compare_losses(records, reference, 3)["ok"]
    off = compare_losses(records, reference, 4)
    assert not off["ok"] and off["detail"]["differ"] == [{"step": 3, "loss": 5.0 + 1e-7, "fault_free": 5.0}]
    assert not compare_losses(records, reference, 0)["ok"]  # nothing compared is no pass


def test_the_volume_is_counted_with_set_asides_apart(tmp_path):
    from resilient_fsdp.bench.campaign import tree_bytes

    for name, size in (
        ("step_00000008/a", 100),
        ("step_00000012.incomplete-ab12/a", 30),
        ("step_00000016.abandoned-1/a", 7),
        ("step_00000004.superseded-2/b", 5),
        ("LEASE", 2),
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    assert tree_bytes(tmp_path) == (132, 12, 1)
    assert tree_bytes(tmp_path / "missing") == (0, 0, 0)


def test_the_bucket_is_measured_and_a_step_without_its_marker_is_found(tmp_path):
    from resilient_fsdp.bench.campaign import LocalS3

    s3 = LocalS3(tmp_path)
    try:
        for key, size in (
            ("job/step_00000004/a.distcp", 10),
            ("job/step_00000004/COMPLETE", 2),
            ("job/step_00000008/a.distcp", 5),
            ("other/step_00000001/a", 100),
        ):
            s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"x" * size)
        assert s3.total_bytes("job") == 17
        assert s3.markerless("job") == ["step_00000008"]
        assert f"checkpoint.s3.uri=s3://{s3.bucket}/job" in s3.overrides("job")
    finally:
        s3.close()


def test_what_grows_fault_after_fault_in_a_leg_fails_the_growth_check_and_what_exceeds_its_bound_the_other():
    """The checks on synthetic samples: ten in-process restarts each leaving ten threads behind
    (as an abort that closed no group did) fail the growth check though every figure stays
    under twice the fault-free peak; a pod over that bound fails the other."""
    from resilient_fsdp.bench.campaign import check_after_faults

    peaks = {"pod_fds": 100, "pod_threads": 200, "pod_processes": 6, "shm_bytes": 1 << 20}
    leaking = [
        {
            "fault": f"exception@{i}:rank=1",
            "leg": "main",
            "layer": "in_process",
            "pod_fds": 60,
            "pod_threads": 40 + 10 * i,
            "pod_processes": 5,
            "shm_bytes": 1 << 20,
        }
        for i in range(10)
    ]
    checks = check_after_faults(leaking, peaks)
    assert checks["resources_bounded_after_every_fault"]["ok"] is True
    assert checks["resources_do_not_grow_fault_after_fault"]["ok"] is False
    assert checks["resources_do_not_grow_fault_after_fault"]["detail"][0]["figure"] == "pod_threads"
    steady = [dict(r, pod_threads=45) for r in leaking]
    steady[3]["pod_processes"] = 13
    checks = check_after_faults(steady, peaks)
    assert checks["resources_do_not_grow_fault_after_fault"]["ok"] is True
    assert checks["resources_bounded_after_every_fault"]["ok"] is False
    assert checks["resources_bounded_after_every_fault"]["detail"]["over"] == [
        {"fault": "exception@3:rank=1", "pod_processes": 13, "bound": 12}
    ]
    assert check_after_faults([], peaks)["resources_bounded_after_every_fault"]["ok"] is False  # nothing measured
    # New processes (an in-job or job-level restart) owe nothing to the faults before them.
    fresh = [dict(r, layer="in_job") for r in leaking]
    assert check_after_faults(fresh, peaks)["resources_do_not_grow_fault_after_fault"]["ok"] is True
    # An in-job restart between two in-process ones starts new processes: a pod caught starting
    # before it and a whole one after are no leak; the same growth within one run still is.
    cut = [dict(leaking[0], pod_threads=9), dict(leaking[1], layer="in_job"), dict(leaking[2], pod_threads=54)]
    assert check_after_faults(cut, peaks)["resources_do_not_grow_fault_after_fault"]["ok"] is True
    assert check_after_faults([cut[0], cut[2]], peaks)["resources_do_not_grow_fault_after_fault"]["ok"] is False


def test_one_restart_that_closes_two_faults_counts_once_and_a_restart_that_closed_none_is_caught(tmp_path):
    """A fault inside a restart (sigkill-during-restore) is closed, with the fault before it, by the
    restart that came through: two recoveries, one attempt, one restart in summary.json."""
    from resilient_fsdp.bench import campaign as c
    from resilient_fsdp.config import parse_fault
    from resilient_fsdp.resilience.ledger import FaultLedger

    ledger = FaultLedger(tmp_path)
    for text, t, attempt in (("exception@11:rank=0", 100.0, "a2"), ("sigkill-during-restore@6:rank=1", 103.0, "a2")):
        spec = parse_fault(text)
        ledger.claim(spec, {"fault": str(spec), "key": spec.key, "kind": spec.kind, "t_fault": t, "completed_step": 10})
        ledger.record_recovery(spec.key, {"fault": str(spec), "layer": "in_job", "attempt": attempt})
    fired = ["exception@11:rank=0", "sigkill-during-restore@6:rank=1"]

    def check(restarts: dict) -> dict:
        (tmp_path / "summary.json").write_text(json.dumps({"restarts": restarts, "faults_injected": fired}))
        return c.check_accounting(tmp_path, fired, "")["restarts_count_the_recoveries"]

    assert check({"in_process": 0, "in_job": 1, "job": 0})["ok"] is True
    two = check({"in_process": 0, "in_job": 2, "job": 0})
    assert two["ok"] is False and two["detail"]["recoveries_by_layer"] == {"in_job": 1}, two
