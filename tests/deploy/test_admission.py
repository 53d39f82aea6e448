"""resilient_fsdp.deploy.admission: the JobSet, Trainer and Job API rules `validate` applies.

Each rule is broken on a rendered object and must be reported at its field; the rendered objects
themselves must pass (tests/deploy/test_chart_kinds.py checks every profile)."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.chart_support import render
from resilient_fsdp.deploy import admission


def rendered(kind: str, *sets: str) -> dict:
    return {d["kind"]: d for d in render(f"workload.kind={kind}", "nodes=4", *sets).documents()}


def node_job(jobset_spec: dict) -> dict:
    return jobset_spec["replicatedJobs"][0]["template"]["spec"]


def findings(check, *args) -> list[tuple[str, str]]:
    return [(f.path, f.message) for f in check(*args)]


def test_should_pass_when_the_charts_objects_are_checked():
    objs = rendered("JobSet")
    assert admission.check_jobset(objs["JobSet"]) == []
    objs = rendered("TrainJob")
    assert admission.check_training_runtime(objs["TrainingRuntime"]) == []
    assert admission.check_trainjob(objs["TrainJob"], objs["TrainingRuntime"]) == []


@pytest.mark.parametrize(
    "break_it, path, words",
    [
        (lambda j: j["template"]["spec"].pop("restartPolicy"), "template.spec.restartPolicy", "only Never"),
        (
            lambda j: j["podFailurePolicy"]["rules"].extend(
                [{"action": "Count", "onExitCodes": {"operator": "In", "values": [200]}}] * 19
            ),
            "podFailurePolicy.rules",
            "at most 20",
        ),
        (
            lambda j: j["podFailurePolicy"]["rules"][1]["onExitCodes"].update(values=list(range(1, 257))),
            "podFailurePolicy.rules[1].onExitCodes.values",
            "1 to 255",
        ),
        (
            lambda j: j["podFailurePolicy"]["rules"][1]["onExitCodes"].update(values=[2, 1]),
            "podFailurePolicy.rules[1].onExitCodes.values",
            "ascending",
        ),
        (
            lambda j: j["podFailurePolicy"]["rules"][1]["onExitCodes"].update(values=[0, 1]),
            "podFailurePolicy.rules[1].onExitCodes.values",
            "not contain 0",
        ),
        (
            lambda j: j["podFailurePolicy"]["rules"][1]["onExitCodes"].update(containerName="pytorch"),
            "podFailurePolicy.rules[1].onExitCodes.containerName",
            "not a container",
        ),
        (
            lambda j: j["podFailurePolicy"]["rules"][0].update(onExitCodes={"operator": "In", "values": [1]}),
            "podFailurePolicy.rules[0]",
            "exactly one",
        ),
        (
            lambda j: j["podFailurePolicy"]["rules"][1].update(action="FailIndex"),
            "podFailurePolicy.rules[1].action",
            "backoffLimitPerIndex",
        ),
        (lambda j: j.update(maxFailedIndexes=1), "maxFailedIndexes", "requires backoffLimitPerIndex"),
        (lambda j: j.update(podReplacementPolicy="TerminatingOrFailed"), "podReplacementPolicy", "must be Failed"),
    ],
)
def test_should_report_the_field_when_a_job_api_rule_is_broken(break_it, path, words):
    js = rendered("JobSet")["JobSet"]
    break_it(node_job(js["spec"]))
    found = findings(admission.check_jobset, js)
    assert any(p == f"spec.replicatedJobs[0].template.spec.{path}" and words in m for p, m in found), found


@pytest.mark.parametrize(
    "break_it, path, words",
    [
        (lambda js: js["metadata"].update(name="a" * 49), "spec.replicatedJobs[0].name", "pod names"),
        (lambda js: js["metadata"].update(name="Bad_Name"), "metadata.name", "DNS-1035"),
        (lambda js: js["spec"]["network"].update(subdomain="x" * 64), "spec.network.subdomain", "63"),
        (
            lambda js: js["spec"]["failurePolicy"]["rules"][0].update(name="9lives"),
            "spec.failurePolicy.rules[0].name",
            "a letter first",
        ),
        (
            lambda js: js["spec"]["failurePolicy"]["rules"][1].update(name="fatalExitCode"),
            "spec.failurePolicy.rules[1].name",
            "repeats rule 0",
        ),
        (
            lambda js: js["spec"]["failurePolicy"]["rules"][0].update(onJobFailureReasons=["OOMKilled"]),
            "spec.failurePolicy.rules[0].onJobFailureReasons",
            "not a Job failure reason",
        ),
        (
            lambda js: js["spec"]["failurePolicy"]["rules"][0].update(action="RestartJob"),
            "spec.failurePolicy.rules[0].action",
            "feature gate",
        ),
        (
            lambda js: js["spec"]["failurePolicy"]["rules"][0].update(targetReplicatedJobs=["workers"]),
            "spec.failurePolicy.rules[0].targetReplicatedJobs",
            "not a replicatedJob",
        ),
        (
            lambda js: js["spec"]["failurePolicy"].update(restartStrategy="InPlaceRestart"),
            "spec.failurePolicy.restartStrategy",
            "feature gate",
        ),
        (
            lambda js: js["spec"]["replicatedJobs"][0].update(dependsOn=[{"name": "x", "status": "Ready"}]),
            "spec.replicatedJobs[0].dependsOn",
            "first ReplicatedJob",
        ),
        (
            lambda js: js["spec"].update(coordinator={"replicatedJob": "node", "jobIndex": 0, "podIndex": 9}),
            "spec.coordinator",
            "outside",
        ),
    ],
)
def test_should_report_the_field_when_a_jobset_webhook_rule_is_broken(break_it, path, words):
    js = rendered("JobSet")["JobSet"]
    break_it(js)
    found = findings(admission.check_jobset, js)
    assert any(p == path and words in m for p, m in found), found


def test_should_apply_the_webhook_default_restart_policy_when_a_jobset_leaves_it_empty():
    js = rendered("JobSet")["JobSet"]
    node_job(js["spec"])["template"]["spec"].pop("restartPolicy")
    (finding,) = admission.check_jobset(js)
    assert "is OnFailure" in finding.message  # what the JobSet webhook makes of an empty one


def test_should_report_the_field_when_a_training_runtime_rule_is_broken():
    rt = rendered("TrainJob")["TrainingRuntime"]
    rjob = rt["spec"]["template"]["spec"]["replicatedJobs"][0]
    broken = copy.deepcopy(rt)
    broken["spec"]["template"]["spec"]["replicatedJobs"][0]["replicas"] = 2
    assert (
        "spec.template.spec.replicatedJobs[0].replicas",
        "always must be 1 (Trainer scales the Job's pods instead)",
    ) in findings(admission.check_training_runtime, broken)
    rjob["template"]["spec"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    found = findings(admission.check_training_runtime, rt)
    assert any(p.endswith("template.spec.template.spec.containers") and "'node'" in m for p, m in found), found
    rt["spec"]["mlPolicy"]["mpi"] = {}
    assert any(p == "spec.mlPolicy" for p, _ in findings(admission.check_training_runtime, rt))


def test_should_report_the_field_when_a_trainjob_rule_is_broken():
    objs = rendered("TrainJob")
    tj, rt = objs["TrainJob"], objs["TrainingRuntime"]
    tj["spec"]["trainer"]["env"] = [{"name": "PET_MASTER_PORT", "value": "1"}]
    tj["spec"]["managedBy"] = "me"
    tj["metadata"]["name"] = "a" * 49  # 49 + "-node-0-3-abcde" > 63: Trainer's JobSet would be refused
    tj["spec"]["runtimePatches"] = [
        {
            "manager": "chart",
            "trainingRuntimeSpec": {
                "template": {
                    "spec": {
                        "replicatedJobs": [
                            {
                                "name": "node",
                                "template": {
                                    "spec": {
                                        "template": {
                                            "spec": {
                                                "containers": [
                                                    {"name": "node", "env": [{"name": "A", "value": "1"}]},
                                                    {"name": "sidecar"},
                                                ]
                                            }
                                        }
                                    }
                                },
                            },
                            {"name": "launcher"},
                        ]
                    }
                }
            },
        }
    ]
    found = findings(admission.check_trainjob, tj, rt)
    paths = {p for p, _ in found}
    patch = "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs"
    assert {
        "spec.trainer.env[0]",
        "spec.managedBy",
        "spec.runtimePatches[0].manager",
        f"{patch}[0].template.spec.template.spec.containers[0].env",
        f"{patch}[0].template.spec.template.spec.containers[1].name",
        f"{patch}[1].name",
        "(the JobSet Trainer builds) spec.replicatedJobs[0].name",
    } <= paths, found
