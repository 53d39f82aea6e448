"""The Helm chart, rendered by Helm's own engine: every profile, and each feature of the pods."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.chart_support import (
    IMAGE,
    MY_CLUSTER,
    REGISTRY,
    PROFILES,
    REPO,
    VALUES_DIR,
    config_map,
    container,
    crds,
    env,
    job,  # noqa: F401
    mount,
    pod_spec,
    profile_files,
    render,
    render_error,
    volume,
)
from resilient_fsdp.deploy import chart, validate
from resilient_fsdp.config import Config, load_config, to_dict
from resilient_fsdp.resilience.ft_config import ft_config, ft_launcher_flags

# The profiles the chart ships; more may be added, none of these removed.
REQUIRED_PROFILES = {
    "dev-cpu",
    "g5-12xlarge-1node",
    "p4d-2node",
    "p5-4node",
    "p5-16node",
    "p5en-64node",
    "p6-b200-8node",
}
INSTANCE_TYPES = yaml.safe_load((REPO / "charts/resilient-fsdp/values.yaml").read_text())["instanceTypes"]


# ---- profiles ----------------------------------------------------------------------------------


def test_should_ship_every_named_profile_when_values_dir_is_listed():
    assert REQUIRED_PROFILES <= set(PROFILES)


@pytest.mark.parametrize("profile", PROFILES)
def test_should_render_lint_and_validate_when_profile_is_used(profile, crds):
    values = chart.load_values(profile_files(profile))
    rendered = chart.render(values)
    assert chart.lint(values) == []
    problems = validate.validate_documents(rendered.documents(), crds)
    assert problems == [], "\n".join(map(str, problems))
    assert {d["kind"] for d in rendered.documents()} >= {"PyTorchJob", "ConfigMap", "ServiceAccount"}


@pytest.mark.parametrize("profile", PROFILES)
def test_should_load_with_the_trainers_own_loader_when_config_map_is_rendered(profile, tmp_path):
    rendered = chart.render(chart.load_values(profile_files(profile)))
    path = tmp_path / "config.yaml"
    path.write_text(rendered.find("ConfigMap")["data"]["config.yaml"])
    cfg = load_config(path)  # the trainer's loader: unknown keys and bad values raise
    # ft_launcher's YAML and flags are exactly what the trainer's resilience module derives.
    assert config_map(rendered, "ft_config.yaml") == ft_config(cfg.resilience)
    args = container(rendered)["args"]
    for flag in ft_launcher_flags(cfg.resilience):
        assert flag in args
    mount_path = (
        yaml.safe_load(VALUES_DIR.joinpath(f"{profile}.yaml").read_text()).get("storage", {}).get("mountPath", "/fsx")
    )
    assert str(cfg.checkpoint_dir).startswith(mount_path + "/")
    assert cfg.run_dir.startswith(mount_path + "/")


@pytest.mark.parametrize("profile", PROFILES)
def test_should_state_its_restart_arithmetic_when_profile_header_is_read(profile):
    text = VALUES_DIR.joinpath(f"{profile}.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    values = yaml.safe_load(text)
    for phrase in ("max_restarts", "backoffLimit", "interval"):
        assert phrase in header, f"{profile}: the header does not explain {phrase}"
    # The numbers the header arrives at are the ones the profile sets.
    backoff = re.search(r"backoffLimit = [^\n]*?= (\d+)", header)
    restarts = re.search(r"max_restarts = [^\n]*?= (\d+)", header)
    assert backoff and int(backoff[1]) == values["job"]["backoffLimit"]
    assert restarts and int(restarts[1]) == values["trainer"]["resilience"]["launcher"]["max_restarts"]
    if profile != "dev-cpu":
        # The advisor's derivation (tests/goodput/test_goodput.py checks the numbers against it).
        assert "MTBF" in header and "Daly" in header and "# advise:" in header
        assert f"checkpoint.interval_s {values['trainer']['checkpoint']['interval_s']}" in header


# ---- numbers through helm's --set ------------------------------------------------------------


def test_should_say_how_to_pass_a_number_when_helm_set_made_it_text():
    """helm's --set reads only integers and booleans; 3e-4 arrives as a string, which the schema
    refuses for a number key: the error names the key and the two ways that give a number."""
    with pytest.raises(chart.ChartError) as info:
        chart.render(chart.load_values([VALUES_DIR / "dev-cpu.yaml"], ["trainer.optim.lr=3e-4"]))
    message = str(info.value)
    assert 'trainer.optim.lr: got "3e-4" (text); allowed: a number' in message
    assert "--set-json trainer.optim.lr=<number>" in message and "values file (-f)" in message
    assert "resilient-fsdp local: --set optim.lr=<number>" in message


def test_should_take_a_number_in_exponent_notation_when_given_with_set_json():
    values = chart.load_values(
        [VALUES_DIR / "dev-cpu.yaml"],
        ["trainer.train.steps=7"],
        ["trainer.optim.lr=3e-4", "trainer.optim.betas=[0.8, 0.9]"],
    )
    cfg = config_map(chart.render(values), "config.yaml")
    assert cfg["optim"]["lr"] == 3e-4 and cfg["optim"]["betas"] == [0.8, 0.9] and cfg["train"]["steps"] == 7
    with pytest.raises(chart.ChartError, match="--set-json 'trainer.optim.lr=3e-'.*expected key=<JSON>"):
        chart.load_values([], [], ["trainer.optim.lr=3e-"])


# ---- resources per instance type ---------------------------------------------------------------


@pytest.mark.parametrize("instance_type", sorted(t for t in INSTANCE_TYPES if t != "cpu"))
def test_should_request_gpus_efa_and_hugepages_of_the_instance_when_instance_type_is_set(instance_type):
    spec = INSTANCE_TYPES[instance_type]
    # 1b: the 8b default's training state fits in no single-GPU instance type's two GPUs.
    rendered = render(f"instanceType={instance_type}", "nodes=2", "trainer.model.preset=1b")
    c, e = container(rendered), env(rendered)
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    assert requests == limits
    assert requests["nvidia.com/gpu"] == spec["gpus"]
    assert f"--nproc-per-node={spec['gpus']}" in c["args"]
    assert job(rendered)["spec"]["nprocPerNode"] == str(spec["gpus"])
    assert requests["cpu"] == spec["cpu"] and requests["memory"] == spec["memory"]
    assert pod_spec(rendered)["nodeSelector"]["node.kubernetes.io/instance-type"] == instance_type
    # EFA or not, every capability stays dropped: EFA relies on the runtime's memlock limit.
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["privileged"] is False
    if spec["efa"]:
        assert requests["vpc.amazonaws.com/efa"] == spec["efa"]
        assert requests["hugepages-2Mi"] == "5120Mi"
        assert e["FI_PROVIDER"] == "efa" and e["FI_EFA_FORK_SAFE"] == "1" and e["RDMAV_FORK_SAFE"] == "1"
        assert e["NCCL_TUNER_PLUGIN"] == "/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so"
        assert ("FI_EFA_USE_DEVICE_RDMA" in e) == spec["gpuDirectRdma"]
    else:
        assert "vpc.amazonaws.com/efa" not in requests and "hugepages-2Mi" not in requests
        assert "FI_PROVIDER" not in e and "FI_EFA_USE_DEVICE_RDMA" not in e and "RDMAV_FORK_SAFE" not in e


def test_should_leave_out_efa_when_job_has_one_pod():
    c = container(render("instanceType=p5.48xlarge", "nodes=1"))
    assert "vpc.amazonaws.com/efa" not in c["resources"]["requests"]
    assert "hugepages-2Mi" not in c["resources"]["requests"]


def test_should_use_fewer_gpus_everywhere_when_gpus_per_node_is_set():
    rendered = render("instanceType=p5.48xlarge", "gpusPerNode=4")
    c = container(rendered)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "--nproc-per-node=4" in c["args"]
    assert job(rendered)["spec"]["nprocPerNode"] == "4"


def test_should_take_efa_count_hugepages_and_resources_from_values_when_overridden():
    c = container(render("efa.devices=16", "efa.hugepages2Mi=8Gi", "resources.cpu=100", "resources.memory=1Ti"))
    req = c["resources"]["requests"]
    assert (req["vpc.amazonaws.com/efa"], req["hugepages-2Mi"], req["cpu"], req["memory"]) == (16, "8Gi", "100", "1Ti")


def test_should_run_cpu_ranks_without_gpu_settings_when_instance_type_is_cpu():
    rendered = render("instanceType=cpu", "selectInstanceType=false", "nodes=1", "cpuRanksPerNode=3")
    c, e = container(rendered), env(rendered)
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert "--nproc-per-node=3" in c["args"]
    assert not any(k.startswith(("NCCL_", "TORCH_NCCL_", "FI_")) for k in e)
    assert "nodeSelector" not in pod_spec(rendered)


def test_should_size_shm_as_memory_volume_when_shm_size_is_set():
    rendered = render("shm.sizeLimit=96Gi")
    assert volume(rendered, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "96Gi"}
    assert mount(rendered, "dshm")["mountPath"] == "/dev/shm"


def test_should_dump_nccl_flight_recorder_on_timeout_and_leave_the_path_to_the_trainer_when_enabled():
    """The dump path is the trainer's (under run_dir on the shared volume, resilience/nccl_env.py):
    the chart mounts no node-local volume for it and sets no path."""
    rendered = render("nccl.flightRecorder.bufferSize=5000")
    e = env(rendered)
    assert e["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "5000" and e["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert not {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(e)
    assert not any(v["name"] == "nccl-flight-recorder" for v in pod_spec(rendered)["volumes"])
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env(render("nccl.flightRecorder.enabled=false"))
    overridden = env(render("pod.env[0].name=TORCH_FR_DUMP_TEMP_FILE", "pod.env[0].value=/logs/fr_"))
    assert overridden["TORCH_FR_DUMP_TEMP_FILE"] == "/logs/fr_"  # what the trainer then keeps


# ---- the launcher -------------------------------------------------------------------------------


def test_should_run_the_node_wrapper_with_an_explicit_rendezvous_when_job_has_fixed_size():
    rendered = render(
        "nodes=4",
        "rendezvous.port=29500",
        "trainer.resilience.launcher.max_restarts=7",
        "trainer.resilience.launcher.workers_stop_timeout_s=20",
        "trainer.resilience.stop.timeout_s=300",
        release="run1",
    )
    c = container(rendered)
    assert c["command"] == ["python", "-m", "resilient_fsdp.resilience.agent"]
    args = c["args"]
    # The agent's own flags, then ft_launcher's; the store connect wait follows the join timeout,
    # the store's read timeout and the agent's give-up time are the store timeout.
    assert args[:14] == [
        "--rejoin-timeout=1800",
        "--store-timeout=60",
        "--max-pod-failures=3",
        "--metrics-port=9410",
        "--prewarm=true",
        "--",
        "--ft-cfg-path=/etc/resilient-fsdp/ft_config.yaml",
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=run1-resilient-fsdp-master-0:29500",
        "--rdzv-id=run1-resilient-fsdp",
        "--rdzv-conf=join_timeout=900,read_timeout=60,store_connect_wait_seconds=900",
        "--max-restarts=7",
    ]
    assert "--workers-stop-timeout=20" in args and "--term-timeout=300" in args
    trainer = args[args.index("-m") :]
    assert trainer == ["-m", "resilient_fsdp.train", "--config=/etc/resilient-fsdp/config.yaml"]
    assert c["ports"] == [
        {"name": "pytorchjob-port", "containerPort": 29500, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9410, "protocol": "TCP"},
    ]
    specs = job(rendered)["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)
    assert "elasticPolicy" not in job(rendered)["spec"]
    assert mount(rendered, "config")["mountPath"] == "/etc/resilient-fsdp"


def test_should_let_ranks_import_their_own_when_prewarm_is_off():
    args = container(render("trainer.resilience.launcher.prewarm=false"))["args"]
    assert not any(a.startswith("--prewarm") for a in args) and "--" in args


def test_should_render_master_only_when_job_has_one_pod():
    specs = job(render("nodes=1"))["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Master"]


def test_should_add_spare_workers_and_train_at_nodes_when_spares_are_set():
    """Spares are more Workers of the same pod; --nnodes=nodes:nodes+spares, so NVRx 0.6+ trains at
    `nodes` and keeps the rest standby; the Master still hosts the store."""
    rendered = render("nodes=4", "spares=2")
    spec = job(rendered)["spec"]
    assert (spec["pytorchReplicaSpecs"]["Master"]["replicas"], spec["pytorchReplicaSpecs"]["Worker"]["replicas"]) == (
        1,
        5,
    )
    assert "elasticPolicy" not in spec
    for role in ("Master", "Worker"):
        args = container(rendered, role)["args"]
        assert "--nnodes=4:6" in args and "--rdzv-endpoint=resilient-fsdp-master-0:29400" in args
    assert "--nnodes=4" in container(render("nodes=4"))["args"]


def test_should_share_one_pod_template_when_job_has_master_and_workers():
    specs = job(render("nodes=3"))["spec"]["pytorchReplicaSpecs"]
    master, worker = specs["Master"]["template"], specs["Worker"]["template"]
    assert master["metadata"]["labels"].pop("app.kubernetes.io/component") == "master"
    assert worker["metadata"]["labels"].pop("app.kubernetes.io/component") == "worker"
    assert master == worker


def test_should_keep_a_nulled_timeout_null_in_both_files_when_user_disables_it(tmp_path):
    rendered = render("trainer.resilience.hang_detection.step_timeout_s=null")
    path = tmp_path / "config.yaml"
    path.write_text(rendered.find("ConfigMap")["data"]["config.yaml"])
    cfg = load_config(path)
    assert cfg.resilience.hang_detection.step_timeout_s is None
    assert config_map(rendered, "ft_config.yaml")["fault_tolerance"]["rank_section_timeouts"]["step"] is None


def test_should_carry_the_trainers_resilience_defaults_as_generated_when_values_yaml_is_read():
    text = (REPO / "charts/resilient-fsdp/values.yaml").read_text()
    lines = text.splitlines()
    start, end = lines.index(chart.RESILIENCE_START), lines.index(chart.RESILIENCE_END)
    assert lines[start : end + 1] == chart.resilience_defaults(), (
        "values.yaml's trainer.resilience is stale: python -m resilient_fsdp.deploy.chart --update-schema"
    )
    defaults = {k: v for k, v in to_dict(Config())["resilience"].items() if k != "inject"}
    assert yaml.safe_load(text)["trainer"]["resilience"] == defaults


def test_should_derive_grace_period_from_graceful_stop_when_not_set():
    assert pod_spec(render("trainer.resilience.stop.timeout_s=300"))["terminationGracePeriodSeconds"] == 360
    assert pod_spec(render("pod.terminationGracePeriodSeconds=900"))["terminationGracePeriodSeconds"] == 900


# ---- storage ------------------------------------------------------------------------------------


def test_should_mount_the_existing_claim_at_checkpoint_dir_when_storage_is_existing_claim():
    rendered = render("storage.mountPath=/data", release="r")
    assert volume(rendered, "shared")["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert mount(rendered, "shared")["mountPath"] == "/data"
    assert config_map(rendered, "config.yaml")["run_dir"] == "/data/runs/r-resilient-fsdp"
    assert not [d for d in rendered.documents() if d["kind"] in ("PersistentVolumeClaim", "StorageClass")]


def test_should_create_fsx_storage_class_and_rwx_claim_when_storage_is_fsx():
    rendered = render(
        "storage.type=fsx",
        "storage.fsx.subnetId=subnet-0abc",
        "storage.fsx.securityGroupIds={sg-01,sg-02}",
        "storage.fsx.perUnitStorageThroughput=500",
        "storage.size=2400Gi",
        base=IMAGE,
        namespace="ml",
    )
    sc, pvc = rendered.find("StorageClass"), rendered.find("PersistentVolumeClaim")
    assert sc["provisioner"] == "fsx.csi.aws.com"
    assert sc["parameters"] == {
        "subnetId": "subnet-0abc",
        "securityGroupIds": "sg-01,sg-02",
        "deploymentType": "PERSISTENT_2",
        "perUnitStorageThroughput": "500",
        "dataCompressionType": "NONE",
    }
    assert sc["reclaimPolicy"] == "Retain" and sc["mountOptions"] == ["flock"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"] == "ml-resilient-fsdp-fsx"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2400Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert volume(rendered, "shared")["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


FSX = ["storage.type=fsx", "storage.fsx.subnetId=subnet-0abc", "storage.fsx.securityGroupIds={sg-01}"]


def test_should_give_an_efa_file_system_the_metadata_configuration_and_lustre_version_fsx_needs():
    """FSx creates an EFA-enabled file system only with a metadata configuration and Lustre 2.15."""

    def params(*sets):
        return render(*FSX, *sets, base=IMAGE).find("StorageClass")["parameters"]

    efa = params("storage.fsx.efaEnabled=true")
    assert (efa["efaEnabled"], efa["metadataConfigurationMode"], efa["fileSystemTypeVersion"]) == (
        "true",
        "AUTOMATIC",
        "2.15",
    )
    assert "metadataIops" not in efa
    provisioned = params(
        "storage.fsx.efaEnabled=true",
        "storage.fsx.metadataConfigurationMode=USER_PROVISIONED",
        "storage.fsx.metadataIops=6000",
        "storage.fsx.fileSystemTypeVersion=2.16",
    )
    assert (
        provisioned["metadataConfigurationMode"],
        provisioned["metadataIops"],
        provisioned["fileSystemTypeVersion"],
    ) == ("USER_PROVISIONED", "6000", "2.16")
    plain = params()
    assert not {"efaEnabled", "metadataConfigurationMode", "metadataIops", "fileSystemTypeVersion"} & set(plain)


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["storage.fsx.efaEnabled=true", "storage.fsx.fileSystemTypeVersion=2.12"],
            "storage.fsx.efaEnabled=true needs Lustre 2.15 or newer, and storage.fsx.fileSystemTypeVersion=2.12",
        ),
        (
            ["storage.fsx.metadataConfigurationMode=USER_PROVISIONED"],
            "storage.fsx.metadataConfigurationMode=USER_PROVISIONED needs storage.fsx.metadataIops",
        ),
        (
            ["storage.fsx.metadataIops=3000"],
            "storage.fsx.metadataIops=3000 applies only with storage.fsx.metadataConfigurationMode=USER_PROVISIONED",
        ),
        (
            ["storage.fsx.deploymentType=SCRATCH_2", "storage.fsx.metadataConfigurationMode=AUTOMATIC"],
            "storage.fsx.metadataConfigurationMode=AUTOMATIC needs storage.fsx.deploymentType=PERSISTENT_2 (it is "
            "SCRATCH_2): remove it",
        ),
    ],
)
def test_should_refuse_a_metadata_configuration_fsx_would_refuse_naming_the_key(sets, message):
    assert message in render_error(*FSX, *sets, base=IMAGE)


def test_should_change_volume_ownership_only_when_the_root_does_not_match_on_every_profile():
    for profile in PROFILES:
        rendered = render(files=profile_files(profile), base=IMAGE if profile != "dev-cpu" else [])
        assert pod_spec(rendered)["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch", profile


def test_should_claim_from_a_named_class_when_fsx_storage_class_is_not_created():
    rendered = render(
        "storage.type=fsx", "storage.fsx.createStorageClass=false", "storage.fsx.storageClassName=fsx-sc", base=IMAGE
    )
    assert rendered.find("PersistentVolumeClaim")["spec"]["storageClassName"] == "fsx-sc"
    assert not [d for d in rendered.documents() if d["kind"] == "StorageClass"]


def test_should_bind_a_static_fsx_volume_when_storage_is_fsx_static():
    rendered = render(
        "storage.type=fsxStatic",
        "storage.fsxStatic.volumeHandle=fs-0123abcd",
        "storage.fsxStatic.dnsname=fs-0123abcd.fsx.us-west-2.amazonaws.com",
        "storage.fsxStatic.mountname=abcdefgh",
        base=IMAGE,
    )
    pv, pvc = rendered.find("PersistentVolume"), rendered.find("PersistentVolumeClaim")
    assert pv["spec"]["csi"] == {
        "driver": "fsx.csi.aws.com",
        "volumeHandle": "fs-0123abcd",
        "volumeAttributes": {"dnsname": "fs-0123abcd.fsx.us-west-2.amazonaws.com", "mountname": "abcdefgh"},
    }
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "" and pvc["spec"]["volumeName"] == pv["metadata"]["name"]


def test_should_put_the_run_on_an_empty_dir_when_storage_is_empty_dir_and_one_pod():
    rendered = render("storage.type=emptyDir", "nodes=1", base=IMAGE)
    assert volume(rendered, "shared")["emptyDir"] == {"sizeLimit": "50Gi"}


def test_should_point_checkpoint_dir_at_the_volume_when_user_moves_it_under_mount_path(tmp_path):
    rendered = render("trainer.checkpoint.dir=/fsx/shared-ckpts/run1")
    assert config_map(rendered, "config.yaml")["checkpoint"]["dir"] == "/fsx/shared-ckpts/run1"


# ---- job policy, scheduling, identity -----------------------------------------------------------


def test_should_restart_on_exit_code_with_defaults_when_job_policy_is_not_set():
    spec = job(render("nodes=2"))["spec"]
    for replica in spec["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "ExitCode"
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3}


def test_should_pass_job_policy_through_when_set():
    rendered = render(
        "job.backoffLimit=9",
        "job.cleanPodPolicy=All",
        "job.ttlSecondsAfterFinished=3600",
        "job.activeDeadlineSeconds=864000",
        "job.schedulingPolicy.minAvailable=4",
        "job.schedulingPolicy.queue=gpu",
        "job.kueueQueue=team-a",
        "job.restartPolicy=OnFailure",
    )
    spec, meta = job(rendered)["spec"], job(rendered)["metadata"]
    assert spec["runPolicy"] == {
        "cleanPodPolicy": "All",
        "backoffLimit": 9,
        "ttlSecondsAfterFinished": 3600,
        "activeDeadlineSeconds": 864000,
        "schedulingPolicy": {"minAvailable": 4, "queue": "gpu"},
    }
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert spec["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"


def test_should_pass_scheduling_settings_through_when_set():
    values = {
        "storage": {"existingClaim": "ckpt"},
        "image": {"repository": REGISTRY},
        "pod": {
            "nodeSelector": {"pool": "train"},
            "priorityClassName": "high",
            "avoidUnhealthyNodes": False,
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                        ]
                    }
                }
            },
        },
    }
    spec = pod_spec(chart.render(values))
    assert spec["nodeSelector"] == {"pool": "train", "node.kubernetes.io/instance-type": "p5.48xlarge"}
    # The user's tolerations first, then the short eviction from a node that stopped reporting.
    unreachable = [
        {"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
        for k in ("unreachable", "not-ready")
    ]
    assert spec["tolerations"] == values["pod"]["tolerations"] + unreachable
    assert spec["affinity"] == values["pod"]["affinity"]
    assert spec["priorityClassName"] == "high"


def test_should_evict_from_a_node_that_stopped_reporting_after_the_set_time_unless_the_user_tolerates_it():
    assert [t["tolerationSeconds"] for t in pod_spec(render("pod.unreachableTolerationSeconds=20"))["tolerations"]] == [
        20,
        20,
    ]
    assert "tolerations" not in pod_spec(render("pod.unreachableTolerationSeconds=null"))
    own = {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 900,
    }
    spec = pod_spec(
        chart.render(
            {"storage": {"existingClaim": "c"}, "image": {"repository": REGISTRY}, "pod": {"tolerations": [own]}}
        )
    )
    assert spec["tolerations"] == [
        own,
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ]


def test_should_annotate_do_not_disrupt_when_enabled():
    meta = job(render())["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]
    assert meta["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    meta = job(render("pod.doNotDisrupt=false"))["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]
    assert "karpenter.sh/do-not-disrupt" not in meta.get("annotations", {})


def test_should_annotate_the_service_account_with_the_role_when_irsa_role_is_set():
    rendered = render("serviceAccount.roleArn=arn:aws:iam::123456789012:role/train", release="r")
    sa = rendered.find("ServiceAccount")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == "arn:aws:iam::123456789012:role/train"
    assert sa["automountServiceAccountToken"] is False
    assert pod_spec(rendered)["serviceAccountName"] == sa["metadata"]["name"] == "r-resilient-fsdp"
    assert pod_spec(rendered)["automountServiceAccountToken"] is False


def test_should_use_a_named_service_account_when_creation_is_off():
    rendered = render("serviceAccount.create=false", "serviceAccount.name=shared-sa")
    assert not [d for d in rendered.documents() if d["kind"] == "ServiceAccount"]
    assert pod_spec(rendered)["serviceAccountName"] == "shared-sa"


def test_should_reference_secrets_and_pass_env_through_when_secret_env_is_set():
    values = {
        "storage": {"existingClaim": "ckpt"},
        "image": {"repository": REGISTRY},
        "pod": {
            "secretEnv": {"HF_TOKEN": {"secretName": "hf", "key": "token"}},
            "env": [
                {"name": "LOGLEVEL", "value": "INFO"},
                {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
            ],
            "envFrom": [{"configMapRef": {"name": "site-env"}}],
        },
    }
    rendered = chart.render(values)
    e, c = env(rendered), container(rendered)
    assert e["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert e["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wandb", "key": "key"}}
    assert e["LOGLEVEL"] == "INFO"
    assert c["envFrom"] == [{"configMapRef": {"name": "site-env"}}]
    assert "token" not in rendered.find("ConfigMap")["data"]["config.yaml"]


def test_should_harden_the_pod_when_defaults_are_used():
    spec, c = pod_spec(render()), container(render())
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert volume(render(), "tmp")["emptyDir"] == {"sizeLimit": "20Gi"}


def test_should_admit_only_the_jobs_pods_when_network_policy_is_on():
    policy = render("metrics.enabled=false").find("NetworkPolicy")
    (rule,) = policy["spec"]["ingress"]  # the metrics scraper's rule: test_chart_metrics.py
    assert rule["from"][0]["podSelector"] == policy["spec"]["podSelector"]
    assert not [d for d in render("networkPolicy.enabled=false").documents() if d["kind"] == "NetworkPolicy"]


def test_should_render_extra_objects_when_given():
    rendered = render('extraObjects[0]=apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: "{{ .Release.Name }}-extra"')
    assert rendered.find("ConfigMap", "resilient-fsdp-extra")


# ---- the chaos drill ----------------------------------------------------------------------------


def test_should_pass_faults_to_the_trainer_and_warn_when_chaos_drill_is_on():
    rendered = render("chaos.enabled=true", "chaos.inject={sigkill@200:rank=3,hang@500}")
    args = container(rendered)["args"]
    assert args[-2:] == ["--inject=sigkill@200:rank=3", "--inject=hang@500"]
    assert "CHAOS DRILL ON" in rendered.notes and "sigkill@200:rank=3" in rendered.notes


def test_should_inject_nothing_and_not_warn_when_chaos_drill_is_off():
    rendered = render()
    assert not [a for a in container(rendered)["args"] if a.startswith("--inject")]
    assert "CHAOS" not in rendered.notes


def test_should_tell_how_to_follow_resume_and_stop_when_notes_are_printed():
    notes = render(release="r").notes
    assert "kubectl -n default get pytorchjob r-resilient-fsdp" in notes
    assert "/fsx/runs/r-resilient-fsdp/checkpoints" in notes
    assert "Resume" in notes and "Stop gracefully" in notes


# ---- values documentation and schema ------------------------------------------------------------


def test_should_match_the_trainer_config_when_values_schema_is_generated():
    schema = (REPO / "charts/resilient-fsdp/values.schema.json").read_text()
    assert json.loads(schema)["properties"]["trainer"] == chart.trainer_schema(), (
        "run: python -m resilient_fsdp.deploy.chart --update-schema"
    )
    assert json.loads(schema)["$schema"] == "http://json-schema.org/draft-07/schema#"


def test_should_document_every_value_when_values_yaml_is_read():
    """Every leaf key has a helm-docs `# --` comment on itself or on an enclosing key."""
    lines = (REPO / "charts/resilient-fsdp/values.yaml").read_text().splitlines()
    key_line = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_.\-]+):(?P<rest>.*)$")
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    undocumented = []
    entries = [(i, key_line.match(line)) for i, line in enumerate(lines)]
    entries = [(i, m) for i, m in entries if m and not lines[i].lstrip().startswith("#")]
    for n, (i, m) in enumerate(entries):
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#") and "# --" not in lines[j]:
            j -= 1
        documented = j >= 0 and "# --" in lines[j] and lines[j].startswith(m["indent"] + "# --")
        inherited = documented or any(d for _, _, d in stack)
        nxt = entries[n + 1][1] if n + 1 < len(entries) else None
        is_leaf = m["rest"].strip() != "" or nxt is None or len(nxt["indent"]) <= indent
        if is_leaf and not inherited:
            undocumented.append(".".join([k for _, k, _ in stack] + [m["key"]]))
        stack.append((indent, m["key"], documented))
    assert undocumented == []


# ---- the commands -------------------------------------------------------------------------------


def test_should_print_manifests_when_render_command_runs(capsys):
    from resilient_fsdp.cli import main

    assert (
        main(
            [
                "render",
                "-f",
                str(VALUES_DIR / "dev-cpu.yaml"),
                "--set",
                "trainer.train.steps=50",
                "--release",
                "demo",
                "--notes",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    docs = [d for d in yaml.safe_load_all(out) if d]
    (pj,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    assert pj["metadata"]["name"] == "demo-resilient-fsdp"
    assert "# Source: resilient-fsdp/templates/pytorchjob.yaml" in out
    assert "Follow the job" in err


def test_should_exit_2_naming_the_key_when_render_gets_a_bad_value(capsys):
    from resilient_fsdp.cli import main

    assert main(["render", "-f", str(VALUES_DIR / "dev-cpu.yaml"), "--set", "nodes=3"]) == 2
    assert "storage.type=emptyDir" in capsys.readouterr().err
    assert main(["render", "-f", str(REPO / "no-such.yaml")]) == 2
    assert "-f " in capsys.readouterr().err


def test_should_pass_when_validate_command_checks_a_profile(capsys, crds):
    from resilient_fsdp.cli import main

    code = main(["validate", "-f", str(VALUES_DIR / "p5-4node.yaml"), "-f", str(MY_CLUSTER)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "ok   PyTorchJob/resilient-fsdp" in out


def test_should_fail_naming_the_field_when_validate_finds_a_bad_object(capsys, crds):
    from resilient_fsdp.cli import main

    bad = "extraObjects[0]=apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  portz: []"
    code = main(["validate", "-f", str(VALUES_DIR / "dev-cpu.yaml"), "--set", bad])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL Service/x" in out and "portz" in out


def test_should_say_how_to_get_crds_when_the_crd_directory_is_missing(capsys, tmp_path):
    from resilient_fsdp.cli import main

    code = main(["validate", "-f", str(VALUES_DIR / "dev-cpu.yaml"), "--crds", str(tmp_path / "none")])
    assert code == 2
    assert "scripts/fetch-crds" in capsys.readouterr().err


# ---- a job's config is fixed for that job ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["PyTorchJob", "JobSet", "TrainJob"])
def test_should_mount_an_immutable_config_named_by_its_content_when_rendered(kind):
    first = render(f"workload.kind={kind}")
    changed = render(f"workload.kind={kind}", "trainer.train.steps=77")
    names = []
    for rendered in (first, changed):
        cm = rendered.find("ConfigMap")
        assert cm["immutable"] is True
        names.append(cm["metadata"]["name"])
        text = rendered.text()
        # Every pod template mounts that one ConfigMap, and no other name of it appears.
        assert text.count(f"name: {cm['metadata']['name']}") >= 2
    assert names[0] != names[1] and all(n.startswith("resilient-fsdp-config-") for n in names)
    assert render(f"workload.kind={kind}").find("ConfigMap")["metadata"]["name"] == names[0]  # deterministic


def test_should_refuse_helm_upgrade_naming_how_to_change_a_running_job():
    with pytest.raises(chart.ChartError) as caught:
        render("workload.kind=JobSet", release="run1", upgrade=True)
    message = str(caught.value)
    assert "helm upgrade of run1: a training job keeps the spec and config it started with" in message
    assert "helm uninstall run1 -n default, then helm install run1 with the new values" in message
    assert "storage.keepOnUninstall" in message


def test_should_give_every_pod_spares_included_its_own_index_for_the_agent():
    """The operator's PET_NODE_RANK is each pod's index, spares included: the node agent reads it for
    who hosts the store (pod 0) and the infrastructure rank NVRx orders the nodes by."""
    from resilient_fsdp.local.manifests.pytorchjob import read_pytorchjob
    from resilient_fsdp.resilience.node_rank import node_index

    pods = read_pytorchjob(job(render("nodes=2", "spares=1"))).pods
    assert [node_index(p.env) for p in pods] == [0, 1, 2]
