"""The environment each restart layer's collectives need (resilience/nccl_env.py), read back from a
real rank process; the in-process wrapper's CUDA health check; the flight recorder's dump path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resilient_fsdp.config import load_config
from resilient_fsdp.resilience import nccl_env
from tests.resilience.node import free_port
from tests.support import REPO, _env, write_module

# The probes' report: a store wait that times out (it logs a C++ warning unless TORCH_CPP_LOG_LEVEL
# took effect), then the variables the trainer set, as one ``ENV {...}`` line.
REPORT = """
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    try:
        store.wait(["absent"], datetime.timedelta(seconds=0.1))
    except Exception:
        pass
    names = ["NCCL_NVLS_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
             "TORCH_CPP_LOG_LEVEL", "TORCH_FR_DUMP_TEMP_FILE"]
    print("ENV " + json.dumps({k: os.environ.get(k) for k in names}), flush=True)
"""

# A model factory that reports what its rank process sees, then stops the run as a configuration
# error would (exit 2, retried by no layer): the environment after the trainer set it up, and
# whether a store wait that times out logged a C++ warning (TORCH_CPP_LOG_LEVEL took effect).
PROBE = """
import json, os, datetime
import torch.distributed as dist
from resilient_fsdp.config import ConfigError

def build(cfg):
{report}
    raise ConfigError("probe done")
""".replace("{report}\n", REPORT.lstrip("\n"))


def run_rank(tmp_path, in_process: bool) -> tuple[dict, str]:
    """``python -m resilient_fsdp.train`` as ft_launcher starts a rank (its variables, its injected
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``); the probe's report and the rank's stderr."""
    write_module(tmp_path / "plugins", "env_probe", PROBE)
    env = _env(
        [tmp_path / "plugins"],
        None,
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        },
    )
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.train",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "dist.device=cpu",
        "--set",
        "model.factory=env_probe:build",
        "--set",
        f"resilience.in_process.enabled={str(in_process).lower()}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ENV "))
    return json.loads(line[4:]), proc.stderr


# ``python -m resilient_fsdp.train --describe-config`` exits before training; at exit the process
# reports the environment its ``__main__`` set before importing torch, and whether a store wait
# that times out logged a C++ warning (TORCH_CPP_LOG_LEVEL took effect only if set before torch).
AT_EXIT = """
import atexit, datetime, json, os, runpy, sys

def report():
    import torch.distributed as dist
{report}
atexit.register(report)
sys.argv = ["resilient_fsdp.train", *sys.argv[1:], "--describe-config"]
runpy.run_module("resilient_fsdp.train", run_name="__main__", alter_sys=True)
""".replace("{report}\n", REPORT.lstrip("\n"))


def run_main(in_process: bool) -> tuple[dict, str]:
    """The trainer's ``__main__`` with ft_launcher's injected ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``."""
    env = _env(None, None, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    cmd = [sys.executable, "-c", AT_EXIT, "--set", f"resilience.in_process.enabled={str(in_process).lower()}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ENV "))
    return json.loads(line[4:]), proc.stderr


def test_in_process_restart_sets_nvrx_nccl_settings_before_torch_loads_over_ft_launchers():
    """Real processes on CPU: the NCCL variables cannot act here, so what is checked is that the
    process has them, over ft_launcher's injected value, and that the log level, which torch reads
    only when it loads, took effect. Without in-process restart nothing is set (the control)."""
    env, err = run_main(in_process=True)
    assert env == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "TORCH_CPP_LOG_LEVEL": "error",
        "TORCH_FR_DUMP_TEMP_FILE": None,
    }
    assert "waitForInput" not in err, err[-2000:]
    env, err = run_main(in_process=False)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the in-job restart keeps ft_launcher's
    assert env["NCCL_NVLS_ENABLE"] is None and env["TORCH_CPP_LOG_LEVEL"] is None
    assert "waitForInput" in err  # the same wait logs a warning at torch's default level


@pytest.mark.extended
def test_a_rank_under_in_process_restart_trains_with_the_settings_and_says_so(tmp_path):
    """The whole rank: launcher variables, in-process restart's wrapper, the process group; a model
    factory reads the environment back where the model is built, then ends the run."""
    env, err = run_rank(tmp_path / "on", in_process=True)
    assert env == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "TORCH_CPP_LOG_LEVEL": "error",
        "TORCH_FR_DUMP_TEMP_FILE": None,
    }  # gloo: no flight-recorder dumps to place
    assert "[resilient-fsdp] rank 0: in-process restart: NCCL_NVLS_ENABLE=0" in err
    assert "waitForInput" not in err, err[-2000:]


def test_on_nccl_the_flight_recorder_dumps_under_the_run_directory_unless_the_pod_says_otherwise(tmp_path):
    """``nccl=True`` stands in for a GPU rank (none exists here): the path torch's flight recorder
    writes to, one directory per in-job restart, made before the process group exists."""
    cfg = load_config(None, [f"run_dir={tmp_path}"])
    env = {"RANK": "3", "TORCHELASTIC_RESTART_COUNT": "2"}
    done = nccl_env.apply(cfg, nccl=True, environ=env)
    prefix = tmp_path / "nccl-flight-recorder" / "restart-2" / "rank_"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(prefix)
    assert prefix.parent.is_dir() and done["TORCH_FR_DUMP_TEMP_FILE"] == str(prefix)
    assert "NCCL_NVLS_ENABLE" not in env  # no in-process restart: no layer settings
    said = []
    env = {"RANK": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/logs/fr_"}
    nccl_env.apply(cfg, nccl=True, environ=env, say=said.append)
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env and said == [
        "[resilient-fsdp] rank 0: NCCL flight-recorder dumps go to /logs/fr_<rank> (set in the environment)"
    ]
    env = {}
    assert nccl_env.apply(cfg, nccl=False, environ=env) == {} and env == {}


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-simulated"])
def test_the_in_process_wrapper_checks_the_cuda_context_on_gpu_nodes(gpu):
    """NVRx's CudaHealthCheck is the wrapper's health check where a GPU is present (simulated with
    ``gpu_present=True``: this machine has none) and absent on CPU, on the installed NVRx."""
    from nvidia_resiliency_ext.inprocess.health_check import CudaHealthCheck

    from resilient_fsdp.resilience.nvrx import rank_health_check

    check = rank_health_check(gpu_present=gpu)
    assert isinstance(check, CudaHealthCheck) if gpu else check is None
