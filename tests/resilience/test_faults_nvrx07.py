"""The fault kinds under the NVRx version the image ships (0.7, the lane prepared by
./scripts/test), on one pod of 2 ranks, whose agent hosts the rendezvous store. In-process restart
off and on; each run ends bitwise equal to the fault-free one. Several pods under 0.7, with node
faults on the store host, are tests/local/test_field_faults.py."""

from __future__ import annotations

import pytest

from tests.resilience.fault_jobs import IN_PROCESS, check_landed_mid_write, check_recoveries, run_with_faults
from tests.support import REPO, assert_no_leftovers, run_local

LANE_VERSION = (REPO / "constraints-image.txt").read_text().split("nvidia-resiliency-ext==")[1].split()[0]


@pytest.mark.timeout(660)
def test_in_job_faults_under_nvrx07(tmp_path, nvrx07_lane, reference_1x2):
    # sigterm: 0.7's checkpoint worker installs its own SIGTERM handler (async_ckpt/core.py) that
    # exits 143; the trainer starts it with SIGTERM blocked, so the SIGTERM ft_launcher sends a
    # stopping node's ranks reaches the trainer only, and the graceful stop's checkpoint commits.
    specs = ["exception@3:rank=0", "hang@7:rank=1", "hang-in-collective@11:rank=0", "sigkill-during-save@13:rank=1",
             "sigterm@18:node=0"]
    # 0.7 counts --max-restarts as rounds of the whole job (its _handle_restart_decision), not per
    # node: four in-job restarts need four.
    summary = run_with_faults(tmp_path / "run", specs, reference_1x2, nodes=1, extra=["--max-restarts=4"],
                              pythonpath=[nvrx07_lane], nvrx_version=LANE_VERSION, timeout=600)
    check_recoveries(summary, ["in_job"] * 4 + ["job"])
    check_landed_mid_write(summary["recoveries"][3])


@pytest.mark.timeout(660)
def test_in_process_restart_under_nvrx07(tmp_path, nvrx07_lane, reference_1x2):
    specs = ["exception@3:rank=0", "hang@6:rank=1", "hang-in-collective@10:rank=0", "sigkill@13:rank=1",
             "node-loss@18:node=0"]
    summary = run_with_faults(tmp_path / "run", specs, reference_1x2, nodes=1, overrides=IN_PROCESS,
                              pythonpath=[nvrx07_lane], nvrx_version=LANE_VERSION, timeout=600)
    check_recoveries(summary, ["in_process", "in_process", "in_process", "in_job", "job"])


@pytest.mark.extended
@pytest.mark.timeout(240)
def test_two_loopback_pods_under_nvrx07(tmp_path, nvrx07_lane):
    """Without namespaces too: 0.7 refuses two agents with one node address, and a loopback
    endpoint makes every agent try to host the store; distinct 127.0.0.x addresses and is_host
    per pod (the loopback deviations) make it work."""
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=1, overrides=["train.steps=4"], pythonpath=[nvrx07_lane],
                     isolation="loopback", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"NVRx {LANE_VERSION}" in proc.stdout
    assert_no_leftovers(run_dir)
