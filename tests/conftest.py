"""Fixtures shared by every test folder; the helpers they use are in ``tests/support.py``."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.support import FAKE_AWS, S3Sandbox, kill_marked, netns_leftovers


@pytest.fixture(scope="session", autouse=True)
def no_local_pods_left_behind():
    """After the whole session, no local pod (network namespace, veth, bridge) outlives its run."""
    yield
    leaked = netns_leftovers()
    assert not leaked, f"local pods left behind by the test session: {leaked}"


@pytest.fixture(autouse=True)
def no_test_processes_outlive_their_test():
    """After each test, whatever it started is gone: a test ended by its time limit (whose own
    guards and checks never ran) would otherwise leave its job running into the next tests."""
    yield
    kill_marked()


# ---- the fault tests' fault-free references: one job per topology, shared by every test that
# compares a faulty run with it (bitwise). Numerics do not depend on the NVRx version or on how
# pods are isolated, so these 0.4.1 runs are the reference of every lane.


@pytest.fixture(scope="session")
def reference_2x2(tmp_path_factory):
    """2 pods x 2 ranks: final parameters and the loss curve."""
    from tests.resilience.fault_jobs import fault_free_run

    return fault_free_run(tmp_path_factory.mktemp("fault-free-2x2"), nodes=2, nproc=2)


@pytest.fixture(scope="session")
def reference_1x2(tmp_path_factory):
    """1 pod x 2 ranks."""
    from tests.resilience.fault_jobs import fault_free_run

    return fault_free_run(tmp_path_factory.mktemp("fault-free-1x2"), nodes=1, nproc=2)


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    """A directory put on the trainers' PYTHONPATH, for custom factories written by a test."""
    return tmp_path / "plugins"


@pytest.fixture(scope="session")
def nvrx_lane() -> Path:
    """The image's NVRx version (pure-Python modules), prepared by ./scripts/test."""
    lane = os.environ.get("RESILIENT_FSDP_NVRX_LANE")
    if lane and (Path(lane) / "nvidia_resiliency_ext").is_dir():
        return Path(lane)
    message = (
        "RESILIENT_FSDP_NVRX_LANE is not set up: run the suite through ./scripts/test, which "
        "prepares the NVRx lane named in constraints-image.txt"
    )
    if os.environ.get("CI"):
        pytest.fail(message)  # in CI a missing lane is a failure, never a silent skip
    pytest.skip(message)


@pytest.fixture(scope="session")
def nvrx07_lane(nvrx_lane) -> Path:
    """The lane with what 0.7's restart paths import (httpx, grpcio, protobuf), for the fault tests."""
    missing = [m for m in ("httpx", "grpc", "google/protobuf") if not (nvrx_lane / m).is_dir()]
    if missing:
        message = (
            f"the NVRx lane {nvrx_lane} lacks {', '.join(missing)}: it was prepared by an older "
            "scripts/lib/venv.sh; ./scripts/test prepares it again"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return nvrx_lane


# ---- the S3 tier's tests: moto's standalone server, a real S3 API over HTTP on loopback ----------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    from resilient_fsdp.bench.s3 import LocalS3Server

    server = LocalS3Server(tmp_path_factory.mktemp("s3-server") / "server.log")
    yield server
    if server.proc.poll() is None:
        os.kill(server.proc.pid, signal.SIGCONT)  # a stopped process would ignore SIGTERM
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    for key, value in FAKE_AWS.items():
        monkeypatch.setenv(key, value)  # inherited by every process a test starts
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    sandbox = S3Sandbox(s3_server, f"test-{uuid.uuid4().hex[:12]}")
    yield sandbox
    sandbox.resume()  # never leave the shared server stopped
