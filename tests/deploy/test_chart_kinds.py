"""Every profile as each workload kind: rendered, linted and validated (CRD schemas, admission
rules, Job and pod templates against Kubernetes), and what the PyTorchJob kind now says of itself."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import PROFILES, crds, job, profile_files, render  # noqa: F401
from resilient_fsdp.deploy import chart, validate

KINDS = ("PyTorchJob", "JobSet", "TrainJob")
OBJECTS = {"PyTorchJob": {"PyTorchJob"}, "JobSet": {"JobSet"}, "TrainJob": {"TrainJob", "TrainingRuntime"}}


def kind_values(profile: str, kind: str) -> dict:
    return chart.load_values(profile_files(profile), [f"workload.kind={kind}"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("profile", PROFILES + ["my-cluster"])
def test_should_render_lint_and_validate_when_profile_runs_as_each_kind(profile, kind, crds):
    if profile == "my-cluster":
        # The example cluster file on its own, over the chart's defaults.
        from tests.deploy.chart_support import MY_CLUSTER

        values = chart.load_values([MY_CLUSTER], [f"workload.kind={kind}", "storage.type=fsx"])
    else:
        values = kind_values(profile, kind)
    rendered = chart.render(values)
    assert chart.lint(values) == []
    docs = rendered.documents()
    problems = validate.validate_documents(docs, crds)
    assert problems == [], "\n".join(map(str, problems))
    job_kinds = {d["kind"] for d in docs} & {"PyTorchJob", "JobSet", "TrainJob", "TrainingRuntime"}
    assert job_kinds == OBJECTS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_should_create_every_pod_spares_included_when_a_profile_with_a_spare_runs_as_each_kind(kind):
    """The p5en-64node profile with one spare: each kind creates 65 pods, and every pod's launcher
    trains at 64 (--nnodes=64:65)."""
    docs = chart.render(
        chart.load_values(profile_files("p5en-64node"), [f"workload.kind={kind}", "spares=1"])
    ).documents()
    if kind == "PyTorchJob":
        specs = next(d for d in docs if d["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
        pods = sum(r["replicas"] for r in specs.values())
        template = specs["Worker"]["template"]
    else:
        owner = next(d for d in docs if d["kind"] == ("JobSet" if kind == "JobSet" else "TrainingRuntime"))
        spec = owner["spec"] if kind == "JobSet" else owner["spec"]["template"]["spec"]
        node_job = spec["replicatedJobs"][0]["template"]["spec"]
        pods = node_job["parallelism"]
        template = node_job["template"]
        if kind == "TrainJob":
            assert next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]["numNodes"] == 65
    assert pods == 65
    assert "--nnodes=64:65" in template["spec"]["containers"][0]["args"]
    # A JobSet's pods (a TrainJob's too) name their install by its UID, for the rendezvous id and
    # the lease; a PyTorchJob's pods have no such label to read.
    install = [e for e in template["spec"]["containers"][0]["env"] if e["name"] == "RESILIENT_FSDP_INSTALL_ID"]
    assert install == (
        []
        if kind == "PyTorchJob"
        else [
            {
                "name": "RESILIENT_FSDP_INSTALL_ID",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"}},
            }
        ]
    )


def test_should_say_what_backoff_limit_really_does_when_pytorchjob_notes_are_printed():
    notes = render("job.backoffLimit=4").notes
    assert "job.backoffLimit=4 does not bound those recreations" in notes
    assert "backoffLimit 0 fails the job at the first pod failure" in notes
    assert "kubeflow/trainer#2045" in notes and "set\njob.activeDeadlineSeconds" in notes
    assert "job.activeDeadlineSeconds=86400 ends a" in render("job.activeDeadlineSeconds=86400").notes


def test_should_warn_that_kueue_ignores_pytorchjobs_by_default_when_queue_is_set():
    notes = render("job.kueueQueue=team-a").notes
    assert "Kueue 0.19 and newer" in notes and "kubeflow.org/pytorchjob" in notes
    assert "integrations.frameworks" in notes and "team-a" in notes
    assert "Kueue 0.19" not in render().notes
    assert "Kueue 0.19" not in render("workload.kind=JobSet", "job.kueueQueue=team-a").notes


def test_should_group_master_and_workers_in_one_domain_when_pytorchjob_uses_topology():
    pj = job(
        render(
            "nodes=3",
            "job.kueueQueue=q",
            "scheduling.topology.required=topology.k8s.aws/network-node-layer-3",
            release="r",
        )
    )
    for role in ("Master", "Worker"):
        annotations = pj["spec"]["pytorchReplicaSpecs"][role]["template"]["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == "topology.k8s.aws/network-node-layer-3"
        assert annotations["kueue.x-k8s.io/podset-group-name"] == "r-resilient-fsdp"


def test_should_render_today_s_pytorchjob_when_kind_is_left_at_its_default():
    rendered = render("nodes=2")
    assert {d["kind"] for d in rendered.documents()} & {"JobSet", "TrainJob", "TrainingRuntime"} == set()
    c = job(rendered)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert c["name"] == "pytorch" and c["ports"][0]["name"] == "pytorchjob-port"
    assert "restartPolicy" not in job(rendered)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
