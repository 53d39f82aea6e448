"""``resilient-fsdp simulate``: Monte Carlo goodput of a long job at cluster scale, per restart strategy.

Each run draws node failures as a Poisson process over a wall-clock horizon, each of a class
(:data:`CLASSES`, in ``--mix`` proportions) that a strategy (:data:`STRATEGIES`) hands to a
restart layer; every recovery resumes from the newest committed checkpoint, and training between
failures follows :mod:`.model`. With ``--memory-stall-s`` the memory tier's strategy runs too, with
``--spares`` the in-job strategies with hot spares. Each figure comes with a range: the low end
fails at Meta RSC-1's rate and recovers ``--recovery-range`` times slower. Stragglers and silent
corruption, which no restart sees, are estimated beside (``model.slow_and_silent``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np

from ..config.errors import UsageError, writable_file
from . import model as gm

# transient: the processes can re-enter the training function (in-process restart can take it);
# process: a crashed or wedged worker on a healthy node (in-job restart); node: lost or replaced (job level).
CLASSES = ("transient", "process", "node")
STRATEGIES = {
    # failure class -> layer that recovers it
    "job": {"transient": "job", "process": "job", "node": "job"},
    "in-job": {"transient": "in_job", "process": "in_job", "node": "job"},
    "in-process": {"transient": "in_process", "process": "in_job", "node": "job"},
}
MEMORY_STRATEGY = "in-job+memory"
"""``in-job`` with the memory tier; simulated when the scenario has a memory stall. A snapshot every
``T_m`` seconds (no write time); ``transient`` and ``process`` failures resume from it, a ``node``
failure too with ``--memory-replicas 1`` (the peer pod's replica), else from the durable checkpoint."""
SPARE_STRATEGIES = {"in-job+spares": "in-job", "in-job+memory+spares": MEMORY_STRATEGY}
"""Each strategy with hot spares -> the same strategy without them; simulated with spares. A node
failure of any pod but pod 0 (the rendezvous store's host) takes a free spare and recovers at the
in-job cost plus ``model.SPARE_JOIN_S``; the spare stays busy until the replacement joins
(``--replacement-s``). With every spare busy, or pod 0 lost, it is a job-level restart."""
# At-scale recovery times (seconds), each from the failure to training again, checkpoint load
# included. Stated assumptions, not measurements: in-process restart's own parts add to ~1.5 s
# (NVRx docs) plus re-initialisation and the load; an in-job restart cycle is about a minute
# (NVRx docs) plus the load; a job-level restart waits for a replacement node to be scheduled,
# pull the image and join, here 10 minutes.
DEFAULT_RECOVERY_S = {"in_process": 30.0, "in_job": 120.0, "job": 600.0}
# Share of failures per class (transient, process, node). Llama 3 attributes ~78% of its
# unexpected interruptions to hardware; most of those take the node out. Stated assumption.
DEFAULT_MIX = (0.2, 0.2, 0.6)
# The range's low end: recovery this many times as long (stated assumption: a restart at 1,000+
# nodes waits 2-3x longer for scheduling, image pulls and the rendezvous than a small one).
DEFAULT_RECOVERY_RANGE = 3.0


@dataclass
class Tally:
    productive: float = 0.0
    stalls: float = 0.0
    lost: float = 0.0
    restarts: float = 0.0
    failures: int = 0
    spare_losses: int = 0
    """Node losses a spare could take (pod 0's excepted), with spares."""
    spare_misses: int = 0
    """Those of them that found every spare busy."""

    def add(self, other: "Tally") -> None:
        self.productive += other.productive
        self.stalls += other.stalls
        self.lost += other.lost
        self.restarts += other.restarts
        self.failures += other.failures
        self.spare_losses += other.spare_losses
        self.spare_misses += other.spare_misses


@dataclass(frozen=True)
class Scenario:
    nodes: int
    node_mtbf_h: float
    horizon_h: float
    interval_s: float
    stall_s: float
    write_s: float
    recovery_s: dict = field(default_factory=lambda: dict(DEFAULT_RECOVERY_S))
    mix: tuple = DEFAULT_MIX
    memory_interval_s: float = 0.0
    """``T_m``: training seconds between memory snapshots (0: no memory tier)."""
    memory_stall_s: float = 0.0
    memory_replicas: int = 1
    memory_durable_interval_s: float = 0.0
    """The durable interval of the memory strategies (0: ``interval_s``, as the others)."""
    spares: int = 0
    """Hot spares (standby pods) for the ``+spares`` strategies."""
    replacement_s: float = DEFAULT_RECOVERY_S["job"]
    """From a spare's taking a lost node's rank until the lost pod's replacement joins as a spare."""
    node_mtbf_low_h: float = 0.0
    """The range's low end: the shortest plausible node MTBF (0: ``node_mtbf_h``, no wider)."""
    recovery_range: float = 1.0
    """The range's low end: recovery (and replacement) times this many times as long."""

    def low_end(self) -> "Scenario":
        """The same job at the worst plausible failure rate and recovery times."""
        return replace(
            self,
            node_mtbf_h=self.node_mtbf_low_h or self.node_mtbf_h,
            recovery_s={k: v * self.recovery_range for k, v in self.recovery_s.items()},
            replacement_s=self.replacement_s * self.recovery_range,
        )

    @property
    def mtbf_s(self) -> float:
        return self.node_mtbf_h * gm.HOUR / self.nodes

    @property
    def memory_saves(self) -> float:
        """Memory snapshots per durable interval (the durable save takes the last slot)."""
        return max(0.0, self.interval_s / self.memory_interval_s - 1.0) if self.memory_interval_s > 0 else 0.0

    def with_memory_durable_interval(self) -> "Scenario":
        """This scenario as the memory strategies run it: their own durable interval, if set."""
        return replace(self, interval_s=self.memory_durable_interval_s) if self.memory_durable_interval_s > 0 else self

    def from_memory(self, cls: str) -> bool:
        """Whether a failure of class ``cls`` resumes from a memory snapshot."""
        return self.memory_interval_s > 0 and (cls != "node" or self.memory_replicas > 0)

    @property
    def node_loss_share(self) -> float:
        return self.mix[CLASSES.index("node")] / sum(self.mix)

    @property
    def busy_spares_mean(self) -> float:
        """``m``: spares waiting for a replacement, on average (``model.busy_spares_mean``)."""
        return gm.busy_spares_mean(self.nodes, self.node_mtbf_h * gm.HOUR, self.node_loss_share, self.replacement_s)


def base_strategy(strategy: str) -> str:
    """The strategy without hot spares."""
    return SPARE_STRATEGIES.get(strategy, strategy)


def run_segment(
    duration: float, s: Scenario, ends_in_failure: bool, memory: bool = False, from_memory: bool = False
) -> Tally:
    """Training for ``duration`` seconds from a restored (committed) state; with ``memory``, the
    scenario's memory snapshots too, and a failure ``from_memory`` keeps the newest of them."""
    stall = s.stall_s + (s.memory_saves * s.memory_stall_s if memory else 0.0)
    cycle = s.interval_s + stall
    k = int(duration // cycle)
    rest = duration - k * cycle
    trained = k * s.interval_s + min(rest, s.interval_s)
    stalled = k * stall + max(0.0, rest - s.interval_s)
    if not ends_in_failure:
        return Tally(productive=trained, stalls=stalled)
    # Checkpoint i (taken at i * cycle) is usable once its write ends, W later.
    committed = max(0, min(k, int((duration - s.write_s) // cycle))) if duration >= s.write_s else 0
    kept = committed * s.interval_s
    if memory and from_memory:
        kept = max(kept, (trained // s.memory_interval_s) * s.memory_interval_s)
    return Tally(productive=kept, stalls=stalled, lost=trained - kept, failures=1)


def simulate_run(
    s: Scenario, strategy: str, rng: np.random.Generator, spare_rng: Optional[np.random.Generator] = None
) -> Tally:
    """One job over the horizon; returns seconds spent per category. ``spare_rng`` draws which
    pod a node loss takes (default ``rng``): a stream of its own leaves the failures drawn from
    ``rng`` the same with spares as without."""
    memory = base_strategy(strategy) == MEMORY_STRATEGY
    layers = STRATEGIES["in-job" if memory else base_strategy(strategy)]
    horizon = s.horizon_h * gm.HOUR
    mix = np.asarray(s.mix, dtype=float) / sum(s.mix)
    spare_rng = rng if spare_rng is None else spare_rng
    # When each spare is free again: its replacement's arrival (all free at the start).
    spare_free_at = [0.0] * (s.spares if strategy in SPARE_STRATEGIES else 0)
    total = Tally()

    def failure_class() -> str:
        return CLASSES[rng.choice(len(CLASSES), p=mix)]

    def recovery(cls: str, at: float) -> float:
        if cls != "node" or not spare_free_at:
            return s.recovery_s[layers[cls]]
        if spare_rng.random() < 1.0 / s.nodes:
            return s.recovery_s[layers[cls]]  # pod 0 hosts the rendezvous store: a job-level restart
        total.spare_losses += 1
        free = next((i for i, t_free in enumerate(spare_free_at) if t_free <= at), None)
        if free is None:
            total.spare_misses += 1
            return s.recovery_s[layers[cls]]
        spare_free_at[free] = at + s.replacement_s
        return s.recovery_s["in_job"] + gm.SPARE_JOIN_S

    t, recovering_until = 0.0, None
    while t < horizon:
        # Failures are memoryless: a fresh draw from every state change is exact.
        failure_at = t + rng.exponential(s.mtbf_s)
        if recovering_until is None:
            if failure_at >= horizon:
                total.add(run_segment(horizon - t, s, ends_in_failure=False, memory=memory))
                break
            cls = failure_class()
            total.add(
                run_segment(failure_at - t, s, ends_in_failure=True, memory=memory, from_memory=s.from_memory(cls))
            )
            t, recovering_until = failure_at, failure_at + recovery(cls, failure_at)
        elif failure_at < min(recovering_until, horizon):
            # Failed again while recovering: the recovery starts over.
            total.restarts += failure_at - t
            total.failures += 1
            t, recovering_until = failure_at, failure_at + recovery(failure_class(), failure_at)
        else:
            end = min(recovering_until, horizon)
            total.restarts += end - t
            t, recovering_until = end, None
    return total


def simulate(s: Scenario, strategy: str, runs: int, seed: int) -> dict:
    """``runs`` jobs of ``strategy``; the shares of wall time, failures per job and, with spares,
    the share of node losses (pod 0's excepted) that found no spare free."""
    rng = np.random.default_rng(seed)
    spare_rng = np.random.default_rng([seed, 1])
    total = Tally()
    for _ in range(runs):
        total.add(simulate_run(s, strategy, rng, spare_rng))
    wall = runs * s.horizon_h * gm.HOUR
    out = {
        "goodput": total.productive / wall,
        "checkpoint_stalls": total.stalls / wall,
        "lost_work": total.lost / wall,
        "restarts": total.restarts / wall,
        "failures_per_run": total.failures / runs,
    }
    if strategy in SPARE_STRATEGIES:
        out["p_no_spare"] = total.spare_misses / total.spare_losses if total.spare_losses else 0.0
    return out


def analytic(s: Scenario, strategy: str) -> float:
    """The closed-form expectation with the strategy's mean recovery time (with the memory tier:
    ``model.expected_goodput_with_memory``, its coverage the share of failures it restores; with
    spares, a node loss's mean recovery is ``model.node_loss_recovery_s``)."""
    memory = base_strategy(strategy) == MEMORY_STRATEGY
    layers = STRATEGIES["in-job" if memory else base_strategy(strategy)]
    mix = np.asarray(s.mix, dtype=float) / sum(s.mix)

    def recovery(cls: str) -> float:
        if cls == "node" and strategy in SPARE_STRATEGIES:
            return gm.node_loss_recovery_s(
                s.nodes, s.spares, s.busy_spares_mean, s.recovery_s["in_job"], s.recovery_s[layers[cls]]
            )
        return s.recovery_s[layers[cls]]

    if not memory:
        mean_r = float(sum(p * recovery(c) for p, c in zip(mix, CLASSES)))
        return gm.expected_goodput(s.interval_s, s.stall_s, s.write_s, mean_r, s.mtbf_s).productive
    covered = [(p, c) for p, c in zip(mix, CLASSES) if s.from_memory(c)]
    others = [(p, c) for p, c in zip(mix, CLASSES) if not s.from_memory(c)]
    coverage = float(sum(p for p, _ in covered))

    def mean(pairs: list) -> float:
        share = sum(p for p, _ in pairs)
        return float(sum(p * recovery(c) for p, c in pairs) / share) if share > 0 else 0.0

    return gm.expected_goodput_with_memory(
        s.interval_s,
        s.stall_s,
        s.write_s,
        mean(others),
        s.mtbf_s,
        s.memory_interval_s,
        s.memory_stall_s,
        mean(covered),
        coverage,
    ).productive


def parse_recovery(text: str) -> dict:
    out = dict(DEFAULT_RECOVERY_S)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in out:
            raise ValueError(f"--recovery-s {part!r}: expected LAYER=SECONDS with LAYER one of {', '.join(out)}")
        out[key] = float(value)
    return out


def recovery_from_bench(path: Path) -> dict:
    """Median recovery per layer from ``bench recovery`` JSON (``full_relaunch`` stands for ``job``)."""
    names = {"in_process": "in_process", "in_job": "in_job", "full_relaunch": "job"}
    try:
        data = json.loads(path.read_text())
        return {layer: float(data[key]["recovery_s_median"]) for key, layer in names.items() if key in data}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--recovery-from-bench {path}: cannot read it as JSON ({exc})") from None
    except (TypeError, KeyError, ValueError, AttributeError):
        raise UsageError(
            f"--recovery-from-bench {path}: not `bench recovery` results (each of "
            f"{', '.join(names)} with a recovery_s_median)"
        ) from None


def startup_from_bench(path: Path, case: str, ranks: int) -> float:
    """What a restarted world of ``ranks`` spends before its first step on planning and the resume's
    metadata (the longest rank blocked by a cold save's plan, plus a durable resume's metadata and
    load planning), from ``bench scale`` JSON: every measured world of ``case`` (``PRESET:LAYOUT``),
    the extrapolation's own points included, interpolated in the world size (beyond them, along the
    line through the origin and the nearest one: the phases grow with the world). Raises
    ValueError naming what is missing."""
    preset, _, layout = case.partition(":")
    points: dict[int, float] = {}
    for record in json.loads(path.read_text()):
        if (record.get("preset"), record.get("layout")) != (preset, layout):
            continue
        measured = {int(w): m for w, m in (record.get("extrapolated_from") or {}).items()}
        if "extrapolated_from" not in record:
            measured[int(record["ranks"])] = record
        for world, m in measured.items():
            points[world] = float(m["max_rank_blocked_s"]) + float(m["resume_metadata_and_plan_s"])
    if not points:
        raise ValueError(
            f"it holds no measured case of {preset} {layout or '(no layout)'} (`resilient-fsdp bench "
            f"scale --case RANKS:{preset}:{layout}` measures one)"
        )
    worlds = sorted(points)
    if ranks <= worlds[0] or ranks >= worlds[-1]:
        nearest = worlds[0] if ranks <= worlds[0] else worlds[-1]
        return points[nearest] * ranks / nearest if ranks > nearest else points[nearest]
    return float(np.interp(ranks, worlds, [points[w] for w in worlds]))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="Monte Carlo goodput per cluster size and restart strategy",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--nodes", default="8,64,512,2048", help="comma-separated node counts")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--node-mtbf-hours", type=float, help="default: Llama 3's interruptions per GPU-hour x GPUs per node"
    )
    p.add_argument("--horizon-hours", type=float, default=24.0 * 14, help="wall time of one simulated job")
    p.add_argument("--runs", type=int, default=200, help="simulated jobs per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-stall-s", type=float, default=1.0)
    p.add_argument("--ckpt-write-s", type=float, default=60.0)
    p.add_argument("--interval-s", type=float, help="checkpoint interval; default: Daly's for each size")
    p.add_argument("--recovery-s", default="", help="LAYER=SECONDS overrides, e.g. in_job=90,job=900")
    p.add_argument("--recovery-from-bench", metavar="FILE", help="recovery times from `bench recovery` JSON")
    p.add_argument(
        "--startup-from-bench",
        metavar="FILE",
        help="adds to every recovery what a restarted world of each size spends planning its first "
        "save and reading the resume's metadata, from `bench scale` JSON (--startup-case)",
    )
    p.add_argument(
        "--startup-case",
        default="70b:fsdp",
        metavar="PRESET:LAYOUT",
        help="the `bench scale` case --startup-from-bench reads (default 70b:fsdp)",
    )
    p.add_argument(
        "--mix",
        default=",".join(f"{x:g}" for x in DEFAULT_MIX),
        help="shares of transient,process,node failures (default 0.2,0.2,0.6)",
    )
    p.add_argument(
        "--memory-stall-s",
        type=float,
        help=f"stall of one memory snapshot: adds the {MEMORY_STRATEGY} strategy (default: not simulated)",
    )
    p.add_argument(
        "--memory-interval-s",
        type=float,
        help="training seconds between memory snapshots; default: Daly's for the memory stall and the "
        "MTBF of the failures it restores, at most the durable interval",
    )
    p.add_argument(
        "--memory-durable-interval-s",
        type=float,
        help="the memory strategies' durable checkpoint interval (default: the others'); `advise "
        "--memory` gives Daly's for the failures the memory tier leaves to the durable checkpoint",
    )
    p.add_argument(
        "--memory-replicas",
        type=int,
        choices=(0, 1),
        default=1,
        help="1 (default): a lost node resumes from its peer's replica; 0: from the durable checkpoint",
    )
    p.add_argument(
        "--spares",
        default="0",
        metavar="S",
        help="hot spares: adds the in-job strategies with S standby pods (in-job+spares, and "
        "in-job+memory+spares with --memory-stall-s); 'auto': the fewest for which at most 1%% of "
        "node losses find none free, per size (default 0: not simulated)",
    )
    p.add_argument(
        "--replacement-s",
        type=float,
        help="from a spare's taking a lost node's rank until the replacement pod joins as a spare "
        "(default: the job-level recovery)",
    )
    p.add_argument(
        "--recovery-range",
        type=float,
        default=DEFAULT_RECOVERY_RANGE,
        metavar="X",
        help="the range's low end takes every recovery time X times as long (default "
        f"{DEFAULT_RECOVERY_RANGE:g}: a restart at 1,000+ nodes; 1: the times as given)",
    )
    p.add_argument(
        "--step-s",
        type=float,
        default=5.0,
        help="a training step at scale, for the replica checks' interval (default 5: assumed)",
    )
    p.add_argument(
        "--straggler-find-s",
        type=float,
        default=gm.STRAGGLER_FIND_S,
        help=f"seconds until a straggler is named (default {gm.STRAGGLER_FIND_S:g}: resilience.stragglers' "
        "defaults, two slow reports a minute apart after half a report's wait)",
    )
    p.add_argument(
        "--sdc-interval-steps",
        type=int,
        default=100,
        help="steps between replica checks (resilience.sdc.interval_steps; default 100)",
    )
    p.add_argument(
        "--sdc-check-cost",
        type=float,
        default=0.001,
        help="a replica check's cost as a share of the steps it covers (default 0.001; "
        "docs/benchmarks.md has the measured figure)",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG of goodput per size and strategy here")
    p.set_defaults(run=main)


def scenarios_from_args(args: argparse.Namespace) -> list[Scenario]:
    try:
        nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        raise UsageError(f"--nodes {args.nodes!r}: give comma-separated whole node counts, e.g. --nodes 8,64") from None
    try:
        mix = tuple(float(x) for x in args.mix.split(","))
    except ValueError:
        raise UsageError(
            f"--mix {args.mix!r}: give three comma-separated numbers (transient,process,node), e.g. --mix 0.5,0.3,0.2"
        ) from None
    try:
        recovery = parse_recovery(args.recovery_s)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
        raise UsageError("--mix needs three non-negative shares (transient,process,node)")
    if not nodes or min(nodes) < 1:
        raise UsageError("--nodes needs positive node counts, e.g. --nodes 8,64")
    if (
        not args.step_s > 0
        or args.straggler_find_s < 0
        or args.sdc_interval_steps < 1
        or not 0 <= args.sdc_check_cost < 1
    ):
        raise UsageError(
            "--step-s must be above 0, --straggler-find-s 0 or more, --sdc-interval-steps 1 or "
            "more and --sdc-check-cost a share of a step from 0 to below 1"
        )
    if args.recovery_from_bench:
        recovery.update(recovery_from_bench(Path(args.recovery_from_bench)))
    node_mtbf = args.node_mtbf_hours or gm.node_mtbf_hours(args.gpus_per_node)
    spares_arg = str(getattr(args, "spares", "0")).strip()
    if spares_arg != "auto" and not spares_arg.isdigit():
        raise UsageError(f"--spares {spares_arg!r}: give a whole number of spare nodes (0 or more) or 'auto'")
    replacement = getattr(args, "replacement_s", None)
    replacement = recovery["job"] if replacement is None else replacement
    if replacement < 0:
        raise UsageError("--replacement-s must not be negative")
    recovery_range = getattr(args, "recovery_range", DEFAULT_RECOVERY_RANGE)
    if not recovery_range >= 1:
        raise UsageError(
            f"--recovery-range {recovery_range:g}: give 1 or more (the low end's recovery "
            "times as a multiple of those given)"
        )
    # A rate the user gives is their cluster's own; the published one is widened to RSC-1's.
    node_mtbf_low = 0.0 if args.node_mtbf_hours else min(node_mtbf, gm.rsc_node_mtbf_hours(args.gpus_per_node))
    startup_file = getattr(args, "startup_from_bench", None)
    out = []
    for n in nodes:
        mtbf_s = node_mtbf * gm.HOUR / n
        recovery_n = recovery
        if startup_file:
            try:
                startup = startup_from_bench(Path(startup_file), args.startup_case, n * args.gpus_per_node)
            except (OSError, ValueError, KeyError) as exc:
                raise UsageError(f"--startup-from-bench {startup_file}: {exc}")
            recovery_n = {k: v + startup for k, v in recovery.items()}
        interval = args.interval_s or max(gm.daly_interval(args.ckpt_stall_s, mtbf_s), args.ckpt_write_s)
        s = Scenario(
            nodes=n,
            node_mtbf_h=node_mtbf,
            horizon_h=args.horizon_hours,
            interval_s=interval,
            stall_s=args.ckpt_stall_s,
            write_s=args.ckpt_write_s,
            recovery_s=recovery_n,
            mix=mix,
            replacement_s=replacement,
            node_mtbf_low_h=node_mtbf_low,
            recovery_range=recovery_range,
        )
        spares = gm.spares_needed(s.busy_spares_mean) if spares_arg == "auto" else int(spares_arg)
        s = replace(s, spares=spares)
        stall = getattr(args, "memory_stall_s", None)
        if stall is not None:
            if stall < 0:
                raise UsageError("--memory-stall-s must not be negative")
            s = Scenario(
                **{
                    **s.__dict__,
                    "memory_stall_s": stall,
                    "memory_replicas": args.memory_replicas,
                    "memory_interval_s": 1.0,
                }
            )  # from_memory needs an interval to say what it covers
            coverage = sum(p for p, c in zip(mix, CLASSES) if s.from_memory(c)) / sum(mix)
            memory_interval = args.memory_interval_s or gm.daly_interval(max(stall, 1e-3), mtbf_s / max(coverage, 1e-9))
            if memory_interval <= 0:
                raise UsageError("--memory-interval-s must be positive")
            durable = getattr(args, "memory_durable_interval_s", None) or interval
            if durable < args.ckpt_write_s:
                raise UsageError(
                    f"--memory-durable-interval-s {durable:g} is shorter than the write "
                    f"(--ckpt-write-s {args.ckpt_write_s:g}): saves would queue behind writes"
                )
            s = Scenario(
                **{
                    **s.__dict__,
                    "memory_interval_s": min(memory_interval, durable),
                    "memory_durable_interval_s": durable,
                }
            )
        out.append(s)
    return out


def input_sources(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Each input of the figures and where it comes from: measured, given, published or assumed."""
    given = {part.partition("=")[0].strip() for part in args.recovery_s.split(",") if part.strip()}
    measured = set(recovery_from_bench(Path(args.recovery_from_bench))) if args.recovery_from_bench else set()
    recovery = ", ".join(
        f"{layer} "
        + (
            "measured (" + args.recovery_from_bench + ")"
            if layer in measured
            else "given"
            if layer in given
            else f"assumed ({DEFAULT_RECOVERY_S[layer]:g} s)"
        )
        for layer in DEFAULT_RECOVERY_S
    )
    rate = (
        "given (--node-mtbf-hours), not widened"
        if args.node_mtbf_hours
        else f"published: {gm.LLAMA3_SOURCE.format(gpu_hours=gm.llama3_gpu_mtbf_hours())}; the low end {gm.RSC_SOURCE}"
    )
    defaults = {a.dest: a.default for a in build_parser()._actions}

    def flag(name: str, text: str) -> str:
        return "given" if getattr(args, name) != defaults.get(name) else f"assumed (default {text})"

    out = [
        ("failure rate", rate),
        (
            "recovery times",
            f"{recovery}; the low end {getattr(args, 'recovery_range', DEFAULT_RECOVERY_RANGE):g}x "
            "(assumed: a large cluster's scheduling, pulls and joins)",
        ),
        ("failure classes", flag("mix", args.mix)),
        (
            "checkpoint stall and write",
            f"stall {flag('ckpt_stall_s', str(defaults.get('ckpt_stall_s')))}, "
            f"write {flag('ckpt_write_s', str(defaults.get('ckpt_write_s')))}",
        ),
    ]
    if getattr(args, "memory_stall_s", None) is not None:
        out.append(("memory snapshot stall", "given"))
    if getattr(args, "startup_from_bench", None):
        out.append(
            (
                "start-up planning and resume metadata",
                f"measured (bench scale {args.startup_from_bench}, {args.startup_case}), added to every recovery",
            )
        )
    else:
        out.append(("start-up planning and resume metadata", "not counted (--startup-from-bench)"))
    out += [
        (
            "stragglers",
            f"published: {gm.STRAGGLER_SOURCE}; assumed: an episode lasts "
            f"{gm.STRAGGLER_EPISODE_H:g} h at {gm.STRAGGLER_SLOWDOWN:g}x; found after "
            f"{args.straggler_find_s:g} s ({flag('straggler_find_s', str(defaults.get('straggler_find_s')))})",
        ),
        (
            "silent corruption",
            f"published: {gm.SDC_SOURCE}; assumed: unchecked, {gm.SDC_UNNOTICED_H:g} h trained "
            f"on it before it shows; checked every {args.sdc_interval_steps} steps at a cost of "
            f"{args.sdc_check_cost:g} of a step, steps of {args.step_s:g} s "
            f"({flag('sdc_check_cost', str(defaults.get('sdc_check_cost')))})",
        ),
    ]
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``simulate`` parser on its own (for its defaults)."""
    parser = argparse.ArgumentParser(prog="resilient-fsdp")
    add_parser(parser.add_subparsers())
    return parser._subparsers._group_actions[0].choices["simulate"]


def strategies_of(s: Scenario) -> list[str]:
    """The strategies a scenario is simulated for: the memory tier's with a memory stall, and
    their variants with spares when it has spares."""
    plain = [*STRATEGIES, *([MEMORY_STRATEGY] if s.memory_interval_s > 0 else [])]
    spared = [k for k, base in SPARE_STRATEGIES.items() if base in plain] if s.spares > 0 else []
    return plain + spared


def run_all(scenarios: list[Scenario], runs: int, seed: int) -> list[dict]:
    rows = []
    for scenario in scenarios:
        for strategy in strategies_of(scenario):
            memory = base_strategy(strategy) == MEMORY_STRATEGY
            s = scenario.with_memory_durable_interval() if memory else scenario
            result = simulate(s, strategy, runs, seed)
            low = simulate(s.low_end(), strategy, runs, seed)["goodput"]
            result.update(goodput_low=low, goodput_mid=(low + result["goodput"]) / 2)
            spares = {
                "spares": s.spares,
                "replacement_s": s.replacement_s,
                "p_no_spare_analytic": gm.p_no_spare(s.spares, s.busy_spares_mean),
            }
            rows.append(
                {
                    "nodes": s.nodes,
                    "strategy": strategy,
                    "interval_s": s.interval_s,
                    **({"memory_interval_s": s.memory_interval_s} if memory else {}),
                    **(spares if strategy in SPARE_STRATEGIES else {}),
                    "job_mtbf_h": s.mtbf_s / gm.HOUR,
                    "analytic_goodput": analytic(s, strategy),
                    **result,
                }
            )
    return rows


def render_table(rows: list[dict]) -> str:
    width = max([13, *(len(r["strategy"]) for r in rows)])
    spares = any("spares" in r for r in rows)
    lines = [
        f"{'nodes':>6} {'job MTBF':>9} {'interval':>9} {'strategy':<{width}} {'goodput':>8} {'range':>13} "
        f"{'middle':>7} {'analytic':>9} {'stalls':>7} {'lost':>7} {'restarts':>9} {'failures':>9}"
        + ("  spares (no spare free)" if spares else "")
    ]
    for r in rows:
        lines.append(
            f"{r['nodes']:>6} {r['job_mtbf_h']:>8.1f}h {r['interval_s']:>8.0f}s {r['strategy']:<{width}} "
            f"{r['goodput']:>8.4f} {r['goodput_low']:>6.4f}-{r['goodput']:.4f} {r['goodput_mid']:>7.4f} "
            f"{r['analytic_goodput']:>9.4f} {r['checkpoint_stalls']:>7.4f} "
            f"{r['lost_work']:>7.4f} {r['restarts']:>9.4f} {r['failures_per_run']:>9.1f}"
            + (f"  {r['spares']} ({r['p_no_spare']:.2%})" if "spares" in r else "")
        )
    return "\n".join(lines)


def slow_and_silent_rows(scenarios: list[Scenario], args: argparse.Namespace) -> list[dict]:
    """Per size, what stragglers and silent corruption cost (analytic, ``model.slow_and_silent``):
    unmitigated, and with a straggler replaced by a hot spare and replicas checked."""
    rows = []
    for s in scenarios:
        check_s = args.sdc_interval_steps * args.step_s
        cost = gm.slow_and_silent(
            s.mtbf_s,
            find_s=args.straggler_find_s,
            replace_s=s.recovery_s["in_job"] + gm.SPARE_JOIN_S,
            check_interval_s=check_s,
            check_cost=args.sdc_check_cost,
            rollback_s=check_s + s.recovery_s["in_job"],
            job_restart_s=s.recovery_s["job"],
        )
        rows.append({"nodes": s.nodes, **cost.as_dict()})
    return rows


def render_slow_and_silent(rows: list[dict]) -> str:
    lines = [
        "slow and silent (analytic; shares of wall time lost): stragglers unmitigated -> found and replaced by "
        "a hot spare; silent corruption unchecked -> replica checks (HSDP)"
    ]
    for r in rows:
        lines.append(
            f"{r['nodes']:>6} nodes: stragglers {r['stragglers_unmitigated']:.2%} -> "
            f"{r['stragglers_replaced']:.2%}; silent corruption {r['sdc_unchecked']:.3%} -> "
            f"{r['sdc_checked']:.3%}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from .report import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        points = sorted((r["nodes"], r["goodput"]) for r in rows if r["strategy"] == strategy)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("goodput (simulated)")
    ax.set_title("Goodput per cluster size and restart strategy")
    ax.grid(True, alpha=0.3)
    ax.legend(title="restart strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise UsageError(f"--runs {args.runs}: give 1 or more simulated jobs per point")
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path:
            writable_file(flag, Path(path))
    scenarios = scenarios_from_args(args)
    rows = run_all(scenarios, args.runs, args.seed)
    slow = slow_and_silent_rows(scenarios, args)
    sources = input_sources(args)
    print(render_table(rows))
    print(render_slow_and_silent(slow))
    print("range: from the low end (the worst plausible inputs below) to the figure; judge a target at the middle")
    for name, source in sources:
        print(f"  {name}: {source}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "run"},
                    "inputs": dict(sources),
                    "rows": rows,
                    "slow_and_silent": slow,
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )
    if args.plot:
        plot(rows, Path(args.plot))
    return 0 if all(math.isfinite(r["goodput"]) for r in rows) else 1
