"""What each layer retries, and the exit code a node (a pod's main process) ends with.

:data:`TABLE` holds the rules, one :class:`Row` per kind of ending: its code, who retries it and
what each kind's job controller does with it. The node agent (:mod:`.agent`), the rejoin rule
(:mod:`.rejoin`) and the trainer (:mod:`resilient_fsdp.train.entrypoint`) act on it, and
``docs/faults-and-restarts.md`` shows :func:`markdown_table` of it (a test keeps the two equal).
Also here: how a rank tells its node agent that it failed for good or finished training.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import atomic
from ..config import ConfigError
from .deterministic import RepeatedFailure
from .faults import NODE_PID_ENV

# Codes the job-level policy retries (PyTorchJob `restartPolicy: ExitCode`, the JobSet rules).
RETRIED = range(128, 256)
EX_TEMPFAIL = 75  # sysexits.h: "temporary failure; the user is invited to retry"


@dataclass(frozen=True)
class Row:
    """One kind of ending: the node's exit code, who retries it, what each kind's controller does."""

    name: str
    code: str  # as shown in the docs ("2", "128 + N")
    kind: str  # "success", "configuration", "stop" or "infrastructure"
    what: str
    retried_by: str
    budget: str
    """What the job level does with it: ``done``, ``fails`` (the job fails at once), ``counted``
    (a retried pod failure, counted against the Job's ``backoffLimit`` under a JobSet) or
    ``none`` (no pod exit: nothing is counted)."""
    codes: range = range(0)
    """The exit codes of the row, for the check against the rendered rules."""
    decides: str = ""
    """Which rule puts an ending in this row: the code that reads it, and from what."""
    rejoined: bool = False  # another node's failure causes it: a node that is not the store host joins again

    def pytorchjob(self) -> str:
        return BUDGET[self.budget][0]

    def jobset(self) -> str:
        return BUDGET[self.budget][1]


SUCCESS = 0
CONFIG = ConfigError.exit_code  # 2
INFRASTRUCTURE = 128 + EX_TEMPFAIL  # 203
NVRX_NO_RESTART = 93  # NVRx 0.7's ft_launcher: NoRestartRequested (--ft-no-restart-exit-code)
# The node lost the rendezvous store (its host, pod 0's agent, went away with its pod): outside
# 129-192, where 128 + a signal lives, so the two read apart.
RENDEZVOUS_LOST = 200
# NVRx's node health checks failed on this node (ft_launcher says 1): the same range, its own code.
UNHEALTHY_NODE = 201
# A rank's first non-finite loss at a step (resilience/non_finite.py): retried like any rank
# failure, its own code so that the rank's exit in the launcher's log says what it was.
NON_FINITE_LOSS = 202
# A straggler's node leaves the job (resilience/stragglers.py): every rank ends the attempt with
# it, retried in-job like a rank failure, its own code so that the launcher's log says why.
STRAGGLER_REPLACED = 204
# The replicas of a shard differed (resilience/sdc.py): every rank ends the attempt with it, and the
# in-job restart resumes from the state last seen to agree.
SILENT_CORRUPTION = 205

# What each kind's controller does with a row's ending: (PyTorchJob, JobSet and TrainJob).
BUDGET = {
    "done": (
        "the pod succeeds; the job is done when the Master is",
        "the pod completes its index; the JobSet is done when every index is (a hot spare's too: it exits 0 "
        "when the job ends)",
    ),
    "fails": (
        "the job fails at once (`restartPolicy: ExitCode`: 1-127 are permanent)",
        "the `FailJob` rule fails the Job, and `fatalExitCode` the JobSet, at once",
    ),
    "counted": (
        "the pod is recreated (`ExitCode` retries 128-255); the operator counts nothing, the agents do: "
        "past `job.backoffLimit` failures in a row without progress the node exits 2 instead",
        "counted against `job.backoffLimit` (not when the pod has `DisruptionTarget`: evicted, "
        "preempted, drained); past it the JobSet restarts whole, up to `workload.jobSet.maxRestarts`",
    ),
    "stop": (
        "the pod is recreated (`ExitCode` retries 128-255); a stop is no failure: nothing counts it",
        "counted against `job.backoffLimit` unless the pod has `DisruptionTarget` (an eviction, a preemption, "
        "a drain has it); past it the JobSet restarts whole, up to `workload.jobSet.maxRestarts`",
    ),
    "none": ("nothing: no pod exits", "nothing is counted: no pod exits"),
}

TABLE: tuple[Row, ...] = (
    Row(
        "done",
        str(SUCCESS),
        "success",
        "training finished: every rank exited 0, or every rank of the node finished training and only "
        "`ft_launcher`'s own shutdown failed (the store host exited first), or the launcher lost the store "
        "and the run directory says the job trained every step (a hot spare, which has no ranks to say so), or, "
        "before any launcher starts, the run directory already says so (a pod recreated after its job ended, "
        "which no launcher would join)",
        "-",
        "done",
        range(0, 1),
        "`ft_launcher`'s return code 0, the ranks' finish marks (`exit_codes.finished_ranks`), the run "
        "directory's last start or finish record: a finish at `train.steps`, or at `train.stop_at_step` when the "
        "run stops there (`agent.training_complete`)",
    ),
    Row(
        "configuration",
        str(CONFIG),
        "configuration",
        "a failure no restart can fix: `ConfigError` (a bad key or value, missing data, a model or checkpoint "
        "that does not fit, a missing `checkpoint.resume_from`, another job's lease, a run or checkpoint directory "
        "the pod's user cannot write); the same failure at the same place after a restart that replayed it (an "
        "exception in the user's `forward` at step 1 twice, a non-finite loss at a step the job already restarted "
        "for: the message names the failure, the place and the ranks, the traceback is in the rank's log); a "
        "checkpoint failure that ends the job (`checkpoint.max_consecutive_failures` saves in a row, the final save, "
        "a lost lease; a full volume named with its path and free bytes); under a PyTorchJob, more than "
        "`job.backoffLimit` pod failures in a row without progress; bad trainer or launcher flags; hot spares "
        "(`--nnodes=N:M`, the chart's `spares`) under an NVRx older than 0.6, which would train at every node that "
        "joins",
        "none: in-process restart re-raises it at once; the rank marks its node, whose agent stops "
        "`ft_launcher` before it restarts the rank",
        "fails",
        range(CONFIG, CONFIG + 1),
        "the exception's class (`exit_codes.is_configuration_failure`): `ConfigError`, "
        "`deterministic.RepeatedFailure` (`deterministic.judge`: the failure's signature and place against the "
        "run directory's records), a checkpoint `SaveFailed` marked permanent; the agent's own checks "
        "(its flags, `pod_failures.judge`)",
    ),
    Row(
        "nvrx-no-restart",
        str(NVRX_NO_RESTART),
        "configuration",
        "NVRx 0.7's `ft_launcher` decided that restarting cannot help (its failure attribution said "
        "stop, or no progress across restarts; this project's flags enable neither)",
        "none",
        "fails",
        range(NVRX_NO_RESTART, NVRX_NO_RESTART + 1),
        "NVRx's `ft_launcher` itself",
    ),
    Row(
        "stopped",
        "128 + N (143 for SIGTERM)",
        "stop",
        "the node was asked to stop (eviction, spot reclaim, scale-down: SIGTERM or SIGINT); its ranks "
        "committed a checkpoint of the current step",
        "job level: the pod is recreated and the job resumes from that checkpoint",
        "stop",
        range(129, 193),
        "the signal the agent received",
    ),
    Row(
        "killed",
        "128 + N (137 for SIGKILL)",
        "infrastructure",
        "`ft_launcher` itself was killed by signal N (the OOM killer, a node going down)",
        "job level: the pod is recreated",
        "counted",
        range(129, 193),
        "`ft_launcher`'s return code (negative: the signal that killed it)",
    ),
    Row(
        "joined-again",
        "- (no exit)",
        "infrastructure",
        "a node that does not host the store saw its `ft_launcher` end with 200 or 203 below, which "
        "another node's failure causes (the store host lost, the job-wide in-job restarts spent by a "
        "peer's fault, a peer that did not join in time)",
        "the node agent: it starts `ft_launcher` again in the same pod, which joins the store pod 0 "
        "hosts, for up to `rendezvous.rejoinTimeoutSeconds` from the event; then it exits with the code",
        "none",
        range(0),
        "`rejoin.Rejoin.decide`: not the store host, within `rendezvous.rejoinTimeoutSeconds`",
    ),
    Row(
        "rendezvous-store-lost",
        str(RENDEZVOUS_LOST),
        "infrastructure",
        "`ft_launcher` failed because the rendezvous store went away (the pod hosting it was lost) and no "
        "store came back within `rendezvous.rejoinTimeoutSeconds`",
        "job level: the pod is recreated",
        "counted",
        range(RENDEZVOUS_LOST, RENDEZVOUS_LOST + 1),
        "`ft_launcher`'s own error lines (`agent.rendezvous_store_lost`)",
        rejoined=True,
    ),
    Row(
        "unhealthy-node",
        str(UNHEALTHY_NODE),
        "infrastructure",
        "NVRx's node health checks found this node unhealthy before a rendezvous (NVRx 0.7: its GPU, NIC "
        "link, storage or external node-health check failed, or a rank asked to exclude the node; 0.4.1: "
        "its GPU check): `ft_launcher` raised `UnhealthyNodeException` and exited 1. The node does not "
        "join again in its pod; with `pod.taintUnhealthyNode.enabled` its agent taints it `NoSchedule` first, "
        "else cordon it or let node auto-repair replace it (docs/faults-and-restarts.md)",
        "job level: the pod is recreated, elsewhere once the node is tainted, cordoned or marked unhealthy",
        "counted",
        range(UNHEALTHY_NODE, UNHEALTHY_NODE + 1),
        "`ft_launcher`'s own error lines (`agent.node_unhealthy`)",
    ),
    Row(
        "non-finite-loss",
        f"{NON_FINITE_LOSS} (the rank's)",
        "infrastructure",
        "the job's loss was non-finite (NaN, inf) at a step for the first time: a suspected hardware fault. "
        "Every rank exits 202; the ranks whose own loss was non-finite, their node and host are recorded in "
        "`<run_dir>/faults/non-finite/` and logged",
        "in-job (not in-process: it would keep the same processes and CUDA state): every rank restarts from "
        "the last checkpoint; job level once the in-job restarts are spent (the node exits 203; a trainer "
        "that is the pod's own process exits 202)",
        "counted",
        range(NON_FINITE_LOSS, NON_FINITE_LOSS + 1),
        "the loss all-reduce (`non_finite.stop`): its first time at a step; the same step again is the 2 row",
    ),
    Row(
        "straggler-replaced",
        f"{STRAGGLER_REPLACED} (the rank's)",
        "infrastructure",
        "a straggler was found (`resilience.stragglers.action=replace`): its rank asked `ft_launcher` to leave "
        "its node out of the next rendezvous, and every rank exits 204 at the same step",
        "in-job: every launcher restarts its workers; the straggler's node fails as unhealthy (the 201 row) "
        "and a hot spare takes its node rank, from the memory tier",
        "counted",
        range(STRAGGLER_REPLACED, STRAGGLER_REPLACED + 1),
        "rank 0's straggler report, broadcast (`stragglers.Stragglers.after_step`)",
    ),
    Row(
        "silent-corruption",
        f"{SILENT_CORRUPTION} (the rank's)",
        "infrastructure",
        "the replicas of a shard differed at a replica check (`resilience.sdc.interval_steps`, HSDP): checkpoints "
        "saved after the last passing check were set aside as suspect, and every rank exits 205 at the same step",
        "in-job: every rank resumes from the newest checkpoint no newer than the last passing check, memory first; "
        "the odd replica out, where 3 or more vote, leaves for a hot spare. Again before any check passed: the "
        "2 row, naming the suspects",
        "counted",
        range(SILENT_CORRUPTION, SILENT_CORRUPTION + 1),
        "the replica check's digests, agreed by one all-reduce (`sdc.ReplicaCheck.after_step`)",
    ),
    Row(
        "restarts-exhausted",
        str(INFRASTRUCTURE),
        "infrastructure",
        "`ft_launcher` failed after infrastructure-type failures: ranks killed by signals, hangs, lost "
        "peers, a join timeout, CUDA/NCCL errors, in-process restarts spent, an exception's first time at a "
        "place; its in-job restarts (`resilience.launcher.max_restarts`, job-wide on NVRx 0.7) are spent. Only "
        "the store host's pod exits with it at once: one count per event, and its replacement hosts a new "
        "store with a fresh in-job budget",
        "in-process (exceptions, hangs), then in-job, then job level (128 + `EX_TEMPFAIL`)",
        "counted",
        range(INFRASTRUCTURE, INFRASTRUCTURE + 1),
        "what is left: a failure no earlier row claims (an exception is judged first, `deterministic.judge`: a "
        "communication or storage error every time, any other the first time at its place)",
        rejoined=True,
    ),
)

# The codes after which a node that is not the store host joins again (:mod:`.rejoin`).
REJOINED_CODES = tuple(code for r in TABLE if r.rejoined for code in r.codes)


def row(name: str) -> Row:
    return next(r for r in TABLE if r.name == name)


def is_configuration_failure(exc: BaseException) -> bool:
    """A failure that no restart can fix (the ``configuration`` row): never retried. A bad
    configuration (:class:`ConfigError`), the same failure at the same place after a restart
    (:class:`.deterministic.RepeatedFailure`, a repeated non-finite loss among them), and an error
    that says so itself with ``permanent = True`` (a checkpoint failure that ends the job:
    ``checkpoint.failures.SaveFailed``)."""
    return (
        isinstance(exc, (ConfigError, FloatingPointError, RepeatedFailure)) or getattr(exc, "permanent", False) is True
    )


def node_exit_code(
    returncode: int,
    stop_signal: Optional[int],
    config_failure: bool = False,
    store_lost: bool = False,
    unhealthy: bool = False,
) -> int:
    """The node's exit code from ``ft_launcher``'s return code, the stop signal the node received
    (if any), whether a rank reported a configuration-type failure, and whether ``ft_launcher``
    failed because the rendezvous store went away or because NVRx found the node unhealthy (both
    read from its output by the agent)."""
    if config_failure:
        return CONFIG
    if returncode < 0:
        return 128 + (-returncode)  # ft_launcher killed by a signal
    if returncode == SUCCESS:
        return SUCCESS
    if stop_signal is not None:
        return 128 + stop_signal  # ranks checkpointed and stopped; ft_launcher says 1
    if returncode in (CONFIG, NVRX_NO_RESTART):
        return returncode  # its own bad flags (argparse), or NVRx decided against a restart
    if unhealthy:
        return UNHEALTHY_NODE  # before store_lost: the bad node is the cause, not its store
    if store_lost:
        return RENDEZVOUS_LOST
    return INFRASTRUCTURE


def describe_code(code: int) -> str:
    """One line for a node's exit code: which row, and whether the job level retries it."""
    if code in RETRIED:
        named = {r.codes[0]: r.name for r in TABLE if len(r.codes) == 1}  # the rows of one code each
        name = named.get(code, "stopped or killed")
        try:
            sig = f" ({signal.Signals(code - 128).name})" if code not in named else ""
        except ValueError:
            sig = ""
        return f"{code}: {name}{sig}, retried by the job level"
    for r in TABLE:
        if r.code == str(code):
            return f"{code}: {r.name}, not retried"
    return f"{code}: not retried"


def markdown_table() -> str:
    """:data:`TABLE` as the Markdown table ``docs/faults-and-restarts.md`` shows."""
    lines = [
        "| node exit code | kind | what happened | which rule decides | retried by | PyTorchJob | JobSet and TrainJob |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in TABLE:
        lines.append(
            f"| {r.code} | {r.kind} | {r.what} | {r.decides} | {r.retried_by} | {r.pytorchjob()} | {r.jobset()} |"
        )
    return "\n".join(lines)


# Where a node writes why it ended, which Kubernetes shows in the pod's status (the container's
# terminationMessagePath); set elsewhere (the local cluster) to a file of the run directory.
TERMINATION_LOG_ENV = "RESILIENT_FSDP_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"

# ---- a rank tells its node that its failure must not be retried ---------------------------------

# Set by the node agent: the file a rank writes the reason of a configuration-type failure into
# before it signals the agent (SIGUSR1), which then stops ft_launcher instead of letting it restart.
NODE_FATAL_ENV = "RESILIENT_FSDP_NODE_FATAL_FILE"
FATAL_SIGNAL = signal.SIGUSR1


def report_configuration_failure(message: str) -> bool:
    """Rank side: record ``message`` for the node agent and signal it; False without an agent."""
    path, agent = os.environ.get(NODE_FATAL_ENV), os.environ.get(NODE_PID_ENV)
    if not path or not agent:
        return False
    try:
        atomic.write_text(Path(path), message)
        os.kill(int(agent), FATAL_SIGNAL)
    except (OSError, ValueError):
        return False
    return True


# ---- a rank tells its node that it finished training ---------------------------------------------

# Set by the node agent: the directory each rank marks when its training finished (the final
# checkpoint committed, a step every rank reaches together). A node whose ranks all finished
# exits 0 whatever ft_launcher's own shutdown says: the store host may exit first, and a later
# node's last store write then fails.
NODE_DONE_ENV = "RESILIENT_FSDP_NODE_DONE_DIR"


def report_finished() -> bool:
    """Rank side: mark this rank's training finished for the node agent; False without an agent."""
    path = os.environ.get(NODE_DONE_ENV)
    if not path:
        return False
    try:
        atomic.write_text(Path(path) / f"rank-{os.environ.get('LOCAL_RANK', '0')}", "done")
    except OSError:
        return False
    return True


def finished_ranks(done_dir: Path) -> int:
    """Node side: how many of the node's ranks marked their training finished."""
    try:
        return sum(1 for p in done_dir.iterdir() if p.name.startswith("rank-"))
    except OSError:
        return 0
