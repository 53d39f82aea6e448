"""What each layer retries and the exit code a node ends with (resilience/exit_codes.py): the table
in the docs is the code's, and each row is shown by real processes where it is about processes."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from resilient_fsdp.config import ConfigError
from resilient_fsdp.local.manifests.pytorchjob import RestartPolicy
from resilient_fsdp.resilience import exit_codes
from resilient_fsdp.resilience.exit_codes import CONFIG, INFRASTRUCTURE, RENDEZVOUS_LOST, node_exit_code
from tests.resilience.node import attempts, run_node, start_node
from tests.support import REPO, assert_no_leftovers, run_local, write_module

# A few steps, a checkpoint every 2, quick restarts.
RUN = [
    "train.steps=6",
    "checkpoint.interval_steps=2",
    "train.log_every=2",
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    "resilience.hang_detection.learn_timeouts=false",
]
IN_PROCESS = [
    "resilience.in_process.enabled=true",
    "dist.timeout_s=8",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
    "resilience.hang_detection.step_timeout_s=60",
]

# What the PyTorchJob controller retries under the chart's ``restartPolicy: ExitCode``.
retryable = RestartPolicy("ExitCode", backoff_limit=4).retryable


def test_the_docs_show_the_codes_table():
    doc = (REPO / "docs" / "faults-and-restarts.md").read_text()
    assert exit_codes.markdown_table() in doc, "regenerate the table: print(exit_codes.markdown_table())"


def test_configuration_codes_fail_the_job_and_infrastructure_codes_are_retried():
    for row in exit_codes.TABLE:
        first = int(row.code.split()[0]) if row.code[0].isdigit() else None
        if row.kind == "configuration":
            assert 1 <= first <= 127 and not retryable(first), row
        elif row.kind == "infrastructure" and first is not None:
            assert retryable(first), row
    assert retryable(INFRASTRUCTURE) and INFRASTRUCTURE == 128 + 75


@pytest.mark.parametrize(
    "returncode,stop,config_failure,expected,row",
    [
        (0, None, False, 0, "done"),
        (0, signal.SIGTERM, False, 0, "done"),  # SIGTERM arrived as training finished
        (1, None, True, CONFIG, "configuration"),  # a rank reported it; ft_launcher was stopped
        (-15, None, True, CONFIG, "configuration"),
        (2, None, False, CONFIG, "configuration"),  # ft_launcher's own bad flags (argparse)
        (93, None, False, 93, "nvrx-no-restart"),  # not reachable with this project's flags
        (1, signal.SIGTERM, False, 143, "stopped"),  # evicted: ranks checkpointed, ft_launcher says 1
        (1, signal.SIGINT, False, 130, "stopped"),
        (-9, None, False, 137, "killed"),
        (1, None, False, INFRASTRUCTURE, "restarts-exhausted"),
    ],
)
def test_node_exit_code_follows_the_table(returncode, stop, config_failure, expected, row):
    code = node_exit_code(returncode, stop, config_failure)
    assert code == expected
    kind = exit_codes.row(row).kind
    assert retryable(code) == (kind in ("stop", "infrastructure"))


@pytest.mark.parametrize(
    "returncode,stop,config_failure,expected",
    [
        (1, None, False, RENDEZVOUS_LOST),  # the store's host went away: this node is healthy
        (1, signal.SIGTERM, False, 143),  # stopped: the stop's code, not the store's
        (1, None, True, CONFIG),  # a configuration failure still fails the job
        (0, None, False, 0),
    ],
)
def test_a_lost_rendezvous_store_is_retried_by_the_job_level(returncode, stop, config_failure, expected):
    """The row only: a node that loses its store is run by the local cluster's tests
    (tests/local/test_four_faults_in_one_job.py)."""
    code = node_exit_code(returncode, stop, config_failure, store_lost=True)
    assert code == expected
    assert retryable(code) == (code >= 128)
    if code == RENDEZVOUS_LOST:
        assert exit_codes.row("rendezvous-store-lost").code == "200"
        assert exit_codes.describe_code(code) == "200: rendezvous-store-lost, retried by the job level"


def test_the_codes_a_node_joins_again_after_and_their_names_come_from_the_table():
    assert exit_codes.REJOINED_CODES == (RENDEZVOUS_LOST, exit_codes.INFRASTRUCTURE)
    assert exit_codes.describe_code(204) == "204: straggler-replaced, retried by the job level"
    assert exit_codes.describe_code(143) == "143: stopped or killed (SIGTERM), retried by the job level"
    assert exit_codes.describe_code(2) == "2: configuration, not retried"


def test_which_exceptions_are_never_retried():
    assert exit_codes.is_configuration_failure(ConfigError("data.path: no such file"))
    assert exit_codes.is_configuration_failure(FloatingPointError("loss is nan at step 3"))
    assert not exit_codes.is_configuration_failure(RuntimeError("NCCL error: unhandled system error"))
    assert not exit_codes.is_configuration_failure(OSError("connection reset by peer"))


# ---- real processes ----------------------------------------------------------------------------

# A configuration error in the middle of training, where in-process restart would retry any other
# exception. (A non-finite loss is retried once: tests/resilience/test_non_finite.py.)
REFUSING_MODEL = """
    from resilient_fsdp.config import ConfigError
    from resilient_fsdp.train.model import build_model

    def build(cfg):
        model = build_model("tiny")
        forward, calls = model.forward, [0]
        def forward_refusing_the_third(tokens):
            calls[0] += 1
            if calls[0] == 3:
                raise ConfigError("model.factory: refusing batch 3 of this data")
            return forward(tokens)
        model.forward = forward_refusing_the_third
        return model
"""


@pytest.mark.parametrize(
    "in_process,lane",
    [(False, "pinned"), pytest.param(True, "pinned", marks=pytest.mark.extended), (True, "image")],
    ids=["in-job", "in-process", "in-process-nvrx07"],
)
def test_a_configuration_failure_is_retried_by_no_layer(tmp_path, request, plugin_dir, in_process, lane):
    """A missing data file (in-job only) or a model that raises a configuration error at step 3
    (in-process restart on, on both NVRx lanes):
    the node exits 2 at once although every layer has restarts left; ft_launcher started the
    ranks once."""
    write_module(plugin_dir, "refusing_model", REFUSING_MODEL)
    run_dir = tmp_path / "run"
    cause = (
        ["model.factory=refusing_model:build"]
        if in_process
        else ["data.source=tokens", f"data.path={tmp_path / 'missing.bin'}"]
    )
    lanes = [request.getfixturevalue("nvrx_lane")] if lane == "image" else []
    t0 = time.monotonic()
    proc = run_local(
        run_dir,
        nodes=1,
        nproc=2,
        pythonpath=[plugin_dir, *lanes],
        timeout=240,
        overrides=RUN + (IN_PROCESS if in_process else []) + cause + ["resilience.launcher.max_restarts=3"],
        extra=["--max-pod-recreations=2"],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == CONFIG, out[-4000:]
    assert "exited with code 2: not retried" in proc.stdout and "recreating" not in proc.stdout, proc.stdout[-3000:]
    reason = "refusing batch 3" if in_process else "data.path="
    assert reason in proc.stdout.split("job FAILED", 1)[1]
    assert attempts(run_dir / "logs" / "node0") == ["attempt_0"], out[-3000:]
    node_log = (run_dir / "logs" / "node0.log").read_text()
    assert "a rank failed with a configuration error, which no restart can fix" in node_log
    if in_process:
        assert "in-process" not in node_log.split(reason, 1)[1].split("\n", 1)[0]
    assert time.monotonic() - t0 < 200
    assert_no_leftovers(run_dir)


def test_bad_trainer_flags_stop_the_node_without_a_restart(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_node(run_dir, RUN + ["resilience.launcher.max_restarts=3"], trainer_args=["--no-such-flag"], timeout=180)
    assert proc.returncode == CONFIG, proc.stderr[-3000:]
    assert "unrecognized arguments: --no-such-flag" in proc.stderr
    assert "invalid trainer arguments" in proc.stderr
    assert attempts(run_dir / "logs") == ["attempt_0"]
    assert_no_leftovers(run_dir)


def test_spent_in_job_restarts_exit_with_the_infrastructure_code(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_node(
        run_dir, RUN + ["resilience.launcher.max_restarts=1"], inject=["exception@2:rank=1", "exception@4:rank=0"]
    )
    assert proc.returncode == INFRASTRUCTURE, proc.stderr[-3000:]
    assert f"exiting {INFRASTRUCTURE}: restarts-exhausted, retried by the job level" in proc.stderr
    assert attempts(run_dir / "logs") == ["attempt_0", "attempt_1"]
    assert_no_leftovers(run_dir)


def test_a_killed_launcher_exits_128_plus_the_signal(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    node = start_node(run_dir, RUN + ["train.steps=400"])
    try:
        deadline = time.monotonic() + 120
        while "step      2 |" not in (run_dir / "node.log").read_text() and time.monotonic() < deadline:
            assert node.poll() is None, (run_dir / "node.log").read_text()[-3000:]
            time.sleep(0.5)
        (launcher,) = psutil.Process(node.pid).children()
        os.kill(launcher.pid, signal.SIGKILL)
        assert node.wait(timeout=60) == 137
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert_no_leftovers(run_dir)


def test_a_node_nvrx_finds_unhealthy_exits_with_its_own_retried_code(tmp_path, nvrx07_lane):
    """Real processes, NVRx 0.7's ft_launcher under the node agent: NVRx's own failure injection
    (``NVRX_INJECT_GPU_FAILURE``, read by its node health check before the first rendezvous) stands
    in for a failed GPU, which cannot exist here. The node exits 201, retried by the job level
    (the chart's rules: tests/deploy/test_restart_rules.py), not the generic 203."""
    from tests.resilience.node import AGENT, free_port
    from tests.support import run_guarded

    cmd = [
        *AGENT,
        "--rejoin-timeout=30",
        "--",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=unhealthy",
        "--rdzv-conf=is_host=true",
        "--max-restarts=0",
        "-m",
        "resilient_fsdp.train",
        "--describe-config",
    ]
    proc = run_guarded(
        cmd, tmp_path, [nvrx07_lane], 120, {"JOB_COMPLETION_INDEX": "0", "NVRX_INJECT_GPU_FAILURE": "0:0"}
    )
    assert proc.returncode == exit_codes.UNHEALTHY_NODE == 201, proc.stderr[-3000:]
    assert exit_codes.UNHEALTHY_NODE in exit_codes.RETRIED
    agent = [line for line in proc.stderr.splitlines() if line.startswith("[resilient-fsdp agent]")]
    assert any(
        "found this node unhealthy" in line and "201: unhealthy-node, retried by the job level" in line
        for line in agent
    ), agent
    # A node that does not host the store never joins again in its pod after it: the node is the fault.
    assert exit_codes.UNHEALTHY_NODE not in exit_codes.REJOINED_CODES


def test_unhealthy_node_output_maps_to_its_code_and_a_ranks_own_lines_do_not():
    from resilient_fsdp.resilience.agent import exit_code

    nvrx07 = ["[ERROR] Agent .run() raised UnhealthyNodeException: Node n0 has an unhealthy GPU."]
    assert exit_code(1, None, nvrx07) == exit_codes.UNHEALTHY_NODE
    assert exit_code(1, None, ["[default0]: UnhealthyNodeException in user code"]) == exit_codes.INFRASTRUCTURE
    # A configuration failure or a stop outranks it; so does a launcher killed by a signal.
    assert exit_code(1, None, nvrx07, config_failure=True) == exit_codes.CONFIG
    assert exit_code(1, 15, nvrx07) == 143 and exit_code(-9, None, nvrx07) == 137
