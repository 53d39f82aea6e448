"""A release uninstalled and installed again while its old pods still stop: the new install never
joins the old one's rendezvous and never writes beside it in the checkpoint directory.

Two ``resilient-fsdp local`` runs of one release as a JobSet stand for the two installs (each a
JobSet of its own, so each has its own ``jobset-uid``) and share one checkpoint directory, as two
installs share the release's volume. The new install starts while the old one trains; its rank 0
finds the old install's lease live and waits, saying whom for. The old install is then deleted
(SIGTERM to its pods, as ``helm uninstall`` does): it commits the step it stopped at and releases
the lease; the new install resumes from that checkpoint and ends bitwise equal to a run without
the reinstall."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import FAST, REPO, _env, assert_no_leftovers, read_losses, read_summary, run_local

STEPS = 600
# JobSet: its UID is the install's id. checkpoint.dir is on each run's volume (the chart requires
# it), where a link leads both runs to one directory, as two installs mount one claim.
COMMON = [f"train.steps={STEPS}", "checkpoint.interval_steps=25", "train.log_every=25"]


def _local_command(run_dir: Path, ckpt: Path) -> list[str]:
    run_dir.mkdir()
    (run_dir / "shared").symlink_to(ckpt, target_is_directory=True)
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        "--nodes=2",
        "--nproc-per-node=1",
        f"--run-dir={run_dir}",
        "--isolation=loopback",
        "--value=workload.kind=JobSet",
    ]
    for o in [*FAST, *COMMON, "checkpoint.dir=/fsx/shared"]:
        cmd += ["--set", o]
    return cmd


@pytest.mark.timeout(600)
def test_a_new_install_waits_for_the_old_one_to_commit_and_resumes_from_it_bitwise(tmp_path):
    reference_dir = tmp_path / "reference"
    ref = run_local(reference_dir, nodes=2, nproc=1, overrides=COMMON, extra=["--isolation=loopback"])
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    reference = read_summary(reference_dir)

    ckpt = tmp_path / "shared-checkpoints"
    ckpt.mkdir()
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old = subprocess.Popen(
        _local_command(old_dir, ckpt),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(None, old_dir),
        cwd=REPO,
        start_new_session=True,
    )
    new = None
    try:
        deadline = time.monotonic() + 180
        while not (ckpt / "step_00000025").is_dir():  # the old install trains
            assert old.poll() is None and time.monotonic() < deadline, old.communicate()
            time.sleep(0.2)
        new = subprocess.Popen(
            _local_command(new_dir, ckpt),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(None, new_dir),
            cwd=REPO,
            start_new_session=True,
        )
        log = new_dir / "logs" / "node0.log"
        while "waiting for the earlier install" not in (log.read_text() if log.exists() else ""):
            assert new.poll() is None and old.poll() is None and time.monotonic() < deadline, new.communicate()
            time.sleep(0.2)
        old.send_signal(signal.SIGTERM)  # helm uninstall: every pod of the old install gets SIGTERM
        old_out, old_err = old.communicate(timeout=120)
        new_out, new_err = new.communicate(timeout=300)
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert new.returncode == 0, new_out[-4000:] + new_err[-4000:]
    # The old install stopped gracefully at a step it committed, which is where the new one resumed.
    summary = read_summary(new_dir)
    resumed = summary["resumed_from_step"]
    stop_line = f"stop requested (SIGTERM): checkpoint of step {resumed} committed"
    assert 25 <= resumed < STEPS and stop_line in (old_dir / "logs" / "node0.log").read_text(), resumed
    waiting = (new_dir / "logs" / "node0.log").read_text()
    assert f"of job 'resilient-fsdp' (host " in waiting and "to release the lease on" in waiting
    assert f"resumed from step {resumed}" in new_out
    # Nothing of the old install's rendezvous: the new install's id carries its JobSet's UID.
    assert "run_id           : resilient-fsdp-" in new_err + waiting
    assert summary["params_sha256"] == reference["params_sha256"]
    assert read_losses(new_dir) == read_losses(reference_dir)[resumed:]
    assert_no_leftovers(old_dir)
    assert_no_leftovers(new_dir)
