"""resilient_fsdp.deploy.release_check, the `helm test` check, run here on CPU against temp dirs.

What these tests can and cannot show: the shared-volume and rendezvous checks run for real (a temp
directory, names that resolve or not). No GPU or EFA device exists on this machine, so the device
checks are exercised only where they do not need one: skipped when nothing is requested, failing
when devices are requested but absent (this machine's real /dev), and counting fake device nodes
in a temp directory. That real device plugins expose /dev/nvidiaN and /dev/infiniband/uverbsN is
checked only on a cluster, by `helm test` itself.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_fsdp.deploy import release_check as rc
from tests.support import REPO


def test_should_write_read_and_remove_a_probe_when_checkpoint_dir_is_on_the_volume(tmp_path):
    target = tmp_path / "runs" / "job" / "checkpoints"
    result = rc.check_shared_volume(tmp_path, target)
    assert result.ok, result
    assert target.is_dir() and list(target.iterdir()) == []  # created, and the probe is gone
    assert f"uid {__import__('os').getuid()}" in result.detail


def test_should_fail_naming_the_fix_when_volume_is_not_mounted(tmp_path):
    result = rc.check_shared_volume(tmp_path / "missing", tmp_path / "missing" / "ckpt")
    assert not result.ok and "storage.mountPath" in result.detail


def test_should_fail_when_checkpoint_dir_is_off_the_volume(tmp_path):
    (tmp_path / "fsx").mkdir()
    result = rc.check_shared_volume(tmp_path / "fsx", tmp_path / "elsewhere")
    assert not result.ok and "trainer.checkpoint.dir" in result.detail


def test_should_fail_naming_the_owner_when_directory_cannot_be_created(tmp_path):
    # Tests run as root, whom permission bits do not stop: a file where a directory should be does.
    (tmp_path / "runs").write_text("not a directory")
    result = rc.check_shared_volume(tmp_path, tmp_path / "runs" / "job")
    assert not result.ok
    assert "cannot create" in result.detail and "owner" in result.detail
    assert "storage.prepare=true" in result.detail and "pod.securityContext.runAsUser" in result.detail


def test_should_fail_naming_the_fix_when_the_volume_refuses_writes(tmp_path, monkeypatch):
    real_open = rc.os.open

    def refuse(path, flags, mode=0o777):
        if ".release-check-" in str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, mode)

    monkeypatch.setattr(rc.os, "open", refuse)
    result = rc.check_shared_volume(tmp_path, tmp_path)
    assert not result.ok and "Permission denied" in result.detail
    # Both fixes, by the values that make them: the chart's init step, or the pods' user.
    assert "storage.prepare=true" in result.detail and "pod.securityContext.runAsUser" in result.detail
    assert f"uid {rc.os.getuid()}" in result.detail


def test_should_skip_the_device_checks_when_no_devices_are_requested(tmp_path):
    assert rc.check_devices("GPUs", 0, tmp_path, r"nvidia[0-9]+", "NVIDIA device plugin").ok
    assert "not requested" in rc.check_devices("EFA", 0, tmp_path, r"uverbs[0-9]+", "EFA device plugin").detail


def test_should_fail_when_requested_gpus_are_not_visible():
    # This machine has no GPU: the real /dev shows no /dev/nvidiaN.
    result = rc.check_devices("GPUs", 8, rc.Path("/dev"), r"nvidia[0-9]+", "NVIDIA device plugin")
    assert not result.ok and "requested 8, 0 visible" in result.detail and "gpusPerNode" in result.detail


def test_should_count_only_numbered_device_nodes_when_devices_are_requested(tmp_path):
    # Fake device nodes (plain files): this tests the counting, not a device plugin.
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert rc.check_devices("GPUs", 2, tmp_path, r"nvidia[0-9]+", "NVIDIA device plugin").ok
    assert not rc.check_devices("GPUs", 3, tmp_path, r"nvidia[0-9]+", "NVIDIA device plugin").ok


def test_should_resolve_the_rendezvous_host_when_it_exists():
    result = rc.check_rendezvous_host("localhost", 29400, timeout_s=0)
    assert result.ok and "localhost:29400" in result.detail


def test_should_retry_then_fail_naming_the_wait_when_rendezvous_host_does_not_resolve():
    calls, now = [], [0.0]

    def resolve(host, port, type):  # noqa: A002 - socket.getaddrinfo's keyword
        calls.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    result = rc.check_rendezvous_host(
        "job-node-0-0.job",
        29400,
        timeout_s=12,
        interval_s=5,
        resolve=resolve,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert not result.ok and len(calls) == 3  # t = 0, 5, 10
    assert "job-node-0-0.job" in result.detail and "joinTimeoutSeconds" in result.detail


def test_should_exit_1_listing_failures_when_run_as_a_module(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.deploy.release_check",
            f"--shared-dir={tmp_path}",
            f"--check-dir={tmp_path}/ckpt",
            "--rdzv-host=localhost",
            "--rdzv-timeout=0",
            "--gpus=1",
            f"--dev-dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ok   shared volume") and lines[1].startswith("FAIL GPUs")
    assert lines[-1] == "release check: 4 ok, 1 failed (GPUs)"


def test_should_exit_0_when_every_check_passes(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.deploy.release_check",
            f"--shared-dir={tmp_path}",
            "--rdzv-host=localhost",
            "--rdzv-timeout=0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 ok, 0 failed" in proc.stdout


def _limited_memlock():
    # Lowering a limit needs no privilege: the child starts with a finite memlock, as under a
    # container runtime that sets none.
    import resource

    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))


def test_should_fail_naming_the_runtime_limit_when_memlock_is_finite_on_an_efa_pod(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_fsdp.deploy.release_check",
            f"--shared-dir={tmp_path}",
            "--rdzv-host=localhost",
            "--rdzv-timeout=0",
            "--memlock",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limited_memlock,
    )
    line = next(ln for ln in proc.stdout.splitlines() if " memlock:" in ln)
    assert proc.returncode == 1 and line.startswith("FAIL"), proc.stdout
    assert "64 KiB" in line and "LimitMEMLOCK" in line and "container runtime" in line


def test_should_pass_memlock_when_unlimited_and_skip_it_without_efa():
    # An unlimited limit cannot be granted to this test process (raising the hard limit needs the
    # runtime's or CAP_SYS_RESOURCE's say), so the limits are handed in here.
    import resource

    unlimited = rc.check_memlock(True, limits=lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert unlimited.ok and unlimited.detail == "unlimited"
    finite = rc.check_memlock(True, limits=lambda _: (8 * 1024 * 1024, resource.RLIM_INFINITY))
    assert not finite.ok and "8192 KiB (hard unlimited)" in finite.detail
    skipped = rc.check_memlock(False, limits=lambda _: (0, 0))
    assert skipped.ok and "skipped" in skipped.detail


def _world_readable_dir():
    """A directory another user can enter (pytest's tmp_path is root-only, 0700)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="resilient-fsdp-inputs-"))
    root.chmod(0o755)
    return root, lambda: shutil.rmtree(root, ignore_errors=True)


def test_should_find_each_trainer_input_readable_by_the_pods_user_or_name_the_fix(request):
    """As the chart's UID 10001: prepared data, a model's config and weights written 0600 by their
    owner (as transformers' save_pretrained writes them), a missing path, and S3 left to the trainer."""
    root, cleanup = _world_readable_dir()
    request.addfinalizer(cleanup)
    os.chown(root, 10001, 10001)  # the volume the chart's storage preparation gives the pods
    data, model = root / "data", root / "llama"
    data.mkdir()
    model.mkdir()
    for f in (data / "tokens.bin", data / "tokens.json", model / "config.json", model / "model.safetensors"):
        f.write_bytes(b"{}")
        f.chmod(0o644)
    (model / "model.safetensors").chmod(0o600)
    args = [
        f"--shared-dir={root}",
        f"--check-dir={root}",
        "--rdzv-host=localhost",
        "--rdzv-timeout=0",
        f"--input=data.path={data}",
        f"--input=model.hf_config={model}",
        f"--input=model.init_from={model}",
        f"--input=model.init_from={root / 'absent'}",
        "--input=data.path=s3://bucket/data/text",
    ]
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=10001",
            "--regid=10001",
            "--clear-groups",
            sys.executable,
            "-m",
            "resilient_fsdp.deploy.release_check",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"ok   input data.path: {data}: 2 file(s) readable by uid 10001" in proc.stdout
    assert any(line.startswith("ok   input model.hf_config") for line in proc.stdout.splitlines())
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL input model.init_from")]
    assert len(failed) == 2, proc.stdout
    assert f"{model / 'model.safetensors'} cannot be read by uid 10001 (mode -rw-------, owner 0:0)" in failed[0]
    assert "chmod a+r" in failed[0]
    assert f"{root / 'absent'} does not exist in this pod (uid 10001)" in failed[1]
    assert "s3://bucket/data/text: in S3, checked by the trainer at start" in proc.stdout
    assert (
        proc.stdout.splitlines()[-1] == "release check: 8 ok, 2 failed (input model.init_from, input model.init_from)"
    )


def test_should_refuse_an_input_it_does_not_know(capsys):
    with pytest.raises(SystemExit):
        rc.build_parser().parse_args(["--shared-dir=/x", "--rdzv-host=h", "--input=data.factory=x"])
    assert "expected KEY=PATH with KEY one of data.path, model.hf_config, model.init_from" in capsys.readouterr().err


def test_should_say_a_directory_that_is_not_what_the_key_names(tmp_path):
    result = rc.check_input("model.init_from", str(tmp_path))
    assert not result.ok and "holds no *.safetensors: not the weights; set trainer.model.init_from" in result.detail
