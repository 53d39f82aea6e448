"""``resilient-fsdp local``'s flags as chart values, and the render kept with the run (no pod starts)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from resilient_fsdp.local import job as local_job


def test_flags_become_chart_values(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 7\n")
    args = argparse.Namespace(
        values_files=[],
        chart_values=["job.backoffLimit=0"],
        chart_values_json=[],
        config=str(config),
        overrides=["seed=3", "resilience.in_process.enabled=true"],
        nodes=3,
        nproc_per_node=1,
        max_restarts=1,
        inject=["sigkill@5:rank=0"],
        rdzv_port=None,
    )
    values = local_job.chart_values(args, tmp_path, "netns")
    assert values["nodes"] == 3 and values["cpuRanksPerNode"] == 1 and values["job"]["backoffLimit"] == 0
    assert values["storage"]["type"] == "existingClaim" and values["trainer"]["run_dir"] == "/fsx"
    assert values["trainer"]["train"] == {"steps": 7} and values["trainer"]["seed"] == 3
    resilience = values["trainer"]["resilience"]  # dev-cpu's, then --set, then --max-restarts
    assert resilience["in_process"]["enabled"] is True and resilience["launcher"]["max_restarts"] == 1
    assert resilience["hang_detection"]["init_timeout_s"] == 300
    assert values["chaos"] == {"enabled": True, "inject": ["sigkill@5:rank=0"]}
    assert values["instanceType"] == "cpu"  # values/dev-cpu.yaml, the default
    loop = local_job.chart_values(args, tmp_path, "loopback", mount_path=str(tmp_path))
    assert loop["storage"]["mountPath"] == str(tmp_path) and 1024 <= loop["rendezvous"]["port"] <= 65535


def test_paths_under_the_volume_name_the_same_files_where_it_is_mounted_elsewhere(tmp_path):
    """Loopback renders the shared volume at the run directory: a path the user wrote under the
    chart's mount path (/fsx) follows it; other paths and look-alikes do not."""
    args = argparse.Namespace(
        values_files=[],
        chart_values=[],
        chart_values_json=[],
        config=None,
        overrides=[
            "data.path=/fsx/data/text",
            "model.hf_config=/fsx",
            "model.init_from=/fsxy/w",
            "checkpoint.dir=/data/ckpt",
        ],
        nodes=1,
        nproc_per_node=1,
        max_restarts=None,
        inject=[],
        rdzv_port=None,
    )
    loop = local_job.chart_values(args, tmp_path, "loopback", mount_path=str(tmp_path))["trainer"]
    assert loop["data"]["path"] == f"{tmp_path}/data/text" and loop["model"]["hf_config"] == str(tmp_path)
    assert loop["model"]["init_from"] == "/fsxy/w" and loop["checkpoint"]["dir"] == "/data/ckpt"
    netns = local_job.chart_values(args, tmp_path, "netns")["trainer"]
    assert netns["data"]["path"] == "/fsx/data/text"


def test_the_rendered_manifests_are_kept_with_the_run(tmp_path, capsys):
    """``local`` writes what it rendered beside the run, and refuses a partition it cannot make."""
    args = argparse.Namespace(
        values_files=[],
        chart_values=[],
        chart_values_json=[],
        config=None,
        overrides=["train.steps=3"],
        nodes=2,
        nproc_per_node=1,
        max_restarts=None,
        inject=["partition@2:node=1"],
        rdzv_port=None,
        run_dir=str(tmp_path / "run"),
        isolation="loopback",
        release="t",
        max_recreations=3,
        verbose=False,
    )
    with pytest.raises(Exception, match="partition faults need --isolation netns"):
        local_job.prepare(args)
    args.inject = ["partition@2:node=1", "node-freeze@3:node=1:for=30"]
    with pytest.raises(Exception, match="node-freeze and partition faults need --isolation netns"):
        local_job.prepare(args)
    args.inject = []
    job, isolation, _ = local_job.prepare(args)
    assert isolation == "loopback" and len(job.workload.pods) == 2
    text = (Path(args.run_dir) / "cluster" / "manifests.yaml").read_text()
    assert "kind: PyTorchJob" in text and "name: t-resilient-fsdp" in text
