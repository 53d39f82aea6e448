"""The node agent: a dead rank's helpers swept, detached monitors left alone."""

from __future__ import annotations

import json

import pytest

from tests.resilience.probes import HERE as PROBES


def test_node_wrapper_kills_a_dead_ranks_helpers_but_not_detached_monitors():
    """Real processes: a rank is SIGKILLed and leaves a helper that ignores SIGTERM, plus a
    detached monitor in its own session (as NVRx's in-process monitor is)."""
    import subprocess
    import sys

    probe = PROBES / "sweeper.py"
    proc = subprocess.run([sys.executable, "-W", "ignore", str(probe)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["killed"] == [result["helper"]]
    assert result["alive"][str(result["helper"])] is False
    assert len(result["monitors"]) == 1 and result["alive"][str(result["monitors"][0])] is True


def test_a_node_that_is_not_the_store_host_joins_again_then_exits_when_no_store_returns(tmp_path):
    """Real processes: node 1 of a two-node job whose store host never starts. Its launcher's
    connect wait (read_timeout) ends; the agent starts it again in the pod, not counted, until the
    rejoin window ends; then the node exits retryably, so the job level counts it."""
    proc, agent = _lonely_node(tmp_path, rejoin_timeout=4, steps=5)
    assert proc.returncode == 200, proc.stderr[-3000:]
    assert agent[0] == "[resilient-fsdp agent] node 1 of the job (GROUP_RANK=1); joins the rendezvous store"
    joins = [line for line in agent if "joining again in this pod, not counted" in line]
    assert joins and "200: rendezvous-store-lost" in joins[0]
    assert any("no rendezvous completed within 4 s of the event" in line for line in agent)


def _lonely_node_cmd(run_dir, rejoin_timeout: int, steps: int, nnodes: str = "2", extra: list | None = None):
    """Node 1 of a job whose store host never starts, training ``train.steps=steps`` in ``run_dir``."""
    from tests.resilience.node import AGENT, free_port

    return [
        *AGENT,
        f"--rejoin-timeout={rejoin_timeout}",
        "--",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=lonely",
        "--rdzv-conf=join_timeout=2,read_timeout=2,store_connect_wait_seconds=2",
        "--max-restarts=0",
        "-m",
        "resilient_fsdp.train",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        f"train.steps={steps}",
        *(extra or []),
    ]


def _lonely_node(
    run_dir,
    rejoin_timeout: int,
    steps: int,
    lane: list | None = None,
    nnodes: str = "2",
    index: str = "1",
    extra: list | None = None,
):
    """Run :func:`_lonely_node_cmd` as the pod of ``index`` to its end: the process, the agent's lines."""
    from tests.support import run_guarded

    proc = run_guarded(
        _lonely_node_cmd(run_dir, rejoin_timeout, steps, nnodes, extra),
        run_dir,
        lane,
        120,
        {"JOB_COMPLETION_INDEX": index},
    )
    return proc, [line for line in proc.stderr.splitlines() if line.startswith("[resilient-fsdp agent]")]


def _records(run_dir, *records: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_pod_that_lost_the_store_exits_0_once_the_run_directory_says_the_job_trained_every_step(tmp_path):
    """Real processes: a hot spare (or a pod recreated just before the last rendezvous) whose
    launcher loses the store as the job ends reads the run directory: once its last record is rank
    0's finish at train.steps, the pod succeeds instead of joining again and being counted. The
    finish is written while the pod's first launcher starts, as the job's would be."""
    import subprocess
    import threading

    from tests.support import REPO, _env

    run_dir = tmp_path / "run"
    _records(run_dir, {"event": "start", "t": 1.0, "layer": "start"}, {"event": "step", "step": 5, "t": 2.0})
    proc = subprocess.Popen(
        _lonely_node_cmd(run_dir, rejoin_timeout=60, steps=5),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(None, run_dir, {"JOB_COMPLETION_INDEX": "1"}),
        cwd=REPO,
        start_new_session=True,
    )
    guard = threading.Timer(120, proc.kill)
    guard.start()
    agent, written = [], False
    try:
        for line in proc.stderr:
            if line.startswith("[resilient-fsdp agent]"):
                agent.append(line.strip())
                if "starting the launcher anyway" in line and not written:
                    written = True
                    with open(run_dir / "metrics.jsonl", "a") as f:
                        f.write(json.dumps({"event": "finish", "step": 5, "t": 3.0}) + "\n")
        proc.wait()
    finally:
        guard.cancel()
    assert proc.returncode == 0, agent
    assert written and not any("joining again in this pod" in line for line in agent), agent
    done = [line for line in agent if "the job's training is complete" in line]
    assert done and "ft_launcher exited" in done[0], agent
    assert "finish at step 5 of train.steps=5" in done[0] and "a standby pod" in done[0]


@pytest.mark.parametrize("index,stop", [("1", None), ("0", 3)], ids=["node-1-at-train.steps", "pod-0-at-stop_at_step"])
def test_a_pod_started_after_its_job_ended_exits_0_without_starting_a_launcher(tmp_path, index, stop):
    """Real agent process: a pod recreated after the job trained its last step (its node froze and
    was replaced as training ended) finds no launcher to join. The run directory's last record is
    the finish at train.steps, or at train.stop_at_step when that stops the run earlier: the pod
    exits 0 at once, before waiting for a store (which would hold a JobSet open for the rejoin
    window), pod 0 included, which would otherwise wait for peers that already left."""
    import time

    run_dir = tmp_path / "run"
    last = stop or 5
    _records(run_dir, {"event": "start", "t": 1.0, "layer": "start"}, {"event": "finish", "step": last, "t": 3.0})
    began = time.monotonic()
    extra = [] if stop is None else ["--set", f"train.stop_at_step={stop}"]
    proc, agent = _lonely_node(run_dir, rejoin_timeout=600, steps=5, index=index, extra=extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in agent if "already complete" in line]
    limit = f"train.stop_at_step={stop}" if stop else "train.steps=5"
    assert said and f"finish at step {last} of {limit}" in said[0] and "without starting ft_launcher" in said[0], agent
    assert not any("joins the rendezvous store" in line and "waited" in line for line in agent)
    assert not any("joining again" in line or "ft_launcher exited" in line for line in agent), agent
    assert time.monotonic() - began < 60  # not the store wait (join_timeout) nor the rejoin window (600 s)


def test_a_pod_that_lost_the_store_joins_again_when_the_run_directory_holds_no_finish_at_the_last_step(tmp_path):
    """The same node, with a finish short of train.steps (a graceful stop, or a job launched again
    for more steps): the job is not done, so it joins again as before."""
    run_dir = tmp_path / "run"
    _records(run_dir, {"event": "start", "t": 1.0, "layer": "start"}, {"event": "finish", "step": 3, "t": 3.0})
    proc, agent = _lonely_node(run_dir, rejoin_timeout=3, steps=5)
    assert proc.returncode == 200, proc.stderr[-3000:]
    assert any("joining again in this pod" in line for line in agent)
    assert not any("training is complete" in line for line in agent)


def test_training_complete_reads_only_a_last_finish_at_the_configured_steps(tmp_path):
    from resilient_fsdp.resilience.agent import training_complete

    run_dir = tmp_path / "run"
    args = ["-m", "resilient_fsdp.train", "--set", f"run_dir={run_dir}", "--set", "train.steps=5"]
    assert training_complete(args) is None  # no metrics.jsonl
    _records(run_dir, {"event": "finish", "step": 5, "t": 3.0})
    assert "finish at step 5 of train.steps=5" in training_complete(args)
    # Launched again on the same run directory: its first attempt's start follows the finish.
    _records(run_dir, {"event": "finish", "step": 5, "t": 3.0}, {"event": "start", "t": 4.0, "layer": "start"})
    assert training_complete(args) is None
    # Records rank 0 writes after its finish (the final upload, S3 retention) and a line torn by a
    # crash mid-write do not hide it; a finish before the last start does not count.
    _records(
        run_dir,
        {"event": "finish", "step": 5, "t": 3.0},
        {"event": "s3_upload", "step": 5, "t": 3.1},
        {"event": "s3_retention", "deleted": [1], "t": 3.2},
    )
    assert "finish at step 5 of train.steps=5" in training_complete(args)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"event": "finish", "step": 5}) + '\n{"event": "fin')
    assert "finish at step 5" in training_complete(args)
    (run_dir / "metrics.jsonl").write_text('{"event": "start", "t": 1.0}\n{"event": "fin')
    assert training_complete(args) is None
    assert training_complete(["-m", "some.other.module"]) is None
    # A run that stops early ends complete at its stop step, and only there.
    stopped = [*args, "--set", "train.stop_at_step=3"]
    _records(run_dir, {"event": "finish", "step": 3, "t": 3.0})
    assert "finish at step 3 of train.stop_at_step=3" in training_complete(stopped)
    assert training_complete(args) is None
    _records(run_dir, {"event": "finish", "step": 2, "t": 3.0})
    assert training_complete(stopped) is None


def test_a_pod_asked_for_hot_spares_exits_2_naming_spares_under_an_nvrx_that_would_train_every_node(tmp_path):
    """Real agent process on the pinned NVRx 0.4.1, whose torch elastic rendezvous would train at
    every node that joins: --nnodes=2:3 is refused before any launcher starts (exit 2, never retried)."""
    from resilient_fsdp.resilience.nvrx import hot_spares_unsupported, installed_version

    assert installed_version() == "0.4.1"  # the pinned lane this test runs on
    proc, agent = _lonely_node(tmp_path / "run", rejoin_timeout=0, steps=5, nnodes="2:3")
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = agent[-1]
    assert "--nnodes=2:3 asks for 1 hot spare pod(s) (the chart's spares=1)" in message
    assert "NVRx 0.4.1 would train at every node that joins" in message and "set spares=0" in message
    # NVRx 0.6 and newer keep the pods beyond the minimum standby: nothing to refuse.
    args = ["--nnodes=2:3", "-m", "resilient_fsdp.train"]
    assert hot_spares_unsupported(args, "0.7.0") is None and hot_spares_unsupported(args, "0.6.0") is None
    assert hot_spares_unsupported(["--nnodes=2", "-m", "x"], "0.4.1") is None
    assert hot_spares_unsupported(["--nnodes=2:2", "-m", "x"], "0.4.1") is None
