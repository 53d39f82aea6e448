"""Every fault kind, injected into a real 2-node x 2-rank job (gloo): the job recovers by the
layer meant for it and ends bitwise equal to the same job without faults."""

from __future__ import annotations

import json

import pytest

from tests.support import assert_no_leftovers, read_losses, read_summary, run_local

STEPS = 24
COMMON = [f"train.steps={STEPS}", "checkpoint.interval_steps=4", "train.log_every=4",
          # Short enough for tests: a stuck rank is killed 2 s after SIGTERM, a hung step is
          # detected after 8 s, rank monitors check twice a second.
          "resilience.workers_stop_timeout_s=2", "resilience.workload_check_interval_s=0.5",
          "resilience.step_timeout_s=8", "resilience.learn_timeouts=false"]
# Gloo cannot be aborted: ranks waiting on a failed peer wait out dist.timeout_s, so in-process
# restart tests keep it short (it applies after the first step; start-up has its own). The soft
# timeout must outlast any legitimate wait inside C++ (NVRx sees no progress then), such as ranks
# of an overloaded two-core machine reaching the first collective seconds apart.
IN_PROCESS = ["resilience.in_process=true", "dist.timeout_s=8", "resilience.in_process_soft_timeout_s=20",
              "resilience.in_process_hard_timeout_s=40", "resilience.in_process_heartbeat_timeout_s=20",
              "resilience.in_process_barrier_timeout_s=120", "resilience.step_timeout_s=60"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fault-free")
    proc = run_local(run_dir, nodes=2, nproc=2, overrides=COMMON)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_no_leftovers(run_dir)
    return read_summary(run_dir), read_losses(run_dir)


# Faults that need their own job: their recovery is asserted in detail below.
CASES = [
    # kind, the layer expected to recover it
    ("sigkill-during-save", "in_job"),
    ("sigterm", "job"),
    ("node-loss", "job"),
]


@pytest.mark.parametrize("kind,layer", CASES, ids=[k for k, _ in CASES])
def test_fault_is_recovered_bitwise(tmp_path, fault_free, kind, layer):
    baseline, baseline_losses = fault_free
    run_dir = tmp_path / "run"
    spec = f"{kind}@10:rank=3"
    proc = run_local(run_dir, nodes=2, nproc=2, overrides=COMMON, extra=[f"--inject={spec}"], timeout=300)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS
    assert summary["params_sha256"] == baseline["params_sha256"], out
    assert read_losses(run_dir) == baseline_losses  # the whole curve, exactly
    assert summary["faults_injected"] == [spec]
    (recovery,) = summary["recoveries"]
    assert recovery["layer"] == layer, out
    assert summary["restarts"][layer] >= 1
    assert recovery["recovery_s"] > 0
    assert 0 < summary["goodput"] < 1
    if kind == "sigterm":
        # Graceful stop: the stop step was checkpointed, so nothing was trained twice.
        assert recovery["lost_steps"] == 0 and recovery["resumed_from_step"] == recovery["fault_step"] + 1
    elif kind == "sigkill-during-save":
        # Killed while step 12's write was in flight: that checkpoint never committed, the
        # job resumed from step 8, and the torn one is left for inspection, not loaded.
        assert recovery["fault_step"] == 12 and recovery["resumed_from_step"] == 8
        assert recovery["lost_steps"] == 4
        assert any(p.name.startswith("step_00000012.incomplete") for p in (run_dir / "checkpoints").iterdir())
    else:
        assert recovery["resumed_from_step"] == 8 and recovery["lost_steps"] == 1
    assert_no_leftovers(run_dir)


# Several faults in one job (each fires once, at a step after the previous recovery); every one
# must be recovered by the layer named, and the job must still end bitwise equal.
MULTI = [
    # faults, extra overrides, the layer expected for each fault
    (["exception@6:rank=3", "hang@12:rank=2", "sigkill@18:rank=1"], [], ["in_job", "in_job", "in_job"]),
    # In-process restart on: a process-killing fault in between goes to the in-job restart, which
    # respawns every rank (new processes, whose nodes' restart counts differ), and the next fault
    # is again recovered in-process.
    (["exception@6:rank=1", "sigkill@12:rank=2", "hang@18:rank=3"], IN_PROCESS, ["in_process", "in_job", "in_process"]),
]


@pytest.mark.parametrize("specs,extra,layers", MULTI, ids=["default", "in_process"])
def test_faults_in_one_job_are_each_recovered_by_their_layer(tmp_path, fault_free, specs, extra, layers):
    baseline, baseline_losses = fault_free
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=2, overrides=COMMON + extra,
                     extra=[f"--inject={s}" for s in specs], timeout=400)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS
    assert summary["params_sha256"] == baseline["params_sha256"], out
    assert read_losses(run_dir) == baseline_losses
    assert summary["faults_injected"] == specs
    recoveries = summary["recoveries"]
    assert [r["layer"] for r in recoveries] == layers, out
    for layer in set(layers):
        assert summary["restarts"][layer] >= layers.count(layer)
    for r in recoveries:
        # Resumed from the newest checkpoint (every 4 steps) before the fault; what came after
        # it was trained again.
        assert r["recovery_s"] > 0
        assert r["resumed_from_step"] == r["fault_step"] - r["fault_step"] % 4
        assert r["lost_steps"] == r["fault_step"] - r["resumed_from_step"]
    assert 0 < summary["goodput"] < 1
    assert_no_leftovers(run_dir)


def test_too_many_faults_fail_with_the_last_fault_named(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=2, overrides=COMMON,
                     extra=["--inject=sigkill@10:rank=3", "--max-restarts=0", "--max-node-restarts=0"], timeout=240)
    assert proc.returncode != 0
    report = proc.stdout.split("job FAILED", 1)[1]
    assert "last fault: sigkill@10:rank=3 (injected after step 9)" in report
    assert "resilience.max_restarts" in report and "--max-node-restarts" in report
    assert not (run_dir / "summary.json").exists()
    # The newest checkpoint is intact: committed, with its manifest.
    committed = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_") and "." not in p.name)
    assert committed[-1].name == "step_00000008"
    assert json.loads((committed[-1] / "COMPLETE").read_text())["step"] == 8
    assert_no_leftovers(run_dir)
