"""The advisor's arithmetic: restart settings for a cluster from its failure rate and costs.

:func:`advise` turns :class:`Inputs` into :class:`Advice`: Daly's checkpoint interval (rounded,
capped at :data:`MAX_INTERVAL_S`, never below the write), section timeouts of :data:`SAFETY` times
what they cover above floors, restart limits at the Poisson 99th percentile of the failures, and
with the memory tier or hot spares their intervals, ``/dev/shm`` and goodput (:mod:`.model` has
the formulas). ``resilient-fsdp advise`` (:mod:`.advise`) and the values profiles (:mod:`.profiles`)
use it; :mod:`.advice_table` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..config import DUMP_MARGIN_S
from ..config.errors import UsageError
from . import costs as gc
from . import model as gm
from .simulate import CLASSES, DEFAULT_MIX, DEFAULT_RECOVERY_S

SAFETY = 5.0  # margin over the measured duration a section timeout covers (NVRx's default factor)
# The first steps after a (re)start run warm-up work (allocator growth, NCCL communicators made
# on first use) that can take minutes at scale; learned timeouts replace these after
# ``resilience.hang_detection.learn_after_steps`` steps.
STEP_TIMEOUT_FLOOR_S = 300.0
CHECKPOINT_TIMEOUT_FLOOR_S = 600.0
INIT_TIMEOUT_FLOOR_S = 900.0
RESTART_LIMIT_FLOOR = 3
RESTART_QUANTILE = 0.99  # the restart limits: a job at the expected rate exhausts them once in 100 runs
DEFAULT_RESTART_S = 120.0  # an in-job restart at scale: detection, respawn, rendezvous, load
DEFAULT_STARTUP_S = 60.0  # building and sharding the model and joining the rendezvous
# What the chart's job.backoffLimit does under each workload.kind. PyTorchJob: training-operator
# v1.9.4 recreates a pod that exits 128-255 under restartPolicy ExitCode, and its backoff check
# (pkg/controller.v1/common/job.go with a FakeWorkQueue whose NumRequeues is always 0;
# pkg/core/job.go, which adds up restarts of Running pods only) fires only for a limit of 0
# (kubeflow/trainer#2045), so the pods' agents apply it (resilience/pod_failures.py). JobSet and
# TrainJob: the Job counts pod failures its podFailurePolicy does not ignore (kubernetes batch/v1),
# and the chart restarts the whole JobSet when it is spent.
BACKOFF_LIMIT_MEANING = {
    "PyTorchJob": "pod failures (exits 128-255 other than a graceful stop's, one at most per event) in a row "
    "without a step trained past the furthest the earlier ones reached, which the pods' agents count: "
    "one more ends the job (exit 2). The operator itself (training-operator v1.9.4, "
    "kubeflow/trainer#2045) recreates such pods for ever, and workload.jobSet.maxRestarts does "
    "nothing here",
    "JobSet": "pod failures (exits 128-255, evictions excepted) the Job absorbs, one at most per event (the "
    "other nodes join again in their pods); one more restarts the whole JobSet with a fresh budget, "
    "up to workload.jobSet.maxRestarts times",
    "TrainJob": "as JobSet, in the TrainingRuntime the chart renders (an existing ClusterTrainingRuntime keeps "
    "its own policy)",
}
# Longer intervals are not worth their lost work in failures the model leaves out (a corrupt
# newest checkpoint sends the job back two intervals; operators stop jobs on purpose).
MAX_INTERVAL_S = 3600
# Whole-JobSet restarts once the Job's backoffLimit is spent, each with a fresh one: (1 + 2) x
# (1 + backoffLimit) counted failures in all, for a burst the Poisson model leaves out (a bad rack).
JOBSET_RESTARTS = 2
# The share of failures an in-job restart from memory recovers: DLRover's flash checkpoint reports
# about 75% of faults recovered by a process restart on 1,536 H800s (docs/blogs/flash_checkpoint.md).
MEMORY_COVERAGE = 0.75
LONG_COMMIT_S = 30.0  # a commit longer than this gets a suggested HSDP shard group
SHM_MARGIN_GIB = 8  # beside the slots and the staging copy: NCCL's shared memory, DataLoader workers
DURABLE_STAGING_COPIES = 1  # the async checkpoint's staging copy of each rank's shard, in /dev/shm too
SPARE_MISS_TARGET = 0.01
"""The recommended spares leave at most this share of node losses without a free spare."""
# The simulation's assumptions: the share of failures that take a node out, and the job-level
# restart that waits for a replacement node to be scheduled and pull the image.
NODE_LOSS_SHARE = DEFAULT_MIX[CLASSES.index("node")] / sum(DEFAULT_MIX)
JOB_RESTART_S = DEFAULT_RECOVERY_S["job"]


class AdviseError(UsageError):
    """Bad advisor input; the message names the flag and the fix."""


@dataclass(frozen=True)
class Inputs:
    instance: str
    nodes: int
    gpus_per_node: int
    node_mtbf_hours: float
    job_hours: float
    ckpt_stall_s: float
    ckpt_write_s: float
    restart_s: float
    step_s: float
    startup_s: float
    mtbf_source: str
    cost_sources: tuple[tuple[str, str], ...] = ()
    """(cost, where it came from: estimated, given, measured) for the stall, write and restart."""
    estimate: Optional[gc.Estimate] = None
    """The checkpoint-cost estimate, when one was made."""
    memory: Optional["MemoryInputs"] = None
    """The memory tier's costs, with ``--memory``."""
    shard_group: int = 0
    """``dist.shard_group_size`` (``--shard-group-size``); 0: FSDP over every GPU."""
    suggested_shard_group: Optional[int] = None
    """The HSDP group the estimate suggests when FSDP's commit is long and none was given."""
    spares: Optional["SpareInputs"] = None
    """Hot spares, with ``--spares``."""


@dataclass(frozen=True)
class SpareInputs:
    count: Optional[int]
    """Spares given (``--spares S``); None: the recommended number (``--spares`` or ``--spares auto``)."""
    replacement_s: float
    """From a spare's taking a lost node's rank until the lost pod's replacement joins as a spare."""
    job_restart_s: float
    """A node loss no spare takes: a job-level restart, a replacement node scheduled and joining."""
    node_loss_share: float
    """The share of failures that take a node out."""


@dataclass(frozen=True)
class MemoryInputs:
    stall_s: float
    restart_s: float
    coverage: float
    shard_gb: Optional[float]
    """One rank's share of the state (for ``shm.sizeLimit``); None without a model size."""
    replicas: int = 1
    """``checkpoint.memory.replicas``: 1 keeps the next pod's snapshots too (two more slots)."""
    coverage_source: str = "DLRover's published share"


@dataclass(frozen=True)
class Advice:
    inputs: Inputs
    job_mtbf_s: float
    young_s: float
    daly_s: float
    interval_s: int
    expected_failures: float
    goodput: dict
    max_restarts: int
    backoff_limit: int
    jobset_max_restarts: int
    step_timeout_s: int
    checkpoint_timeout_s: int
    init_timeout_s: int
    out_of_section_timeout_s: int
    dist_timeout_s: int
    memory: Optional[dict] = None
    """With ``--memory``: ``durable_daly_s`` and ``durable_interval_s`` (``checkpoint.interval_s``
    with the memory tier: Daly's for the failures it does not cover), ``daly_s``, ``interval_s``,
    ``interval_steps`` (the memory tier's), ``goodput`` (its breakdown) and ``shm_gib`` (None
    without a model size)."""
    spares: Optional[dict] = None
    """With ``--spares``: ``count``, ``recommended`` (whether the advisor chose the count),
    ``busy_mean`` (m), ``p_no_spare``, ``cost_share`` (S / (N + S)), ``replacement_s``,
    ``job_restart_s``, ``node_loss_share``, ``node_loss_recovery_s`` (a node loss's mean recovery
    with the spares), ``goodput`` / ``goodput_without`` (durable checkpoints, with and without
    the spares), ``goodput_memory`` / ``goodput_memory_without`` (with ``--memory``, else None),
    ``goodput_per_paid_node_hour`` (the best of those with spares x N / (N + S)), ``breakdown``
    (that figure's) and ``explain`` (the arithmetic, one line each)."""

    def values(self) -> dict:
        """The chart values these settings map to."""
        values = self._values()
        if self.spares is not None:
            values = {"spares": self.spares["count"], **values}  # top level, beside the chart's nodes
        if self.inputs.shard_group:
            values["trainer"]["dist"]["shard_group_size"] = self.inputs.shard_group
        if self.memory is not None:
            values["trainer"]["checkpoint"]["interval_s"] = self.memory["durable_interval_s"]
            values["trainer"]["checkpoint"]["memory"] = {
                "interval_steps": self.memory["interval_steps"],
                "replicas": self.inputs.memory.replicas,
            }
            if self.memory["shm_gib"] is not None:
                values["shm"] = {"sizeLimit": f"{self.memory['shm_gib']}Gi"}
        return values

    def _values(self) -> dict:
        return {
            "trainer": {
                "dist": {"timeout_s": self.dist_timeout_s},
                "checkpoint": {"interval_s": self.interval_s},
                "resilience": {
                    "launcher": {"max_restarts": self.max_restarts},
                    "hang_detection": {
                        "init_timeout_s": self.init_timeout_s,
                        "step_timeout_s": self.step_timeout_s,
                        "checkpoint_timeout_s": self.checkpoint_timeout_s,
                        "out_of_section_timeout_s": self.out_of_section_timeout_s,
                    },
                },
            },
            "job": {"backoffLimit": self.backoff_limit},
            "workload": {"jobSet": {"maxRestarts": self.jobset_max_restarts}},
        }


def round_interval(seconds: float) -> int:
    """Whole minutes from ten minutes up, ten seconds below, whole seconds under ten."""
    step = 60 if seconds >= 600 else 10 if seconds >= 10 else 1
    return max(1, int(seconds // step) * step)


def advise(inputs: Inputs) -> Advice:
    """The settings for ``inputs``. ``job.backoffLimit`` equals ``max_restarts``: an event spends one
    in-job restart and at most one counted pod failure (:mod:`resilient_fsdp.resilience.rejoin`)."""
    for name in ("nodes", "gpus_per_node"):
        if getattr(inputs, name) < 1:
            raise AdviseError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("node_mtbf_hours", "job_hours", "step_s", "startup_s"):
        if getattr(inputs, name) <= 0:
            raise AdviseError(f"--{name.replace('_', '-')} must be positive")
    for name in ("ckpt_stall_s", "ckpt_write_s", "restart_s"):
        if getattr(inputs, name) < 0:
            raise AdviseError(f"--{name.replace('_', '-')} must not be negative")
    mtbf_s = inputs.node_mtbf_hours * gm.HOUR / inputs.nodes
    stall = max(inputs.ckpt_stall_s, 1e-3)  # a zero stall would make every interval zero
    young, daly = gm.young_interval(stall, mtbf_s), gm.daly_interval(stall, mtbf_s)
    interval = durable_interval(daly, inputs.ckpt_write_s)
    failures = inputs.job_hours * gm.HOUR / mtbf_s
    breakdown = gm.expected_goodput(interval, inputs.ckpt_stall_s, inputs.ckpt_write_s, inputs.restart_s, mtbf_s)
    limit = max(RESTART_LIMIT_FLOOR, gm.poisson_quantile(failures, RESTART_QUANTILE))
    # A save waits for the previous write when it has not finished, so the checkpoint section
    # may include a whole write on top of the stall.
    checkpoint_timeout = max(CHECKPOINT_TIMEOUT_FLOOR_S, SAFETY * (inputs.ckpt_stall_s + inputs.ckpt_write_s))
    # Start-up builds the model and loads the checkpoint, which reads as much as a save writes.
    init_timeout = max(INIT_TIMEOUT_FLOOR_S, SAFETY * (inputs.startup_s + inputs.ckpt_write_s))
    step_timeout = max(STEP_TIMEOUT_FLOOR_S, SAFETY * inputs.step_s)
    memory = _memory_advice(inputs, interval, mtbf_s) if inputs.memory is not None else None
    return Advice(
        memory=memory,
        spares=_spare_advice(inputs, interval, mtbf_s, memory) if inputs.spares is not None else None,
        inputs=inputs,
        job_mtbf_s=mtbf_s,
        young_s=young,
        daly_s=daly,
        interval_s=interval,
        expected_failures=failures,
        goodput=breakdown.as_dict(),
        max_restarts=limit,
        backoff_limit=limit,
        jobset_max_restarts=JOBSET_RESTARTS,
        step_timeout_s=_whole(step_timeout),
        checkpoint_timeout_s=_whole(checkpoint_timeout),
        init_timeout_s=_whole(init_timeout),
        # Between sections (logging, data) nothing long happens; the step timeout covers it.
        out_of_section_timeout_s=_whole(step_timeout),
        # The shortest section a collective runs in is the step (the others are at least as long).
        dist_timeout_s=_whole(step_timeout) - int(DUMP_MARGIN_S),
    )


def durable_interval(daly_s: float, write_s: float) -> int:
    """``checkpoint.interval_s`` for Daly's interval: rounded down, at most :data:`MAX_INTERVAL_S`,
    never below the write time (a save never queues behind the previous write)."""
    return max(round_interval(min(daly_s, MAX_INTERVAL_S)), math.ceil(write_s))


def _memory_advice(inputs: Inputs, durable_only_s: int, mtbf_s: float) -> dict:
    """The durable interval with the memory tier, the tier's own interval, the pod's
    ``/dev/shm`` for it, and the goodput it gives.

    A covered failure resumes from memory, so the durable checkpoint serves only the others, one
    every ``M / (1 - coverage)``: Daly's interval for that MTBF, as the durable-only interval
    (``durable_only_s``) is for ``M`` (the multi-level checkpointing rule; all covered: the cap).
    """
    m = inputs.memory
    if not 0 < m.coverage <= 1:
        raise AdviseError("--memory-coverage must be above 0 and at most 1 (the share of failures the pods survive)")
    durable_daly = (
        gm.daly_interval(max(inputs.ckpt_stall_s, 1e-3), mtbf_s / (1.0 - m.coverage)) if m.coverage < 1 else math.inf
    )
    interval_s = max(durable_interval(durable_daly, inputs.ckpt_write_s), durable_only_s)
    stall = max(m.stall_s, 1e-3)
    daly = gm.daly_interval(stall, mtbf_s / m.coverage)
    steps = max(1, min(int(daly // inputs.step_s), max(1, int(interval_s // inputs.step_s))))
    memory_interval = steps * inputs.step_s
    goodput = gm.expected_goodput_with_memory(
        interval_s,
        inputs.ckpt_stall_s,
        inputs.ckpt_write_s,
        inputs.restart_s,
        mtbf_s,
        memory_interval,
        m.stall_s,
        m.restart_s,
        m.coverage,
    )
    # Two slots of its own per rank, two of its peer's with replicas, and the durable checkpoint's
    # staging copy of its shard beside them (the async engines stage in shared memory too).
    slots = 2 * (1 + m.replicas) + DURABLE_STAGING_COPIES
    shm = (
        math.ceil(slots * m.shard_gb * 1e9 / 2**30 * inputs.gpus_per_node) + SHM_MARGIN_GIB
        if m.shard_gb is not None
        else None
    )
    return {
        "durable_daly_s": durable_daly,
        "durable_interval_s": interval_s,
        "daly_s": daly,
        "interval_s": memory_interval,
        "interval_steps": steps,
        "goodput": goodput.as_dict(),
        "shm_gib": shm,
    }


def _spare_advice(inputs: Inputs, interval_s: int, mtbf_s: float, memory: Optional[dict]) -> dict:
    """How many hot spares, how often a node loss finds none, what they cost and gain."""
    sp, n = inputs.spares, inputs.nodes
    if not 0 <= sp.node_loss_share <= 1:
        raise AdviseError("--node-loss-share must be between 0 and 1 (the share of failures that take a node out)")
    for name in ("replacement_s", "job_restart_s"):
        if getattr(sp, name) < 0:
            raise AdviseError(f"--{name.replace('_', '-')} must not be negative")
    if sp.count is not None and sp.count < 0:
        raise AdviseError(f"--spares {sp.count}: give 0 or more spare nodes, or leave the number out for the advisor's")
    if n == 1 and sp.count != 0:
        raise AdviseError(
            "--spares with --nodes 1: the one node is pod 0, which hosts the rendezvous store, and its "
            "loss is a job-level restart whatever the spares; leave --spares out"
        )
    node_mtbf_s = inputs.node_mtbf_hours * gm.HOUR
    busy = gm.busy_spares_mean(n, node_mtbf_s, sp.node_loss_share, sp.replacement_s)
    r, rj, share = inputs.restart_s, sp.job_restart_s, sp.node_loss_share

    def durable(add: float) -> gm.GoodputBreakdown:
        return gm.expected_goodput(interval_s, inputs.ckpt_stall_s, inputs.ckpt_write_s, r + add, mtbf_s)

    def with_memory(add: float) -> gm.GoodputBreakdown:
        m = inputs.memory
        return gm.expected_goodput_with_memory(
            memory["durable_interval_s"],
            inputs.ckpt_stall_s,
            inputs.ckpt_write_s,
            r + add,
            mtbf_s,
            memory["interval_s"],
            m.stall_s,
            m.restart_s + add,
            m.coverage,
        )

    def best(spares: int) -> gm.GoodputBreakdown:
        # A node loss costs its own recovery instead of --restart-s: per failure, its share of the difference.
        add = share * (gm.node_loss_recovery_s(n, spares, busy, r, rj) - r)
        return with_memory(add) if memory is not None else durable(add)

    count = gm.spares_needed(busy, SPARE_MISS_TARGET) if sp.count is None else sp.count
    without = best(0).productive
    # Recommended only where they pay: a spare idles a whole node, so below some size the
    # node-hours it costs outweigh the restarts it saves.
    unpaid = sp.count is None and best(count).productive * n / (n + count) < without
    available = count
    if unpaid:
        count = 0
    p_none = gm.p_no_spare(count, busy)
    node_r = gm.node_loss_recovery_s(n, count, busy, r, rj)
    extra, extra_without = share * (node_r - r), share * (rj - r)
    chosen = best(count)
    paid = chosen.productive * n / (n + count)
    rate_h = max(n - 1, 0) * share / inputs.node_mtbf_hours
    explain = [
        f"node losses a spare can take: {n - 1} nodes (not pod 0, the store's host) x {share:.0%} of failures / "
        f"node MTBF {inputs.node_mtbf_hours:,.0f} h = {rate_h:.3g} per hour",
        f"busy spares ~ Poisson(m), m = {rate_h:.3g}/h x replacement {sp.replacement_s:g} s = {busy:.3g}; "
        f"P(a node loss finds none of {available} free) = P(Poisson({busy:.3g}) >= {available}) = "
        f"{gm.p_no_spare(available, busy):.2g}"
        + (f" (the fewest with <= {SPARE_MISS_TARGET:.0%})" if sp.count is None else ""),
        f"a node loss: restart R {r:g} s + last call {gm.SPARE_JOIN_S:g} s when a spare takes it, else the "
        f"job-level {rj:g} s: {node_r:.4g} s on average (without spares: {rj:g} s)",
        f"cost: {count} idle of {n + count} nodes = {count / (n + count):.2%} of the node-hours paid; goodput per "
        f"paid node-hour {chosen.productive:.4f} x {n} / {n + count} = {paid:.4f}",
    ]
    if unpaid:
        spent = best(available)
        explain.append(
            f"none recommended: {available} spare(s) would cost {available / (n + available):.2%} of the "
            f"node-hours for goodput {spent.productive:.4f} instead of {without:.4f}, "
            f"{spent.productive * n / (n + available):.4f} per paid node-hour; spares pay at larger sizes "
            "(or with a longer --replacement-s)"
        )
    return {
        "count": count,
        "recommended": sp.count is None,
        "busy_mean": busy,
        "p_no_spare": p_none,
        "cost_share": count / (n + count),
        "replacement_s": sp.replacement_s,
        "job_restart_s": rj,
        "node_loss_share": share,
        "node_loss_recovery_s": node_r,
        "goodput": durable(extra).productive,
        "goodput_without": durable(extra_without).productive,
        "goodput_memory": with_memory(extra).productive if memory is not None else None,
        "goodput_memory_without": with_memory(extra_without).productive if memory is not None else None,
        "goodput_per_paid_node_hour": paid,
        "breakdown": chosen.as_dict(),
        "explain": explain,
    }


def _whole(seconds: float) -> int:
    """Timeouts in whole tens of seconds, rounded up (they are margins, not measurements)."""
    return int(math.ceil(seconds / 10.0) * 10)
