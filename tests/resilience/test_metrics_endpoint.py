"""The node agent's metrics endpoint over a run directory of real files, scraped over HTTP on this
machine's loopback and read with prometheus_client's own parser (no training runs here; a scrape of
a running job is tests/local/test_launcher.py's)."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO
from resilient_fsdp.config import FaultSpec
from resilient_fsdp.resilience import agent
from resilient_fsdp.resilience.accounting import JOB_START_ENV, record_recoveries, summarize
from resilient_fsdp.resilience.ledger import FaultLedger
from resilient_fsdp.resilience.metrics_endpoint import METRICS, MetricsError, serve, trainer_run_dir


def append(path, *records, newline=True):
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        if not newline:
            f.write('{"event": "step", "step": 99')  # a line still being written


def scrape(port: int) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample, parsed as Prometheus parses it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({"node": "3", **labels}.items())))]


@pytest.fixture
def endpoint(tmp_path, monkeypatch):
    monkeypatch.delenv(JOB_START_ENV, raising=False)  # the job began at its first start event
    _, server = serve(0, tmp_path, node="3", address="127.0.0.1")
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_should_serve_the_runs_records_and_follow_them_when_scraped(tmp_path, endpoint):
    metrics = tmp_path / "metrics.jsonl"
    empty = scrape(endpoint)  # before the first attempt wrote anything: counters at 0, no step yet
    assert value(empty, "resilient_fsdp_restarts_total", layer="job") == 0
    assert not [k for k in empty if k[0] in ("resilient_fsdp_step", "resilient_fsdp_goodput_ratio")]

    append(
        metrics,
        {"event": "start", "t": 100.0, "layer": "start"},
        *(
            {"event": "step", "step": s, "loss": 5.0 - s / 10, "step_time_s": 0.5, "tokens": 1024, "t": 100.0 + s}
            for s in range(1, 5)
        ),
        {"event": "checkpoint", "t": 104.5, "step": 4, "stall_s": 0.25, "write_s": 2.0, "bytes": 10},
    )
    first = scrape(endpoint)
    assert value(first, "resilient_fsdp_step") == 4 and value(first, "resilient_fsdp_loss") == pytest.approx(4.6)
    assert value(first, "resilient_fsdp_tokens_per_second") == 2048.0
    assert value(first, "resilient_fsdp_last_step_timestamp_seconds") == 104.0
    assert value(first, "resilient_fsdp_checkpoint_step") == 4
    assert value(first, "resilient_fsdp_checkpoint_stall_seconds_count") == 1
    assert value(first, "resilient_fsdp_checkpoint_stall_seconds_sum") == 0.25
    assert value(first, "resilient_fsdp_checkpoint_write_seconds_sum") == 2.0
    assert value(first, "resilient_fsdp_productive_seconds") == 2.0
    wall = value(first, "resilient_fsdp_job_wall_seconds")  # since the start event at t=100
    assert value(first, "resilient_fsdp_goodput_ratio") == pytest.approx(2.0 / wall)

    # A fault, an in-job restart that resumes from step 4 and recovers, then more steps; the last
    # line is still being written and waits for the next scrape.
    ledger = FaultLedger(tmp_path)
    spec = FaultSpec("sigkill", 6, 0)
    ledger.claim(spec, {"fault": str(spec), "key": spec.key, "kind": "sigkill", "t_fault": 106.0, "completed_step": 5})
    append(metrics, {"event": "step", "step": 5, "loss": 4.5, "step_time_s": 0.5, "tokens": 1024, "t": 105.0})
    assert value(scrape(endpoint), "resilient_fsdp_productive_seconds") == 2.5
    # The resumed attempt rewrites the file without step 5, as the trainer does, and goes on.
    kept = [line for line in metrics.read_text().splitlines() if '"step": 5' not in line]
    metrics.write_text("".join(line + "\n" for line in kept))
    append(
        metrics,
        {"event": "start", "t": 110.0, "layer": "in_job"},
        {"event": "step", "step": 5, "loss": 4.4, "step_time_s": 1.0, "tokens": 1024, "t": 111.0},
        newline=False,
    )
    record_recoveries(ledger, "in_job", resumed_step=4, now=111.5)
    second = scrape(endpoint)
    assert value(second, "resilient_fsdp_step") == 5 and value(second, "resilient_fsdp_loss") == pytest.approx(4.4)
    assert value(second, "resilient_fsdp_restarts_total", layer="in_job") == 1
    assert value(second, "resilient_fsdp_restarts_total", layer="in_process") == 0
    assert value(second, "resilient_fsdp_faults_injected_total") == 1
    assert value(second, "resilient_fsdp_non_finite_losses_total") == 0
    ledger.record_non_finite({"step": 7, "t": 112.0, "loss": float("nan"), "ranks": [], "outcome": "restart"}, seen=0)
    assert value(scrape(endpoint), "resilient_fsdp_non_finite_losses_total") == 1
    assert value(second, "resilient_fsdp_recoveries_total", layer="in_job") == 1
    assert value(second, "resilient_fsdp_recovery_seconds_total", layer="in_job") == 5.5
    assert value(second, "resilient_fsdp_lost_steps_total", layer="in_job") == 1
    # The timeline holds each final step once: the retrained step 5 counts, the lost one does not.
    assert value(second, "resilient_fsdp_productive_seconds") == 3.0
    # As summary.json says it, for the same files (the torn line is skipped there too).
    summary = summarize(metrics, ledger, now=200.0)
    assert summary["productive_s"] == 3.0 and summary["restarts"] == {"in_process": 0, "in_job": 1, "job": 0}

    with open(metrics, "a") as f:  # the line is finished
        f.write(', "loss": 4.3, "step_time_s": 1.0, "tokens": 1024, "t": 112.0}\n')
    append(metrics, {"event": "finish", "t": 120.0, "step": 99})
    third = scrape(endpoint)
    assert value(third, "resilient_fsdp_step") == 99 and value(third, "resilient_fsdp_productive_seconds") == 4.0
    # A finished job's wall time stops at its end.
    assert value(third, "resilient_fsdp_job_wall_seconds") == 20.0
    assert value(third, "resilient_fsdp_goodput_ratio") == pytest.approx(0.2)
    assert value(third, "resilient_fsdp_tokens_per_second") == pytest.approx(6 * 1024 / 4.0)


def test_should_count_failed_saves_and_the_s3_backlog_until_a_commit_and_a_marker_clear_them(tmp_path, endpoint):
    metrics = tmp_path / "metrics.jsonl"
    append(
        metrics,
        {"event": "start", "t": 100.0, "layer": "start"},
        {"event": "checkpoint_failed", "t": 101.0, "step": 4, "cause": "volume_full", "consecutive": 1},
        {"event": "checkpoint_failed", "t": 102.0, "step": 8, "cause": "volume_full", "consecutive": 2},
        {"event": "s3_lagging", "t": 103.0, "ranks": [1, 3], "awaiting": 2},
        {"event": "s3_released", "t": 104.0, "step": 4, "waiting_for": [1, 3], "awaiting": 2},
    )
    failing = scrape(endpoint)
    assert value(failing, "resilient_fsdp_checkpoint_failures_total") == 2
    assert value(failing, "resilient_fsdp_checkpoint_consecutive_failures") == 2
    assert value(failing, "resilient_fsdp_s3_lagging_ranks") == 2
    assert value(failing, "resilient_fsdp_s3_awaiting_checkpoints") == 2
    assert value(failing, "resilient_fsdp_s3_released_total") == 1
    append(
        metrics,
        {"event": "checkpoint", "t": 105.0, "step": 12, "stall_s": 0.1, "write_s": 1.0, "bytes": 10},
        {"event": "s3_lagging", "t": 106.0, "ranks": [], "awaiting": 1},
        {"event": "s3_upload", "t": 107.0, "step": 12, "awaiting": 0},
    )
    healed = scrape(endpoint)
    assert value(healed, "resilient_fsdp_checkpoint_failures_total") == 2  # a counter: it only grows
    assert value(healed, "resilient_fsdp_checkpoint_consecutive_failures") == 0
    assert value(healed, "resilient_fsdp_s3_lagging_ranks") == 0
    assert value(healed, "resilient_fsdp_s3_awaiting_checkpoints") == 0


def test_should_name_the_port_when_it_is_in_use_and_leave_the_agent_running(tmp_path, capsys):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            MetricsError,
            match=rf"--metrics-port={port}: port {port} is already in use on "
            r"127\.0\.0\.1; choose another \(the chart's metrics\.port\), or 0",
        ):
            serve(port, tmp_path, node="0", address="127.0.0.1")
        # The agent says so once and carries on (the training matters more than its metrics).
        args = ["--nnodes=1", "-m", "resilient_fsdp.train", f"--run-dir={tmp_path}"]
        agent.start_metrics(port, args, tmp_path, None, 0, {"PET_LOCAL_ADDR": "127.0.0.1"}, 60.0)
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"no metrics endpoint: --metrics-port={port}: port {port} is already in use" in err
    assert "training goes on without it" in err


def test_should_read_the_run_directory_as_the_trainer_resolves_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("run_dir: /from/the/file\n")
    launcher = ["--nnodes=2", "--max-restarts=3", "-m", "resilient_fsdp.train", f"--config={config}"]
    assert trainer_run_dir(launcher) == Path("/from/the/file")
    assert trainer_run_dir(launcher + ["--set", "run_dir=/from/set"]) == Path("/from/set")
    with pytest.raises(MetricsError, match="ft_launcher's arguments run no `-m resilient_fsdp.train`"):
        trainer_run_dir(["--nnodes=1", "train.py"])
    with pytest.raises(MetricsError, match="(?s)the trainer's configuration does not load.*unknown key 'run_dri'"):
        trainer_run_dir(launcher + ["--set", "run_dri=/typo"])


@pytest.mark.parametrize("flag", ["--metrics-port=http", "--metrics-port=70000", "--metrics-port=-1"])
def test_should_refuse_a_metrics_port_that_is_not_one(flag):
    with pytest.raises(
        ValueError,
        match=rf"{flag}: give --metrics-port=PORT, a whole number from 1 to 65535 "
        r"\(0: no metrics\)",
    ):
        agent.parse_agent_args([flag, "--", "--nnodes=1"])
    assert agent.parse_agent_args(["--metrics-port=9410", "--rejoin-timeout=5", "--", "x"]) == (
        {"--metrics-port": 9410, "--rejoin-timeout": 5.0},
        ["x"],
    )


def test_should_document_every_metric_when_docs_are_read():
    text = (REPO / "docs" / "eks-helm.md").read_text()
    missing = [name for name in METRICS if f"`resilient_fsdp_{name}`" not in text]
    assert missing == [], f"docs/eks-helm.md's metrics table lacks {missing}"


def test_should_serve_stopped_replication_until_the_next_attempt_and_count_resumes_by_tier(tmp_path, endpoint):
    metrics = tmp_path / "metrics.jsonl"
    append(
        metrics,
        {"event": "start", "t": 100.0, "layer": "start", "resumed_from_tier": None},
        {"event": "memory_replication", "t": 101.0, "step": 7, "stopped_ranks": 2},
    )
    stopped = scrape(endpoint)
    assert value(stopped, "resilient_fsdp_memory_replication_stopped_ranks") == 2
    assert value(stopped, "resilient_fsdp_resumes_total", tier="memory") == 0
    append(
        metrics,
        {"event": "start", "t": 110.0, "layer": "in_job", "resumed_from_tier": "memory"},
        {"event": "start", "t": 120.0, "layer": "job", "resumed_from_tier": "durable"},
        {"event": "start", "t": 130.0, "layer": "in_job", "resumed_from_tier": "memory"},
    )
    again = scrape(endpoint)
    assert value(again, "resilient_fsdp_memory_replication_stopped_ranks") == 0  # the restart made it again
    assert [value(again, "resilient_fsdp_resumes_total", tier=t) for t in ("memory", "durable", "s3")] == [2, 1, 0]


def test_should_serve_straggler_scores_and_count_stragglers_and_replica_mismatches(tmp_path, endpoint):
    metrics = tmp_path / "metrics.jsonl"
    append(
        metrics,
        {"event": "start", "t": 100.0, "layer": "start"},
        {"event": "straggler_report", "t": 101.0, "step": 10, "slowest": {"0": 0.97, "1": 1.0}, "slow": {}},
    )
    before = scrape(endpoint)
    assert value(before, "resilient_fsdp_straggler_score", rank="0") == 0.97
    assert value(before, "resilient_fsdp_stragglers_total", action="replaced") == 0
    ledger = FaultLedger(tmp_path)
    ledger.record_straggler({"key": "step00000020-rank1", "rank": 1, "t_found": 105.0, "action": "replaced"})
    ledger.record_straggler({"key": "step00000030-rank2", "rank": 2, "t_found": 106.0, "action": "reported"})
    append(
        metrics,
        {
            "event": "straggler_report",
            "t": 106.0,
            "step": 20,
            "slowest": {"1": 0.4, "0": 1.0},
            "slow": {"1": {"part": "optimizer", "score": 0.4, "reports": 2}},
        },
    )
    after = scrape(endpoint)
    assert value(after, "resilient_fsdp_straggler_score", rank="1") == 0.4  # the newest report's
    assert [value(after, "resilient_fsdp_stragglers_total", action=a) for a in ("replaced", "reported")] == [1, 1]
    assert value(after, "resilient_fsdp_replica_mismatches_total") == 0
    ledger.record_sdc({"key": "step00000015", "step": 15, "last_pass_step": 10, "t_detected": 107.0})
    assert value(scrape(endpoint), "resilient_fsdp_replica_mismatches_total") == 1
