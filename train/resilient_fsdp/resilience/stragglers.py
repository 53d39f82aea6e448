"""Slow ranks (``resilience.stragglers``): found with NVRx's straggler detector
(:mod:`.straggler_detector`), named in the log, ``summary.json`` and the metrics, and, with
``action=replace``, routed around without a job restart.

The detector's sections are the step's ``forward_backward`` and ``optimizer``; a rank is a
straggler when it is slow in ``consecutive_reports`` reports in a row (:class:`Stragglers`).
Rank 0 decides and broadcasts, so every rank acts at the same step. To replace one, its rank asks
``ft_launcher`` to leave its node out, every rank ends the attempt (:class:`StragglerReplaced`,
exit 204) and a hot spare takes its node rank; where that cannot be done (no spare, pod 0, no
``ft_launcher``) it is reported only, saying why. The trainer calls it after each step.
"""

from __future__ import annotations

import contextlib
import math
import socket
import statistics
import sys
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..config.sections import StragglersConfig
from .faults import node_index
from .ledger import FaultLedger
from .node_rank import SPARES_ENV

KERNELS = "kernels"
# Why a straggler is not replaced, agreed as the largest code any rank gives.
NOT_REPLACED = {
    1: "no ft_launcher to ask (the trainer runs without the node agent)",
    2: "no hot spare (spares=0)",
    3: "it runs on pod 0, which hosts the rendezvous store: its leaving would restart the job",
    4: "every hot spare has taken a node's place already: NVRx's rendezvous admits as many nodes left "
    "out as the job has spares, and one more would close it and end the job",
}
# The slowest ranks of each report kept in the records (the metrics' per-rank scores).
SLOWEST_KEPT = 8
# Steps before an attempt's first report with a cadence in seconds: the first steps' times
# (allocation, warm-up) are no step to convert seconds with.
FIRST_REPORT_STEPS = 10


class StragglerReplaced(BaseException):
    """A straggler's node leaves and a hot spare takes its place: every rank ends the attempt
    with the code the in-job restart retries. A ``BaseException``, so that in-process restart,
    which retries every ``Exception`` in the same processes and nodes, passes it on."""


def why_not_replaceable(launcher_active: bool, spares: int, pod: int, ledger: FaultLedger) -> int:
    """Rank-local: 0 when this rank's node can leave the job for a hot spare, else the code of
    :data:`NOT_REPLACED` that says why not. Every node left out so far counts against the spares
    (stragglers replaced, odd replicas out of :mod:`.sdc`)."""
    left = sum(1 for r in ledger.stragglers() if r.get("action") == "replaced") + sum(
        len(r.get("replaced", [])) for r in ledger.sdc()
    )
    return 1 if not launcher_active else 2 if spares < 1 else 3 if pod == 0 else 4 if left >= spares else 0


def spares_in(env: dict) -> int:
    raw = env.get(SPARES_ENV, "")
    return int(raw) if raw.isdigit() else 0


def slow_ranks(
    scores: dict[str, dict[int, float]],
    excess_s: dict[str, dict[int, float]],
    kernels: dict[int, float],
    threshold: float,
    min_excess_s: float,
) -> dict[int, tuple[str, float]]:
    """Each rank slow in one report: its slowest part below ``threshold`` (for a section, also
    costing at least ``min_excess_s`` more than the fastest rank) and that part's score."""
    out: dict[int, tuple[str, float]] = {}

    def note(rank: int, part: str, score: float) -> None:
        if rank not in out or score < out[rank][1]:
            out[rank] = (part, score)

    for section, by_rank in scores.items():
        for rank, score in by_rank.items():
            if math.isfinite(score) and score < threshold and excess_s.get(section, {}).get(rank, 0.0) >= min_excess_s:
                note(rank, section, score)
    for rank, score in kernels.items():
        if math.isfinite(score) and score < threshold:
            note(rank, KERNELS, score)
    return out


def lowest_scores(scores) -> list[tuple[float, int]]:
    """(each rank's lowest score of the report, over its parts and kernels, the rank), lowest first."""
    parts = [*scores.sections.values(), scores.kernels]
    ranks = {r for by_rank in scores.sections.values() for r in by_rank}
    return sorted((min((p[r] for p in parts if r in p and math.isfinite(p[r])), default=1.0), r) for r in ranks)


class Stragglers:
    """One attempt's straggler detection; every method is collective unless it says otherwise.

    A rank is slow in a report when a score (the fastest rank's median over its own) is below
    ``threshold`` and, for a section, its median exceeds the fastest rank's by at least
    ``min_excess`` of the median step (a part of a millisecond that varies twofold slows nobody).
    A section holding a collective runs at the slowest rank's pace on every rank, so the slow rank
    shows in its CUDA kernels' own times on a GPU, in its own optimizer step on CPU. Replacing one
    needs a hot spare left (NVRx closes its rendezvous once more nodes were left out than the job
    has spares) and a node other than pod 0 (its leaving is a job-level restart).
    """

    def __init__(
        self,
        cfg: StragglersConfig,
        rank: int,
        device: torch.device,
        ledger: FaultLedger,
        exclude_this_node: Callable[[str], bool],
        launcher_active: bool,
        spares: int,
        log: Callable[[dict, str], None],
    ):
        self.cfg, self.rank, self.device, self.ledger = cfg, rank, device, ledger
        self.exclude_this_node, self.launcher_active, self.spares, self.log = (
            exclude_this_node,
            launcher_active,
            spares,
            log,
        )
        self.detector = None
        self.streak: dict[int, int] = {}  # rank -> reports in a row it was slow in
        self.found: set[int] = {r["rank"] for r in ledger.stragglers() if r.get("action") == "reported"}
        self.pending: dict = {}  # rank 0: the straggler being acted on
        self.next_report: Optional[int] = None  # the step of the next report, agreed
        self.last_report = 0  # the step of the last one (0: none yet this attempt)
        self.steps_between: list[int] = []  # the steps each report covered
        self.reports = 0
        self.report_s: list[float] = []  # this rank's time in each report (the detector's cost)
        if cfg.enabled:
            from .straggler_detector import StragglerDetector

            self.detector = StragglerDetector(device.type == "cuda", f"pod {node_index()} ({socket.gethostname()})")

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Rank-local: time the block as the detector's section ``name``."""
        if self.detector is None:
            yield
            return
        with self.detector.section(name):
            yield

    def after_step(self, step: int, step_times: list[float]) -> None:
        """After step ``step``: every ``report_every_steps`` steps, score the ranks and act on a
        straggler found (raises :class:`StragglerReplaced` to replace it)."""
        if self.detector is None:
            return
        if self.next_report is None:  # the attempt's first report: after a warm-up of steps
            self.next_report = step - 1 + (self.cfg.report_every_steps or FIRST_REPORT_STEPS)
        if step < self.next_report:
            return
        t0 = time.perf_counter()
        scores = self.detector.report()
        target, every = -1, 0
        since = step_times[-(step - self.last_report) :] if step_times else []
        if scores is not None:  # rank 0
            target = self._judge(step, scores, since)
            every = self.cfg.report_every_steps or max(
                1,
                round(self.cfg.report_every_s / statistics.median(since))
                if since and statistics.median(since) > 0
                else 1,
            )
        decided = torch.tensor([target, every], dtype=torch.int64, device=self.device)
        dist.broadcast(decided, src=0)
        target, every = (int(v) for v in decided.tolist())
        self.steps_between.append(step - self.last_report)
        self.last_report, self.next_report = step, step + every
        self.reports += 1
        self.report_s.append(time.perf_counter() - t0)
        if target >= 0:
            self._act(step, target)

    def _judge(self, step: int, scores, step_times: list[float]) -> int:
        """Rank 0: the rank to act on in this report (newly a straggler), else -1."""
        median_step = statistics.median(step_times) if step_times else 0.0
        excess: dict[str, dict[int, float]] = {}
        for section, by_rank in scores.sections.items():
            fastest_ms = scores.fastest_median(section, 0)
            if fastest_ms is not None:
                excess[section] = {
                    r: fastest_ms / 1000.0 * (1.0 / s - 1.0) if s > 0 else math.inf for r, s in by_rank.items()
                }
        slow = slow_ranks(
            scores.sections, excess, scores.kernels, self.cfg.threshold, self.cfg.min_excess * median_step
        )
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}  # a report not slow ends a streak
        self.log(
            {
                "event": "straggler_report",
                "t": time.time(),
                "step": step,
                "slowest": {str(r): round(s, 4) for s, r in lowest_scores(scores)[:SLOWEST_KEPT]},
                "slow": {
                    str(r): {"part": p, "score": round(s, 4), "reports": self.streak[r]} for r, (p, s) in slow.items()
                },
            },
            "",
        )
        due = [r for r, n in self.streak.items() if n >= self.cfg.consecutive_reports and r not in self.found]
        if not due:
            return -1
        target = min(due, key=lambda r: slow[r][1])
        part, score = slow[target]
        self.pending = {
            "rank": target,
            "part": part,
            "score": round(score, 4),
            "found_at_step": step,
            "reports": self.streak[target],
            "median_step_s": median_step,
            "excess_s": round(excess.get(part, {}).get(target, math.nan), 6),
        }
        return target

    def _act(self, step: int, target: int) -> None:
        """Every rank: name the straggler; replace it when that can be done."""
        who = [None] * dist.get_world_size()
        dist.all_gather_object(who, (node_index(), socket.gethostname()))
        pod, host = who[target]
        reason = 0
        if self.cfg.action == "replace" and self.rank == target:
            reason = why_not_replaceable(self.launcher_active, self.spares, pod, self.ledger)
        replace = self.cfg.action == "replace"
        if replace:
            agreed = torch.tensor([reason], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            reason = int(agreed.item())
            replace = reason == 0
        if self.rank == 0:
            found = {
                **self.pending,
                "key": f"step{step:08d}-rank{target}",
                "t_found": time.time(),
                "pod": pod,
                "host": host,
                "action": "replaced" if replace else "reported",
            }
            if self.cfg.action == "replace" and not replace:
                found["not_replaced"] = NOT_REPLACED[reason]
            self.ledger.record_straggler(found)
            then = (
                "its node leaves the job and a hot spare takes its place (in-job restart)"
                if replace
                else f"reported only: {found['not_replaced']}"
                if "not_replaced" in found
                else "reported"
            )
            self.log(
                {"event": "straggler", **found},
                f"straggler: rank {target} (pod {pod}, host {host}): its {found['part']} scored "
                f"{found['score']:.2f} of the fastest rank's in {found['reports']} reports in a row, "
                f"at step {step}; {then}",
            )
        self.found.add(target)
        if not replace:
            return
        if self.rank == target:
            self.exclude_this_node(
                f"straggler: rank {target} scored below resilience.stragglers.threshold="
                f"{self.cfg.threshold:g} in {self.cfg.consecutive_reports} reports"
            )
            print(
                f"[resilient-fsdp] rank {target}: asked ft_launcher to leave this node out of the next rendezvous",
                file=sys.stderr,
                flush=True,
            )
        raise StragglerReplaced(f"rank {target} is a straggler: its node leaves the job at step {step}")

    def summary(self, step_times: list[float]) -> Optional[dict]:
        """This attempt's detection: its reports, and what they and the timed sections cost this
        rank against its median step (the cost of a report is spread over the steps it covers)."""
        if self.detector is None:
            return None
        median_step = statistics.median(step_times) if step_times else 0.0
        per_report = statistics.median(self.report_s) if self.report_s else 0.0
        # Past the first report, which comes after a fixed warm-up: the cadence the steps set.
        between = statistics.median(self.steps_between[1:] or self.steps_between) if self.steps_between else 0
        return {
            "reports": self.reports,
            "steps_between_reports": between,
            "report_s_median": round(per_report, 6),
            "kernels": self.detector.kernels or "profiled (CUPTI)",
            "report_cost_over_step": round(per_report / between / median_step, 6) if median_step and between else None,
        }

    def close(self) -> None:
        if self.detector is not None:
            self.detector.close()
            self.detector = None


def close_replacements(ledger: FaultLedger, resumed_step: int, now: float, log: Callable[[dict, str], None]) -> None:
    """Every rank, after the first step of an attempt: the stragglers replaced before it get their
    replacement (the pod and host now holding the rank) and the time routing around took."""
    open_ = [r for r in ledger.stragglers() if r.get("action") == "replaced" and "replaced_by" not in r]
    if not open_:
        return
    who = [None] * dist.get_world_size()
    dist.all_gather_object(who, (node_index(), socket.gethostname()))
    if dist.get_rank() != 0:
        return
    for record in open_:
        pod, host = who[record["rank"]]
        record.update(
            replaced_by={"pod": pod, "host": host},
            resumed_from_step=resumed_step,
            route_around_s=round(now - record["t_found"], 3),
        )
        ledger.record_straggler(record)
        log(
            {"event": "straggler_replaced", "t": now, **record},
            f"straggler rank {record['rank']} (pod {record['pod']}) replaced by pod {pod} (host {host}): training "
            f"again {record['route_around_s']:.2f} s after it was found, from step {resumed_step}",
        )
