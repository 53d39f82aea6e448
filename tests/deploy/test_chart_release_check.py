"""templates/tests/release-check.yaml: the `helm test` Pod."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import crds, pod_spec, render  # noqa: F401
from resilient_fsdp.deploy import validate


def check_pod(rendered) -> dict:
    return rendered.find("Pod")


def test_should_run_the_check_as_a_helm_test_hook_with_the_training_pods_identity_when_enabled():
    rendered = render("nodes=2")
    pod, training = check_pod(rendered), pod_spec(rendered)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    for key in ("serviceAccountName", "automountServiceAccountToken", "securityContext", "nodeSelector"):
        assert spec[key] == training[key], key
    (c,) = spec["containers"]
    assert c["image"] == training["containers"][0]["image"]
    assert c["securityContext"] == training["containers"][0]["securityContext"]
    assert c["command"] == ["python", "-m", "resilient_fsdp.deploy.release_check"]
    assert {v["name"] for v in spec["volumes"]} == {"shared", "tmp"}
    assert [v for v in spec["volumes"] if v["name"] == "shared"][0]["persistentVolumeClaim"] == {"claimName": "ckpt"}


def test_should_request_little_and_check_no_devices_when_devices_are_off():
    c = check_pod(render())["spec"]["containers"][0]
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "500m", "memory": "512Mi"}
    assert "--gpus=0" in c["args"] and "--efa=0" in c["args"]


def test_should_request_and_check_one_pods_gpus_and_efa_when_devices_are_on():
    c = check_pod(render("releaseCheck.devices=true", "nodes=2"))["spec"]["containers"][0]
    assert c["resources"]["requests"] == {
        "cpu": "500m",
        "memory": "512Mi",
        "nvidia.com/gpu": 8,
        "vpc.amazonaws.com/efa": 32,
        "hugepages-2Mi": "5120Mi",
    }
    assert "--gpus=8" in c["args"] and "--efa=32" in c["args"]


@pytest.mark.parametrize(
    "kind, host",
    [
        ("PyTorchJob", "r-resilient-fsdp-master-0"),
        ("JobSet", "r-resilient-fsdp-node-0-0.r-resilient-fsdp"),
        ("TrainJob", "r-resilient-fsdp-node-0-0.r-resilient-fsdp"),
    ],
)
def test_should_check_the_kinds_rendezvous_host_and_the_checkpoint_dir_when_kind_is_set(kind, host):
    c = check_pod(render(f"workload.kind={kind}", "rendezvous.port=29411", release="r"))["spec"]["containers"][0]
    assert f"--rdzv-host={host}" in c["args"] and "--rdzv-port=29411" in c["args"]
    assert "--check-dir=/fsx/runs/r-resilient-fsdp/checkpoints" in c["args"] and "--shared-dir=/fsx" in c["args"]


def test_should_render_no_check_pod_when_disabled():
    assert not [d for d in render("releaseCheck.enabled=false").documents() if d["kind"] == "Pod"]


def test_should_pass_the_kubernetes_pod_schema_when_validated(crds):
    problems = validate.validate_documents([check_pod(render("releaseCheck.devices=true"))], crds)
    assert problems == []


def test_should_reject_a_bad_quantity_naming_the_key_when_resources_are_set():
    from tests.deploy.chart_support import render_error

    assert "releaseCheck.resources.memory" in render_error("releaseCheck.resources.memory=lots")


def test_should_check_the_trainers_input_paths_the_values_set():
    """data.path only when the job trains on a token file (not a factory's dataset), the Hugging Face
    config and weights whenever they are set; none by default."""

    def inputs(*sets):
        (c,) = check_pod(render(*sets))["spec"]["containers"]
        return [a for a in c["args"] if a.startswith("--input=")]

    assert inputs() == []
    assert inputs(
        "trainer.data.source=tokens",
        "trainer.data.path=/fsx/data/text",
        "trainer.model.hf_config=/fsx/models/llama",
        "trainer.model.init_from=/fsx/models/llama",
    ) == [
        "--input=data.path=/fsx/data/text",
        "--input=model.hf_config=/fsx/models/llama",
        "--input=model.init_from=/fsx/models/llama",
    ]
    assert inputs("trainer.data.path=/fsx/data/text") == []  # source synthetic: the path is not read
    assert inputs("trainer.data.source=tokens", "trainer.data.path=/fsx/d", "trainer.data.factory=my.data:build") == []
