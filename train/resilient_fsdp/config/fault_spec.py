"""The fault kinds and the grammar of one fault to inject,
``KIND@STEP[:rank=R | :node=N][:for=SECONDS][:factor=F]``.

:data:`FAULT_KINDS` is the one table of kinds: the configuration checks ``resilience.inject``
against it, the injector (:mod:`resilient_fsdp.resilience.faults`) fires each kind where its
``when`` says, the local cluster executes the kinds marked ``by_cluster``, and restart accounting
expects a recovery only for the kinds that ``stop`` training. A new kind is a row here and its
action in the injector.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Optional

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FaultKind:
    """One kind of fault: where it fires, what it does, and who recovers."""

    name: str
    when: Literal["step", "optimizer", "collective", "loss", "save", "write", "commit", "replicate", "restore"]
    """``step``: as step STEP starts; ``optimizer``: just after step STEP's optimizer step; ``collective``: just before step STEP's loss all-reduce;
    ``loss``: on the rank's own loss of step STEP, just before that all-reduce;
    ``save``: while the rank's checkpoint writer writes the first checkpoint at or after STEP;
    ``write``: inside the checkpoint writer, as it writes step STEP's checkpoint;
    ``commit``: inside rank 0's commit of the first checkpoint at or after STEP, every write done;
    ``replicate``: between the record and the bytes of the first replica at or after STEP that the
    rank sends (``checkpoint.memory.replicas``);
    ``restore``: armed as step STEP starts, it fires in the rank's next restore (in the restart
    that a later fault causes)."""
    what: str
    recovered_by: str
    once_per_job: bool = True
    """False: it fires each time its step runs, the restarts it causes included."""
    by_cluster: bool = False
    """It acts on a whole node (pod), which a rank cannot do to its own: the cluster carries it out (``resilient-fsdp local`` reads
    the rank's request; elsewhere ``node-loss`` kills the pod's processes from inside)."""
    takes_duration: bool = False
    """``:for=SECONDS`` applies."""
    stops: bool = True
    """Training stops (a restart follows); False: it only slows something down."""


# A failed save is not a failed attempt (checkpoint.max_consecutive_failures).
_SAVE_FAILS = "none: the save fails on every rank and training goes on"
FAULT_KINDS: dict[str, FaultKind] = {
    k.name: k
    for k in (
        FaultKind("exception", "step", "the step raises", "in-process, else in-job"),
        FaultKind(
            "exception-repeat",
            "step",
            "as exception, each time the step runs: a deterministic bug, as a model's forward that always raises there",
            "none: after its one restart the job fails (exit 2) naming the failure and the step",
            once_per_job=False,
        ),
        FaultKind("hang", "step", "the rank stops making progress (sleeps forever)", "in-process, else in-job"),
        FaultKind(
            "hang-in-collective",
            "collective",
            "the rank stops just before the step's loss all-reduce; its peers block inside it",
            "in-process, else in-job",
        ),
        FaultKind(
            "nan-loss",
            "loss",
            "the rank's loss of the step is NaN, as from a GPU that computes silent NaNs: the job's loss is non-finite",
            "in-job: one restart from the last checkpoint (not in-process)",
        ),
        FaultKind(
            "nan-loss-repeat",
            "loss",
            "as nan-loss, each time the step runs: the restart meets it again",
            "none: after its one restart the job fails (exit 2) naming the step and the ranks",
            once_per_job=False,
        ),
        FaultKind("sigkill", "step", "the rank's process is killed", "in-job"),
        FaultKind(
            "sigkill-during-save",
            "save",
            "the rank and its checkpoint writer are killed while the writer is writing (bytes on disk > 0, < final)",
            "in-job (previous checkpoint)",
        ),
        FaultKind(
            "sigkill-during-commit",
            "commit",
            "rank 0 and its commit process are killed inside the commit of the "
            "first checkpoint at or after STEP: every rank's write is done, the engine's metadata written, the "
            "manifest and the rename not yet",
            "in-job (previous checkpoint; this one stays incomplete, swept later)",
        ),
        FaultKind(
            "sigkill-during-replication",
            "replicate",
            "the rank is killed while it sends the replica of its first "
            "memory checkpoint at or after STEP: its holder has received the record, not the bytes",
            "in-job (from memory: the holder keeps its previous replica)",
        ),
        FaultKind(
            "sigkill-during-restore",
            "restore",
            "armed as step STEP starts; the rank is killed inside its next "
            "restore, in the restart a later fault causes: the checkpoint chosen (replicas moved in, files "
            "verified), the live state not yet loaded",
            "in-job (the restore again, from the same checkpoint)",
        ),
        FaultKind("sigterm", "step", "its node (agent) gets SIGTERM, as on eviction", "graceful stop + job level"),
        FaultKind(
            "node-loss",
            "step",
            "its whole node dies: agent, workers, helpers",
            "job level (node recreated)",
            by_cluster=True,
        ),
        FaultKind(
            "partition",
            "step",
            "its node's network goes down (for good, or for SECONDS)",
            "job level, or none when it heals in time",
            by_cluster=True,
            takes_duration=True,
        ),
        FaultKind(
            "node-freeze",
            "step",
            "its node stops reporting, as after a kernel hang or a wedged network driver: "
            "its link goes down and every process of its pod stops, closing no connection; the pod stays until "
            "the node is deleted for:SECONDS later (node auto-repair, the out-of-service taint)",
            "in-job with a hot spare (pod 0: job level once its node is deleted)",
            by_cluster=True,
            takes_duration=True,
        ),
        FaultKind(
            "writer-exit",
            "write",
            "the checkpoint writer dies after writing the data, before the save is finalized",
            _SAVE_FAILS + " (a new writer takes the next save)",
            stops=False,
        ),
        FaultKind("writer-raise", "write", "the checkpoint writer's write fails", _SAVE_FAILS, stops=False),
        FaultKind(
            "writer-hang",
            "write",
            "the checkpoint writer never finishes the write",
            _SAVE_FAILS + " at checkpoint.write_timeout_s",
            stops=False,
        ),
        FaultKind(
            "writer-slow",
            "write",
            "the checkpoint writer finishes SECONDS later",
            "none: the write is late",
            takes_duration=True,
            stops=False,
        ),
        FaultKind(
            "memory-corrupt",
            "step",
            "a byte of the rank's newest memory checkpoint flips (after its replica "
            "left), as a bad DIMM's would: its CRC32C fails at the next restore",
            "none now; the next restore takes the replica a peer keeps, else the durable checkpoint",
            stops=False,
        ),
        FaultKind(
            "replica-corrupt",
            "step",
            "a byte of the newest replica the rank keeps (of its peer's memory checkpoint) flips",
            "none now; a restore that needs it falls back to the durable checkpoint",
            stops=False,
        ),
        FaultKind(
            "slow",
            "step",
            "from STEP on, the rank's steps take FACTOR times as long (default 2), as on a "
            "throttled GPU or a degraded link: the extra time lands in the rank's own optimizer step, a part "
            "no peer waits inside, as a slow GPU's own kernels would; its pod stays slow after an in-job "
            "restart",
            "none by itself; resilience.stragglers finds the rank, and with action=replace a hot "
            "spare takes its place in an in-job restart",
            stops=False,
        ),
        FaultKind(
            "bitflip",
            "optimizer",
            "one bit of one parameter of the rank's shard flips just after step STEP's "
            "optimizer step, as a GPU computing a wrong number would leave it: nothing fails, the replicas differ",
            "under HSDP with resilience.sdc.interval_steps: found at the next replica check, the job rolls back to "
            "the state last seen to agree (in-job restart)",
            stops=False,
        ),
        FaultKind(
            "slow-exit",
            "step",
            "the rank finishes training, then waits SECONDS (default 30) before it exits, "
            "as a slow teardown does: its node ends after the store host's",
            "none: the node still exits 0",
            takes_duration=True,
            stops=False,
        ),
    )
}
NODE_FAULT_KINDS = tuple(k.name for k in FAULT_KINDS.values() if k.by_cluster)
# Kinds that act on the memory tier's snapshots (checkpoint.memory): refused without it.
MEMORY_FAULT_KINDS = ("memory-corrupt", "replica-corrupt", "sigkill-during-replication")
# Kinds that act on the replicas (checkpoint.memory.replicas): refused without them.
REPLICA_FAULT_KINDS = ("replica-corrupt", "sigkill-during-replication")
# Kinds that take a pod's network link down: only a cluster that reads requests can (netns pods).
CUT_OFF_KINDS = ("partition", "node-freeze")
_FAULT_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?P<options>(?::[^:]*)*)$")
_FAULT_GRAMMAR = "KIND@STEP[:rank=R | :node=N][:for=SECONDS][:factor=F]"


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """One fault to inject, ``KIND@STEP[:rank=R | :node=N][:for=SECONDS][:factor=F]`` (see
    :mod:`resilient_fsdp.resilience.faults`). ``node=N`` targets the lowest rank of node (pod) N,
    its local rank 0; without ``node`` the target is ``rank`` (0 by default). ``for_s``: how long a
    ``partition`` lasts (None: for good), or how much later a ``writer-slow`` write finishes.
    ``factor``: how many times as long a ``slow`` rank's steps take."""

    kind: str
    step: int
    rank: int = 0
    node: Optional[int] = None
    for_s: Optional[float] = None
    factor: Optional[float] = None

    @property
    def key(self) -> str:
        """File-name-safe identity of this fault."""
        target = f"node{self.node}" if self.node is not None else f"rank{self.rank}"
        return f"{self.kind}@{self.step}-{target}"

    @property
    def target(self) -> str:
        return f"node={self.node}" if self.node is not None else f"rank={self.rank}"

    @property
    def kind_info(self) -> FaultKind:
        return FAULT_KINDS[self.kind]

    def __str__(self) -> str:
        duration = f":for={self.for_s:g}" if self.for_s is not None else ""
        factor = f":factor={self.factor:g}" if self.factor is not None else ""
        return f"{self.kind}@{self.step}:{self.target}{duration}{factor}"


def parse_fault(text: str, key: str = "--inject") -> FaultSpec:
    m = _FAULT_SPEC.match(text.strip())
    if not m:
        raise ConfigError(f"{key} {text!r}: expected {_FAULT_GRAMMAR}, e.g. sigkill@20:rank=1 or node-loss@12:node=0")
    if m["kind"] not in FAULT_KINDS:
        raise ConfigError(f"{key} {text!r}: unknown fault kind '{m['kind']}'; choose one of {', '.join(FAULT_KINDS)}")
    kind = FAULT_KINDS[m["kind"]]
    step = int(m["step"])
    if step < 1:
        raise ConfigError(f"{key} {text!r}: STEP must be 1 or more")
    options: dict[str, str] = {}
    for part in m["options"].split(":")[1:]:
        name, _, value = part.partition("=")
        if name not in ("rank", "node", "for", "factor") or not value:
            raise ConfigError(f"{key} {text!r}: unknown option {part!r}; expected {_FAULT_GRAMMAR}")
        if name in options:
            raise ConfigError(f"{key} {text!r}: '{name}' is given twice")
        options[name] = value
    if "rank" in options and "node" in options:
        raise ConfigError(f"{key} {text!r}: give rank=R or node=N, not both (node=N fires on the node's local rank 0)")
    for name in ("rank", "node"):
        if name in options and not options[name].isdigit():
            raise ConfigError(f"{key} {text!r}: {name} must be a whole number 0 or more")
    for_s = None
    if "for" in options:
        if not kind.takes_duration:
            takes = ", ".join(k.name for k in FAULT_KINDS.values() if k.takes_duration)
            raise ConfigError(f"{key} {text!r}: for=SECONDS applies to {takes} only")
        try:
            for_s = float(options["for"])
        except ValueError:
            for_s = -1.0
        if not for_s > 0:
            raise ConfigError(f"{key} {text!r}: for= must be a number of seconds above 0")
    elif kind.name == "writer-slow":
        raise ConfigError(f"{key} {text!r}: writer-slow needs :for=SECONDS, how much later the write finishes")
    elif kind.name == "node-freeze":
        raise ConfigError(
            f"{key} {text!r}: node-freeze needs :for=SECONDS, when the frozen node is deleted (as node "
            "auto-repair or the out-of-service taint does) and its pod replaced"
        )
    factor = None
    if "factor" in options:
        if kind.name != "slow":
            raise ConfigError(f"{key} {text!r}: factor=F applies to slow only")
        try:
            factor = float(options["factor"])
        except ValueError:
            factor = 0.0
        if not factor > 1:
            raise ConfigError(
                f"{key} {text!r}: factor= must be a number above 1 (2: the rank's steps take twice as long)"
            )
    node = int(options["node"]) if "node" in options else None
    if kind.when == "commit" and (node is not None or int(options.get("rank", 0)) != 0):
        raise ConfigError(f"{key} {text!r}: only rank 0 commits checkpoints; give rank=0 (or no target)")
    return FaultSpec(m["kind"], step, int(options.get("rank", 0)), node, for_s, factor)


def parse_faults(texts: list[str], world_size: Optional[int] = None, nodes: Optional[int] = None) -> list[FaultSpec]:
    specs = [parse_fault(t, "resilience.inject") for t in texts]
    for spec in specs:
        if world_size is not None and spec.node is None and spec.rank >= world_size:
            raise ConfigError(
                f"resilience.inject {str(spec)!r}: rank {spec.rank} does not exist in a job of {world_size} ranks"
            )
        if nodes is not None and spec.node is not None and spec.node >= nodes:
            raise ConfigError(
                f"resilience.inject {str(spec)!r}: node {spec.node} does not exist in a job of {nodes} node(s)"
            )
    return specs
