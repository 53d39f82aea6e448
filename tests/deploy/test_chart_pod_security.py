"""Every profile's pods against Pod Security Standards, and `resilient-fsdp validate --pod-security`.

The pods are the chart's as rendered by Helm's engine: the training pods of each workload kind, their
init containers when the chart renders any, and the `helm test` pod. The checker is
resilient_fsdp.deploy.pod_security (tests/deploy/test_pod_security.py tests its rules); no API server
with pod-security-admission runs here.
"""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import MY_CLUSTER, PROFILES, VALUES_DIR, profile_files, render
from resilient_fsdp.cli import main
from resilient_fsdp.deploy import chart, pod_security

GPU_PROFILES = [p for p in PROFILES if p != "dev-cpu"]


def pods(docs: list[dict]) -> list[str]:
    return [
        f"{doc['kind']}/{doc['metadata']['name']}:{at or 'spec'}"
        for doc in docs
        for at, _ in pod_security.pod_templates(doc)
    ]


# The JobSet's pods come from the same pod template; their check is the extended tier's.
@pytest.mark.parametrize("kind", ["PyTorchJob", pytest.param("JobSet", marks=pytest.mark.extended)])
@pytest.mark.parametrize("profile", PROFILES)
def test_should_pass_baseline_for_every_pod_when_a_profile_is_rendered(profile, kind):
    docs = chart.render(chart.load_values(profile_files(profile), [f"workload.kind={kind}"])).documents()
    checked = pods(docs)
    # The training pods and the helm test pod are all there to be checked.
    assert any(p.startswith("Pod/") and "release-check" in p for p in checked), checked
    assert any(p.startswith(f"{kind}/") for p in checked), checked
    found = pod_security.check_documents(docs, "baseline")
    assert found == [], "\n".join(f"{name}: {f.path}: {f.message}" for name, f in found)


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_should_add_no_capability_to_an_efa_pod_when_a_gpu_profile_is_rendered(profile):
    docs = chart.render(chart.load_values(profile_files(profile))).documents()
    for doc in docs:
        for _, template in pod_security.pod_templates(doc):
            for c in template["spec"]["containers"]:
                assert "add" not in c["securityContext"].get("capabilities", {}), (doc["kind"], c["name"])
            # storage.prepare's init container: CHOWN alone, which baseline allows.
            for c in template["spec"].get("initContainers", []):
                assert c["securityContext"]["capabilities"].get("add", []) in ([], ["CHOWN"]), (doc["kind"], c["name"])


def test_should_refuse_a_hostpath_volume_at_baseline_naming_the_volume():
    docs = render("pod.extraVolumes[0].name=node-logs", "pod.extraVolumes[0].hostPath.path=/var/log/nccl").documents()
    found = [(name, f.path) for name, f in pod_security.check_documents(docs, "baseline")]
    assert found == [
        ("PyTorchJob/resilient-fsdp", f"spec.pytorchReplicaSpecs.{role}.template.spec.volumes[4].hostPath")
        for role in ("Master", "Worker")
    ]


def test_should_refuse_an_added_capability_when_a_user_adds_ipc_lock_back():
    docs = render("pod.containerSecurityContext.capabilities.add={IPC_LOCK}").documents()
    found = {f.path.rsplit(".template.", 1)[-1] for _, f in pod_security.check_documents(docs, "baseline")}
    assert found == {"spec.containers[0].securityContext.capabilities.add[0]"}


def test_should_fail_validate_on_the_pod_security_finding_alone_naming_the_field(capsys):
    # One validate run costs ~10 s here (the Kubernetes schemas); the profile without the hostPath
    # passes validate at the default level in test_chart.py.
    args = [
        "validate",
        "-f",
        str(VALUES_DIR / "p5-4node.yaml"),
        "-f",
        str(MY_CLUSTER),
        "--set",
        "pod.extraVolumes[0].name=node-logs",
        "--set",
        "pod.extraVolumes[0].hostPath.path=/var/log/nccl",
    ]
    assert main(args) == 1
    out = capsys.readouterr().out
    problems = [ln.strip() for ln in out.splitlines() if ln.startswith("  ")]
    assert len(problems) == 2 and all(
        "volumes[4].hostPath: hostPath volumes are forbidden" in p
        and p.endswith("[Pod Security baseline (Kubernetes 1.34)]")
        for p in problems
    )
