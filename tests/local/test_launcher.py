"""``resilient-fsdp local``: the chart's pods on this machine, failures, and cleanup.

Each test starts a real job (gloo on CPU); as root every pod is a network namespace, otherwise
processes on loopback (tests that need namespaces say so). ``test_manifests.py`` checks what the
pods run without starting them."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import (
    REPO,
    _env,
    assert_no_leftovers,
    netns_required,
    processes_of,
    read_losses,
    read_summary,
    run_local,
    write_module,
)
from resilient_fsdp.local.cluster.launcher import find_root_cause
from resilient_fsdp.local.runtime.netns_pods import plumbing


def test_two_nodes_by_two_ranks_completes_with_a_valid_summary(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=2, overrides=["train.steps=12", "train.log_every=5"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(run_dir)
    assert summary["world_size"] == 4 and summary["final_step"] == 12
    assert summary["final_loss"] == read_losses(run_dir)[-1]
    # Output is forwarded with a node/local-rank prefix; rank 0 reports progress. The demo's
    # world and model (the warm-up's steps do not depend on train.steps): the README's loss.
    step10 = re.search(r"\[node0/local0\] \[resilient-fsdp\] step     10 \| loss (\S+) \|", proc.stdout)
    assert step10 and f"step     10 | loss {step10[1]} |" in (REPO / "README.md").read_text()
    assert "job finished: every pod exited 0" in proc.stdout
    assert "2 pod(s) x 2 rank(s): PyTorchJob resilient-fsdp" in proc.stdout
    # Two ranks a pod, each forked from the pod's pre-warmed server: one intra-op thread each, as
    # ft_launcher sets for a node of several ranks, not one per core.
    assert set(re.findall(r"\] rank (\d) of 4: node \d, local rank \d, 1 CPU thread, host", proc.stdout)) == set("0123")
    assert "this rank imports its own" not in proc.stdout + proc.stderr
    # Pod 0's agent hosts the rendezvous store, as the Master pod does on the cluster.
    assert "hosts the TCP store" in (run_dir / "logs" / "node0.log").read_text()
    assert "hosts the TCP store" not in (run_dir / "logs" / "node1.log").read_text()
    assert "kind: PyTorchJob" in (run_dir / "cluster" / "manifests.yaml").read_text()
    assert_no_leftovers(run_dir)


def test_a_rank_that_raises_fails_the_job_with_its_error(tmp_path, plugin_dir):
    write_module(
        plugin_dir,
        "raising_model",
        """
        import os
        from resilient_fsdp.train.model import build_model

        def build(cfg):
            model = build_model("tiny")
            forward, calls = model.forward, [0]
            def failing_forward(tokens):
                calls[0] += 1
                if os.environ["RANK"] == "1" and calls[0] == 3:
                    raise RuntimeError("injected failure on rank 1 at step 3")
                return forward(tokens)
            model.forward = failing_forward
            return model
    """,
    )
    run_dir = tmp_path / "run"
    # An exception is an infrastructure-type failure (retried by every layer); with no in-job
    # restarts and backoffLimit 0 (the job level spent at the first pod failure) the job fails.
    # Two pods of one rank: the failing rank is pod 1's, not the store host's.
    proc = run_local(
        run_dir,
        nodes=2,
        nproc=1,
        pythonpath=[plugin_dir],
        extra=["--max-restarts=0", "--value=job.backoffLimit=0"],
        overrides=["train.steps=50", "model.factory=raising_model:build"],
    )
    assert proc.returncode == 203, proc.stdout[-4000:]
    assert "job FAILED" in proc.stdout
    assert "RuntimeError: injected failure on rank 1 at step 3" in proc.stdout.split("job FAILED", 1)[1]
    assert not (run_dir / "summary.json").exists()
    assert_no_leftovers(run_dir)


def test_bad_config_fails_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, overrides=["train.stepz=3"])
    assert proc.returncode == 2
    assert "unknown key 'train.stepz' (did you mean 'train.steps'?)" in proc.stderr
    assert not (run_dir / "logs").exists()


@pytest.mark.timeout(240)
def test_pods_run_as_network_namespaces_with_their_hostnames(tmp_path):
    """Each pod has the hostname the operator gives it, the Service names resolve in every pod,
    and NVRx sees one node address per pod."""
    netns_required()
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=1, overrides=["train.steps=4", "optim.lr=3e-4"], isolation="netns")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pods as network namespaces" in proc.stdout
    # --set takes a learning rate as people write it, through the chart's schema to the trainer.
    assert "  lr: 0.0003\n" in (run_dir / "config.yaml").read_text()
    # The console names paths on this machine (the pods see the run directory at /fsx); the
    # pods' own logs keep the pods' view.
    assert f"summary {run_dir}/summary.json" in proc.stdout and f"config {run_dir}/config.yaml" in proc.stdout
    assert f"-> {run_dir}/checkpoints/step_00000004" in proc.stdout and "/fsx" not in proc.stdout
    assert "summary /fsx/summary.json" in (run_dir / "logs" / "node0.log").read_text()
    node1 = (run_dir / "logs" / "node1.log").read_text()
    assert "resilient-fsdp-worker-0" in node1 and "resilient-fsdp-master-0" not in node1.split("\n", 1)[0]
    assert_no_leftovers(run_dir)


@pytest.mark.timeout(240)
def test_loopback_runs_the_same_pods_as_processes(tmp_path):
    """Without root: the rendered pods as processes on 127.0.0.x, the deviations named at start."""
    run_dir = tmp_path / "run"
    proc = run_local(run_dir, nodes=2, nproc=1, overrides=["train.steps=4"], isolation="loopback")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "pods as processes on loopback (resilient-fsdp-master-0=127.0.0.1, resilient-fsdp-worker-0=127.0.0.2"
        in proc.stdout
    )
    assert read_summary(run_dir)["world_size"] == 2
    assert_no_leftovers(run_dir)


@pytest.mark.timeout(240)
def test_a_sigkilled_launcher_leaves_nothing_after_the_next_start(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: its pods live on, and the next local run
    (any PodNetwork) removes them, processes included."""
    netns_required()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        "--nodes=2",
        "--nproc-per-node=1",
        f"--run-dir={run_dir}",
        "--isolation=netns",
        "--set",
        "train.steps=100000",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(mark=run_dir), cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.5)
    assert (run_dir / "metrics.jsonl").exists(), "training never started"
    proc.kill()
    proc.wait(timeout=30)
    assert plumbing.leaked(), "the killed launcher's pods should still be there"
    assert processes_of(run_dir), "and their processes with them"
    removed = plumbing.cleanup_stale()  # what the next `resilient-fsdp local` does first
    assert removed and not plumbing.leaked()
    assert_no_leftovers(run_dir, wait_s=10)


def scrape_pod0(command: str) -> dict:
    """Pod 0's metrics by the command the launcher printed (curl, from inside the pod in netns
    mode), parsed as Prometheus parses them: {name: value} of the samples without a layer."""
    argv = shlex.split(command)
    argv = argv[1:] if argv[0] == "sudo" else argv  # the tests run as root, where sudo may be absent
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{command}: {out.stderr}"
    return {
        s.name: s.value
        for f in text_string_to_metric_families(out.stdout)
        for s in f.samples
        if s.labels.get("node") == "0" and "layer" not in s.labels
    }


def test_a_running_job_serves_metrics_and_interrupting_the_launcher_stops_every_process(tmp_path):
    """While the job trains, pod 0's endpoint, read with the command the launcher prints, shows the
    step and the goodput moving; SIGTERM to the launcher then stops every process."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        "--nodes=2",
        "--nproc-per-node=1",
        f"--run-dir={run_dir}",
        "--set",
        "train.steps=100000",
        "--set",
        "dist.timeout_s=60",
    ]
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=_env(mark=run_dir), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and '"event": "step"' not in _read(run_dir / "metrics.jsonl"):
            time.sleep(0.5)
        assert '"event": "step"' in _read(run_dir / "metrics.jsonl"), "training never started: " + _read(log)
        assert len(processes_of(run_dir)) >= 5  # launcher, 2 agents, 2 ranks (and NVRx monitors)
        note = re.search(r"metrics: every pod's agent serves the run's metrics on port \d+; pod 0's: (.+)", _read(log))
        assert note, _read(log)
        first = scrape_pod0(note[1])
        second = first
        while time.monotonic() < deadline and second["resilient_fsdp_step"] <= first["resilient_fsdp_step"]:
            time.sleep(0.5)
            second = scrape_pod0(note[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert second["resilient_fsdp_step"] > first["resilient_fsdp_step"] >= 1
    assert second["resilient_fsdp_goodput_ratio"] != first["resilient_fsdp_goodput_ratio"]
    assert 0 < second["resilient_fsdp_goodput_ratio"] < 1 and second["resilient_fsdp_tokens_per_second"] > 0
    out = _read(log)
    assert proc.returncode == 130, out
    assert "interrupted (SIGTERM): stopping every pod" in out
    assert_no_leftovers(run_dir)


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_root_cause_prefers_the_rank_that_failed_first(tmp_path):
    import json

    for node, local, ts, msg in [
        (0, 0, 100, "RuntimeError: Connection closed by peer [127.0.0.1]:1"),
        (1, 1, 100, "ValueError: the real problem"),
        (1, 0, 99, "RuntimeError: Connection closed by peer [127.0.0.1]:2"),
    ]:
        d = tmp_path / f"node{node}" / "job_x" / "attempt_0" / str(local)
        d.mkdir(parents=True)
        (d / "error.json").write_text(json.dumps({"message": {"message": msg, "extraInfo": {"timestamp": ts}}}))
    cause = find_root_cause(tmp_path)
    assert cause["message"] == "ValueError: the real problem"
    assert cause["where"] == "node1 local rank 1 (attempt_0)"
    assert find_root_cause(tmp_path / "empty") is None
    # A job no layer retried ended on its newest error; the earlier ones were retried.
    d = tmp_path / "node0" / "job_x" / "attempt_1" / "0"
    d.mkdir(parents=True)
    (d / "error.json").write_text(
        json.dumps({"message": {"message": "RepeatedNonFiniteLoss: step 3 again", "extraInfo": {"timestamp": 130}}})
    )
    assert find_root_cause(tmp_path)["message"] == "ValueError: the real problem"
    assert find_root_cause(tmp_path, last=True)["where"] == "node0 local rank 0 (attempt_1)"
