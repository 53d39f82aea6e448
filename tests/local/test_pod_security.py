"""Local pods run as their pod spec says: user and groups, fsGroup, a read-only root, dropped
capabilities, a container runtime's ``nofile`` limit, the ``/dev/shm`` size, init containers.

Each test starts real pods (network namespaces, the pod-side setup, the chart's rendered
security context) with a small command in place of the trainer's; one short run trains through
the chart's ``storage.prepare`` on a root-owned shared volume. Needs root, as every netns test.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from resilient_fsdp.local.manifests.kinds import pods_of
from resilient_fsdp.local.manifests.security import security_of
from resilient_fsdp.local.manifests.spec import InitContainer, WorkloadError, quantity_bytes
from resilient_fsdp.local.runtime.netns import NetnsRuntime
from tests.checkpoint.probes import HERE as CHECKPOINT_PROBES
from tests.local.manifest_support import rendered
from tests.support import netns_required, run_local

PROBE = textwrap.dedent("""
    import json, os, resource, sys
    def writes(path):
        try:
            with open(os.path.join(path, "probe"), "w") as f:
                f.write("x")
            return "ok"
        except OSError as exc:
            return exc.strerror
    caps = {l.split(":")[0]: int(l.split()[1], 16) for l in open("/proc/self/status") if l.startswith("Cap")}
    st = os.statvfs("/dev/shm")
    print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                      "caps": caps, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                      "writes": {p: writes(p) for p in ("/", "/etc", "/tmp", "/fsx", "/dev/shm")},
                      "shm_bytes": st.f_blocks * st.f_frsize,
                      "group_of": {p: os.stat(p).st_gid for p in ("/tmp", "/dev/shm", "/fsx")},
                      "setgid": {p: bool(os.stat(p).st_mode & 0o2000) for p in ("/tmp", "/fsx")}}))
""")


@pytest.fixture(autouse=True)
def needs_netns():
    netns_required()


def start(workload, run_dir: Path, command: list[str], shared_fs_group: str = "skip", nofile=None) -> tuple[int, str]:
    """Pod 0 of ``workload`` with ``command`` as its trainer container's: (exit status, output)."""
    pod = workload.pods[0]
    pod.command, pod.args = command, []
    runtime = NetnsRuntime(workload, run_dir, None, dict(os.environ), shared_mount="/fsx")
    runtime.shared_fs_group = shared_fs_group
    if nofile:
        runtime.nofile = nofile
    try:
        proc = runtime.start(pod, {})
        out = proc.communicate(timeout=60)[0]
        return proc.returncode, out
    finally:
        runtime.close()


def probe(workload, run_dir: Path, **kwargs) -> dict:
    code, out = start(workload, run_dir, [sys.executable, "-c", PROBE], **kwargs)
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def shared_volume(tmp_path: Path) -> Path:
    """A root-owned shared volume anyone may write (so the other checks can run), as root made it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    return run_dir


def test_the_chart_pod_runs_as_its_security_context_says(tmp_path):
    """The dev-cpu chart's pod: UID/GID 10001 with fsGroup 10001, read-only root, ALL dropped,
    the runtime's 1024 soft nofile, /dev/shm the size of shm.sizeLimit; fsGroup on the emptyDirs
    but not on the shared (RWX, FSx-like) volume."""
    workload = pods_of(rendered("shm.sizeLimit=96Mi").documents())
    seen = probe(workload, shared_volume(tmp_path))
    assert (seen["uid"], seen["gid"], seen["groups"]) == (10001, 10001, [10001])
    assert seen["caps"]["CapEff"] == 0 and seen["caps"]["CapBnd"] == 0 and seen["caps"]["CapPrm"] == 0
    assert seen["nofile"][0] == 1024 and seen["nofile"][1] >= 1024
    assert seen["writes"]["/"] == seen["writes"]["/etc"] == "Read-only file system"
    assert seen["writes"]["/tmp"] == seen["writes"]["/fsx"] == seen["writes"]["/dev/shm"] == "ok"
    assert seen["shm_bytes"] == quantity_bytes("96Mi")
    assert seen["group_of"]["/tmp"] == seen["group_of"]["/dev/shm"] == 10001 and seen["setgid"]["/tmp"]
    assert seen["group_of"]["/fsx"] == 0 and not seen["setgid"]["/fsx"]  # the CSI driver skips RWX


def test_other_ids_capabilities_limits_and_an_fsgroup_driver_are_applied_as_given(tmp_path):
    """Root with only CHOWN, a writable root, other groups, --nofile 512:4096, and a shared volume
    whose driver applies fsGroup: each follows the values, so none of the above is a default."""
    workload = pods_of(
        rendered(
            "pod.securityContext.runAsNonRoot=false",
            "pod.securityContext.runAsUser=0",
            "pod.securityContext.runAsGroup=3000",
            "pod.securityContext.fsGroup=4000",
            "pod.securityContext.supplementalGroups={5000}",
            "pod.containerSecurityContext.readOnlyRootFilesystem=false",
            "pod.containerSecurityContext.capabilities.add={CHOWN}",
        ).documents()
    )
    run_dir = shared_volume(tmp_path)
    seen = probe(workload, run_dir, shared_fs_group="apply", nofile=(512, 4096))
    assert (seen["uid"], seen["gid"], seen["groups"]) == (0, 3000, [4000, 5000])
    assert seen["caps"]["CapEff"] == seen["caps"]["CapBnd"] == 1 << 0  # CAP_CHOWN alone
    assert seen["nofile"] == [512, 4096]
    assert seen["writes"]["/tmp"] == "ok" and seen["writes"]["/"] != "Read-only file system"
    assert seen["group_of"]["/fsx"] == 4000 and seen["setgid"]["/fsx"]
    (Path("/") / "probe").unlink(missing_ok=True)  # what the writable root let the probe write


def test_init_containers_run_first_in_order_and_a_failing_one_fails_the_pod(tmp_path):
    """storage.prepare's init container makes the run and checkpoint directories the pod user's on
    a root-owned volume; a later failing init container ends the pod with its status before the
    trainer container runs."""
    workload = pods_of(rendered("storage.prepare=true").documents())
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)  # root's: a fresh FSx root (0700: once the user's, root cannot look in)
    pod = workload.pods[0]
    assert [i.name for i in pod.init_containers] == ["prepare-storage"]
    code, out = start(workload, run_dir, ["sh", "-c", "touch /fsx/checkpoints/by-trainer && id -u"])
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "10001"
    assert (run_dir.stat().st_uid, (run_dir / "checkpoints").stat().st_uid) == (10001, 10001)
    assert (run_dir / "checkpoints" / "by-trainer").stat().st_uid == 10001
    # A run directory the user already owns, its checkpoint directory missing: root without
    # DAC_OVERRIDE cannot make it there, so the init container leaves it to the trainer.
    (run_dir / "checkpoints" / "by-trainer").unlink()
    (run_dir / "checkpoints").rmdir()
    os.chmod(run_dir, 0o755)
    code, out = start(workload, run_dir, ["sh", "-c", "mkdir /fsx/checkpoints && echo made"])
    assert code == 0 and out.strip().endswith("made"), out

    spec = {"securityContext": {"runAsUser": 10001}}
    failing = InitContainer(
        "fails", ["sh", "-c", "touch /fsx/second-ran; exit 3"], {}, pod.mounts[1:2], security_of(spec, {}, "test")
    )
    pod.init_containers.append(failing)
    code, out = start(workload, run_dir, ["sh", "-c", "touch /fsx/trainer-ran"])
    assert code == 3 and "init container fails exited with status 3" in out, out
    assert (run_dir / "second-ran").exists() and not (run_dir / "trainer-ran").exists()


def test_prepare_storage_passes_when_another_pod_takes_the_volume_root_mid_script(tmp_path):
    """Two pods prepare one volume at once: the other pod's last chown (the volume root, mode 0700,
    now the user's) lands between this pod's look at the checkpoint directory and its chown of it,
    which root without DAC_READ_SEARCH then cannot reach. The script judges by what it can reach
    afterwards, so this pod passes and its trainer writes there. The other pod is played,
    at exactly that moment, by a ``chown`` first on the init container's PATH."""
    workload = pods_of(rendered("storage.prepare=true").documents())
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "checkpoints").mkdir()
    shims = tmp_path / "shims"
    shims.mkdir()
    real = shutil.which("chown")
    (shims / "chown").write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        for last; do :; done
        if [ "$last" = /fsx/checkpoints ]; then {real} 10001:10001 /fsx/checkpoints /fsx; fi
        exec {real} "$@"
    """)
    )
    os.chmod(shims / "chown", 0o755)
    pod = workload.pods[0]
    (init,) = pod.init_containers
    init.env = {**init.env, "PATH": f"{shims}:{os.environ['PATH']}"}
    code, out = start(workload, run_dir, ["sh", "-c", "touch /fsx/checkpoints/by-trainer && echo wrote"])
    assert code == 0 and out.strip().endswith("wrote"), out
    assert (run_dir.stat().st_uid, run_dir.stat().st_mode & 0o777) == (10001, 0o700)


def test_prepare_storage_that_cannot_prepare_passes_and_the_trainer_names_its_log(tmp_path):
    """A file system that squashes root, whose root another UID owns (played by the init container
    running as root with no capability at all, on a 0755 volume of UID 20000): the init container
    cannot give the run directory to the pod's user, says so, and exits 0, so no controller retries
    it for ever; the trainer's own check then refuses the start, pointing at that log."""
    workload = pods_of(rendered("storage.prepare=true").documents())
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chown(run_dir, 20000, 20000)
    pod = workload.pods[0]
    (init,) = pod.init_containers
    init.security = security_of(
        {"securityContext": {"runAsUser": 0, "runAsGroup": 0}},
        {"securityContext": {"capabilities": {"drop": ["ALL"]}}},
        "squashed root",
    )
    check = (
        "from pathlib import Path; from resilient_fsdp.checkpoint.shared_volume import require_writable; "
        "require_writable(Path('/fsx/checkpoints'), 'checkpoint.dir')"
    )
    code, out = start(workload, run_dir, [sys.executable, "-c", check])
    assert "prepare-storage: could not give /fsx to 10001:10001" in out, out
    assert "init container prepare-storage exited" not in out  # it passed: the trainer container ran
    assert code == 1 and "ConfigError: checkpoint.dir='/fsx/checkpoints' is not writable by uid 10001" in out, out
    assert "storage.prepare is on and its init container could not make it so" in out
    assert "kubectl logs POD -c prepare-storage" in out
    assert run_dir.stat().st_uid == 20000  # nothing was changed


def test_loopback_runs_init_containers_before_the_command_and_stops_at_a_failing_one(tmp_path):
    """Loopback (no namespaces, no security context): the init containers still run first, in
    order, with the mount path in their arguments rewritten to the run directory, and a failing one
    ends the pod."""
    from resilient_fsdp.local.runtime.loopback import LoopbackRuntime

    workload = pods_of(rendered("storage.prepare=true").documents())
    pod = workload.pods[0]
    pod.init_containers.append(
        InitContainer(
            "second",
            ["sh", "-c", 'echo $STEP > "$1/second"', "sh", "/fsx"],
            {"STEP": "2"},
            pod.mounts[1:2],
            security_of({}, {}, "test"),
        )
    )
    pod.command, pod.args = ["sh", "-c", 'cat "$1/second"', "sh", "/fsx"], []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    runtime = LoopbackRuntime(workload, run_dir, "lbinit", dict(os.environ))
    try:
        proc = runtime.start(pod, {})
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and out.strip() == "2", out
        assert (run_dir / "checkpoints").stat().st_uid == 10001  # storage.prepare's, as the launcher's user
        pod.init_containers[1].argv = ["sh", "-c", "exit 4"]
        failed = runtime.start(pod, {})
        out = failed.communicate(timeout=60)[0]
        assert failed.returncode == 4 and out.strip() == "init container second exited with status 4: the pod fails", (
            out
        )
    finally:
        runtime.close()


def test_without_storage_prepare_a_root_owned_volume_is_refused_naming_the_values(tmp_path):
    """The trainer's start check, as the pod's user on a root-owned volume without the init
    container: a configuration failure naming storage.prepare and pod.securityContext."""
    workload = pods_of(rendered("storage.prepare=false").documents())
    assert workload.pods[0].init_containers == []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    check = (
        "from pathlib import Path; from resilient_fsdp.checkpoint.shared_volume import require_writable; "
        "require_writable(Path('/fsx'), 'run_dir')"
    )
    code, out = start(workload, run_dir, [sys.executable, "-c", check])
    assert code == 1 and "ConfigError: run_dir='/fsx' is not writable by uid 10001" in out, out
    assert "storage.prepare=true" in out and "pod.securityContext.runAsUser" in out


def test_a_privileged_or_root_run_as_non_root_pod_is_refused():
    with pytest.raises(WorkloadError, match="runAsNonRoot is true but runAsUser"):
        security_of({"securityContext": {"runAsNonRoot": True}}, {}, "pod")
    with pytest.raises(WorkloadError, match="privileged: true"):
        security_of({}, {"securityContext": {"privileged": True}}, "pod")
    with pytest.raises(WorkloadError, match="unknown capability 'NET_FOO'"):
        security_of({}, {"securityContext": {"capabilities": {"add": ["NET_FOO"]}}}, "pod")


def test_a_first_run_on_a_root_owned_volume_trains_through_storage_prepare(tmp_path):
    """The whole job at UID 10001, read-only root, no capabilities and nofile 1024 (soft and hard,
    so raising the soft limit cannot help) on a root-owned run directory: the init container makes
    it writable, and a model of over 3,000 staged tensors trains and checkpoints (the one short run
    of this file in CI; the refusal without it is extended)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_local(
        run_dir,
        nproc=1,
        overrides=["train.steps=2", "checkpoint.interval_steps=2", "model.factory=many_tensors:build"],
        pythonpath=[CHECKPOINT_PROBES],
        extra=["--nofile", "1024:1024"],
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    step = run_dir / "checkpoints" / "step_00000002"
    assert step.is_dir() and step.stat().st_uid == 10001
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 2
    # The trainer saw the pod's limit and could not raise it.
    assert "soft limit 1024, hard limit 1024" in result.stdout, result.stdout[-3000:]


@pytest.mark.extended
def test_a_first_run_without_storage_prepare_is_refused_before_training(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_local(
        run_dir, nproc=1, overrides=["train.steps=2"], extra=["--value", "storage.prepare=false"], timeout=180
    )
    assert result.returncode == 2, result.stdout[-3000:]
    assert "is not writable by uid 10001" in result.stdout and "storage.prepare=true" in result.stdout
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
