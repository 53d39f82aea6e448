"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_fsdp.checkpoint.memory.slots import remove_job

SHM = Path("/dev/shm")


@pytest.fixture
def shm_job(tmp_path):
    """A job name of this test's own, whose memory slots lie on this machine's tmpfs as in a pod's
    memory-backed /dev/shm; removed after the test."""
    if not SHM.is_dir():
        pytest.fail("/dev/shm is missing: the memory tier's tests need a tmpfs there")
    job = f"test-{tmp_path.name[-20:]}-{id(tmp_path) & 0xFFFF:x}"
    yield job
    remove_job(SHM, job)
