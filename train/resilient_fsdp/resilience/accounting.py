"""Which layer restarted the job, what each fault cost, and the job's goodput.

Every start of the training function (an *attempt*) logs a ``start`` event to ``metrics.jsonl``
with the layer that caused it, found by mechanism, not by fault kind (:func:`agree_attempt`).
The recovery of an injected fault runs from its ``t_fault`` to the first step completed after the
restore; goodput is the time in steps that count (each final step once) over the wall time since
the job began. The attempt (:mod:`.attempt`) and ``resilient-fsdp`` reports use it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import psutil

from ..config import FAULT_KINDS
from .faults import NODE_START_ENV
from .ledger import FaultLedger
from .prewarm import PROCESS_START_ENV

if TYPE_CHECKING:
    import torch

LAYERS = ("in_process", "in_job", "job")
JOB_START_ENV = "RESILIENT_FSDP_JOB_START"
_LIFECYCLE = ("start", "finish")
# What a fault's ledger record says about how it landed, carried into its recovery record:
# the rank that fired it, a sigkill-during-save's bytes on disk, a node fault's request file.
_FAULT_DETAILS = (
    "rank",
    "node_index",
    "during_write",
    "bytes_on_disk",
    "expected_bytes",
    "checkpoint_step",
    "note",
    "request",
    "during_commit",
    "commit_pid",
    "commit_in_own_process",
    "pid",
    "during_replication",
    "replica_step",
    "during_restore",
    "restore_step",
    "restore_tier",
)


def read_records(metrics_path: Path) -> list[dict]:
    if not metrics_path.exists():
        return []
    out = []
    for line in metrics_path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a crash mid-write
    return out


def node_start_time() -> float:
    """When this rank's node (agent) started: set by the agent wrapper, else the parent's age."""
    raw = os.environ.get(NODE_START_ENV)
    if raw:
        return float(raw)
    try:
        return psutil.Process(os.getppid()).create_time()
    except psutil.Error:
        return 0.0


def _process_start() -> Optional[float]:
    """When this rank's process started, on the clock ``t_fault`` is read from: the stamp the
    trainer's ``__main__`` leaves in :data:`PROCESS_START_ENV` (the process ``ft_launcher``
    started, also when the pre-warmed server forked the rank for it), else the kernel's start
    time, which is whole seconds off (its boot time is counted in whole seconds)."""
    raw = os.environ.get(PROCESS_START_ENV)
    if raw:
        try:
            return float(raw)
        except ValueError:
            pass
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return None


def agree_attempt(metrics_path: Path, iteration: int, rank: int, device: torch.device) -> tuple[str, str]:
    """Collective: the layer that caused this attempt, and the attempt's id, rank 0's, the same on
    every rank (the failures an attempt records are told apart by it). The layer is found by
    mechanism: ``start`` (the job's first attempt, or one after a clean ``finish``), ``in_process``
    (the wrapper re-entered the function), ``job`` (a node agent is younger than the previous
    attempt: a pod was recreated) or ``in_job`` (``ft_launcher`` respawned the workers)."""
    # torch only here: the node agent reads restarts and goodput from this module without it.
    import torch
    import torch.distributed as dist

    t = torch.tensor([node_start_time()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    newest_node = float(t.item())
    layer = None
    if rank == 0:
        lifecycle = [r for r in read_records(metrics_path) if r.get("event") in _LIFECYCLE]
        if not lifecycle or lifecycle[-1]["event"] == "finish":
            layer = "start"
        elif iteration > 0:
            layer = "in_process"
        elif newest_node > lifecycle[-1]["t"]:
            layer = "job"
        else:
            layer = "in_job"
    box = [(layer, f"{int(time.time())}-{uuid.uuid4().hex[:8]}" if rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def phases(t_fault: float, marks: dict, now: float, process_start: Optional[float] = None) -> dict:
    """Where a recovery's time went, in seconds, from rank 0's marks of the attempt that recovered:

    - ``restart_s``: the fault until this attempt began: detection, the abort and NVRx's restart
      (in-process), or until the process started (in-job, job: detection, stopping the workers,
      rendezvous, pod recreation);
    - ``process_start_s``: a new process's interpreter and imports until the attempt began (0 in-process);
    - ``group_s``: the process group (every rank has to arrive);
    - ``model_s``: which layer restarted (a collective), the data, the model built and sharded, the
      optimizer;
    - ``engine_s``: the checkpointer and its engine;
    - ``load_s``: finding and loading the checkpoint;
    - ``first_step_s``: the first step after it.

    A mark the attempt did not reach counts as reached at the previous one.
    """
    attempt = marks["attempt"]
    started = process_start if process_start is not None and t_fault < process_start <= attempt else attempt
    out = {"restart_s": started - t_fault, "process_start_s": attempt - started}
    previous = attempt
    for name, mark in (("group_s", "group"), ("model_s", "model"), ("engine_s", "built"), ("load_s", "resumed")):
        reached = marks.get(mark, previous)
        out[name], previous = reached - previous, reached
    out["first_step_s"] = now - previous
    return {k: round(max(0.0, v), 3) for k, v in out.items()}


def record_recoveries(
    ledger: FaultLedger,
    layer: str,
    resumed_step: int,
    now: float,
    marks: Optional[dict] = None,
    attempt: Optional[str] = None,
) -> list[dict]:
    """Rank 0, after the first step completed in an attempt caused by a restart: close every
    fired fault that has no recovery yet, with where its time went when ``marks`` are given, and
    the ``attempt`` that closed it (a fault inside a restart is closed with the one before it, by
    the restart that came through). Returns the new recovery records."""
    done = {**ledger.recoveries(), **ledger.went_on()}
    new = []
    for fault in ledger.fired():
        if fault["key"] in done or fault["t_fault"] > now or not _stops(fault):
            continue
        record = {
            "fault": fault["fault"],
            "kind": fault["kind"],
            "layer": layer,
            "recovery_s": now - fault["t_fault"],
            "fault_step": fault["completed_step"],
            "resumed_from_step": resumed_step,
            "attempt": attempt,
            "lost_steps": max(0, fault["completed_step"] - resumed_step),
            **{k: fault[k] for k in _FAULT_DETAILS if k in fault},
        }
        if marks:
            record["phases_s"] = phases(fault["t_fault"], marks, now, _process_start())
        ledger.record_recovery(fault["key"], record)
        new.append(record)
    return new


def restart_counts(records: list[dict]) -> dict[str, int]:
    """Attempts started by each restart layer (:data:`LAYERS`), from the ``start`` events."""
    restarts = {layer: 0 for layer in LAYERS}
    for r in records:
        if r.get("event") == "start" and r.get("layer") in restarts:
            restarts[r["layer"]] += 1
    return restarts


def job_start_time(records: list[dict]) -> Optional[float]:
    raw = os.environ.get(JOB_START_ENV)
    if raw:
        return float(raw)
    starts = [r["t"] for r in records if r.get("event") == "start"]
    return min(starts) if starts else None


def summarize(metrics_path: Path, ledger: FaultLedger, now: Optional[float] = None) -> dict:
    """The fault-tolerance part of ``summary.json``; read from files, so it spans every attempt."""
    now = time.time() if now is None else now
    records = read_records(metrics_path)
    restarts = restart_counts(records)
    recoveries, went_on = ledger.recoveries(), ledger.went_on()
    faults = ledger.fired()
    start = job_start_time(records)
    # Steps of this job only: a run directory relaunched as a new job (a rewind, a resize) keeps
    # the earlier job's step records up to the step it resumed from, trained before it began.
    productive = sum(
        r["step_time_s"] for r in records if r.get("event") == "step" and (start is None or r.get("t", start) >= start)
    )
    wall = now - start if start is not None else 0.0
    return {
        "faults_injected": [f["fault"] for f in faults],
        "restarts": restarts,
        "recoveries": [recoveries[f["key"]] for f in faults if f["key"] in recoveries],
        # Fired, and no restart followed: training went on (a partition that healed before any
        # collective timed out, or one nothing executed).
        "unrecovered": [
            _unrecovered(f, went_on.get(f["key"])) for f in faults if f["key"] not in recoveries and _stops(f)
        ],
        # Non-finite losses the job met, each restarted once as a suspected hardware fault
        # (resilience/non_finite.py): the step, the ranks whose own loss it was, their node and host.
        "non_finite_losses": ledger.non_finite(),
        # Slow ranks found (resilience/stragglers.py): the rank, its pod and host, the part and
        # score that named it, the step, and what was done: replaced (by which pod, how long it
        # took to train again) or reported (and why not replaced).
        "stragglers": ledger.stragglers(),
        # Replica mismatches (resilience/sdc.py): the step, the last passing check rolled back to,
        # the suspects, the checkpoints set aside, and the step a check passed again.
        "silent_corruption": ledger.sdc(),
        "productive_s": productive,
        "job_wall_s": wall,
        "goodput": productive / wall if wall > 0 else 0.0,
    }


def _stops(fault: dict) -> bool:
    """Whether the fault stops training, so that a recovery is expected (the kinds table)."""
    kind = FAULT_KINDS.get(fault["kind"])
    return kind is None or kind.stops


def _unrecovered(fault: dict, went_on: Optional[dict]) -> dict:
    if went_on:
        why = f"no restart: training went on (step {went_on['step']} completed {went_on['after_s']:.1f} s after it)"
    else:
        why = "no restart followed it"
    return {
        "fault": fault["fault"],
        "kind": fault["kind"],
        "fault_step": fault["completed_step"],
        "why": why,
        **{k: fault[k] for k in _FAULT_DETAILS if k in fault},
    }
