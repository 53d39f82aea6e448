"""The prepared GPU check, rehearsed on CPU so it cannot rot: ``scripts/gpu-check --cpu --tiny``
runs every section with real processes (gloo instead of NCCL), and the report says what it skipped
because it needs CUDA. The wheel selection it makes on the GPU machine is tested on real files."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import LANES, REPO, assert_no_leftovers, lane_path, run_guarded
from resilient_fsdp.bench.gpu import check as gpu_check
from resilient_fsdp.bench.gpu import measure, section
from resilient_fsdp.bench.gpu.wheels import PINS, decide, install, read_pins


# Extended tier (3.5 minutes): run it before a GPU run (docs/gpu-check.md); CI tests the parts.
@pytest.mark.extended
@pytest.mark.timeout(900)  # every section of the check, each with its own budget, runs for real
def test_cpu_rehearsal_runs_every_section_and_says_what_it_skipped(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = run_guarded(
        ["bash", str(REPO / "scripts" / "gpu-check"), "--cpu", "--tiny", "--out", str(out), "--work-dir", str(work)],
        tmp_path,
        None,
        timeout=900,
        env={"PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_no_leftovers(tmp_path)
    data = json.loads((out / "gpu-check.json").read_text())
    assert data["status"] == "ok"
    assert data["mode"]["cpu"] and data["mode"]["tiny"]
    sections = data["sections"]
    assert set(sections) == set(gpu_check.RUN_ORDER)
    assert {name: s["status"] for name, s in sections.items()} == {name: "ok" for name in gpu_check.RUN_ORDER}

    env = data["environment"]
    assert env["torch"] and env["nvrx"] and env["date_utc"] and env["cuda_available"] is False
    assert all(v == "ok" for v in env["imports"].values()), env["imports"]
    assert "NCCL needs CUDA" in env["skipped"]["nccl"]

    t = sections["throughput"]["results"]
    assert t["preset"] == "tiny" and t["steps_measured"] > 0
    assert t["steps_per_s"] > 0 and t["tokens_per_s"] > 0 and t["flops_per_token"] > 0
    assert t["mfu"] is None and "not applicable on CPU" in t["skipped"]["mfu"]

    c = sections["checkpoint"]["results"]
    assert c["state_bytes"] > 0 and c["sync"]["bytes"] > 0
    assert c["sync"]["stall_s"] > 0 and c["async"]["stall_s"] > 0 and c["async"]["write_s"] > 0
    # Every engine, with the figures of bench checkpoint, and the 8b preset's needs.
    assert c["engines_measured"] == ["sync", "async", "dcp_process", "torch-async", "dcp_thread"]
    for engine in ("async", "dcp_process", "torch_async", "dcp_thread"):
        f = c[engine]
        # The stall is the save call, the wait before the step and the commit on the training thread.
        assert f["stall_s"] == pytest.approx(
            f["save_call_s"] + f["wait_before_step_s"] + f["commit_s"], rel=1e-6, abs=1e-9
        )
        assert f["write_s"] > 0 and f["bytes"] > 0 and c["ratios"][f"{engine}_stall_over_sync"] > 0
        # Who used the cores while the write ran: this process's threads and every core's states.
        cpu = f["cpu_s_during_write"]
        assert cpu["process"] >= cpu["main_thread"] > 0 and f["core_s_during_write"], f
    for engine in ("async", "torch_async"):  # the staging thread's copy is accounted apart
        assert c[engine]["cpu_s_during_write"]["staging_copy"] > 0
    big = c["other_presets"]["8b"]
    assert big["estimate"]["params"] > 7e9 and "GPU only" in big["skipped"]
    assert c["async_stall_over_sync"] > 0 and isinstance(c["target_met"], bool)
    assert "copy-bound floor does not apply" in c["skipped"]["copy_floor"]
    # The device-memory assertions run on a GPU only; the hash's code path runs here too.
    assert "GPU only" in c["skipped"]["device_memory"] and len(c["params_sha256"]) == 64
    assert "device_memory_flat_during_save" not in c

    e = sections["exact_resume"]["results"]
    plan = section.TINY_PLAN
    assert e["resumed_from_step"] == plan.stop_step and e["steps_compared"] == plan.run_steps
    assert e["bitwise_equal"] and e["losses_equal"] and e["max_abs_loss_diff"] == 0

    for name, layer in (("in_process", "in_process"), ("in_job", "in_job")):
        r = sections[name]["results"]
        assert r["layer_seen"] == layer and r["recovery_s"] > 0 and r["final_step"] == plan.run_steps
        assert r["equal_to_fault_free"] is True, r  # bitwise equal to exact_resume's straight run
        assert r["not_exercised"]
    assert "needs CUDA" in sections["in_process"]["results"]["skipped"]["nccl_abort"]
    in_job = sections["in_job"]["results"]
    assert in_job["restarts"]["in_job"] == 1
    # The restart restored from the pod's memory, its optimizer state read ahead during the build.
    assert in_job["restored_from_memory"] and in_job["lost_steps"] <= 1, in_job
    assert "read ahead beside the build" in in_job["memory_restore"] and in_job["load_s"] > 0
    assert "no CUDA" in in_job["skipped"]["memory_slots_pinned"] and "memory_slots_pinned" not in in_job

    md = (out / "gpu-check.md").read_text()
    assert "| 1. steps/s and MFU | ok |" in md and "MFU n/a" in md
    assert "| 5. exact resume | ok | bitwise: parameters and every loss equal" in md
    assert "from memory yes, load phase" in md
    assert "skipped mfu: not applicable on CPU" in md and "skipped nccl_abort: needs CUDA" in md
    log = (out / "gpu-check.log").read_text()
    assert "===== section in_job: in_job-runs.log" in log and "===== section in_process: in_process-runs.log" in log
    assert "| 2. checkpoint engines | ok |" in proc.stdout  # the table is printed last
    assert "| 6. memory tier and NVRx's local checkpoints | ok |" in md


@pytest.mark.parametrize("lane", LANES)
def test_the_memory_tier_and_nvrxs_local_checkpoints_are_timed_on_one_state_and_load_back_bitwise(
    tmp_path, request, lane
):
    """The side-by-side section alone, on CPU: both save the same shards under the same loop, both
    load back what they saved after training moved the state on, and what a GPU would do
    differently (NVRx's CUDA-only state dict, replication with one GPU) is said in the results."""
    work = tmp_path / "work"
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.bench.gpu.check",
        "--section",
        "local_checkpoints",
        "--work-dir",
        str(work),
        "--budget-s",
        "300",
        "--cpu",
        "--tiny",
    ]
    proc = run_guarded(cmd, tmp_path, lane_path(request, lane), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((work / "local_checkpoints.json").read_text())
    assert data["status"] == "ok", data
    r = data["results"]
    assert r["nvrx"] == ("0.4.1" if lane == "pinned" else "0.7.0") and r["preset"] == "tiny"
    for name in ("memory", "nvrx_local"):
        f = r[name]
        assert f["stall_s"] == pytest.approx(f["save_call_s"] + f["wait_before_step_s"]) and f["stall_s"] > 0, f
        # A save that completes before the first poll was trained through by no step (no step time).
        assert f["write_s"] >= f["save_call_s"] and (f["step_time_s"] is None or f["step_time_s"] > 0), f
        # Each wrote the state's bytes and little else (a record; NVRx's pickle of its dict).
        assert r["state_bytes"] <= f["bytes"] < 1.1 * r["state_bytes"], (name, f, r["state_bytes"])
    assert r["nvrx_local_stall_over_memory"] == round(r["nvrx_local"]["stall_s"] / r["memory"]["stall_s"], 2)
    assert r["memory_load_bitwise"] is True and r["nvrx_local_load_bitwise"] is True, r
    assert r["memory_load_s"] > 0 and r["nvrx_local_load_s"] > 0 and set(r["memory_load_phases_s"]) >= {"copy"}
    assert "asserts CUDA tensors" in r["stand_ins"][0] and "second rank" in r["skipped"]["replication"]
    measured, target, verdict = gpu_check._measured("local_checkpoints", r)
    assert "NVRx LocalCheckpointManager" in measured and "(bitwise) /" in measured and verdict == "met"
    assert_no_leftovers(tmp_path)


def test_a_section_over_its_budget_is_killed_and_recorded(tmp_path):
    args = gpu_check.parse_args(["--cpu", "--tiny", "--work-dir", str(tmp_path)])
    log = tmp_path / "throughput.log"
    record = gpu_check.run_section("throughput", args, tmp_path, 0.5, log)
    assert record["status"] == "timeout" and "exceeded its time budget" in record["error"], record
    assert record["elapsed_s"] < 15


def test_bad_flags_are_named_with_the_fix(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check"), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert proc.returncode == 2 and "--cpu needs --tiny" in proc.stderr
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check"), "--wheels", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert proc.returncode == 2 and "run scripts/gpu-wheels" in proc.stderr


def test_mfu_peak_is_known_for_h200_and_refused_for_unknown_gpus():
    assert measure.peak_flops("NVIDIA H200", None)[0] == 989.4e12
    peak, why = measure.peak_flops("NVIDIA A10G", None)
    assert peak is None and "--peak-tflops" in why
    assert measure.peak_flops("NVIDIA A10G", 125.0) == (125e12, "--peak-tflops")


def test_carried_wheels_are_pinned_and_agree_with_the_project_pins():
    pins = dict(read_pins())
    image = dict(read_pins(REPO / "constraints-image.txt"))
    assert pins["nvidia-resiliency-ext"] == image["nvidia-resiliency-ext"]
    project = {k.lower().replace("_", "-"): v for k, v in read_pins(REPO / "constraints.txt")}
    for name in ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "defusedxml"):
        assert pins[name] == project[name.replace("_", "-")], name
    assert PINS.name == "constraints-gpu-check.txt"


def _wheel(folder: Path, name: str, version: str, module: str) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{name}-{version}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


def test_only_wheels_the_machine_lacks_or_has_older_are_installed(tmp_path):
    import importlib.metadata

    wheels = tmp_path / "whl"
    wheels.mkdir()
    pytest_version = importlib.metadata.version("pytest")
    _wheel(wheels, "pytest", "0.1", "pytest_old_copy")  # older than the machine's: keep the machine's
    _wheel(wheels, "resilient_fsdp_absent_pkg", "1.0", "resilient_fsdp_absent_pkg")  # missing: install
    decisions = {d.name: d for d in decide(sorted(wheels.glob("*.whl")))}
    assert decisions["pytest"].action == "keep-present" and decisions["pytest"].present == pytest_version
    assert decisions["resilient-fsdp-absent-pkg"].action == "install"
    target = tmp_path / "site"
    install(wheels, target)
    assert (target / "resilient_fsdp_absent_pkg" / "__init__.py").exists()
    assert not (target / "pytest_old_copy").exists()
    with pytest.raises(RuntimeError, match="was not made by this installer"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "keep.txt").write_text("x")
        install(wheels, tmp_path / "mine")


def test_the_in_job_section_reads_whether_every_memory_save_copied_into_page_locked_slots(tmp_path):
    from resilient_fsdp.bench.gpu.restarts import memory_slots_pinned

    metrics = tmp_path / "metrics.jsonl"
    assert memory_slots_pinned(metrics) is None  # no run
    saves = [
        {"event": "memory_checkpoint", "pinned": True, "error": None},
        {"event": "memory_checkpoint", "pinned": None, "error": "its commit did not finish"},
        {"event": "step", "step": 3},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in saves) + '{"event": "memo')
    assert memory_slots_pinned(metrics) is True
    metrics.write_text(
        "".join(json.dumps(r) + "\n" for r in [*saves, {"event": "memory_checkpoint", "pinned": False, "error": None}])
    )
    assert memory_slots_pinned(metrics) is False


def test_the_report_renders_gpu_figures_and_keeps_the_table_intact():
    """The GPU-only figures cannot be produced here; the report's rendering of them can be checked."""
    data = {
        "mode": {"cpu": False, "tiny": False},
        "status": "some sections failed",
        "environment": {"gpu_name": "NVIDIA H200", "driver": "580.159.04", "nccl": "2.27.7", "nvrx": "0.7.0"},
        "sections": {
            "environment": {
                "status": "ok",
                "results": {"ceilings": {"bf16_matmul_tflops": 790.1, "d2h_pinned_gb_per_s": 53.2}},
            },
            "throughput": {
                "status": "ok",
                "results": {
                    "steps_per_s": 5.1,
                    "tokens_per_s": 41800.0,
                    "mfu": 0.309,
                    "peak_flops": 989.4e12,
                    "preset": "1b",
                },
            },
            "checkpoint": {
                "status": "timeout",
                "error": "exceeded its time budget",
                "results": {"sync": {"stall_s": 9.8}, "state_bytes": 13_200_580_608},
            },
            "exact_resume": {
                "status": "ok",
                "results": {
                    "bitwise_equal": False,
                    "losses_equal": False,
                    "within_tolerance": True,
                    "verdict": "a | b",
                },
            },
        },
    }
    md = gpu_check.markdown(data)
    assert "# resilient-fsdp GPU check: NVIDIA H200" in md and "driver 580.159.04" in md and "NCCL 2.27.7" in md
    assert "MFU 30.9% of 989.4 TFLOP/s" in md and "bf16 matmul 790 TFLOP/s" in md
    assert "| 2. checkpoint engines | timeout | stall: sync 9.800 s" in md and "state 13.20 GB" in md
    assert "**checkpoint** error: exceeded its time budget" in md
    assert "| 4. in-job restart (ft_launcher) | pending |" in md
    rows = [line for line in md.splitlines() if line.startswith("| 5.")]
    assert rows and rows[0].count(" | ") == 4  # a "|" inside a cell is escaped, not a new column


def test_every_configuration_the_gpu_plan_uses_is_valid(tmp_path):
    """The GPU run has one try: its trainer configurations are validated here, without a GPU."""
    from resilient_fsdp.config import load_config

    args = gpu_check.parse_args(["--work-dir", str(tmp_path)])
    s = section.Section("in_process", args)
    assert s.plan is section.GPU_PLAN and not s.cpu
    big = load_config(None, s.overrides(tmp_path, big=True) + ["train.deterministic=false"])
    assert (big.model.preset, big.data.seq_len, big.dist.device, big.optim.lr) == ("1b", 2048, "cuda", 3e-4)
    runs = load_config(None, s.in_process_overrides(tmp_path))
    assert runs.model.preset == "125m" and runs.resilience.in_process.enabled
    assert runs.dist.timeout_s > runs.resilience.in_process.hard_timeout_s == 90
    assert load_config(None, s.run_overrides(tmp_path) + [f"train.stop_at_step={s.plan.stop_step}"])
