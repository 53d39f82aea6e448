"""The fault kinds under the NVRx version the image ships (0.7, the lane prepared by
./scripts/test), on the loopback launcher: one pod of 2 ranks, whose agent hosts the rendezvous
store (0.7 refuses two agents with one node address, so several pods need the network-namespace
cluster). In-process restart off and on; each run ends bitwise equal to the fault-free one."""

from __future__ import annotations

import os

import pytest

from tests.resilience.fault_jobs import IN_PROCESS, check_landed_mid_write, check_recoveries, run_with_faults
from tests.support import REPO, assert_no_leftovers, run_local

LANE_VERSION = (REPO / "constraints-image.txt").read_text().split("nvidia-resiliency-ext==")[1].split()[0]


@pytest.fixture(scope="module")
def lane(nvrx_lane):
    """The lane with what 0.7's restart paths import (httpx, grpcio, protobuf)."""
    missing = [m for m in ("httpx", "grpc", "google/protobuf") if not (nvrx_lane / m).is_dir()]
    if missing:
        message = (f"the NVRx lane {nvrx_lane} lacks {', '.join(missing)}: it was prepared by an older "
                   "scripts/lib/venv.sh; ./scripts/test prepares it again")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return nvrx_lane


def test_in_job_faults_under_nvrx07(tmp_path, lane, reference_1x2):
    # Not sigterm here: 0.7's checkpoint worker installs a SIGTERM handler that exits 143 (its
    # async_ckpt/core.py, at worker start), overriding the ignored SIGTERM it inherits, so the
    # SIGTERM ft_launcher sends a stopping node's ranks kills the writer and the graceful stop's
    # final checkpoint never finishes. Shielding the writer is the restart-policy issue's.
    specs = ["exception@3:rank=0", "hang@7:rank=1", "hang-in-collective@11:rank=0", "sigkill-during-save@13:rank=1"]
    # 0.7 counts --max-restarts as rounds of the whole job (its _handle_restart_decision), not per
    # node: four in-job restarts need four.
    summary = run_with_faults(tmp_path / "run", specs, reference_1x2, nodes=1, extra=["--max-restarts=4"],
                              pythonpath=[lane], nvrx_version=LANE_VERSION, timeout=600)
    check_recoveries(summary, ["in_job"] * 4)
    check_landed_mid_write(summary["recoveries"][3])


def test_in_process_restart_under_nvrx07(tmp_path, lane, reference_1x2):
    specs = ["exception@3:rank=0", "hang@6:rank=1", "hang-in-collective@10:rank=0", "sigkill@13:rank=1",
             "node-loss@18:node=0"]
    summary = run_with_faults(tmp_path / "run", specs, reference_1x2, nodes=1, overrides=IN_PROCESS,
                              pythonpath=[lane], nvrx_version=LANE_VERSION, timeout=600)
    check_recoveries(summary, ["in_process", "in_process", "in_process", "in_job", "job"])


def test_several_loopback_nodes_are_refused_under_nvrx07(tmp_path, lane):
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=1, pythonpath=[lane], timeout=60)
    assert proc.returncode == 2
    assert "barrier rendezvous, which closes when two agents share one node address" in proc.stderr
    assert not (run_dir / "logs").exists()
    assert_no_leftovers(run_dir)
