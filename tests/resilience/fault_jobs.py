"""What the fault tests share: the job they run (``resilient-fsdp local`` on values/dev-cpu.yaml:
as root each pod a network namespace, whose node-level faults the local cluster executes), its
fault-free reference, and the checks every faulty run must pass."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support import REPO, assert_no_leftovers, read_losses, read_summary, run_local
from resilient_fsdp.checkpoint.writer.process import NVRX_VERSION

# The NVRx version of the image (its lane): what a job on that lane reports.
IMAGE_NVRX = (REPO / "constraints-image.txt").read_text().split("nvidia-resiliency-ext==")[1].split()[0]


def lane_run(request, lane: str) -> dict:
    """``run_with_faults``'s arguments for ``lane`` (:data:`tests.support.LANES`): the PYTHONPATH
    and the NVRx version the job must report."""
    if lane == "pinned":
        return {"pythonpath": [], "nvrx_version": NVRX_VERSION}
    return {"pythonpath": [request.getfixturevalue("nvrx07_lane")], "nvrx_version": IMAGE_NVRX}


# 40 steps: room for four faults 8 steps apart (tests/local/test_four_faults_in_one_job.py), one reference for all.
STEPS = 40
COMMON = [
    f"train.steps={STEPS}",
    "checkpoint.interval_steps=4",
    "train.log_every=4",
    # Short enough for tests: a stuck rank is killed 2 s after SIGTERM, a hung step is
    # detected after 8 s, rank monitors check twice a second.
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    "resilience.hang_detection.step_timeout_s=8",
    "resilience.hang_detection.learn_timeouts=false",
]
# Gloo cannot be aborted: ranks waiting on a failed peer wait out dist.timeout_s, so in-process
# restart tests keep it short (it applies after the first step; start-up has its own). The soft
# timeout must outlast any legitimate wait inside C++ (NVRx sees no progress then), such as ranks
# of an overloaded two-core machine reaching the first collective seconds apart.
IN_PROCESS = [
    "resilience.in_process.enabled=true",
    "dist.timeout_s=8",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
    "resilience.hang_detection.step_timeout_s=60",
]


def fault_free_run(run_dir: Path, nodes: int, nproc: int) -> tuple[dict, list[float]]:
    proc = run_local(run_dir, nodes=nodes, nproc=nproc, overrides=COMMON)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_no_leftovers(run_dir)
    return read_summary(run_dir), read_losses(run_dir)


def run_with_faults(
    run_dir: Path,
    specs: list[str],
    reference: tuple[dict, list[float]],
    nodes: int = 2,
    nproc: int = 2,
    overrides: list[str] | None = None,
    extra: list[str] | None = None,
    timeout: float = 400,
    nvrx_version: str = NVRX_VERSION,
    **kwargs,
) -> dict:
    """Run the job with ``specs`` injected; it must finish bitwise equal to ``reference`` with
    every fault recorded and nothing left running, and say which NVRx and torch it ran.
    Returns its summary."""
    baseline, baseline_losses = reference
    proc = run_local(
        run_dir,
        nodes=nodes,
        nproc=nproc,
        overrides=COMMON + (overrides or []),
        extra=[f"--inject={s}" for s in specs] + (extra or []),
        timeout=timeout,
        **kwargs,
    )
    out = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS
    assert summary["params_sha256"] == baseline["params_sha256"], out
    assert read_losses(run_dir) == baseline_losses  # the whole curve, exactly
    assert summary["faults_injected"] == specs
    assert 0 < summary["goodput"] < 1
    assert summary["nvrx_version"] == nvrx_version and summary["torch_version"] == torch.__version__
    assert f"NVRx {nvrx_version}, torch {torch.__version__}" in proc.stdout  # the start line
    assert_no_leftovers(run_dir)
    summary["_output"], summary["_stdout"] = out, proc.stdout
    return summary


def check_recoveries(summary: dict, layers: list[str]) -> None:
    """One recovery per fault, by the layer named, from a committed checkpoint before it (every 4
    steps); what came after that checkpoint was trained again."""
    recoveries = summary["recoveries"]
    assert [r["layer"] for r in recoveries] == layers, summary["_output"]
    for layer in set(layers):
        assert summary["restarts"][layer] >= layers.count(layer)
    for r in recoveries:
        assert r["recovery_s"] > 0, r
        if r["kind"] == "sigkill-during-save":  # the checkpoint it tore (fault_step) never committed
            assert r["resumed_from_step"] == r["fault_step"] - 4, r
        elif r["kind"] == "sigterm":
            # Graceful stop: the step it stopped at was checkpointed. That is the fault's step, or
            # a later one when the signal reached a rank after that step's loss all-reduce.
            assert r["resumed_from_step"] > r["fault_step"], r
        else:
            # The newest checkpoint before the fault, or the one before it when the fault came
            # before the newest's asynchronous write had committed (it commits at a later step).
            newest = r["fault_step"] - r["fault_step"] % 4
            assert r["resumed_from_step"] in (newest, max(0, newest - 4)), r
        assert r["lost_steps"] == max(0, r["fault_step"] - r["resumed_from_step"]), r


def check_landed_mid_write(record: dict) -> None:
    """A sigkill-during-save killed its rank while the checkpoint had some, not all, of its bytes."""
    assert record["during_write"] is True, record
    assert 0 < record["bytes_on_disk"] < record["expected_bytes"], record
