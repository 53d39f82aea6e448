"""The save in flight (:class:`PendingSave`) and what its commit makes of it.

:class:`.checkpointer.Checkpointer` holds one :class:`PendingSave` from the save's start until
every rank learned its commit's outcome; :func:`commit_job` is what rank 0 hands to
:mod:`.commit`, :func:`commit_record` turns that commit's result into the record every rank logs
or the failure every rank raises, and :func:`add_broadcast` completes the record on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..resilience.attempt import NoHooks
from . import commit, failures
from .engines import Engine
from .failures import Failure
from .lease import Lease


@dataclass
class PendingSave:
    """A save started and not yet learned committed or failed by every rank."""

    step: int
    dir: Path
    started_unix: float
    stall_s: float  # the save call, then every wait charged to this checkpoint
    save_call_s: float
    save_call_parts_s: dict
    plan: Optional[str]  # the async engine's save plan (cached or new); None for the others
    staging_wait_s: float = 0.0
    staged: bool = False  # the copy of the state is done: the optimizer step may change it
    committing: bool = False  # handed to rank 0's commit process; the ranks wait to learn the outcome
    gather_s: float = 0.0
    inline_commit_s: Optional[float] = None  # rank 0 committed on its training thread (no commit process)


def commit_job(
    pending: PendingSave, gathered: list[bytes], manifest: dict, engine: Engine, lease: Optional[Lease], hooks: NoHooks
) -> commit.CommitJob:
    """Rank 0: the commit of ``pending`` (:mod:`.commit`), from every rank's pickled outcome."""
    job = commit.CommitJob(
        step=pending.step,
        where=str(pending.dir),
        gathered=gathered,
        started_unix=pending.started_unix,
        manifest=manifest,
        lease_path=str(lease.path) if lease is not None else None,
        lease_holder=lease.holder if lease is not None else None,
    )
    try:
        keyed = engine.commit_metadata()
    except Exception as exc:  # noqa: BLE001 - the commit reports it as its failure
        job.error = f"{type(exc).__name__}: {exc}"
        keyed = None
    if keyed is not None:
        job.metadata_key, job.metadata = keyed
    job.fault = hooks.commit_fault(job.step, Path(job.where) / commit.FAULT_MARKER)
    return job


def commit_record(
    pending: PendingSave,
    result: commit.CommitResult,
    gather_s: float,
    mode: str,
    lease: Optional[Lease],
    failure: Callable[[str, str, int, object], Failure],
) -> tuple[Optional[dict], Optional[Failure]]:
    """Rank 0: ``result`` of the commit of ``pending`` as (record, None) or (None, the failure
    every rank raises). ``gather_s``: how long gathering every rank's outcome took; ``failure``
    makes a failed save's :class:`.failures.Failure` (a full volume said as such)."""
    step, where = pending.step, pending.dir
    if result.failed:
        rank, error = next(((r, e) for r, e in result.failed if failures.is_volume_full(e)), result.failed[0])
        others = f"; {len(result.failed) - 1} other rank(s) failed too" if len(result.failed) > 1 else ""
        message = (
            f"checkpoint of step {step} failed (rank {rank}: {error.strip()}{others}); it "
            f"stays incomplete at {where} and will not be loaded; the previous checkpoint is intact"
        )
        return None, failure(message, failures.WRITER, step, error)
    if result.lease_lost:
        if lease is not None:
            lease.lost = result.lease_lost
        return None, Failure(result.lease_lost, failures.LEASE, step, fatal=True)
    if result.error:
        return None, failure(
            f"checkpoint of step {step} failed while finalizing: {result.error}; it stays incomplete at {where}",
            failures.TIMEOUT if result.timed_out else failures.FINALIZE,
            step,
            result.error,
        )
    # Where the commit's time went: gathering every rank's outcome, the engine's metadata
    # (DCP's .metadata, pickled), the manifest and the rename, and the rest (outcomes, lease).
    commit_parts = {
        "gather_s": gather_s,
        "finalize_s": result.finalize_s,
        "manifest_s": result.manifest_s,
        "other_s": max(0.0, result.total_s - result.finalize_s - result.manifest_s),
        "broadcast_s": 0.0,
    }
    return {
        "step": step,
        "mode": mode,
        "stall_s": pending.stall_s,
        "save_call_s": pending.save_call_s,
        "save_call_parts_s": pending.save_call_parts_s,
        "staging_wait_s": pending.staging_wait_s,
        "plan": pending.plan,
        "write_s": result.write_s,
        "commit_s": sum(commit_parts.values()),
        "commit_parts_s": commit_parts,
        "bytes": result.nbytes,
        "path": result.path,
        "manifest": result.manifest,
    }, None


def add_broadcast(record: dict, broadcast_s: float, charge: bool, on_thread_s: Optional[float] = None) -> None:
    """Complete a committed record on every rank: the broadcast's time (this rank's) joins
    ``commit_s``, and the commit joins ``stall_s`` where it is charged to this checkpoint (a
    commit waited for by the next save is that save's ``previous_s`` instead). A commit made in
    rank 0's commit process (``on_thread_s``: what the training thread spent on it, the gather and
    the broadcast) charges only that; ``commit_on_thread_s`` is what the training thread spent on
    the commit either way."""
    parts = dict(record["commit_parts_s"], broadcast_s=broadcast_s)
    record["commit_parts_s"] = parts
    record["commit_s"] = sum(parts.values())
    record["commit_background"] = on_thread_s is not None
    record["commit_on_thread_s"] = record["commit_s"] if on_thread_s is None else on_thread_s
    if charge:
        record["stall_s"] += record["commit_s"] if on_thread_s is None else on_thread_s
