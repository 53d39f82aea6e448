"""Values the chart must refuse: each cross-key rule in templates/validations.yaml, and the schema.

Every case checks that the message names the key at fault and says what to set.
"""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import IMAGE, crds, profile_files, render, render_error  # noqa: F401
from resilient_fsdp.deploy import chart, validate

FSX = ["storage.type=fsx", "storage.fsx.subnetId=subnet-0abc", "storage.fsx.securityGroupIds={sg-01}"]

# (--set expressions, base, fragments the message must contain)
RULES = {
    "unknown instance type": (
        ["instanceType=p9.48xlarge"],
        None,
        ["instanceType=p9.48xlarge", "set instanceType to one of", "p5.48xlarge"],
    ),
    "image repository empty": (["image.repository="], None, ["image.repository", "set it"]),
    "the local image name on a gpu instance type": (
        ["image.repository=resilient-fsdp"],
        None,
        [
            "image.repository=resilient-fsdp is the chart's default for a local cluster",
            "instanceType=p5.48xlarge has GPUs",
            "pull resilient-fsdp:0.1.0 from Docker Hub",
            "Set image.repository to the registry the nodes pull from",
        ],
    ),
    "gpus per node above the instance": (
        ["gpusPerNode=16"],
        None,
        ["gpusPerNode=16", "8 GPUs", "p5.48xlarge", "set gpusPerNode to 8"],
    ),
    "gpus per node on a cpu instance": (["instanceType=cpu", "gpusPerNode=1"], None, ["gpusPerNode=1", "no GPUs"]),
    "cuda device on a cpu instance": (
        ["instanceType=cpu", "trainer.dist.device=cuda"],
        None,
        ["trainer.dist.device=cuda", "set trainer.dist.device=auto"],
    ),
    "efa on an instance without it": (
        ["instanceType=g5.4xlarge", "efa.enabled=true"],
        None,
        ["efa.enabled=true", "g5.4xlarge", "no EFA"],
    ),
    "more efa devices than the instance": (
        ["efa.devices=64"],
        None,
        ["efa.devices=64", "32 EFA", "set efa.devices to 32"],
    ),
    "efa devices with efa off": (
        ["efa.enabled=false", "efa.devices=4"],
        None,
        ["efa.devices=4", "EFA is off", "efa.enabled=true"],
    ),
    "hugepages without efa": (
        ["instanceType=g5.4xlarge", "efa.hugepages2Mi=2Gi"],
        None,
        ["efa.hugepages2Mi=2Gi", "EFA is off", "set efa.hugepages2Mi=auto"],
    ),
    "gpudirect rdma on g6": (
        ["instanceType=g6.48xlarge", "efa.gpuDirectRdma=true"],
        None,
        ["efa.gpuDirectRdma=true", "g6.48xlarge", "GPUDirect RDMA"],
    ),
    "gpudirect rdma with efa off": (
        ["efa.enabled=false", "efa.gpuDirectRdma=true"],
        None,
        ["efa.gpuDirectRdma=true", "EFA is off"],
    ),
    "spares beside a single node": (
        ["nodes=1", "spares=1"],
        None,
        ["spares=1 with nodes=1", "pod 0, which hosts the rendezvous store", "Set spares=0"],
    ),
    "shard group that does not divide the world": (
        ["nodes=2", "trainer.dist.shard_group_size=24"],
        None,
        [
            "trainer.dist.shard_group_size=24 does not divide the world size of nodes=2 x 8 ranks a pod = 16",
            "Set trainer.dist.shard_group_size to a divisor of 16",
        ],
    ),
    "two storage choices": (
        FSX[1:],
        None,
        ["storage.fsx.subnetId is set but storage.type=existingClaim", "set storage.type=fsx"],
    ),
    "existing claim and static volume": (
        ["storage.fsxStatic.volumeHandle=fs-0abc"],
        None,
        ["storage.fsxStatic.volumeHandle is set", "storage.type=fsxStatic"],
    ),
    "existing claim missing": ([], [], ["storage.existingClaim", "ReadWriteMany"]),
    "fsx without subnet": (["storage.type=fsx", "storage.fsx.securityGroupIds={sg-01}"], [], ["storage.fsx.subnetId"]),
    "fsx without security groups": (
        ["storage.type=fsx", "storage.fsx.subnetId=subnet-0abc"],
        [],
        ["storage.fsx.securityGroupIds"],
    ),
    "fsx efa on scratch": (
        FSX + ["storage.fsx.efaEnabled=true", "storage.fsx.deploymentType=SCRATCH_2"],
        [],
        ["storage.fsx.efaEnabled=true", "PERSISTENT_2"],
    ),
    "fsx class name missing": (
        ["storage.type=fsx", "storage.fsx.createStorageClass=false"],
        [],
        ["storage.fsx.storageClassName"],
    ),
    "static fsx without dns name": (
        ["storage.type=fsxStatic", "storage.fsxStatic.volumeHandle=fs-0abc", "storage.fsxStatic.mountname=m"],
        [],
        ["storage.fsxStatic.dnsname"],
    ),
    "empty dir with several pods": (
        ["storage.type=emptyDir", "nodes=2"],
        [],
        ["storage.type=emptyDir", "set storage.type=existingClaim"],
    ),
    "checkpoint dir off the volume": (
        ["trainer.checkpoint.dir=/scratch/ckpt"],
        None,
        ["trainer.checkpoint.dir=/scratch/ckpt", "storage.mountPath=/fsx", "set trainer.checkpoint.dir under /fsx/"],
    ),
    "run dir off the volume": (
        ["trainer.run_dir=/home/runs/x"],
        None,
        ["trainer.run_dir=/home/runs/x", "storage.mountPath=/fsx"],
    ),
    "grace period shorter than graceful stop": (
        ["pod.terminationGracePeriodSeconds=300"],
        None,
        [
            "pod.terminationGracePeriodSeconds=300",
            "trainer.resilience.stop.timeout_s=600",
            "raise pod.terminationGracePeriodSeconds",
        ],
    ),
    "restart setting removed": (
        ["trainer.resilience.launcher.max_restarts=null"],
        None,
        ["trainer.resilience.launcher.max_restarts", "give it a value"],
    ),
    "faults outside the drill": (
        ["trainer.resilience.inject={sigkill@5}"],
        None,
        ["trainer.resilience.inject", "chaos.inject", "chaos.enabled=true"],
    ),
    "faults with the drill off": (["chaos.inject={sigkill@5}"], None, ["chaos.inject", "set chaos.enabled=true"]),
    "drill on without faults": (["chaos.enabled=true"], None, ["chaos.enabled=true", "chaos.inject is empty"]),
    "fault on a rank that does not exist": (
        ["chaos.enabled=true", "chaos.inject={sigkill@5:rank=16}", "nodes=2"],
        None,
        ["chaos.inject sigkill@5:rank=16", "16 ranks", "below 16"],
    ),
    "a memory-tier fault without the memory tier": (
        ["chaos.enabled=true", "chaos.inject={memory-corrupt@5:rank=1}", "trainer.checkpoint.memory.interval_steps=0"],
        None,
        ["chaos.inject memory-corrupt@5:rank=1", "trainer.checkpoint.memory.interval_steps is 0", "set it, e.g. to 2"],
    ),
    "a replica fault without replicas": (
        [
            "chaos.enabled=true",
            "chaos.inject={sigkill-during-replication@5:rank=1}",
            "trainer.checkpoint.memory.replicas=0",
        ],
        None,
        ["chaos.inject sigkill-during-replication@5:rank=1", "trainer.checkpoint.memory.replicas is 0", "set it to 1"],
    ),
    "privileged container": (
        ["pod.containerSecurityContext.privileged=true"],
        None,
        ["pod.containerSecurityContext.privileged=true", "remove it"],
    ),
    "secret as a plain value": (
        ["pod.env[0].name=AWS_SECRET_ACCESS_KEY", "pod.env[0].value=abc"],
        None,
        ["pod.env[0] AWS_SECRET_ACCESS_KEY", "pod.secretEnv.AWS_SECRET_ACCESS_KEY", "secretKeyRef"],
    ),
    "fsx size off the capacity steps": (
        FSX + ["storage.size=3600Gi"],
        IMAGE,
        ["storage.size=3600Gi", "PERSISTENT_2", "a multiple of 2400Gi", "set storage.size"],
    ),
    "irsa role without a created account": (
        ["serviceAccount.create=false", "serviceAccount.roleArn=arn:aws:iam::123456789012:role/r"],
        None,
        ["serviceAccount.roleArn", "serviceAccount.create=true"],
    ),
    "memory slots off the pod's memory": (
        ["trainer.checkpoint.memory.interval_steps=2", "trainer.checkpoint.memory.dir=/fsx/slots"],
        None,
        [
            "trainer.checkpoint.memory.dir=/fsx/slots is not under /dev/shm",
            "shm.sizeLimit",
            "trainer.checkpoint.memory.dir=/dev/shm",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(RULES))
def test_should_fail_naming_the_key_when_values_break_a_cross_key_rule(case):
    sets, base, fragments = RULES[case]
    message = render_error(*sets, **({} if base is None else {"base": base}))
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"
    assert "execution error" not in message  # only the rule's own words reach the user


@pytest.mark.parametrize("size", ["1200Gi", "2400Gi", "4800Gi", "14400Gi"])
def test_should_take_each_fsx_capacity_step_when_storage_is_fsx(size):
    assert render(*FSX, f"storage.size={size}", base=IMAGE).find("PersistentVolumeClaim")


def test_should_fail_naming_the_release_when_job_name_is_not_dns_1035():
    from resilient_fsdp.deploy import chart

    with pytest.raises(chart.ChartError) as caught:
        chart.render({"storage": {"existingClaim": "ckpt"}}, release="9lives")
    assert "9lives" in str(caught.value) and "fullnameOverride" in str(caught.value)


SCHEMA = {
    "unknown top-level key": ("nodez=2", ["unknown key 'nodez'"]),
    "unknown nested key": ("efa.enabledd=true", ["unknown key 'efa.enabledd'"]),
    "unknown trainer key": ("trainer.model.presett=1b", ["unknown key 'trainer.model.presett'"]),
    "bad trainer value": ("trainer.model.preset=3b", ["trainer.model.preset"]),
    "bad enum": ("storage.type=nfs", ["storage.type"]),
    "below minimum": ("nodes=0", ["nodes"]),
    "wrong type": ("spares=yes", ["spares"]),
    "elastic membership": (
        "elastic.enabled=true",
        ["unknown key 'elastic'", "Set nodes (the pods that train) and spares"],
    ),
    "latest tag": ("image.tag=latest", ["image.tag"]),
    "bad fault spec": ("chaos.inject={explode@5}", ["chaos.inject"]),
    "bad quantity": ("shm.sizeLimit=lots", ["shm.sizeLimit"]),
    "bad role arn": ("serviceAccount.roleArn=my-role", ["serviceAccount.roleArn"]),
    "bad efa mode": ("efa.enabled=maybe", ["efa.enabled"]),
}


@pytest.mark.parametrize("case", sorted(SCHEMA))
def test_should_reject_naming_the_key_when_values_break_the_schema(case):
    expression, fragments = SCHEMA[case]
    message = render_error(expression)
    assert message.startswith("values rejected by the chart's values.schema.json")
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"


def test_should_list_the_schema_fault_kinds_when_trainer_kinds_change():
    import json

    from tests.deploy.chart_support import REPO
    from resilient_fsdp.config import FAULT_KINDS

    schema = json.loads((REPO / "charts/resilient-fsdp/values.schema.json").read_text())
    pattern = schema["properties"]["chaos"]["properties"]["inject"]["items"]["pattern"]
    assert sorted(pattern[pattern.index("(") + 1 : pattern.index(")")].split("|")) == sorted(FAULT_KINDS)
    assert pattern == chart.fault_spec_pattern(), "stale: python -m resilient_fsdp.deploy.chart --update-schema"


def test_should_refuse_the_fault_kinds_the_trainer_refuses_without_the_memory_tier():
    """The chart's lists of the kinds that need the memory tier, and replicas, are the trainer's
    (config.fault_spec), and the trainer refuses the same drill once --inject adds it."""
    import re

    from tests.deploy.chart_support import REPO
    from resilient_fsdp.config.fault_spec import MEMORY_FAULT_KINDS, REPLICA_FAULT_KINDS

    text = (REPO / "charts/resilient-fsdp/templates/validations.yaml").read_text()

    def kinds(name: str) -> tuple:
        line = re.search(r"\$" + name + r" := list (.*?) }}", text)
        return tuple(re.findall(r'"([a-z-]+)"', line[1]))

    assert kinds("memoryKinds") == MEMORY_FAULT_KINDS and kinds("replicaKinds") == REPLICA_FAULT_KINDS
    assert render("chaos.enabled=true", "chaos.inject={memory-corrupt@5:rank=1,replica-corrupt@7:rank=2}").documents()


# ---- the validator itself must catch what the cluster would reject --------------------------------


def _job_docs():
    return render("nodes=2").documents()


def _pytorchjob(docs):
    (pj,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    return pj


def test_should_report_an_unknown_pod_field_when_crd_schema_is_strict(crds):
    docs = _job_docs()
    _pytorchjob(docs)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containerz"] = []
    problems = validate.validate_documents(docs, crds)
    assert any("containerz" in p.message and p.check == "CRD schema" for p in problems), problems


def test_should_report_a_bad_type_when_kubernetes_schema_checks_a_pod_template(crds):
    docs = _job_docs()
    worker = _pytorchjob(docs)["spec"]["pytorchReplicaSpecs"]["Worker"]
    worker["template"]["spec"]["terminationGracePeriodSeconds"] = "x"
    problems = validate.validate_documents(docs, crds)
    assert any(p.path.endswith("terminationGracePeriodSeconds") for p in problems), problems


@pytest.mark.parametrize(
    "break_it, path, words",
    [
        (
            lambda s: s["pytorchReplicaSpecs"]["Master"].update(replicas=2),
            "spec.pytorchReplicaSpecs.Master.replicas",
            "must be 1",
        ),
        (
            lambda s: s["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(name="trainer"),
            "spec.pytorchReplicaSpecs.Worker.template.spec.containers",
            "named pytorch",
        ),
        (
            lambda s: (s.update(elasticPolicy={"minReplicas": 1}), s["pytorchReplicaSpecs"].pop("Worker")),
            "spec.pytorchReplicaSpecs.Worker",
            "elastic policy",
        ),
        (
            lambda s: s["pytorchReplicaSpecs"].update(Chief=s["pytorchReplicaSpecs"]["Worker"]),
            "spec.pytorchReplicaSpecs.Chief",
            "Master or Worker",
        ),
    ],
)
def test_should_apply_the_operator_webhook_rules_when_validating_a_pytorchjob(break_it, path, words):
    docs = _job_docs()
    break_it(_pytorchjob(docs)["spec"])
    problems = validate.check_pytorchjob_webhook(_pytorchjob(docs))
    assert any(p.path == path and words in p.message for p in problems), problems
    assert validate.check_pytorchjob_webhook(_pytorchjob(_job_docs())) == []


def test_should_render_hsdp_whose_shard_group_divides_the_world_whatever_the_spares():
    """Spares never train beside the nodes: the world, and so the shard groups, are nodes x ranks a pod."""
    rendered = render("nodes=4", "spares=1", "trainer.dist.shard_group_size=16")
    assert "shard_group_size: 16" in rendered.find("ConfigMap")["data"]["config.yaml"]
    assert "does not divide" in render_error("nodes=4", "spares=1", "trainer.dist.shard_group_size=40")


def test_should_take_the_local_image_name_where_the_nodes_have_no_gpus():
    """kind or minikube with the image loaded by name: the default repository is what they need."""
    rendered = render("instanceType=cpu", "image.repository=resilient-fsdp")
    pytorchjob = rendered.find("PyTorchJob")
    image = pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"]
    assert image == "resilient-fsdp:0.1.0"
