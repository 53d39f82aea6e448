"""``storage.prepare``: the init container that makes the run and checkpoint directories the pod
user's on a volume whose root is root's (a new FSx), rendered by the real Helm engine."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import IMAGE, pod_spec, profile_files, render, render_error

FSX = ["storage.type=fsx", "storage.fsx.subnetId=subnet-0abc", "storage.fsx.securityGroupIds={sg-01}"]
STATIC = [
    "storage.type=fsxStatic",
    "storage.fsxStatic.volumeHandle=fs-0123abcd",
    "storage.fsxStatic.dnsname=fs-0123abcd.fsx.us-west-2.amazonaws.com",
    "storage.fsxStatic.mountname=abc",
]


def init_containers(rendered) -> list[dict]:
    return pod_spec(rendered).get("initContainers") or []


@pytest.mark.parametrize(
    "sets, on",
    [
        (FSX, True),
        (STATIC, True),
        (["storage.existingClaim=ckpt"], False),
        (["storage.type=emptyDir", "nodes=1"], False),
        (["storage.existingClaim=ckpt", "storage.prepare=true"], True),
        (FSX + ["storage.prepare=false"], False),
    ],
)
def test_should_prepare_a_new_or_static_fsx_when_storage_prepare_is_auto_or_forced(sets, on):
    assert [c["name"] for c in init_containers(render(*sets, base=IMAGE))] == (["prepare-storage"] if on else [])


def test_should_own_only_the_run_and_checkpoint_directories_with_chown_alone_when_preparing():
    rendered = render(
        *FSX,
        "pod.securityContext.runAsUser=2000",
        "pod.securityContext.runAsGroup=3000",
        "trainer.checkpoint.dir=/fsx/ckpt/a",
        base=IMAGE,
        release="r",
    )
    (init,) = init_containers(rendered)
    assert init["args"] == ["/fsx/runs/r-resilient-fsdp", "/fsx/ckpt/a", "2000:3000"]
    script = init["command"][2]
    assert "chown -- " in script and "-R" not in script  # two directories, never what is in them
    assert init["image"] == pod_spec(rendered)["containers"][0]["image"]
    assert init["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
    }
    assert init["volumeMounts"] == [{"name": "shared", "mountPath": "/fsx"}]
    assert init["resources"]["limits"] == init["resources"]["requests"]


def test_should_refuse_a_storage_prepare_that_is_not_auto_true_or_false():
    assert "storage.prepare" in render_error("storage.prepare=sometimes")


@pytest.mark.parametrize("name", ["p4d-2node", "p5-4node"])
def test_should_prepare_the_volume_when_a_gpu_profile_provisions_a_new_fsx(name):
    """The profiles' new FSx gets the init container by default; test_chart validates every
    profile's documents (the init container with them) against the Kubernetes schemas."""
    rendered = render(files=profile_files(name), base=IMAGE)
    assert rendered.find("StorageClass")["provisioner"] == "fsx.csi.aws.com"
    assert [c["name"] for c in init_containers(rendered)] == ["prepare-storage"]


def test_should_never_fail_the_pod_when_the_volume_cannot_be_prepared():
    """What the script cannot do is permanent (a root-squashed file system): it says so and exits
    0, since a failed init container is retried for ever (a PyTorchJob reads the missing `pytorch`
    exit code as 0xbeef) or spends a JobSet's budget at once; the trainer's own check fails the job
    with exit 2 (tests/local/test_pod_security.py runs it)."""
    (init,) = init_containers(render(*FSX, base=IMAGE))
    script = init["command"][2]
    assert "exit 1" not in script and script.rstrip().endswith("exit 0")
    assert "prepare-storage: $*; the trainer checks the directories and says how to fix them" in script
    env = {e["name"]: e.get("value") for e in pod_spec(render(*FSX, base=IMAGE))["containers"][0]["env"]}
    assert env["RESILIENT_FSDP_STORAGE_PREPARED"] == "true"


def test_should_prepare_the_volume_in_the_release_check_pod_too():
    """`helm test` on a fresh FSx: its pod prepares the directories as the training pods do, so its
    writability check sees what they will see."""
    rendered = render(*FSX, base=IMAGE)
    check = rendered.find("Pod")
    assert [c["name"] for c in check["spec"]["initContainers"]] == ["prepare-storage"]
    assert check["spec"]["initContainers"] == init_containers(rendered)
    assert {"name": "RESILIENT_FSDP_STORAGE_PREPARED", "value": "true"} in check["spec"]["containers"][0]["env"]
    assert "initContainers" not in render(*FSX, "storage.prepare=false", base=IMAGE).find("Pod")["spec"]


@pytest.mark.parametrize("kind", ["JobSet", "PyTorchJob"])
def test_should_create_a_new_fsx_in_a_release_of_its_own_and_mount_it_from_the_jobs_release(kind):
    """A new FSx takes 10-30 minutes to create: its storage-only release holds nothing that runs (no
    GPU node is asked for), and the job's release mounts its claim and renders no storage."""
    storage = render(*FSX, "storage.only=true", f"workload.kind={kind}", base=IMAGE, release="run1-fs")
    assert sorted(d["kind"] for d in storage.documents() if d) == ["PersistentVolumeClaim", "StorageClass"]
    claim = storage.find("PersistentVolumeClaim")["metadata"]
    assert claim["annotations"]["helm.sh/resource-policy"] == "keep"
    assert f"--set storage.fromRelease=run1-fs" in storage.notes and f"wait pvc/{claim['name']}" in storage.notes
    job = render(*FSX, "storage.fromRelease=run1-fs", f"workload.kind={kind}", base=IMAGE, release="run1")
    kinds = {d["kind"] for d in job.documents() if d}
    assert not kinds & {"PersistentVolumeClaim", "StorageClass", "PersistentVolume"} and kind in kinds
    owner = job.find(kind)
    spec = (
        owner["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        if kind == "PyTorchJob"
        else owner["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    )
    (shared,) = [v for v in spec["volumes"] if v["name"] == "shared"]
    assert shared["persistentVolumeClaim"]["claimName"] == claim["name"] == "run1-fs-resilient-fsdp-shared"
    # The new file system's root still belongs to root: the job prepares its directories.
    assert [c["name"] for c in spec["initContainers"]] == ["prepare-storage"]


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["storage.existingClaim=ckpt", "storage.only=true"],
            "storage.only=true with storage.type=existingClaim: there is no volume to create first",
        ),
        (
            [*FSX, "storage.only=true", "storage.fromRelease=run1-fs"],
            "storage.only=true with storage.fromRelease=run1-fs",
        ),
        (
            ["storage.existingClaim=ckpt", "storage.fromRelease=run1-fs"],
            "storage.fromRelease=run1-fs with storage.type=existingClaim: it names the release that made an fsx or fsxStatic "
            "volume",
        ),
    ],
)
def test_should_refuse_a_storage_only_or_from_release_that_has_nothing_to_create_or_mount(sets, message):
    assert message in render_error(*sets, base=IMAGE)
