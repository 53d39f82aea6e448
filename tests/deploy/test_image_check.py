"""scripts/check-image (resilient_fsdp.deploy.image_check): the checks a built image runs on itself.

This machine is not the image: its torch is the CPU build and it has no NCCL, EFA libraries or
GPU. So here the checks must fail where the image would pass, naming what is missing, and the
one-process FSDP step, which needs none of them with --cpu-ok, must pass for real.
"""

from __future__ import annotations

import importlib.metadata
import subprocess

import pytest
import torch

from tests.deploy.image_support import REPO
from resilient_fsdp.deploy import image_check
from resilient_fsdp.deploy.image_check import Pins

NO_GPU = not torch.cuda.is_available()
NVRX_HERE = importlib.metadata.version("nvidia-resiliency-ext")  # this venv's (0.4.1), not the image's


def check_image(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO / "scripts/check-image"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def lines(out: subprocess.CompletedProcess) -> dict[str, tuple[str, str]]:
    found = {}
    for line in out.stdout.splitlines():
        parts = line.removeprefix("[check-image] ").split(None, 2)
        if len(parts) == 3 and parts[0] in ("ok", "FAIL", "skip"):
            found[parts[1]] = (parts[0], parts[2])
    return found


@pytest.mark.skipif(not NO_GPU, reason="asserts what a CPU-only machine lacks")
def test_on_this_machine_the_missing_cuda_nccl_and_efa_are_named_and_the_fsdp_step_runs():
    out = check_image("--cpu-ok", "--expect-nvrx", NVRX_HERE)
    assert out.returncode == 1, out.stdout + out.stderr
    got = lines(out)
    assert got["torch"][0] == "FAIL" and "was built without CUDA" in got["torch"][1]
    assert got["nccl"][0] == "FAIL" and "has no NCCL backend" in got["nccl"][1]
    assert got["libfabric"][0] == "FAIL" and "libfabric.so.1 not found" in got["libfabric"][1]
    assert got["aws-ofi-nccl"][0] == "FAIL" and "libnccl-net-ofi.so" in got["aws-ofi-nccl"][1]
    assert got["nccl-tuner"] == (
        "FAIL",
        "/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so (the chart's "
        "efa.ncclTunerPlugin) is not in the image: NCCL would keep its own algorithm "
        "choices on EFA; set efa.ncclTunerPlugin to where this aws-ofi-nccl puts its tuner, "
        "or to an empty string",
    )
    assert got["nvrx"] == ("ok", f"nvidia-resiliency-ext {NVRX_HERE}")
    assert got["trainer"][0] == "ok"
    assert got["gpu"][0] == "skip" and got["efa-device"][0] == "skip" and got["memlock"][0] == "skip"
    status, detail = got["fsdp-step"]
    assert status == "ok", detail
    assert "3 steps on (cpu, gloo)" in detail and "checkpoint step_00000003" in detail
    assert out.stdout.splitlines()[-1].startswith("[check-image] ") and "failed" in out.stdout.splitlines()[-1]


def test_build_mode_skips_the_node_checks_and_compares_versions():
    out = check_image("--build", "--expect-nvrx", "0.7.0")
    got = lines(out)
    assert set(got) == {
        "torch",
        "cuda",
        "nccl",
        "nvrx",
        "trainer",
        "ft_launcher",
        "libfabric",
        "aws-ofi-nccl",
        "nccl-tuner",
    }
    assert got["nvrx"] == ("FAIL", f"nvidia-resiliency-ext {NVRX_HERE}, pinned 0.7.0 (NVRX_VERSION)")
    assert out.returncode == 1 and out.stdout.rstrip().endswith("(build-time checks)")


def test_pins_are_saved_only_when_every_check_passed(tmp_path, monkeypatch):
    pins = tmp_path / "pins.json"
    out = check_image("--build", "--expect-nccl", "2.30.7", "--save-pins", str(pins))
    assert out.returncode == 1 and not pins.exists()
    # A passing run needs a CUDA build of torch, NCCL and EFA, which cannot exist here: the checks'
    # results stand in for that one case, and the saved file is read back by the real loader.
    monkeypatch.setattr(image_check, "run_checks", lambda *a, **k: [image_check.Result("torch", "ok", "")])
    args = [
        "--build",
        "--expect-torch",
        "2.13.0a0",
        "--expect-cuda",
        "13.3",
        "--expect-nccl",
        "2.30.7",
        "--expect-nvrx",
        "0.7.0",
        "--save-pins",
        str(pins),
    ]
    assert image_check.main(args) == 0
    assert image_check.load_pins(pins) == Pins(torch="2.13.0a0", cuda="13.3", nccl="2.30.7", nvrx="0.7.0")


def test_bad_expectations_name_the_flag():
    out = check_image("--build", "--expect-nccl", "two point thirty")
    assert out.returncode != 0
    assert "--expect-nccl='two point thirty': expected a version such as 2.30.7" in out.stderr
    out = check_image("--build", "--pins", "/no/such/pins.json")
    assert "--pins /no/such/pins.json: no such file" in out.stderr


def test_version_comparisons_ignore_the_local_build_label(monkeypatch):
    # The base's CUDA build of torch cannot exist here: its version attributes stand in for it.
    monkeypatch.setattr(torch, "__version__", "2.13.0a0+9186a08b2c.nv26.07")
    monkeypatch.setattr(torch.version, "cuda", "13.3")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    assert image_check.check_torch(Pins(torch="2.13.0a0")).status == "ok"
    assert image_check.check_torch(Pins(torch="2.12.0a0")).detail.endswith("pinned 2.12.0a0 (BASE_TORCH_VERSION)")
    assert image_check.check_cuda(Pins(cuda="13.3")).status == "ok"
    assert image_check.check_cuda(Pins(cuda="13.0")).status == "FAIL"


def test_one_process_step_leaves_the_jobs_launcher_variables_alone(monkeypatch):
    # In a pod, the operator sets MASTER_ADDR and friends: the check's trainer must stay a world of one.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PET_NNODES"):
        assert image_check.LAUNCHER_ENV.match(name)
    assert not image_check.LAUNCHER_ENV.match("NCCL_DEBUG")


def test_memlock_must_be_unlimited_only_where_the_node_has_efa():
    # No EFA device exists here and this process cannot be given an unlimited limit: the devices
    # and the limits are handed in.
    import resource

    finite = lambda _: (8 * 1024 * 1024, 8 * 1024 * 1024)  # noqa: E731
    unlimited = lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)  # noqa: E731
    assert image_check.check_memlock(Pins(), devices=[], limits=finite).status == "skip"
    bad = image_check.check_memlock(Pins(), devices=["rdmap16s27"], limits=finite)
    assert bad.status == "FAIL" and "8192 KiB" in bad.detail and "LimitMEMLOCK=infinity" in bad.detail
    good = image_check.check_memlock(Pins(), devices=["rdmap16s27"], limits=unlimited)
    assert good.status == "ok" and "rdmap16s27" in good.detail


def test_the_tuner_checked_is_the_one_the_chart_names_and_another_found_is_offered(tmp_path):
    import yaml

    from resilient_fsdp.deploy.image_check import NCCL_TUNER_PLUGIN, check_nccl_tuner

    values = yaml.safe_load((REPO / "charts/resilient-fsdp/values.yaml").read_text())
    assert values["efa"]["ncclTunerPlugin"] == str(NCCL_TUNER_PLUGIN)
    (tmp_path / "libnccl-net-ofi-tuner.so").write_bytes(b"")
    result = check_nccl_tuner(None, tmp_path / "libnccl-ofi-tuner.so")
    assert result.status == "FAIL"
    assert f"{tmp_path} has libnccl-net-ofi-tuner.so: set efa.ncclTunerPlugin to it" in result.detail
    (tmp_path / "libnccl-ofi-tuner.so").write_bytes(b"")
    assert check_nccl_tuner(None, tmp_path / "libnccl-ofi-tuner.so").status == "ok"
