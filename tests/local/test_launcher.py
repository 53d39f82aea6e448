"""``resilient-fsdp local``: simulated nodes under ft_launcher, failures, and cleanup."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.support import REPO, _env, assert_no_leftovers, processes_of, read_losses, read_summary, run_local, write_module
from resilient_fsdp.local.launcher import LocalJob, agent_command, find_root_cause


def test_agent_command_is_what_a_pod_runs(tmp_path):
    job = LocalJob(nodes=3, nproc_per_node=4, run_dir=tmp_path, trainer_args=["--set", "seed=1"], run_id="r1")
    cmd = agent_command(job, node=2, port=29555)
    assert cmd[1:3] == ["-m", "resilient_fsdp.resilience.agent"]  # the node wrapper, around ft_launcher
    for flag in ("--nnodes=3", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29555",
                 "--rdzv-id=r1", "--max-restarts=3", "--rdzv-conf=is_host=false", "--workers-stop-timeout=15",
                 "--term-timeout=600"):
        assert flag in cmd
    trainer = len(cmd) - cmd[::-1].index("-m") - 1  # the last -m: the module ft_launcher starts
    assert cmd[trainer:] == ["-m", "resilient_fsdp.train", "--set", "seed=1"]


def test_two_nodes_by_two_ranks_completes_with_a_valid_summary(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=2, overrides=["train.steps=12", "train.log_every=4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(run_dir)
    assert summary["world_size"] == 4 and summary["final_step"] == 12
    assert summary["final_loss"] == read_losses(run_dir)[-1]
    # Output is forwarded with a node/local-rank prefix; rank 0 reports progress.
    assert "[node0/local0] [resilient-fsdp] step      4 | loss" in proc.stdout or \
        "[node1/local0] [resilient-fsdp] step      4 | loss" in proc.stdout
    assert "job finished: every node exited 0" in proc.stdout
    assert (run_dir / "logs" / "node0.log").stat().st_size > 0 and (run_dir / "logs" / "node1.log").exists()
    assert_no_leftovers(run_dir)


def test_a_rank_that_raises_fails_the_job_with_its_error(tmp_path, plugin_dir):
    write_module(plugin_dir, "raising_model", """
        import os
        from resilient_fsdp.train.model import build_model

        def build(cfg):
            model = build_model("tiny")
            forward, calls = model.forward, [0]
            def failing_forward(tokens):
                calls[0] += 1
                if os.environ["RANK"] == "3" and calls[0] == 3:
                    raise RuntimeError("injected failure on rank 3 at step 3")
                return forward(tokens)
            model.forward = failing_forward
            return model
    """)
    run_dir = tmp_path / "run"
    # An exception is an infrastructure-type failure (retried by every layer): no job-level restart
    # here, so the job fails once the in-job restarts are spent.
    proc = run_local(run_dir, nodes=2, nproc=2, pythonpath=[plugin_dir],
                     overrides=["train.steps=50", "model.factory=raising_model:build"], extra=["--max-node-restarts=0"])
    assert proc.returncode == 203
    assert "job FAILED" in proc.stdout
    assert "RuntimeError: injected failure on rank 3 at step 3" in proc.stdout.split("job FAILED", 1)[1]
    assert not (run_dir / "summary.json").exists()
    assert_no_leftovers(run_dir)


def test_bad_config_fails_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, overrides=["train.stepz=3"])
    assert proc.returncode == 2
    assert "unknown key 'train.stepz' (did you mean 'train.steps'?)" in proc.stderr
    assert not (run_dir / "logs").exists()


def test_interrupting_the_launcher_stops_every_process(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "resilient_fsdp.cli", "local", "--nodes=2", "--nproc-per-node=1",
           f"--run-dir={run_dir}", "--set", "train.steps=100000", "--set", "dist.timeout_s=60"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(mark=run_dir), cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.5)
    assert (run_dir / "metrics.jsonl").exists(), "training never started"
    assert len(processes_of(run_dir)) >= 5  # launcher, 2 agents, 2 ranks (and NVRx monitors)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted (SIGTERM): stopping every node" in out
    assert_no_leftovers(run_dir)


def test_root_cause_prefers_the_rank_that_failed_first(tmp_path):
    import json
    for node, local, ts, msg in [(0, 0, 100, "RuntimeError: Connection closed by peer [127.0.0.1]:1"),
                                 (1, 1, 100, "ValueError: the real problem"),
                                 (1, 0, 99, "RuntimeError: Connection closed by peer [127.0.0.1]:2")]:
        d = tmp_path / f"node{node}" / "job_x" / "attempt_0" / str(local)
        d.mkdir(parents=True)
        (d / "error.json").write_text(json.dumps({"message": {"message": msg, "extraInfo": {"timestamp": ts}}}))
    cause = find_root_cause(tmp_path)
    assert cause["message"] == "ValueError: the real problem"
    assert cause["where"] == "node1 local rank 1 (attempt_0)"
    assert find_root_cause(tmp_path / "empty") is None
