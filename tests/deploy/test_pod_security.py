"""resilient_fsdp.deploy.pod_security: each Pod Security Standards rule refuses what it should, naming the field.

The checker is a restatement of Kubernetes' pod-security-admission (no API server runs here), so
every rule gets a case that breaks it on an otherwise clean pod, and the clean pod passes.
"""

from __future__ import annotations

import copy

import pytest

from resilient_fsdp.deploy import pod_security as pss


def clean_pod() -> dict:
    """A pod restricted admits: the training pod's security settings, one container and one init container."""
    container = {
        "name": "pytorch",
        "image": "trainer:1",
        "ports": [{"containerPort": 29400}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [dict(copy.deepcopy(container), name="prepare")],
        "containers": [container],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": "ckpt"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "config", "configMap": {"name": "cfg"}},
        ],
    }


def paths(findings) -> list[str]:
    return [f.path for f in findings]


def test_should_admit_the_clean_pod_at_every_level():
    for level in pss.LEVELS:
        assert pss.check_pod_spec(clean_pod(), level=level) == []


def _set(spec: dict, dotted: str, value) -> None:
    node = spec
    keys = dotted.replace("[", ".").replace("]", "").split(".")
    for key in keys[:-1]:
        key = int(key) if key.isdigit() else key
        if isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            node = node[key]
    last = keys[-1]
    node[int(last) if last.isdigit() else last] = value


BASELINE_BREACHES = [
    ("hostNetwork", True, "spec.hostNetwork"),
    ("hostPID", True, "spec.hostPID"),
    ("hostIPC", True, "spec.hostIPC"),
    ("securityContext.windowsOptions.hostProcess", True, "spec.securityContext.windowsOptions.hostProcess"),
    ("containers[0].securityContext.privileged", True, "spec.containers[0].securityContext.privileged"),
    ("initContainers[0].securityContext.privileged", True, "spec.initContainers[0].securityContext.privileged"),
    (
        "containers[0].securityContext.capabilities.add",
        ["IPC_LOCK"],
        "spec.containers[0].securityContext.capabilities.add[0]",
    ),
    (
        "containers[0].securityContext.capabilities.add",
        ["SYS_ADMIN"],
        "spec.containers[0].securityContext.capabilities.add[0]",
    ),
    ("volumes[1]", {"name": "nccl", "hostPath": {"path": "/var/log/nccl"}}, "spec.volumes[1].hostPath"),
    ("containers[0].ports[0].hostPort", 29400, "spec.containers[0].ports[0].hostPort"),
    ("containers[0].securityContext.procMount", "Unmasked", "spec.containers[0].securityContext.procMount"),
    ("securityContext.seccompProfile.type", "Unconfined", "spec.securityContext.seccompProfile.type"),
    (
        "containers[0].securityContext.seccompProfile",
        {"type": "Unconfined"},
        "spec.containers[0].securityContext.seccompProfile.type",
    ),
    (
        "containers[0].securityContext.appArmorProfile",
        {"type": "Unconfined"},
        "spec.containers[0].securityContext.appArmorProfile.type",
    ),
    ("securityContext.seLinuxOptions", {"type": "spc_t"}, "spec.securityContext.seLinuxOptions.type"),
    (
        "containers[0].securityContext.seLinuxOptions",
        {"user": "system_u"},
        "spec.containers[0].securityContext.seLinuxOptions.user",
    ),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "spec.securityContext.sysctls[0].name"),
    (
        "containers[0].livenessProbe",
        {"httpGet": {"host": "10.0.0.1", "port": 80}},
        "spec.containers[0].livenessProbe.httpGet.host",
    ),
    (
        "containers[0].lifecycle",
        {"preStop": {"tcpSocket": {"host": "node", "port": 22}}},
        "spec.containers[0].lifecycle.preStop.tcpSocket.host",
    ),
]


@pytest.mark.parametrize("field, value, path", BASELINE_BREACHES, ids=[b[2] for b in BASELINE_BREACHES])
def test_should_refuse_each_baseline_breach_naming_the_field(field, value, path):
    spec = clean_pod()
    _set(spec, field, value)
    for level in ("baseline", "restricted"):
        found = pss.check_pod_spec(spec, level=level)
        assert path in paths(found), found
    assert pss.check_pod_spec(spec, level="privileged") == []


def test_should_refuse_an_apparmor_annotation_other_than_the_runtime_default():
    meta = {"annotations": {pss.APPARMOR_ANNOTATION + "pytorch": "unconfined"}}
    found = pss.check_pod_spec(clean_pod(), meta, "baseline")
    assert paths(found) == [f"metadata.annotations[{pss.APPARMOR_ANNOTATION}pytorch]"]
    ok = {"annotations": {pss.APPARMOR_ANNOTATION + "pytorch": "runtime/default"}}
    assert pss.check_pod_spec(clean_pod(), ok, "baseline") == []


def test_should_admit_what_baseline_allows_and_restricted_does_not():
    # CHOWN and a root user: what an init container that chowns the shared volume needs.
    spec = clean_pod()
    spec["initContainers"][0]["securityContext"].update(
        runAsUser=0, runAsNonRoot=False, capabilities={"drop": ["ALL"], "add": ["CHOWN"]}
    )
    assert pss.check_pod_spec(spec, level="baseline") == []
    found = paths(pss.check_pod_spec(spec, level="restricted"))
    assert found == [
        "spec.initContainers[0].securityContext.runAsNonRoot",
        "spec.initContainers[0].securityContext.runAsUser",
        "spec.initContainers[0].securityContext.capabilities.add[0]",
    ]


RESTRICTED_BREACHES = [
    ("volumes[0]", {"name": "shared", "nfs": {"server": "x", "path": "/"}}, "spec.volumes[0].nfs"),
    (
        "containers[0].securityContext.allowPrivilegeEscalation",
        True,
        "spec.containers[0].securityContext.allowPrivilegeEscalation",
    ),
    ("securityContext.runAsNonRoot", False, "spec.securityContext.runAsNonRoot"),
    ("containers[0].securityContext.runAsNonRoot", False, "spec.containers[0].securityContext.runAsNonRoot"),
    ("securityContext.runAsUser", 0, "spec.securityContext.runAsUser"),
    ("containers[0].securityContext.runAsUser", 0, "spec.containers[0].securityContext.runAsUser"),
    ("securityContext.seccompProfile", {}, "spec.containers[0].securityContext.seccompProfile.type"),
    ("containers[0].securityContext.capabilities", {}, "spec.containers[0].securityContext.capabilities.drop"),
    (
        "containers[0].securityContext.capabilities.add",
        ["CHOWN"],
        "spec.containers[0].securityContext.capabilities.add[0]",
    ),
]


@pytest.mark.parametrize("field, value, path", RESTRICTED_BREACHES, ids=[b[2] for b in RESTRICTED_BREACHES])
def test_should_refuse_each_restricted_breach_that_baseline_admits(field, value, path):
    spec = clean_pod()
    _set(spec, field, value)
    assert pss.check_pod_spec(spec, level="baseline") == []
    assert path in paths(pss.check_pod_spec(spec, level="restricted"))


def test_should_take_the_pod_level_setting_for_every_container_and_a_container_level_one_for_itself():
    spec = clean_pod()
    del spec["securityContext"]["seccompProfile"]
    for c in spec["initContainers"] + spec["containers"]:
        c["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    assert pss.check_pod_spec(spec, level="restricted") == []
    del spec["initContainers"][0]["securityContext"]["seccompProfile"]
    assert paths(pss.check_pod_spec(spec, level="restricted")) == [
        "spec.initContainers[0].securityContext.seccompProfile.type"
    ]


def test_should_find_the_pods_in_each_workload_kind_and_name_the_object():
    bad = clean_pod()
    bad["hostNetwork"] = True
    template = {"metadata": {}, "spec": bad}
    docs = [
        {"kind": "Pod", "metadata": {"name": "p"}, "spec": bad},
        {
            "kind": "PyTorchJob",
            "metadata": {"name": "j"},
            "spec": {"pytorchReplicaSpecs": {"Worker": {"template": template}}},
        },
        {
            "kind": "JobSet",
            "metadata": {"name": "s"},
            "spec": {"replicatedJobs": [{"template": {"spec": {"template": template}}}]},
        },
        {
            "kind": "TrainingRuntime",
            "metadata": {"name": "r"},
            "spec": {"template": {"spec": {"replicatedJobs": [{"template": {"spec": {"template": template}}}]}}},
        },
        {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {}},
    ]
    found = [(name, f.path) for name, f in pss.check_documents(docs, "baseline")]
    assert found == [
        ("Pod/p", "spec.hostNetwork"),
        ("PyTorchJob/j", "spec.pytorchReplicaSpecs.Worker.template.spec.hostNetwork"),
        ("JobSet/s", "spec.replicatedJobs[0].template.spec.template.spec.hostNetwork"),
        ("TrainingRuntime/r", "spec.template.spec.replicatedJobs[0].template.spec.template.spec.hostNetwork"),
    ]


def test_should_refuse_an_unknown_level_naming_the_levels():
    with pytest.raises(ValueError, match="privileged, baseline, restricted"):
        pss.check_pod_spec(clean_pod(), level="strict")
