"""A node's index, who hosts the store and the node rank, from what each controller sets."""

from __future__ import annotations

import pytest

from resilient_fsdp.resilience.node_rank import (
    NodeIndexError,
    launcher_env,
    node_index,
    rdzv_conf,
    rdzv_endpoint,
    with_store_host,
)

ARGS = [
    "--nnodes=4",
    "--rdzv-conf=join_timeout=900,read_timeout=900",
    "-m",
    "resilient_fsdp.train",
    "--config=/etc/c.yaml",
]


@pytest.mark.parametrize(
    "env, index",
    [
        ({"PET_NODE_RANK": "3", "JOB_COMPLETION_INDEX": "1"}, 3),  # the operator's node rank first
        ({"JOB_COMPLETION_INDEX": "2"}, 2),  # JobSet: the Indexed Job's index
        ({"RESILIENT_FSDP_NODE_INDEX": "5"}, 5),  # elastic PyTorchJob: the chart's replica index
        ({}, None),  # a node run by hand
    ],
)
def test_the_index_comes_from_the_first_variable_a_controller_sets(env, index):
    assert node_index(env) == index


def test_a_malformed_index_names_its_variable():
    with pytest.raises(NodeIndexError, match="JOB_COMPLETION_INDEX='x'"):
        node_index({"JOB_COMPLETION_INDEX": "x"})


def test_is_host_joins_the_launchers_rdzv_conf_and_an_explicit_one_is_kept():
    assert with_store_host(ARGS, True)[1] == "--rdzv-conf=join_timeout=900,read_timeout=900,is_host=true"
    assert rdzv_conf(with_store_host(ARGS, False)) == {"join_timeout": "900", "read_timeout": "900", "is_host": "false"}
    explicit = ["--rdzv-conf=is_host=true", *ARGS]
    assert with_store_host(explicit, False) == explicit
    # No --rdzv-conf: a new flag before the training module; the trainer's own flags are not read.
    bare = ["--nnodes=2", "-m", "resilient_fsdp.train", "--rdzv-conf=is_host=true"]
    assert with_store_host(bare, False)[:3] == ["--nnodes=2", "--rdzv-conf=is_host=false", "-m"]


def test_group_rank_is_the_index_unless_set():
    assert launcher_env({"A": "1"}, 7) == {"A": "1", "GROUP_RANK": "7"}
    assert launcher_env({"GROUP_RANK": "2"}, 7)["GROUP_RANK"] == "2"
    assert "GROUP_RANK" not in launcher_env({}, None)


@pytest.mark.parametrize(
    "args, endpoint",
    [
        (["--rdzv-endpoint=pod-0.job:29400", *ARGS], ("pod-0.job", 29400)),
        (["--rdzv_endpoint", "10.0.0.2:29500", *ARGS], ("10.0.0.2", 29500)),
        (["--rdzv-endpoint=[fd00::1]:29400", *ARGS], ("fd00::1", 29400)),
        (["--rdzv-endpoint=pod-0.job", *ARGS], None),  # no port: NVRx's default applies, not watched
        ([*ARGS, "--rdzv-endpoint=trainer:1"], None),  # the trainer's flag, not the launcher's
    ],
)
def test_the_rendezvous_endpoint_is_read_from_the_launchers_flags(args, endpoint):
    assert rdzv_endpoint(args) == endpoint


def test_the_rendezvous_id_names_the_install_and_the_job_keeps_the_id_as_given():
    from resilient_fsdp.resilience.node_rank import INSTALL_ENV, JOB_ENV, with_install

    args = ["--nnodes=4", "--rdzv-id=run1-resilient-fsdp", "-m", "resilient_fsdp.train", "--rdzv-id=trainer-arg"]
    out, env = with_install(args, {INSTALL_ENV: "5f0c7a2e-93aa-4b7e-8c1d-0123456789ab", "PATH": "/bin"})
    assert out == [
        "--nnodes=4",
        "--rdzv-id=run1-resilient-fsdp-5f0c7a2e",
        "-m",
        "resilient_fsdp.train",
        "--rdzv-id=trainer-arg",
    ]  # the trainer's own arguments are not the launcher's
    assert env[JOB_ENV] == "run1-resilient-fsdp" and env["PATH"] == "/bin"
    spaced, _ = with_install(["--rdzv_id", "job", "-m", "x"], {INSTALL_ENV: "abcdef0123"})
    assert spaced == ["--rdzv_id", "job-abcdef01", "-m", "x"]
    # No install (a PyTorchJob, a node run by hand): nothing changes.
    assert with_install(args, {}) == (args, {})
    assert with_install(args, {INSTALL_ENV: " "})[0] == args
