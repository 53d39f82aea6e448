"""Rank 0's commit of a checkpoint (:func:`run`), and the process it runs in between steps.

A commit unpickles and checks every rank's outcome (each rank pickled its own, so rank 0's
training thread only moves bytes), writes the engine's files (DCP's ``.metadata``), checks the
lease, writes the manifest and renames the directory (:func:`.store.commit`). A commit the ranks
wait for runs on the training thread; one found ready between steps runs in
:class:`CommitProcess` while training goes on (:class:`~.checkpointer.Checkpointer`). A commit it
does not finish leaves the checkpoint incomplete, never loaded, and swept later.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from . import store
from .lease import taken_over
from .writer import dcp_plan, fork_server

FAULT_MARKER = ".commit-stopped-by-fault"
"""In the checkpoint's directory: the process that commits it has stopped there for a fault."""
FAULT_STOP_S = 120.0

_PROCESS_METADATA: dict[str, Any] = {}
"""In the commit process: the global metadata of the plan in use, by key (one plan at a time)."""


@dataclass
class CommitJob:
    """One commit, everything it needs by value (it may be pickled to :class:`CommitProcess`)."""

    step: int
    where: str
    gathered: list[bytes]
    """Every rank's :class:`~.engines.LocalOutcome`, pickled by the rank."""
    manifest: dict
    """The manifest's fields known before the commit: identity, mode, world size, batch, versions."""
    started_unix: float
    """When the save started, for its ``write_s``."""
    lease_path: Optional[str] = None
    lease_holder: Optional[str] = None
    metadata_key: Optional[str] = None
    """The plan whose global metadata ``.metadata`` is made from; None: the engine writes none."""
    metadata: Any = None
    """That metadata; None when the commit process already holds it (:meth:`CommitProcess.holds`)."""
    error: Optional[str] = None
    """A failure found before the commit (the engine's metadata missing): the commit's failure."""
    fault: Optional[str] = None
    """``stop``: a ``sigkill-during-commit`` fault (``resilience.faults``) is to land inside this
    commit: once the engine's metadata is written the commit says so (:data:`FAULT_MARKER`, its
    process id) and waits, at most :data:`FAULT_STOP_S`, to be killed."""


@dataclass
class CommitResult:
    """What a commit came to: ``failed`` (rank, error) pairs when a rank's write failed, else
    ``error`` (an exception in the commit, ``lease_lost``: why the lease is not this job's), else
    the committed ``path``, its ``manifest`` and where the time went."""

    failed: list = field(default_factory=list)
    error: Optional[str] = None
    lease_lost: Optional[str] = None
    timed_out: bool = False
    """No result within the commit's deadline (``error`` says so): its process was killed."""
    path: Optional[str] = None
    manifest: Optional[dict] = None
    nbytes: int = 0
    write_s: float = 0.0
    finalize_s: float = 0.0
    manifest_s: float = 0.0
    total_s: float = 0.0
    pid: int = 0


def run(job: CommitJob) -> CommitResult:
    """Commit ``job``; never raises (a failure is in the result)."""
    t0 = time.perf_counter()
    result = CommitResult(pid=os.getpid())
    try:
        outcomes = [pickle.loads(b) for b in job.gathered]
        result.failed = [(o.rank, o.error) for o in outcomes if o.error]
        if result.failed:
            return result
        if job.error:
            result.error = job.error
            return result
        checksums = {}
        for o in outcomes:
            checksums.update({n: {**e, "writer": o.rank} for n, e in o.checksums.items()})
        t_finish = time.perf_counter()
        if job.metadata_key is not None:
            metadata = _metadata_for(job)
            sums = dcp_plan.write_metadata(Path(job.where), metadata, [o.results or [] for o in outcomes])
            checksums.update({n: {**e, "writer": 0} for n, e in sums.items()})
        if job.fault == "stop":
            _stop_for_fault(Path(job.where))
        t_finished = time.perf_counter()
        result.lease_lost = taken_over(Path(job.lease_path), job.lease_holder) if job.lease_path else None
        if result.lease_lost:
            return result
        result.nbytes = sum(e["bytes"] for e in checksums.values())
        result.write_s = time.time() - job.started_unix
        manifest = {
            **job.manifest,
            "bytes": result.nbytes,
            "write_s": result.write_s,
            "created_unix": time.time(),
            "checksums": checksums,
        }
        t_manifest = time.perf_counter()
        result.path = str(store.commit(Path(job.where), manifest))
        t_end = time.perf_counter()
        result.manifest = manifest
        result.finalize_s, result.manifest_s, result.total_s = t_finished - t_finish, t_end - t_manifest, t_end - t0
    except (Exception, BaseException) as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _stop_for_fault(where: Path) -> None:
    """Say where this commit stands (:data:`FAULT_MARKER`) and wait to be killed; a fault whose
    killer never came leaves the commit to go on, without the marker."""
    marker = where / FAULT_MARKER
    marker.write_text(str(os.getpid()))
    time.sleep(FAULT_STOP_S)
    marker.unlink(missing_ok=True)


def _metadata_for(job: CommitJob) -> Any:
    """The job's plan metadata: sent with it (kept for the next jobs of the plan) or kept."""
    if job.metadata is not None:
        _PROCESS_METADATA.clear()
        _PROCESS_METADATA[job.metadata_key] = job.metadata
        return job.metadata
    if job.metadata_key not in _PROCESS_METADATA:
        raise RuntimeError(f"the commit process does not hold the metadata of plan {job.metadata_key}")
    return _PROCESS_METADATA[job.metadata_key]


def _commit_process_started(rank_pid: int, given: Optional[fork_server.Inheritance]) -> None:
    """In the commit process, before its first job, as in a checkpoint writer: what it would have
    inherited from its rank (``given``: forked by the pod's fork server), no GPU, training's
    priority lowered, and an exit once the rank is gone (a commit it cuts short stays incomplete)."""
    from .writer.priority import lower_this_thread
    from .writer.worker import exit_when_orphaned, hide_gpus

    if given is not None:
        fork_server.take(given)
    hide_gpus()
    lower_this_thread()
    exit_when_orphaned(rank_pid)


class CommitProcess:
    """Rank 0's commit process: one at a time, started at the first commit handed to it,
    replaced when it dies.

    A process, not a thread: pickling holds the interpreter's lock for as long as a C call lasts,
    and seconds of it (about 4.9 s at 2,048 nodes under HSDP, ``goodput/costs``) would hold up the
    training thread's every kernel launch. The plan's global metadata is about as large as
    ``.metadata``, so it is sent once per plan (:attr:`CommitJob.metadata`) and kept by the
    process. Forked from the pod's writer fork server when there is one, else spawned; it never
    sees a GPU."""

    def __init__(self, fn: Callable[[CommitJob], CommitResult] = run) -> None:
        self.fn = fn  # what the process runs per job (:func:`run`; a module-level function)
        self.unavailable: Optional[str] = None  # why the last job was committed on the calling thread
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self._held: Optional[str] = None  # the plan metadata key the process holds

    def holds(self, metadata_key: Optional[str]) -> bool:
        return metadata_key is not None and self._pool is not None and self._held == metadata_key

    def submit(self, job: CommitJob) -> concurrent.futures.Future:
        """Hand ``job`` over (its metadata is sent only when the process lacks it); never waits.

        A process found dead between commits (its pool broken) is replaced once; where no process
        can be started at all, the job is committed here, on the calling thread, and
        :attr:`unavailable` says why (the caller says it)."""
        metadata, error = job.metadata, None
        for _ in range(2):
            try:
                return self._submit(job)
            except Exception as exc:  # noqa: BLE001 - a broken pool, or no process could start
                self.close(kill=True)
                job.metadata, error = metadata, exc
        self.unavailable = f"{type(error).__name__}: {error}"
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(self.fn(job))
        return future

    def _submit(self, job: CommitJob) -> concurrent.futures.Future:
        if self._pool is None:
            forked = fork_server.writer_context()
            given = fork_server.inheritance() if forked is not None else None
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=forked or multiprocessing.get_context("spawn"),
                initializer=_commit_process_started,
                initargs=(os.getpid(), given),
            )
            self._held = None
        if job.metadata_key is not None and self.holds(job.metadata_key):
            job.metadata = None
        future = self._pool.submit(self.fn, job)
        self._held = job.metadata_key if job.metadata_key is not None else self._held
        future.add_done_callback(self._forget_if_broken)
        return future

    def _forget_if_broken(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and isinstance(future.exception(), concurrent.futures.process.BrokenProcessPool):
            self._held = None

    def result(self, future: concurrent.futures.Future, timeout: Optional[float] = None) -> CommitResult:
        """``future``'s result; a process that died makes a failed result, and is replaced at the
        next :meth:`submit`. Raises ``TimeoutError`` when ``timeout`` passes first."""
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.process.BrokenProcessPool as exc:
            self.close(kill=True)
            return CommitResult(error=f"the commit process died ({exc})")

    def close(self, kill: bool = False) -> None:
        """Stop the process: after its commit in flight, or at once with ``kill``."""
        pool, self._pool, self._held = self._pool, None, None
        if pool is None:
            return
        if kill:
            # The standard library kills a pool's workers only from 3.14 (kill_workers).
            for proc in list(getattr(pool, "_processes", {}).values()):
                try:
                    proc.kill()
                except (OSError, AttributeError):
                    pass
        pool.shutdown(wait=not kill, cancel_futures=True)


class BackgroundCommit:
    """Rank 0's commit in flight in its :class:`CommitProcess`, given up ``timeout_s``
    (``checkpoint.write_timeout_s``) after it was handed over."""

    def __init__(self, timeout_s: float, process: Optional[CommitProcess] = None) -> None:
        self.timeout_s = timeout_s
        self.process = process or CommitProcess()
        self.future: Optional[concurrent.futures.Future] = None
        self.deadline = math.inf

    def submit(self, job: CommitJob) -> Optional[str]:
        """Hand ``job`` over; why no process could take it (it was committed on this thread), or None."""
        self.future = self.process.submit(job)
        self.deadline = time.monotonic() + self.timeout_s
        unavailable, self.process.unavailable = self.process.unavailable, None
        return unavailable

    def running(self) -> bool:
        """Still on the commit, within its deadline. Past the deadline it counts as finished, so
        that every rank learns the failure a hung commit is."""
        return self.future is not None and not self.future.done() and time.monotonic() < self.deadline

    def result(self) -> Optional[CommitResult]:
        """The commit's result (None: none in flight), waited for until its deadline at most; a
        commit that outlives it is a failed save (its process killed, the checkpoint left
        incomplete and swept later), never a wait without end."""
        future, self.future = self.future, None
        if future is None:
            return None
        try:
            return self.process.result(future, timeout=max(0.0, self.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self.process.close(kill=True)
            return CommitResult(
                error=f"rank 0's commit did not finish within checkpoint.write_timeout_s="
                f"{self.timeout_s:g}; its commit process was killed, and the next save "
                "commits in a new one",
                timed_out=True,
            )

    def close(self) -> bool:
        """Let a commit in flight finish (every write is whole; the commit is atomic), up to
        ``timeout_s``, then stop the process; False when the commit did not finish (killed)."""
        finished = True
        if self.future is not None:
            try:
                self.process.result(self.future, timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                self.process.close(kill=True)
                finished = False
            self.future = None
        self.process.close()
        return finished
