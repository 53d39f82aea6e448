"""The fault tests' fault-free references: one job per topology, shared by every test that
compares a faulty run with it (bitwise)."""

from __future__ import annotations

import pytest

from tests.resilience.fault_jobs import fault_free_run


@pytest.fixture(scope="session")
def reference_2x2(tmp_path_factory):
    """2 nodes x 2 ranks on NVRx 0.4.1: final parameters and the loss curve."""
    return fault_free_run(tmp_path_factory.mktemp("fault-free-2x2"), nodes=2, nproc=2)


@pytest.fixture(scope="session")
def reference_1x2(tmp_path_factory):
    """1 node x 2 ranks, the single pod NVRx 0.7 runs on loopback. Numerics do not depend on the
    NVRx version, so the 0.4.1 run is the reference of both."""
    return fault_free_run(tmp_path_factory.mktemp("fault-free-1x2"), nodes=1, nproc=2)
