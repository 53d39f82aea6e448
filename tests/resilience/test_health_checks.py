"""NVRx's restart health checks: kept on GPU nodes, the GPU/NVLink/NIC ones dropped (and said)
without a GPU, on both NVRx versions."""

from __future__ import annotations

import pytest


def _health_checks(names):
    """NVRx 0.7's ``Wrapper.restart_health_check``: a ``Compose`` of its checks. Stand-ins that carry
    their class names (the real ones need a GPU to run), composed by the installed NVRx's own
    ``Compose``; the real 0.7 wrapper is built below, in the image's lane."""
    from types import SimpleNamespace

    from nvidia_resiliency_ext.inprocess.compose import Compose
    from nvidia_resiliency_ext.inprocess.health_check import HealthCheck

    def check_class(name):
        return type(name, (HealthCheck,), {"__call__": lambda self, state, train_ex=None: state})

    checks = [check_class(n)() for n in names]
    return SimpleNamespace(restart_health_check=Compose(*checks)), checks


def test_without_a_gpu_only_the_gpu_nvlink_and_nic_checks_are_dropped_and_said(capsys):
    from resilient_fsdp.resilience.nvrx import adapt_health_checks

    wrapper, (user, *_hw) = _health_checks(
        ["UserCheck", "ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"]
    )
    dropped = adapt_health_checks(wrapper, gpu_present=False)
    assert dropped == ["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"]
    assert wrapper.restart_health_check is user
    assert "no GPU: in-process restart runs without NVRx's ChainedGPUHealthCheck" in capsys.readouterr().err
    wrapper, _ = _health_checks(["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"])
    adapt_health_checks(wrapper, gpu_present=False)
    assert wrapper.restart_health_check is None
    wrapper, checks = _health_checks(["UserA", "ChainedGPUHealthCheck", "UserB"])
    adapt_health_checks(wrapper, gpu_present=False)
    assert [type(c).__name__ for c in wrapper.restart_health_check.instances] == ["UserA", "UserB"]


def test_on_a_gpu_node_every_health_check_is_kept(capsys):
    """Simulated: this machine has no GPU, so the GPU branch is taken by passing gpu_present."""
    from resilient_fsdp.resilience.nvrx import adapt_health_checks

    wrapper, checks = _health_checks(["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"])
    before = wrapper.restart_health_check
    assert adapt_health_checks(wrapper, gpu_present=True) == []
    assert wrapper.restart_health_check is before and list(before.instances) == checks
    assert capsys.readouterr().err == ""


def test_nvrx_0_4_has_no_restart_health_checks_to_adapt():
    from nvidia_resiliency_ext import inprocess
    from resilient_fsdp.resilience.nvrx import adapt_health_checks

    wrapper = inprocess.Wrapper()
    assert not hasattr(wrapper, "restart_health_check") and adapt_health_checks(wrapper, gpu_present=False) == []


NVRX07_WRAPPER = """
import os, sys
os.environ["LOCAL_RANK"] = "0"
from nvidia_resiliency_ext import inprocess
from resilient_fsdp.resilience.nvrx import new_wrapper
wrapper = new_wrapper(inprocess.Wrapper, gpu_present=sys.argv[1] == "gpu", health_check=None)
checks = wrapper.restart_health_check
print("checks:", ",".join(type(c).__name__ for c in getattr(checks, "instances", ())) if checks else "none")
print("LOCAL_RANK:", os.environ["LOCAL_RANK"])
"""


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-simulated"])
def test_nvrx07_wrapper_is_built_without_gpu_checks_only_without_a_gpu(nvrx_lane, gpu):
    """NVRx 0.7's real ``Wrapper`` (the image's lane). Without a GPU it is built without its GPU,
    NVLink and NIC checks, so no NVML error is logged, and the rank says so. The GPU branch is
    simulated (``gpu_present=True`` on this GPU-less machine): the three checks are built and
    kept, and constructing them on CPU is what logs the NVML errors the other branch avoids."""
    import subprocess
    import sys

    from resilient_fsdp.resilience.nvrx import GPU_HEALTH_CHECKS

    from tests.support import REPO, _env

    proc = subprocess.run(
        [sys.executable, "-c", NVRX07_WRAPPER, "gpu" if gpu else "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=_env([nvrx_lane]),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOCAL_RANK: 0" in proc.stdout
    if gpu:
        assert f"checks: {','.join(GPU_HEALTH_CHECKS)}" in proc.stdout
        assert "no GPU" not in proc.stderr
        assert "NVMLError" in proc.stderr  # what the CPU branch must not log
    else:
        assert "checks: none" in proc.stdout
        assert "NVMLError" not in proc.stderr and "Failed to shut down NVML" not in proc.stderr, proc.stderr[-3000:]
        assert (
            "no GPU: in-process restart runs without NVRx's ChainedGPUHealthCheck, ChainedNVLHealthCheck, "
            "ChainedNicHealthCheck"
        ) in proc.stderr
