"""``resilient-fsdp advise``: restart settings for a cluster size, from the goodput model.

Inputs: the instance type and node count (GPUs per node come from the chart's instance table), a
node MTBF (default: the Llama 3 failure rate per GPU-hour), the planned job length, and three
costs: the checkpoint stall, the background write time, and the restart time. The checkpoint
costs are estimated from the model's size (``--preset`` or ``--params``) and the shared volume
(``--storage-size``, ``--deployment-type``, ``--storage-throughput``; default: the chart's) as
:mod:`~resilient_fsdp.goodput.costs` says; measured ones replace the estimate, each on its own
(``--ckpt-stall-s``, ``--ckpt-write-s``, ``--restart-s``, or ``bench checkpoint`` /
``bench recovery`` JSON with ``--from-bench``).

Outputs, with the rule behind each (see ``model`` for the formulas):

* ``checkpoint.interval_s``: Daly's interval, rounded down to a whole minute (ten seconds below
  ten minutes), at most an hour, never below the write time;
* expected failures over the job, expected goodput and its breakdown;
* section timeouts: each at least ``SAFETY`` times what it covers and never below a floor that
  absorbs slow starts (``ft_launcher`` kills a rank that overstays a section);
* ``dist.timeout_s``: :data:`~resilient_fsdp.config.DUMP_MARGIN_S` below the step timeout, so NCCL's
  watchdog times a hung collective out, and its flight recorder dumps, before ``ft_launcher`` kills
  the rank (the rule the configuration enforces on NCCL);
* ``resilience.launcher.max_restarts`` and ``job.backoffLimit``: the 99th percentile of the Poisson number
  of failures over the job, at least 3, so a job with the expected failure rate exhausts neither
  more than once in a hundred runs. Both count events, because that is what one event costs each:
  an event spends one in-job restart (a rendezvous round; NVRx 0.7's budget is job-wide), and at
  most one counted pod failure (the pod that failed, or the store host's pod when the in-job
  budget is spent; the other nodes join again in their pods, :mod:`resilient_fsdp.resilience.rejoin`).
  What ``job.backoffLimit`` then does depends on the chart's ``workload.kind`` (``--kind``;
  :data:`BACKOFF_LIMIT_MEANING`): a JobSet's Job counts it, a PyTorchJob under
  ``restartPolicy: ExitCode`` does not;
* ``workload.jobSet.maxRestarts``: :data:`JOBSET_RESTARTS` whole restarts once the Job's budget is
  spent, each with a fresh one: (1 + maxRestarts) x (1 + backoffLimit) counted failures in all,
  three times the 99th percentile's budget, for a burst the failure model leaves out (a bad rack);
* with ``--memory``, ``checkpoint.interval_s`` is sized for the failures the memory tier leaves to
  the durable checkpoint: Daly's interval for the durable stall and their MTBF
  (``M / (1 - coverage)``), rounded, capped and floored as above (the durable-only interval beside
  it); ``checkpoint.memory.interval_steps``: Daly's interval for the memory tier's
  stall and the MTBF of the failures it covers (``M / coverage``), in whole steps, at least one and
  at most the durable interval; ``checkpoint.memory.replicas`` as given; ``shm.sizeLimit``: two
  slots of a rank's shard per GPU of the pod, two more with replicas, and the durable checkpoint's
  staging copy of it, plus :data:`SHM_MARGIN_GIB` for NCCL; and the goodput with and without it
  (``model.expected_goodput_with_memory``);
* with ``--spares``, ``spares`` (the chart's, beside ``nodes``): standby pods that take a lost
  node's rank within an in-job restart. Without a number, the fewest (at least one) for which a
  node loss finds every spare busy at most :data:`SPARE_MISS_TARGET` of the time: busy spares are
  Poisson with mean ``m`` = the rate of node losses a spare can take (pod 0's cannot: it hosts
  the rendezvous store) x the time the lost pod's replacement takes to join
  (``model.spares_needed``). Beside it: that probability, the spares' share of the node-hours paid
  ``S / (N + S)``, and the goodput with and without them, where a node loss (``--node-loss-share``
  of the failures) costs the job-level restart (``--job-restart-s``) instead of ``--restart-s``
  unless a spare takes it (``model.node_loss_recovery_s``), and that goodput per paid node-hour
  (``x N / (N + S)``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import yaml

from ..config import DUMP_MARGIN_S
from . import costs as gc
from . import model as gm
from .simulate import CLASSES, DEFAULT_MIX, DEFAULT_RECOVERY_S

CHART_VALUES = Path(__file__).resolve().parents[3] / "charts" / "resilient-fsdp" / "values.yaml"
SAFETY = 5.0  # margin over the measured duration a section timeout covers (NVRx's default factor)
# The first steps after a (re)start run warm-up work (allocator growth, NCCL communicators made
# on first use) that can take minutes at scale; learned timeouts replace these after
# ``resilience.hang_detection.learn_after_steps`` steps.
STEP_TIMEOUT_FLOOR_S = 300.0
CHECKPOINT_TIMEOUT_FLOOR_S = 600.0
INIT_TIMEOUT_FLOOR_S = 900.0
RESTART_LIMIT_FLOOR = 3
RESTART_QUANTILE = 0.99
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


class AdviseError(ValueError):
    """Bad advisor input; the message names the flag and the fix."""


def chart_storage_defaults(values_path: Path = CHART_VALUES) -> dict:
    """The chart's default shared volume: ``size``, ``deploymentType``, ``perUnitStorageThroughput``."""
    try:
        storage = yaml.safe_load(values_path.read_text())["storage"]
        return {"size": storage["size"], "deploymentType": storage["fsx"]["deploymentType"],
                "perUnitStorageThroughput": float(storage["fsx"]["perUnitStorageThroughput"])}
    except (OSError, KeyError, TypeError) as exc:
        raise AdviseError(f"cannot read the storage defaults from {values_path} ({exc}); pass --storage-size, "
                          "--deployment-type and --storage-throughput") from exc


def instance_gpus(instance: str, values_path: Path = CHART_VALUES) -> int:
    """GPUs per node of ``instance``, from the chart's ``instanceTypes`` table (one source)."""
    try:
        table = yaml.safe_load(values_path.read_text())["instanceTypes"]
    except (OSError, KeyError, TypeError) as exc:
        raise AdviseError(f"cannot read the instance table from {values_path} ({exc}); "
                          f"pass --gpus-per-node instead") from exc
    if instance not in table:
        raise AdviseError(f"--instance {instance!r} is not in the chart's instanceTypes "
                          f"({', '.join(sorted(table))}); pass --gpus-per-node for other types")
    return int(table[instance]["gpus"])


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
            values["trainer"]["checkpoint"]["memory"] = {"interval_steps": self.memory["interval_steps"],
                                                         "replicas": self.inputs.memory.replicas}
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
        inputs=inputs, job_mtbf_s=mtbf_s, young_s=young, daly_s=daly, interval_s=interval,
        expected_failures=failures, goodput=breakdown.as_dict(), max_restarts=limit, backoff_limit=limit,
        jobset_max_restarts=JOBSET_RESTARTS,
        step_timeout_s=_whole(step_timeout), checkpoint_timeout_s=_whole(checkpoint_timeout),
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
    durable_daly = gm.daly_interval(max(inputs.ckpt_stall_s, 1e-3), mtbf_s / (1.0 - m.coverage)) \
        if m.coverage < 1 else math.inf
    interval_s = max(durable_interval(durable_daly, inputs.ckpt_write_s), durable_only_s)
    stall = max(m.stall_s, 1e-3)
    daly = gm.daly_interval(stall, mtbf_s / m.coverage)
    steps = max(1, min(int(daly // inputs.step_s), max(1, int(interval_s // inputs.step_s))))
    memory_interval = steps * inputs.step_s
    goodput = gm.expected_goodput_with_memory(interval_s, inputs.ckpt_stall_s, inputs.ckpt_write_s, inputs.restart_s,
                                              mtbf_s, memory_interval, m.stall_s, m.restart_s, m.coverage)
    # Two slots of its own per rank, two of its peer's with replicas, and the durable checkpoint's
    # staging copy of its shard beside them (the async engines stage in shared memory too).
    slots = 2 * (1 + m.replicas) + DURABLE_STAGING_COPIES
    shm = (math.ceil(slots * m.shard_gb * 1e9 / 2**30 * inputs.gpus_per_node) + SHM_MARGIN_GIB
           if m.shard_gb is not None else None)
    return {"durable_daly_s": durable_daly, "durable_interval_s": interval_s, "daly_s": daly,
            "interval_s": memory_interval, "interval_steps": steps, "goodput": goodput.as_dict(), "shm_gib": shm}


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
        raise AdviseError("--spares with --nodes 1: the one node is pod 0, which hosts the rendezvous store, and its "
                          "loss is a job-level restart whatever the spares; leave --spares out")
    node_mtbf_s = inputs.node_mtbf_hours * gm.HOUR
    busy = gm.busy_spares_mean(n, node_mtbf_s, sp.node_loss_share, sp.replacement_s)
    r, rj, share = inputs.restart_s, sp.job_restart_s, sp.node_loss_share

    def durable(add: float) -> gm.GoodputBreakdown:
        return gm.expected_goodput(interval_s, inputs.ckpt_stall_s, inputs.ckpt_write_s, r + add, mtbf_s)

    def with_memory(add: float) -> gm.GoodputBreakdown:
        m = inputs.memory
        return gm.expected_goodput_with_memory(memory["durable_interval_s"], inputs.ckpt_stall_s, inputs.ckpt_write_s,
                                               r + add, mtbf_s,
                                               memory["interval_s"], m.stall_s, m.restart_s + add, m.coverage)

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
        f"{gm.p_no_spare(available, busy):.2g}" + (f" (the fewest with <= {SPARE_MISS_TARGET:.0%})" if sp.count is None else ""),
        f"a node loss: restart R {r:g} s + last call {gm.SPARE_JOIN_S:g} s when a spare takes it, else the "
        f"job-level {rj:g} s: {node_r:.4g} s on average (without spares: {rj:g} s)",
        f"cost: {count} idle of {n + count} nodes = {count / (n + count):.2%} of the node-hours paid; goodput per "
        f"paid node-hour {chosen.productive:.4f} x {n} / {n + count} = {paid:.4f}",
    ]
    if unpaid:
        spent = best(available)
        explain.append(f"none recommended: {available} spare(s) would cost {available / (n + available):.2%} of the "
                       f"node-hours for goodput {spent.productive:.4f} instead of {without:.4f}, "
                       f"{spent.productive * n / (n + available):.4f} per paid node-hour; spares pay at larger sizes "
                       "(or with a longer --replacement-s)")
    return {"count": count, "recommended": sp.count is None, "busy_mean": busy, "p_no_spare": p_none,
            "cost_share": count / (n + count), "replacement_s": sp.replacement_s, "job_restart_s": rj,
            "node_loss_share": share, "node_loss_recovery_s": node_r,
            "goodput": durable(extra).productive, "goodput_without": durable(extra_without).productive,
            "goodput_memory": with_memory(extra).productive if memory is not None else None,
            "goodput_memory_without": with_memory(extra_without).productive if memory is not None else None,
            "goodput_per_paid_node_hour": paid, "breakdown": chosen.as_dict(), "explain": explain}


def _whole(seconds: float) -> int:
    """Timeouts in whole tens of seconds, rounded up (they are margins, not measurements)."""
    return int(math.ceil(seconds / 10.0) * 10)


def costs_from_bench(path: Path) -> dict:
    """``ckpt_stall_s`` / ``ckpt_write_s`` from ``bench checkpoint`` JSON, ``restart_s`` from
    ``bench recovery`` JSON (its in-job median); either or both keys may be present. ``bench
    scale`` JSON gives ``scale``: its path, for the start-up a restart adds at the job's size."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdviseError(f"--from-bench {path}: cannot read it as JSON ({exc})") from exc
    if isinstance(data, list) and data and all(isinstance(r, dict) and "cold_save_plan_s" in r for r in data):
        return {"scale": path}
    if not isinstance(data, dict):
        raise AdviseError(f"--from-bench {path}: not `bench checkpoint`, `bench recovery` or `bench scale` results")
    found = {}
    if isinstance(data.get("async"), dict):
        found["ckpt_stall_s"] = float(data["async"]["stall_s"])
        found["ckpt_write_s"] = float(data["async"]["write_s"])
    if isinstance(data.get("in_job"), dict):
        found["restart_s"] = float(data["in_job"]["recovery_s_median"])
    if not found:
        raise AdviseError(f"--from-bench {path}: neither `bench checkpoint` (key `async`) nor `bench recovery` "
                          f"(key `in_job`) results")
    return found


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("advise", help="checkpoint interval, timeouts and restart limits for a cluster size",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--instance", required=True, help="EC2 instance type, a key of the chart's instanceTypes")
    p.add_argument("--nodes", type=int, required=True, help="nodes (pods) in the job")
    p.add_argument("--gpus-per-node", type=int, help="default: the instance type's GPUs")
    p.add_argument("--node-mtbf-hours", type=float,
                   help="one node's mean time between failures; default: Llama 3's rate per GPU-hour x GPUs")
    p.add_argument("--job-hours", type=float, default=24.0 * 14, help="planned length of the job (default 336)")
    p.add_argument("--preset", help="the model: a built-in preset (tiny, 125m, 1b, 8b, 70b), to estimate the "
                                    "checkpoint costs from its state")
    p.add_argument("--params", type=float, help="the model's parameter count (e.g. 70.6e9), instead of --preset")
    p.add_argument("--storage-size", help="the shared volume's capacity as storage.size writes it (e.g. 14400Gi); "
                                          "default: the chart's")
    p.add_argument("--deployment-type", choices=("SCRATCH_2", "PERSISTENT_2"),
                   help="the FSx deployment type (storage.fsx.deploymentType); default: the chart's")
    p.add_argument("--storage-throughput", type=float, metavar="MB_S_PER_TIB",
                   help="FSx throughput per TiB (storage.fsx.perUnitStorageThroughput: 125, 250, 500, 1000 for "
                        "PERSISTENT_2); default: the chart's (SCRATCH_2: 200)")
    p.add_argument("--ckpt-stall-s", type=float, help="measured training stall per checkpoint (seconds); replaces "
                                                      "the estimate")
    p.add_argument("--ckpt-write-s", type=float, help="measured background write time per checkpoint (seconds); "
                                                      "replaces the estimate")
    p.add_argument("--restart-s", type=float, help=f"time from a failure to training again (default {DEFAULT_RESTART_S:g})")
    p.add_argument("--step-s", type=float, default=10.0, help="time of one training step (default 10)")
    p.add_argument("--startup-s", type=float, default=DEFAULT_STARTUP_S,
                   help=f"model build, sharding and rendezvous at start (default {DEFAULT_STARTUP_S:g})")
    p.add_argument("--shard-group-size", type=int, default=0, metavar="GPUS",
                   help="dist.shard_group_size: HSDP, each parameter sharded over this many GPUs (whole pods that "
                        "divide the job) and replicated across the groups; default 0, FSDP over every GPU")
    p.add_argument("--memory", action="store_true",
                   help="also size the memory tier (checkpoint.memory): its interval, /dev/shm, the goodput gained")
    p.add_argument("--memory-stall-s", type=float, help="measured stall of one memory save; default: the copy of a "
                                                        "rank's shard at the instance's device-to-host rate")
    p.add_argument("--memory-restart-s", type=float,
                   help="an in-job restart from memory (measured: bench recovery's in_job_memory row); "
                        "default: --restart-s")
    p.add_argument("--memory-replicas", type=int, choices=(0, 1), default=1,
                   help="checkpoint.memory.replicas: 1 (default) also keeps the next pod's snapshots, so a lost "
                        "pod resumes from memory; its two slots count in shm.sizeLimit")
    p.add_argument("--memory-coverage", type=float,
                   help="the share of failures the pods survive, restored from memory (default: what --from-run "
                        f"measured, else {MEMORY_COVERAGE:g}, DLRover's published share)")
    p.add_argument("--from-run", type=Path, metavar="RUN_DIR",
                   help="with --memory: take the coverage from a run with the memory tier on, the share of its "
                        "restarts that resumed from memory (its metrics.jsonl start records)")
    p.add_argument("--spares", nargs="?", const="auto", metavar="S",
                   help="hot spares (the chart's spares): with no number or 'auto', the fewest for which a node loss "
                        f"finds none free at most {SPARE_MISS_TARGET:.0%}% of the time; with a number, that many. "
                        "Shows the chance, the cost and the goodput with and without them")
    p.add_argument("--replacement-s", type=float,
                   help="with --spares: until a lost pod's replacement joins as a spare (default: --job-restart-s)")
    p.add_argument("--job-restart-s", type=float, default=JOB_RESTART_S,
                   help=f"with --spares: a node loss without a spare, a job-level restart that waits for a "
                        f"replacement node (default {JOB_RESTART_S:g}, the simulation's)")
    p.add_argument("--node-loss-share", type=float, default=NODE_LOSS_SHARE,
                   help=f"with --spares: the share of failures that take a node out (default {NODE_LOSS_SHARE:g}, "
                        "the simulation's)")
    p.add_argument("--from-bench", action="append", default=[], metavar="FILE",
                   help="take measured costs from `bench checkpoint` / `bench recovery` JSON (repeatable)")
    p.add_argument("--values", action="store_true", help="print a values snippet for the chart instead of the table")
    p.add_argument("--kind", choices=sorted(BACKOFF_LIMIT_MEANING), default="PyTorchJob",
                   help="the chart's workload.kind, which decides what job.backoffLimit does (default PyTorchJob)")
    p.set_defaults(run=main)


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    costs: dict = {}
    sources: dict[str, str] = {}
    for path in args.from_bench:
        found = costs_from_bench(Path(path))
        costs.update(found)
        sources.update({key: f"measured, --from-bench {path}" for key in found})
    for key in ("ckpt_stall_s", "ckpt_write_s", "restart_s"):
        if getattr(args, key) is not None:
            costs[key] = getattr(args, key)
            sources[key] = f"given, --{key.replace('_', '-')}"
    gpus = args.gpus_per_node if args.gpus_per_node is not None else instance_gpus(args.instance)
    group = _shard_group(args, gpus)
    missing = [k for k in ("ckpt_stall_s", "ckpt_write_s") if k not in costs]
    estimate = None
    if missing:
        try:
            params = gc.params_of(args.preset, args.params)
            if params is None:
                raise AdviseError("the checkpoint costs are needed: pass the model's size (--preset, or --params) to "
                                  "estimate them from the state and the storage, or measured ones: " +
                                  " and ".join(f"--{k.replace('_', '-')}" for k in missing) +
                                  ", or --from-bench with `bench checkpoint` results")
            defaults = chart_storage_defaults()
            deployment = args.deployment_type or defaults["deploymentType"]
            throughput = args.storage_throughput
            if throughput is None and args.deployment_type is None:
                throughput = defaults["perUnitStorageThroughput"]
            volume = gc.storage(args.storage_size or defaults["size"], deployment, throughput)
            estimate = gc.estimate(params, args.nodes * gpus, args.instance, volume, group)
        except gc.CostError as exc:
            raise AdviseError(str(exc)) from None
        for key, value in (("ckpt_stall_s", estimate.stall_s), ("ckpt_write_s", estimate.write_s)):
            if key in missing:
                costs[key], sources[key] = value, "estimated"
    if "restart_s" not in costs:
        sources["restart_s"] = "default"
    scale = costs.pop("scale", None)
    if scale is not None:  # what a restarted world of this size spends planning and reading metadata
        from .simulate import startup_from_bench

        if args.preset is None:
            raise AdviseError(f"--from-bench {scale}: `bench scale` results are per model: pass --preset")
        case = f"{args.preset}:{f'hsdp-{group}' if group else 'fsdp'}"
        try:
            startup = startup_from_bench(scale, case, args.nodes * gpus)
        except (ValueError, KeyError) as exc:
            raise AdviseError(f"--from-bench {scale}: {exc}") from None
        costs["restart_s"] = costs.get("restart_s", DEFAULT_RESTART_S) + startup
        sources["restart_s"] += f"; + {startup:.1f} s of start-up planning and resume metadata (measured, " \
                                f"--from-bench {scale}, {case})"
    if args.node_mtbf_hours is not None:
        mtbf, source = args.node_mtbf_hours, "given (--node-mtbf-hours)"
    else:
        mtbf = gm.node_mtbf_hours(gpus)
        source = gm.LLAMA3_SOURCE.format(gpu_hours=gm.llama3_gpu_mtbf_hours())
    memory = None
    if getattr(args, "memory", False):
        memory = _memory_inputs(args, estimate, costs.get("restart_s", DEFAULT_RESTART_S), gpus, group)
    suggested = None
    if estimate is not None and not group and estimate.commit_s > LONG_COMMIT_S:
        suggested = gc.suggested_shard_group(estimate.params, estimate.gpus, gpus, args.instance)
    return Inputs(spares=_spare_inputs(args), memory=memory, shard_group=group, suggested_shard_group=suggested, instance=args.instance, nodes=args.nodes, gpus_per_node=gpus, node_mtbf_hours=mtbf,
                  job_hours=args.job_hours, ckpt_stall_s=costs["ckpt_stall_s"], ckpt_write_s=costs["ckpt_write_s"],
                  restart_s=costs.get("restart_s", DEFAULT_RESTART_S), step_s=args.step_s,
                  startup_s=args.startup_s, mtbf_source=source,
                  cost_sources=tuple((k, sources[k]) for k in ("ckpt_stall_s", "ckpt_write_s", "restart_s")),
                  estimate=estimate)


def _spare_inputs(args: argparse.Namespace) -> Optional[SpareInputs]:
    text = getattr(args, "spares", None)
    if text is None:
        return None
    if text != "auto" and not str(text).isdigit():
        raise AdviseError(f"--spares {text!r}: give a whole number of spare nodes, or 'auto' (or no value) for the "
                          "advisor's")
    job_restart = getattr(args, "job_restart_s", JOB_RESTART_S)
    replacement = args.replacement_s if getattr(args, "replacement_s", None) is not None else job_restart
    return SpareInputs(count=None if text == "auto" else int(text), replacement_s=replacement,
                       job_restart_s=job_restart, node_loss_share=getattr(args, "node_loss_share", NODE_LOSS_SHARE))


def _shard_group(args: argparse.Namespace, gpus_per_node: int) -> int:
    group, world = getattr(args, "shard_group_size", 0) or 0, args.nodes * gpus_per_node
    if group < 0 or (group and world % group):
        raise AdviseError(f"--shard-group-size {group} does not divide the job's {world} GPUs: give a divisor of "
                          f"{world} (whole pods: a multiple of {gpus_per_node}), or 0 for FSDP over every GPU")
    return 0 if group == world else group


def _memory_inputs(args: argparse.Namespace, estimate: Optional[gc.Estimate], restart_s: float,
                   gpus: int, group: int = 0) -> MemoryInputs:
    shard = estimate.shard_gb if estimate is not None else None
    if shard is None:
        params = gc.params_of(args.preset, args.params)
        shard = params * gc.BYTES_PER_PARAM / 1e9 / (group or args.nodes * gpus) if params else None
    stall = args.memory_stall_s
    if stall is None:
        if shard is None:
            raise AdviseError("--memory needs the memory save's stall: pass --memory-stall-s, or the model's size "
                              "(--preset or --params) to estimate it")
        stall = gc.memory_stall_s(shard, args.instance)
    # Without a measurement, a restart from memory costs what the in-job restart does: its load is
    # a small part of it (1.4 of 18.9 s in bench recovery's in-job runs), the gain is in lost work.
    restart = args.memory_restart_s if args.memory_restart_s is not None else restart_s
    coverage, source = args.memory_coverage, "given, --memory-coverage"
    if coverage is None and getattr(args, "from_run", None) is not None:
        coverage, restarts = coverage_from_run(args.from_run)
        source = f"measured, --from-run {args.from_run}: {round(coverage * restarts)} of {restarts} restarts from memory"
    if coverage is None:
        coverage, source = MEMORY_COVERAGE, "DLRover's published share"
    return MemoryInputs(stall_s=stall, restart_s=restart, coverage=coverage, shard_gb=shard,
                        replicas=args.memory_replicas, coverage_source=source)


def coverage_from_run(run_dir: Path) -> tuple[float, int]:
    """The share of ``run_dir``'s restarts that resumed from the pods' memory, and how many restarts
    resumed at all: its ``start`` records of attempts a restart began (each names where it
    resumed from). Replication that stopped, a lost pod without a replica, a snapshot that failed
    its checks: each shows as a restart that resumed from the durable checkpoint."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AdviseError(f"--from-run {run_dir}: cannot read {path} ({exc.strerror or exc}); give the run directory "
                          "of a job that ran with the memory tier on") from None
    tiers = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash
        if isinstance(record, dict) and record.get("event") == "start" and record.get("layer") != "start" \
                and record.get("resumed_from_tier"):
            tiers.append(record["resumed_from_tier"])
    if not tiers:
        raise AdviseError(f"--from-run {run_dir}: no restart of that run resumed from a checkpoint, so it measured no "
                          "coverage; give a run that recovered from faults, or --memory-coverage")
    return tiers.count("memory") / len(tiers), len(tiers)


def render_table(a: Advice, kind: str = "PyTorchJob") -> str:
    i = a.inputs
    g = a.goodput
    source = dict(i.cost_sources) or {"ckpt_stall_s": "given", "ckpt_write_s": "given", "restart_s": "given"}
    rows = [
        ("cluster", f"{i.nodes} x {i.instance} ({i.nodes * i.gpus_per_node} GPUs)"),
        ("node MTBF", f"{i.node_mtbf_hours:,.0f} h ({i.mtbf_source})"),
        ("job MTBF M", f"{a.job_mtbf_s / gm.HOUR:,.1f} h = node MTBF / {i.nodes} nodes"),
        ("expected failures", f"{a.expected_failures:.2f} over {i.job_hours:g} h"),
        ("checkpoint costs", f"stall delta {i.ckpt_stall_s:.3g} s ({source['ckpt_stall_s']}), write W "
                             f"{i.ckpt_write_s:.4g} s ({source['ckpt_write_s']}); restart R {i.restart_s:g} s "
                             f"({source['restart_s']})"),
        *(("  estimate", line) for line in (i.estimate.explain() if i.estimate else [])),
        *((("  storage", slow),) if (slow := _slow_storage_note(a)) else ()),
        *((("dist.shard_group_size", hsdp),) if (hsdp := _shard_group_note(a)) else ()),
        ("Young sqrt(2 delta M)", f"{a.young_s:,.0f} s"),
        ("Daly", f"{a.daly_s:,.0f} s"),
        ("checkpoint.interval_s", f"{a.interval_s} (Daly, rounded down, at most {MAX_INTERVAL_S}; never below W)"),
        ("expected goodput", f"{g['productive']:.4f}: stalls {g['checkpoint_stalls']:.4f}, lost work "
                             f"{g['lost_work']:.4f}, restarts {g['restarts']:.4f}"),
        ("step_timeout_s", f"{a.step_timeout_s} = max({STEP_TIMEOUT_FLOOR_S:g}, {SAFETY:g} x step {i.step_s:g} s)"),
        ("checkpoint_timeout_s", f"{a.checkpoint_timeout_s} = max({CHECKPOINT_TIMEOUT_FLOOR_S:g}, {SAFETY:g} x (delta + W))"),
        ("init_timeout_s", f"{a.init_timeout_s} = max({INIT_TIMEOUT_FLOOR_S:g}, {SAFETY:g} x (start-up "
                           f"{i.startup_s:g} s + load ~W))"),
        ("out_of_section_timeout_s", f"{a.out_of_section_timeout_s} = step_timeout_s (heartbeats are off: "
                                     f"sections cover the loop)"),
        ("dist.timeout_s", f"{a.dist_timeout_s} = step_timeout_s - {DUMP_MARGIN_S:g} (NCCL times a hung collective "
                           "out and dumps its flight recorder before ft_launcher kills the rank)"),
        ("max_restarts / backoffLimit", f"{a.max_restarts} / {a.backoff_limit} = max({RESTART_LIMIT_FLOOR}, "
                                        f"Poisson({a.expected_failures:.2f}) {RESTART_QUANTILE:.0%} quantile)"),
        (f"backoffLimit ({kind})", BACKOFF_LIMIT_MEANING[kind]),
        ("workload.jobSet.maxRestarts", f"{a.jobset_max_restarts}: whole-JobSet restarts after backoffLimit, "
                                        f"{(1 + a.jobset_max_restarts) * (1 + a.backoff_limit)} counted failures in all "
                                        "(JobSet and TrainJob)"),
    ]
    if a.memory is not None:
        m, mi = a.memory, i.memory
        gm_ = m["goodput"]
        rows += [
            ("memory tier costs", f"stall {mi.stall_s:.3g} s, restart from memory {mi.restart_s:.3g} s, covering "
                                  f"{mi.coverage:.0%} of failures ({mi.coverage_source})"),
            ("checkpoint.interval_s with it", f"{m['durable_interval_s']} (Daly for delta and the failures it leaves to "
                                              f"the durable checkpoint, M / (1 - coverage): {m['durable_daly_s']:,.0f} s, "
                                              f"rounded down, at most {MAX_INTERVAL_S}; never below the durable-only "
                                              f"{a.interval_s})"),
            ("checkpoint.memory.interval_steps", f"{m['interval_steps']} ({m['interval_s']:g} s; Daly for the memory "
                                                 f"stall and M / coverage: {m['daly_s']:,.0f} s, in whole steps, at "
                                                 "most the durable interval)"),
            ("goodput with memory", f"{gm_['productive']:.4f} (without: {g['productive']:.4f}): stalls "
                                    f"{gm_['checkpoint_stalls']:.4f}, lost work {gm_['lost_work']:.4f}, restarts "
                                    f"{gm_['restarts']:.4f}"),
            ("shm.sizeLimit", f"{m['shm_gib']}Gi = ({2 * (1 + mi.replicas)} slots (own{' and a peer' if mi.replicas else ''}"
                              f"'s) + the durable staging copy) x shard x {i.gpus_per_node} GPUs + {SHM_MARGIN_GIB}Gi"
                              if m["shm_gib"] is not None else "n/a (no model size: pass --preset or --params)"),
        ]
    rows += _slow_and_silent_rows(a)
    if a.spares is not None:
        rows += _spare_rows(a)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# resilience.sdc: a check every 100 steps.
SDC_INTERVAL_STEPS = 100
SDC_CHECK_COST = 0.001  # of a step: assumed, the order docs/benchmarks.md measures


def _slow_and_silent_rows(a: Advice) -> list[tuple[str, str]]:
    """Stragglers and silent corruption, the classes no restart sees, at published rates: what
    they cost unmitigated and with ``resilience.stragglers`` (replace) and ``resilience.sdc``."""
    i = a.inputs
    check_s = SDC_INTERVAL_STEPS * i.step_s
    c = gm.slow_and_silent(a.job_mtbf_s, find_s=gm.STRAGGLER_FIND_S, replace_s=i.restart_s + gm.SPARE_JOIN_S,
                           check_interval_s=check_s, check_cost=SDC_CHECK_COST, rollback_s=check_s + i.restart_s,
                           job_restart_s=i.restart_s)
    hsdp = "" if i.shard_group else " (needs HSDP: --shard-group-size)"
    return [("stragglers", f"{c.stragglers_unmitigated:.1%} of wall time unmitigated ({gm.STRAGGLER_SOURCE}; "
                           f"assumed {gm.STRAGGLER_EPISODE_H:g} h episodes at {gm.STRAGGLER_SLOWDOWN:g}x) -> "
                           f"{c.stragglers_replaced:.1%} with resilience.stragglers.action=replace and a standby pod "
                           f"(found in {gm.STRAGGLER_FIND_S:g} s)"),
            ("silent data corruption", f"{c.sdc_unchecked:.2%} unchecked ({gm.SDC_SOURCE}; assumed "
                                       f"{gm.SDC_UNNOTICED_H:g} h trained on it before it shows) -> {c.sdc_checked:.2%} "
                                       f"with resilience.sdc.interval_steps={SDC_INTERVAL_STEPS}{hsdp}")]


def _spare_rows(a: Advice) -> list[tuple[str, str]]:
    s, n = a.spares, a.inputs.nodes
    why = ("given" if not s["recommended"] else "none: at this size a spare costs more node-hours than it saves"
           if not s["count"] else f"the fewest leaving <= {SPARE_MISS_TARGET:.0%} of node losses without one")
    b = s["breakdown"]
    rows = [
        ("spares", f"{s['count']} ({why}; P(a node loss finds none free) = {s['p_no_spare']:.2g})"),
        *(("  spares", line) for line in s["explain"]),
        ("goodput with spares", f"{s['goodput']:.4f} (without: {s['goodput_without']:.4f}, node losses "
                                f"{s['node_loss_share']:.0%} of failures at the job-level {s['job_restart_s']:g} s; "
                                f"the expected goodput above charges every failure R {a.inputs.restart_s:g} s)"),
    ]
    if s["goodput_memory"] is not None:
        rows.append(("goodput with memory and spares", f"{s['goodput_memory']:.4f} (without spares: "
                                                       f"{s['goodput_memory_without']:.4f})"))
    rows.append(("goodput per paid node-hour", f"{s['goodput_per_paid_node_hour']:.4f} (x {n} / {n + s['count']} "
                                               f"nodes paid); the training nodes' time lost: stalls "
                                               f"{b['checkpoint_stalls']:.4f}, lost work {b['lost_work']:.4f}, "
                                               f"restarts {b['restarts']:.4f}"))
    return rows


def _shard_group_note(a: Advice) -> str:
    """The shard group given, or the one suggested when FSDP's commit is long."""
    i = a.inputs
    if i.shard_group:
        return f"{i.shard_group} (given: HSDP, {i.nodes * i.gpus_per_node // i.shard_group} replicas of the state)"
    if i.suggested_shard_group is None:
        return ""
    e, group = i.estimate, i.suggested_shard_group
    hsdp = gc.estimate(e.params, e.gpus, i.instance, e.storage, group)
    return (f"0 (FSDP over all {e.gpus} GPUs: rank 0's commit takes {e.commit_s:,.0f} s before each checkpoint is "
            f"durable); HSDP over {group} GPUs ({group // i.gpus_per_node} pods, the fewest whose share of the state "
            f"fits in {gc.STATE_SHARE_OF_GPU:.0%} of a GPU) commits in {hsdp.commit_s:.3g} s: "
            f"--shard-group-size {group}")


def _slow_storage_note(a: Advice) -> str:
    """What the estimated storage needs when its write time, not Daly, sets the interval."""
    e = a.inputs.estimate
    if e is None or a.inputs.ckpt_write_s <= a.daly_s or dict(a.inputs.cost_sources).get("ckpt_write_s") != "estimated":
        return ""
    need = gc.capacity_for(e.state_gb, a.daly_s, e.storage.mb_s_per_tib)
    return (f"W is longer than Daly's interval, so the interval waits for the write: storage.size {need}Gi at "
            f"{e.storage.mb_s_per_tib:g} MB/s/TiB writes it within {a.daly_s:,.0f} s (--storage-size, "
            "--storage-throughput)")


def values_for_kind(values: dict, kind: str) -> dict:
    """``values`` (every key the advisor derives) with only the keys that act under ``kind``: a
    PyTorchJob has no JobSet to restart (``workload.jobSet``); another kind is named, so that the
    snippet selects it."""
    out = {k: v for k, v in values.items() if k != "workload"}
    if kind != "PyTorchJob":
        out["workload"] = {"kind": kind, **values.get("workload", {})}
    return out


def render_values(a: Advice, kind: str = "PyTorchJob") -> str:
    i = a.inputs
    header = (f"# resilient-fsdp advise --instance {i.instance} --nodes {i.nodes} --job-hours {i.job_hours:g} "
              f"--ckpt-stall-s {i.ckpt_stall_s:.3g} --ckpt-write-s {i.ckpt_write_s:.4g} --restart-s {i.restart_s:g} "
              f"--step-s {i.step_s:g} --startup-s {i.startup_s:g}"
              + (f" --spares {a.spares['count']} --replacement-s {a.spares['replacement_s']:g} --job-restart-s "
                 f"{a.spares['job_restart_s']:g} --node-loss-share {a.spares['node_loss_share']:g}"
                 if a.spares is not None else "") + "\n"
              + "".join(f"#   spares: {line}\n" for line in (a.spares["explain"] if a.spares is not None else []))
              + "".join(f"#   estimated {line}\n" for line in (i.estimate.explain() if i.estimate else []))
              + f"# job.backoffLimit with workload.kind={kind}: {BACKOFF_LIMIT_MEANING[kind]}\n")
    return header + yaml.safe_dump(values_for_kind(a.values(), kind), sort_keys=False)


def main(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    try:
        advice = advise(inputs_from_args(args))
    except AdviseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = getattr(args, "kind", "PyTorchJob")
    print(render_values(advice, kind) if args.values else render_table(advice, kind), file=out)
    return 0


def as_json(a: Advice) -> dict:
    return {**asdict(a), "values": a.values()}


def parse_advise_line(line: str) -> Optional[argparse.Namespace]:
    """The arguments of a ``# advise: ...`` line in a values profile's header, else None."""
    prefix = "# advise:"
    if not line.startswith(prefix):
        return None
    parser = argparse.ArgumentParser(prog="advise", add_help=False)
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    return parser.parse_args(["advise", *line[len(prefix):].split()])
