"""The node agent's Prometheus endpoint: a run's progress, checkpoints, restarts, recoveries and goodput.

The ranks already record all of it on the shared volume: rank 0's ``metrics.jsonl`` (a record per
step and per committed checkpoint, a ``start`` event per attempt with the layer that restarted it)
and the fault ledger (``faults/``). The agent, a pod's PID 1, outlives ft_launcher's restarts of
the ranks, so it serves them (``--metrics-port``): nothing runs in the ranks, nothing waits on the
training loop. Each scrape reads what was appended since the one before (:class:`RunRecords`),
so a scrape costs as much at step 100,000 as at step 10.

The values are the job's, read from its one run directory, so every pod serves the same ones,
labelled with its ``node`` index: aggregate with ``max without (node, pod, instance)``. Goodput,
restarts and recoveries are defined as in ``summary.json`` (:mod:`.accounting`).
:data:`METRICS` names every metric; docs/eks-helm.md lists them with their meaning.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from ..config import Config, ConfigError
from . import accounting, node_reports
from .ledger import FaultLedger

TRAINER_MODULE = "resilient_fsdp.train"
PREFIX = "resilient_fsdp_"
# name (without the prefix) -> (type, meaning). The exposition adds _total to counters and
# _count/_sum to summaries.
METRICS = {
    "step": ("gauge", "The newest completed training step."),
    "loss": ("gauge", "The loss of that step (mean over every rank and micro-batch)."),
    "step_time_seconds": ("gauge", "How long that step took."),
    "tokens_per_second": ("gauge", "Tokens trained per second over the newest steps (up to 10)."),
    "last_step_timestamp_seconds": ("gauge", "When that step completed (Unix time): a stalled job stops moving it."),
    "checkpoint_step": ("gauge", "The step of the newest committed checkpoint."),
    "checkpoint_stall_seconds": ("summary", "Time training waited for each committed checkpoint (count, sum)."),
    "checkpoint_write_seconds": ("summary", "From the start of each committed checkpoint to its commit (count, sum)."),
    "checkpoint_last_stall_seconds": ("gauge", "Time training waited for the newest committed checkpoint."),
    "checkpoint_last_write_seconds": ("gauge", "Write time of the newest committed checkpoint."),
    "checkpoint_failures_total": ("counter", "Saves that failed (each a checkpoint_failed record)."),
    "checkpoint_consecutive_failures": (
        "gauge",
        "Saves failed in a row since the newest commit; the job fails at checkpoint.max_consecutive_failures.",
    ),
    "s3_awaiting_checkpoints": (
        "gauge",
        "Checkpoints rank 0 waits for every rank's S3 upload of before putting the marker (held from local retention).",
    ),
    "s3_lagging_ranks": (
        "gauge",
        "Ranks holding up S3 markers: missing from the oldest of several awaiting checkpoints.",
    ),
    "s3_released_total": (
        "counter",
        "Checkpoints that stopped waiting past checkpoint.s3.max_awaiting: never marked complete on S3.",
    ),
    "memory_replication_stopped_ranks": (
        "gauge",
        "Ranks whose memory replication stopped in the current attempt "
        "(their newer snapshots have no replica on another pod; the next restart "
        "makes it again).",
    ),
    "resumes_total": (
        "counter",
        "Starts that resumed from a checkpoint, by where it came from (label tier: memory, "
        "durable, s3): the share from memory is the memory tier's measured coverage.",
    ),
    "restarts_total": ("counter", "Attempts started by each restart layer (label layer: in_process, in_job, job)."),
    "faults_injected_total": ("counter", "Faults the chaos drill fired."),
    "non_finite_losses_total": (
        "counter",
        "Non-finite losses the job met, each restarted once as a suspected hardware fault (resilience/non_finite.py).",
    ),
    "straggler_score": (
        "gauge",
        "Each of the slowest ranks' score in the newest straggler report (label rank): the "
        "fastest rank's median time of a part of the step over its own, 1 for the fastest "
        "(resilience.stragglers).",
    ),
    "replica_mismatches_total": (
        "counter",
        "Replica checks that found the replicas of a shard differ (silent data "
        "corruption, resilience.sdc), each rolled back.",
    ),
    "stragglers_total": ("counter", "Stragglers found, by what was done (label action: replaced, reported)."),
    "recoveries_total": ("counter", "Recoveries from fired faults, by the layer that recovered (label layer)."),
    "recovery_seconds_total": ("counter", "Time from each fault to the first step after it, summed, by layer."),
    "lost_steps_total": ("counter", "Steps trained again after recoveries, by layer."),
    "productive_seconds": ("gauge", "Time spent in the steps of the run's timeline (each final step once)."),
    "job_wall_seconds": ("gauge", "Wall time since the job began (until it finished)."),
    "goodput_ratio": ("gauge", "productive_seconds / job_wall_seconds, as summary.json's goodput."),
    "silent_nodes": (
        "gauge",
        "Pods that stopped reporting without ending (their node hung or cut off, or the pod "
        "being replaced); served by pods 0 and 1 (resilience/node_reports.py).",
    ),
    "node_silent_seconds": ("gauge", "How long each such pod has not reported (labels pod_index, kubernetes_node)."),
}


class MetricsError(Exception):
    """The endpoint cannot be served; the message names the flag or value and the fix."""


def trainer_run_dir(launcher_args: list[str]) -> Path:
    """The run directory of the trainer that ``ft_launcher`` starts (``-m resilient_fsdp.train
    ARGS``), resolved as the trainer resolves its configuration."""
    return Path(trainer_config(launcher_args).run_dir)


def trainer_config(launcher_args: list[str]) -> Config:
    """The configuration of the trainer that ``ft_launcher`` starts, resolved as the trainer does;
    :class:`MetricsError` says why when it cannot be."""
    from ..train.arguments import parse_args, resolve_config

    starts = [
        i for i in range(len(launcher_args) - 1) if launcher_args[i] == "-m" and launcher_args[i + 1] == TRAINER_MODULE
    ]
    if not starts:
        raise MetricsError(
            f"ft_launcher's arguments run no `-m {TRAINER_MODULE}`, so the run directory "
            "the metrics come from is unknown"
        )
    try:
        args = parse_args(launcher_args[starts[0] + 2 :])
    except SystemExit:
        raise MetricsError("the trainer's arguments do not parse (the ranks report why)") from None
    try:
        return resolve_config(args)
    except ConfigError as exc:
        raise MetricsError(f"the trainer's configuration does not load (the ranks report it): {exc}") from None


class RunRecords:
    """``metrics.jsonl`` as it grows, folded into what the metrics need.

    The file is only appended to, except when an attempt resumes: rank 0 then rewrites it without
    the records past the step it resumed from. A rewrite shows as another inode, a shorter file,
    or other bytes just before where the last read stopped; the file is then read again from the
    start. A line still being written waits for the next read.
    """

    TAIL = 256  # bytes kept from before the read position, to notice a rewrite
    CHUNK = 4 << 20  # the first read of a long run's file goes in pieces of this size
    WINDOW = 10  # steps tokens_per_second averages over

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reset(None)

    def _reset(self, inode: Optional[int]) -> None:
        self.inode, self.offset, self.tail = inode, 0, b""
        self.last_step: Optional[dict] = None
        self.recent: collections.deque = collections.deque(maxlen=self.WINDOW)
        self.productive_s = 0.0
        self.checkpoints, self.stall_s, self.write_s = 0, 0.0, 0.0
        self.last_checkpoint: Optional[dict] = None
        self.failures, self.consecutive_failures = 0, 0
        self.s3_awaiting: Optional[int] = None
        self.s3_lagging, self.s3_released = 0, 0
        self.lifecycle: list[dict] = []  # start and finish events: a few per attempt
        self.replication_stopped = 0
        self.resumes = {"memory": 0, "durable": 0, "s3": 0}
        self.straggler_scores: dict[str, float] = {}  # the newest straggler report's slowest ranks

    def refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.inode or st.st_size < self.offset or not self._same_tail(f):
                    self._reset(st.st_ino)
                f.seek(self.offset)
                pending = b""
                while chunk := f.read(self.CHUNK):
                    pending += chunk
                    end = pending.rfind(b"\n") + 1
                    for line in pending[:end].splitlines():
                        self._fold(line)
                    self.offset += end
                    self.tail = (self.tail + pending[:end])[-self.TAIL :]
                    pending = pending[end:]
        except FileNotFoundError:
            self._reset(None)  # before the first attempt wrote anything

    def _same_tail(self, f) -> bool:
        if not self.offset:
            return True
        f.seek(self.offset - len(self.tail))
        return f.read(len(self.tail)) == self.tail

    def _fold(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return  # a line torn by a crash mid-write
        event = record.get("event") if isinstance(record, dict) else None
        if event == "step":
            self.last_step = record
            self.recent.append((record.get("tokens", 0), record.get("step_time_s", 0.0)))
            self.productive_s += record.get("step_time_s", 0.0)
        elif event == "checkpoint":
            self.checkpoints += 1
            self.stall_s += record.get("stall_s", 0.0)
            self.write_s += record.get("write_s", 0.0)
            self.last_checkpoint = record
            self.consecutive_failures = 0
        elif event == "checkpoint_failed":
            self.failures += 1
            self.consecutive_failures = record.get("consecutive", self.consecutive_failures + 1)
        elif event in ("s3_upload", "s3_released", "s3_lagging") and "awaiting" in record:
            self.s3_awaiting = record["awaiting"]
            self.s3_released += event == "s3_released"
            if event == "s3_lagging":
                self.s3_lagging = len(record.get("ranks", []))
        elif event == "straggler_report":
            self.straggler_scores = record.get("slowest", {})
        elif event == "memory_replication":
            self.replication_stopped = record.get("stopped_ranks", 0)
        elif event in ("start", "finish"):
            self.lifecycle.append(record)
            if event == "start":
                self.replication_stopped = 0  # a new attempt makes its replica group anew
                if record.get("resumed_from_tier") in self.resumes:
                    self.resumes[record["resumed_from_tier"]] += 1

    def tokens_per_s(self) -> Optional[float]:
        seconds = sum(s for _, s in self.recent)
        return sum(t for t, _ in self.recent) / seconds if seconds > 0 else None

    def wall_s(self, now: float) -> Optional[float]:
        """Since the job began (:func:`.accounting.job_start_time`); a finished job's stops at its end."""
        start = accounting.job_start_time(self.lifecycle)
        if start is None:
            return None
        if self.lifecycle and self.lifecycle[-1].get("event") == "finish":
            now = self.lifecycle[-1].get("t", now)
        return max(0.0, now - start)


class RunCollector:
    """A Prometheus collector over a run directory: each scrape reads the newest records."""

    def __init__(self, run_dir: Path, node: str, silent_after_s: float = node_reports.INTERVAL_S * 6):
        self.run_dir, self.node, self.silent_after_s = Path(run_dir), node, silent_after_s
        self.records = RunRecords(self.run_dir / "metrics.jsonl")
        self.ledger = FaultLedger(self.run_dir)
        self._lock = threading.Lock()  # scrapes are served on threads of their own

    def collect(self) -> Iterator:
        with self._lock:
            try:
                self.records.refresh()
            except OSError:
                pass  # unreadable for now (the volume): serve what the last read found
            fired = self.ledger.fired()
            recoveries = list(self.ledger.recoveries().values())
            yield from self._families(
                self.records,
                fired,
                recoveries,
                time.time(),
                len(self.ledger.non_finite()),
                self.ledger.stragglers(),
                len(self.ledger.sdc()),
            )
            if self.node.isdigit() and int(self.node) in node_reports.WATCHERS:
                yield from self._silent(node_reports.read_reports(self.run_dir), time.time())

    def _silent(self, reports: list[dict], now: float) -> Iterator:
        quiet = node_reports.silent([r for r in reports if str(r["index"]) != self.node], now, self.silent_after_s)
        yield self._gauge("silent_nodes", len(quiet))
        family = GaugeMetricFamily(
            PREFIX + "node_silent_seconds",
            METRICS["node_silent_seconds"][1],
            labels=["node", "pod_index", "kubernetes_node"],
        )
        for report, silence in quiet:
            family.add_metric([self.node, str(report["index"]), str(report.get("node") or "")], silence)
        yield family

    def _families(
        self,
        r: RunRecords,
        fired: list[dict],
        recoveries: list[dict],
        now: float,
        non_finite: int = 0,
        stragglers: Optional[list[dict]] = None,
        mismatch_count: int = 0,
    ) -> Iterator:
        stragglers = stragglers or []
        node = [self.node]
        if r.last_step is not None:
            step = r.last_step
            yield self._gauge("step", step.get("step", 0))
            yield self._gauge("loss", step.get("loss", float("nan")))
            yield self._gauge("step_time_seconds", step.get("step_time_s", 0.0))
            if step.get("t") is not None:
                yield self._gauge("last_step_timestamp_seconds", step["t"])
        rate = r.tokens_per_s()
        if rate is not None:
            yield self._gauge("tokens_per_second", rate)
        for name, total in (("checkpoint_stall_seconds", r.stall_s), ("checkpoint_write_seconds", r.write_s)):
            family = SummaryMetricFamily(PREFIX + name, METRICS[name][1], labels=["node"])
            family.add_metric(node, count_value=r.checkpoints, sum_value=total)
            yield family
        if r.last_checkpoint is not None:
            yield self._gauge("checkpoint_step", r.last_checkpoint.get("step", 0))
            yield self._gauge("checkpoint_last_stall_seconds", r.last_checkpoint.get("stall_s", 0.0))
            yield self._gauge("checkpoint_last_write_seconds", r.last_checkpoint.get("write_s", 0.0))
        yield self._counter("checkpoint_failures_total", r.failures)
        yield self._gauge("checkpoint_consecutive_failures", r.consecutive_failures)
        if r.s3_awaiting is not None:
            yield self._gauge("s3_awaiting_checkpoints", r.s3_awaiting)
            yield self._gauge("s3_lagging_ranks", r.s3_lagging)
            yield self._counter("s3_released_total", r.s3_released)
        yield self._gauge("memory_replication_stopped_ranks", r.replication_stopped)
        resumes = CounterMetricFamily(PREFIX + "resumes_total", METRICS["resumes_total"][1], labels=["node", "tier"])
        for tier, n in r.resumes.items():
            resumes.add_metric([*node, tier], n)
        yield resumes
        restarts = accounting.restart_counts(r.lifecycle)
        yield self._by_layer("restarts_total", {layer: [n] for layer, n in restarts.items()})
        injected = CounterMetricFamily(
            PREFIX + "faults_injected_total", METRICS["faults_injected_total"][1], labels=["node"]
        )
        injected.add_metric(node, len(fired))
        yield injected
        losses = CounterMetricFamily(
            PREFIX + "non_finite_losses_total", METRICS["non_finite_losses_total"][1], labels=["node"]
        )
        losses.add_metric(node, non_finite)
        yield losses
        if r.straggler_scores:
            scores = GaugeMetricFamily(
                PREFIX + "straggler_score", METRICS["straggler_score"][1], labels=["node", "rank"]
            )
            for rank, score in sorted(r.straggler_scores.items(), key=lambda kv: int(kv[0])):
                scores.add_metric([*node, str(rank)], float(score))
            yield scores
        mismatches = CounterMetricFamily(
            PREFIX + "replica_mismatches_total", METRICS["replica_mismatches_total"][1], labels=["node"]
        )
        mismatches.add_metric(node, mismatch_count)
        yield mismatches
        found = CounterMetricFamily(
            PREFIX + "stragglers_total", METRICS["stragglers_total"][1], labels=["node", "action"]
        )
        for action in ("replaced", "reported"):
            found.add_metric([*node, action], sum(1 for x in stragglers if x.get("action") == action))
        yield found
        by_layer: dict[str, list] = {layer: [] for layer in accounting.LAYERS}
        for rec in recoveries:
            by_layer.setdefault(rec.get("layer", "unknown"), []).append(rec)
        yield self._by_layer("recoveries_total", {k: [len(v)] for k, v in by_layer.items()})
        yield self._by_layer(
            "recovery_seconds_total", {k: [sum(x.get("recovery_s", 0.0) for x in v)] for k, v in by_layer.items()}
        )
        yield self._by_layer(
            "lost_steps_total", {k: [sum(x.get("lost_steps", 0) for x in v)] for k, v in by_layer.items()}
        )
        wall = r.wall_s(now)
        if wall is not None:
            yield self._gauge("productive_seconds", r.productive_s)
            yield self._gauge("job_wall_seconds", wall)
            yield self._gauge("goodput_ratio", r.productive_s / wall if wall > 0 else 0.0)

    def _gauge(self, name: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, METRICS[name][1], labels=["node"])
        family.add_metric([self.node], float(value))
        return family

    def _counter(self, name: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, METRICS[name][1], labels=["node"])
        family.add_metric([self.node], float(value))
        return family

    def _by_layer(self, name: str, values: dict[str, list]) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, METRICS[name][1], labels=["node", "layer"])
        for layer, (value,) in values.items():
            family.add_metric([self.node, layer], float(value))
        return family


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the agent's exit

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # Both families on one socket: IPv4 scrapers too, whatever the host's bindv6only says.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        # Not HTTPServer's own: it looks the address up by name (getfqdn), which can wait on DNS.
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()


class _Server4(_Server):
    address_family = socket.AF_INET


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass  # a line per scrape would bury the node's log


def serve(
    port: int,
    run_dir: Path,
    node: str,
    address: Optional[str] = None,
    silent_after_s: float = node_reports.INTERVAL_S * 6,
) -> tuple[str, WSGIServer]:
    """Serve :class:`RunCollector` over HTTP on ``port`` (0: any free port) from a daemon thread: on
    ``address``, else on every address (IPv6 and IPv4, or IPv4 where the host has no IPv6).
    Returns (where it listens, the server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(run_dir, node, silent_after_s))
    candidates = [address] if address else ["::", "0.0.0.0"]
    for host in candidates:
        ipv6 = ":" in host
        try:
            server = (_Server6 if ipv6 else _Server4)((host, port), _QuietHandler)
            break
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsError(
                    f"--metrics-port={port}: port {port} is already in use on {host}; choose "
                    "another (the chart's metrics.port), or 0 for no metrics"
                ) from None
            if host != candidates[-1] and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # no IPv6 here
            raise MetricsError(f"--metrics-port={port}: cannot listen on {host}: {exc.strerror or exc}") from None
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-endpoint", daemon=True).start()
    where = f"{host}:{server.server_port}" if address else f"port {server.server_port} on every address"
    return where, server
