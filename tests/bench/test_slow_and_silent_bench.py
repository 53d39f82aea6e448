"""``bench slow-and-silent`` end to end, small (the figures in docs/benchmarks.md come from its full
run): each part's cost pairs, the slow rank found and replaced by the spare, the flipped bit found
and rolled back, every faulty job bitwise equal to the fault-free one. Network-namespace pods
(root) on the image's NVRx (hot spares)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support import netns_required, run_guarded


@pytest.mark.extended  # four minutes: the mechanisms are tests/resilience/test_stragglers.py and test_sdc.py's
def test_the_benchmark_measures_both_classes_and_every_faulty_job_is_exact(tmp_path, nvrx07_lane):
    netns_required()
    out = tmp_path / "bench.json"
    proc = run_guarded(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "bench",
            "slow-and-silent",
            "--steps",
            "40",
            "--repeats",
            "1",
            "--run-dir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
        ],
        tmp_path,
        [nvrx07_lane],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    slow, flip = r["stragglers"], r["silent_corruption"]
    assert slow["cost"]["step_on_over_off"] > 0 and 0 < slow["cost"]["report_cost_over_step"] < 1
    (s,) = slow["samples"]
    assert 0 < s["found_after_steps"] <= 20 and s["route_around_s"] > 0 and s["restarts"]["in_job"] == 1, s
    (f,) = flip["samples"]
    assert f["found_after_steps"] == 10 - 12 % 10 and f["rolled_back_to_step"] == 10, f
    assert f["training_again_after_s"] > 0 and 0 < flip["cost"]["check_cost_over_step"] < 1
    assert s["bitwise_equal_to_fault_free"] and f["bitwise_equal_to_fault_free"]


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--repeats", "0"], "--repeats 0: give 1 or more"),
        (["--steps", "20"], "--steps 20 leaves no room to find the faults"),
        (["--factor", "1"], "--factor 1: give a number above 1"),
    ],
)
def test_flags_that_cannot_run_are_refused_before_any_job_naming_the_flag(tmp_path, flags, words):
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.cli",
            "bench",
            "slow-and-silent",
            *flags,
            "--run-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything ran
