"""The three ways of writing a checkpoint (``checkpoint.mode``): :class:`Engine`, what every one
is, and ``sync``, ``async`` and ``torch-async``.

Each starts a write, reports when this rank's part is done, hands over this rank's outcome
(:class:`LocalOutcome`, never an exception, so that every rank reports the same failure), and on
the coordinator finishes. ``async`` (default) writes a standard DCP checkpoint through NVRx in the
rank's writer process; ``torch-async`` one ``torch.save`` file per rank (resumes only at the same
world size); ``sync`` is plain DCP, the baseline. Everything NVRx-specific is in :mod:`.writer`;
used by :class:`.checkpointer.Checkpointer` and :mod:`resilient_fsdp.train.resources`.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from . import integrity
from .staging import StagingJob, StateStager, structure
from .state import per_rank_path, to_local
from .writer import dcp_plan, decentralized_plan, handoff
from .writer.process import NVRX_VERSION, WriterProcess
from .writer.report import SaveReport
from .writer.worker import worker_torch_save_staged

__all__ = [
    "Engine",
    "LocalOutcome",
    "NVRX_VERSION",
    "build_engine",
    "PLAN_CACHED",
    "PLAN_DECENTRALIZED",
    "PLAN_FRESH",
    "PLAN_KEEP",
    "PLAN_NAMES",
]


@dataclass
class LocalOutcome:
    """What one rank hands over when its write finished: its error, or its DCP write results and
    the checksum of every file it wrote (by name)."""

    rank: int
    error: Optional[str] = None
    results: Optional[list] = None
    checksums: dict[str, dict] = field(default_factory=dict)


# The plans a save can use, agreed from every rank's vote (:meth:`Engine.vote`, :meth:`Engine.agree`):
# the plan cache's level, the minimum over the ranks; a save without a cached plan is planned by
# every rank alone (``PLAN_DECENTRALIZED``) when the ranks' digests of the state's global structure agree.
PLAN_FRESH, PLAN_KEEP, PLAN_CACHED, PLAN_DECENTRALIZED = 0, 1, 2, 3
# What a save's record says of its plan.
PLAN_NAMES = {
    PLAN_FRESH: "collective",
    PLAN_KEEP: "collective",
    PLAN_CACHED: "cached",
    PLAN_DECENTRALIZED: "decentralized",
}


class Engine:
    """One way of writing a checkpoint. ``start`` blocks the loop; the rest happens later."""

    mode = ""
    reshardable = True

    def __init__(self, rank: int):
        self.rank = rank
        self.notes: list[str] = []  # said by the checkpointer at the next step
        # Set when a write outlived checkpoint.write_timeout_s: its writer may never take another
        # write, so it is not waited for again and the engine is replaced, not reused.
        self.hung = False

    def attach(self, world_size: int, rank: int, kept_plan: Optional[Path] = None) -> None:
        """A new attempt (a new checkpointer, process group, model) starts using this engine as
        ``rank``; ``kept_plan``: where the pod keeps this rank's save plan between processes."""

    def warm(self, sd: dict) -> None:
        """Get ready, in the background, for saves of ``sd``'s structure (staging buffers)."""

    def vote(self, sd: dict) -> Any:
        """What this rank can do with its plan cache for ``sd``; the checkpointer gathers every
        rank's and passes what :meth:`agree` makes of them to :meth:`start`."""
        return PLAN_CACHED

    def agree(self, votes: list) -> int:
        """The plan every rank uses, from every rank's :meth:`vote` (the same on every rank):
        ``PLAN_CACHED`` (skip planning), ``PLAN_DECENTRALIZED`` (every rank plans alone),
        ``PLAN_KEEP`` (plan collectively, keep the cache), ``PLAN_FRESH``."""
        return min(votes)

    def start(
        self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH, fault: Optional[str] = None
    ) -> None:
        """Start writing ``sd`` into ``partial_dir`` (``fault``: what the writer is to do wrong,
        an injected ``writer-*`` fault). Returns once the loop may go on."""
        raise NotImplementedError

    def staged(self) -> float:
        """Wait until the live state may change again (the staging copy is done); the seconds
        waited. The trainer calls it before ``optimizer.step()``; not collective."""
        return 0.0

    def local_status(self) -> tuple[bool, Optional[str]]:
        """(this rank's write finished, why not if its writer died); never blocks."""
        return True, None

    def collect(self) -> LocalOutcome:
        """After every rank's write finished: this rank's outcome. Never raises."""
        return LocalOutcome(self.rank)

    def commit_metadata(self) -> Optional[tuple[str, Any]]:
        """Coordinator, after :meth:`collect`: what its commit makes the engine's own file from
        (DCP's global metadata, for ``.metadata``) and a key that stays the same while the plan
        does, so it is sent to the commit process once; None: the engine writes no file of its own."""
        return None

    def drain(self, timeout_s: float = 120.0) -> None:
        """Rank-local: let a write left by a failed attempt finish, so an in-process restart can
        reuse this engine. That write stays an incomplete checkpoint; it is never committed."""
        deadline = time.monotonic() + timeout_s
        while not self.hung and time.monotonic() < deadline:
            done, _ = self.local_status()
            if done:
                break
            time.sleep(0.05)
        self.forget()

    def forget(self) -> None:
        """Drop what is left of a save that will never be collected."""

    def abandon(self) -> None:
        """The write in flight ran out of time: drop it and mark the engine as hung."""
        self.hung = True
        self.forget()

    def close(self, abort: bool = False) -> None:
        pass

    def job_ended(self) -> None:
        """The job has ended: what the engine kept for a next process of the rank goes."""

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes


class SyncEngine(Engine):
    mode = "sync"

    def __init__(self, rank: int):
        super().__init__(rank)
        self.recorder = integrity.Recorder()
        self.error: Optional[str] = None

    def start(
        self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH, fault: Optional[str] = None
    ) -> None:
        writer = FileSystemWriter(str(partial_dir))
        writer.fs = integrity.HashingFileSystem(self.recorder)
        try:
            # DCP agrees on a failure itself: every rank raises the same exception here.
            dcp.save(sd, storage_writer=writer)
            self.error = None
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            self.error = f"{type(exc).__name__}: {exc}"

    def collect(self) -> LocalOutcome:
        sums = self.recorder.take(renames={".metadata.tmp": ".metadata"})
        return LocalOutcome(self.rank, self.error, None, sums)


class StagedEngine(Engine):
    """What ``async`` and ``torch-async`` share: the rank's writer process, started at construction
    in the background, and staging into a reused arena (:mod:`.arena`) that the writer receives once. A save in
    flight is its :class:`.writer.report.SaveReport` until it is collected. The tensors are copied
    while the next forward and backward run, and the trainer waits for the copy just before
    ``optimizer.step()`` (:meth:`Engine.staged`); the copy's helper thread then hands the write to
    the writer (:mod:`.writer.handoff`). Every file is checksummed while written (:mod:`.integrity`)."""

    torch_save = False

    def __init__(self, rank: int):
        super().__init__(rank)
        self.stager = StateStager()
        self.registry: Optional[handoff.Registry] = None
        self.job: Optional[StagingJob] = None
        self.report: Optional[SaveReport] = None
        self.dead: Optional[str] = None
        self.writer = WriterProcess(rank, torch_save=self.torch_save)

    def _stage(self, sd: Any, key: Optional[tuple] = None) -> Any:
        """``sd`` over the staging arena; None, with a failed job, when the arena cannot be made
        (host shared memory full or capped): the save fails on every rank, training goes on."""
        try:
            staged = self.stager.prepare(sd, key)
        except (OSError, RuntimeError) as exc:
            self.job = self.stager.failed(f"{type(exc).__name__}: {exc}")
            return None
        name = f"{os.getpid()}-{id(self):x}-{self.stager.generation}"
        if self.registry is None or self.registry.key != name:
            self.registry = handoff.Registry(name, self.stager.arena.bytes)
        return staged

    def _begin(self, token: str) -> tuple[Optional[str], SaveReport]:
        """A new save: (why the writer cannot take it, or None; its report)."""
        unavailable = self.writer.usable()
        self.notes += self.writer.notes
        self.writer.notes = []
        self.dead = None
        self.report = SaveReport.new(token, self.rank)
        return unavailable, self.report

    def warm(self, sd: Any) -> None:
        self.stager.allocate_in_background(sd)

    def staged(self) -> float:
        return self.job.wait() if self.job is not None else 0.0

    def local_status(self) -> tuple[bool, Optional[str]]:
        if self.job is not None and not self.job.done():
            return False, None  # still copying or handing over: nothing to poll yet
        done, error = self.writer.poll()
        self.dead = self.dead or error
        return done, error

    def _take(self) -> tuple[dict[str, dict], Optional[str], Optional[SaveReport]]:
        """The finished save's checksums, its first error (staging, or what the writer reported)
        and its report, which the caller discards once read."""
        job, self.job = self.job, None
        job_error = None
        if job is not None:
            job.join()
            job_error = job.error
        report, self.report = self.report, None
        sums, report_error = report.read() if report is not None else ({}, None)
        return sums, job_error or report_error, report

    def _failed(self) -> None:
        """After a failed save the writer may lack the buffers: send them again."""
        if self.registry is not None:
            self.registry.sent_to = None

    def drain(self, timeout_s: float = 120.0) -> None:
        """As :meth:`Engine.drain`; a write still running at the deadline is killed with its writer,
        and a new writer is started, so the next attempt does not queue behind it."""
        deadline = time.monotonic() + timeout_s
        while not self.hung and not self.local_status()[0]:
            if time.monotonic() > deadline:
                self.stager.wait()
                self.writer.restart()  # the new writer gets the buffers again
                break
            time.sleep(0.05)
        self.forget()

    def forget(self) -> None:
        self.stager.wait()  # a copy or hand-off still running finishes first
        self.job = None
        report, self.report = self.report, None
        if report is not None:
            report.discard()

    def close(self, abort: bool = False) -> None:
        self.stager.wait()
        self.writer.close(abort=abort)
        self.forget()
        self.stager.close()


class AsyncEngine(StagedEngine):
    """NVRx async DCP: ``FileSystemWriterAsync`` planned here (or by the staging thread, with a
    validated plan cache), written by the writer process."""

    mode = "async"

    def __init__(self, rank: int, thread_count: int, planning: str = "decentralized"):
        self.thread_count = thread_count
        super().__init__(rank)
        self.plans = dcp_plan.PlanCache()
        self.decentralized = planning == "decentralized"
        self.said_apart = False  # rank 0 said once that the ranks' structures differ
        self.world_size, self.plan_rank = 1, rank
        self.voted_key: Optional[tuple] = None
        self.save: Optional[dcp_plan.DcpSave] = None
        self.collected: Optional[dcp_plan.DcpSave] = None
        self._metadata_key: tuple[str, Any] = ("", None)  # the key of the plan metadata last committed

    def attach(self, world_size: int, rank: int, kept_plan: Optional[Path] = None) -> None:
        self.world_size, self.plan_rank = world_size, rank
        self.plans.attach(kept_plan, rank)  # the plan the pod kept for this rank, if any

    def vote(self, sd: dict) -> tuple[int, Optional[str]]:
        """(the plan cache's level, and without a validated cache the digest of ``sd``'s global
        structure when planning alone is allowed)."""
        self.voted_key = (structure(sd), self.world_size)
        if not self.plans.valid_for(self.voted_key):
            level = PLAN_FRESH
        else:
            level = PLAN_CACHED if self.plans.validated() else PLAN_KEEP
        digest = None
        if level < PLAN_CACHED and self.decentralized:
            digest = decentralized_plan.global_structure(sd, self.plan_rank, per_rank_path)
        return level, digest

    def agree(self, votes: list) -> int:
        level = min(v[0] for v in votes)
        digests = {v[1] for v in votes}
        if level < PLAN_CACHED and len(digests) == 1 and None not in digests:
            return PLAN_DECENTRALIZED
        if level < PLAN_CACHED and None not in digests and self.plan_rank == 0 and not self.said_apart:
            self.said_apart = True
            self.notes.append(
                f"the ranks' states differ in structure ({len(digests)} digests of "
                f"{len(votes)} ranks): saves of it are planned collectively, through rank 0"
            )
        return level

    def start(
        self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH, fault: Optional[str] = None
    ) -> None:
        unavailable, report = self._begin(token)
        key = self.voted_key if self.voted_key is not None else (structure(sd), self.world_size)
        self.voted_key = None
        self.save = None
        staged = self._stage(sd, key[0])
        if staged is None:
            return
        cache = self.plans.use(key, keep=plan in (PLAN_KEEP, PLAN_CACHED))
        plan_now = partial(dcp_plan.plan_dcp_save, staged, partial_dir, self.thread_count, report, self.registry, cache)
        # Planning gathers every rank's plan unless the cache is validated or each rank plans
        # alone: then it is done in the background with the rest; otherwise here, while every
        # rank is in this call.
        planned = None if plan in (PLAN_CACHED, PLAN_DECENTRALIZED) else plan_now()
        rank, world_size = self.plan_rank, self.world_size

        def schedule() -> None:  # on the staging thread, once the copy is done
            if unavailable:
                raise RuntimeError(unavailable)
            if plan == PLAN_DECENTRALIZED:  # this rank's plan, made alone: a validated cache from now on
                try:
                    alone = decentralized_plan.plan_save(
                        staged, rank, world_size, coordinator=rank == 0, per_rank_path=per_rank_path
                    )
                except Exception as exc:
                    # The same state would fail the same way: this process plans collectively from
                    # now on (its vote carries no digest), and this save fails once, named.
                    self.decentralized = False
                    raise RuntimeError(
                        f"planning this save alone failed ({type(exc).__name__}: {exc}); this "
                        "rank plans its saves collectively from the next one"
                    ) from exc
                dcp_plan.prefill(cache, alone)
            self.save = dcp_plan.schedule_dcp_save(
                self.writer, planned or plan_now(), self.registry, token, report, fault
            )
            note = self.plans.keep()  # once validated: for this rank's next process (off the loop)
            if note:
                self.notes.append(note)

        self.job = self.stager.start_copy(sd, schedule)

    def collect(self) -> LocalOutcome:
        save, self.save = self.save, None
        sums, error, report = self._take()
        results, retrieve_error = (None, None)
        if save is not None and not self.dead and error is None:
            results, retrieve_error = dcp_plan.collect_save(save)
        if report is not None:
            report.discard()
        if save is None:
            return LocalOutcome(self.rank, error or "no checkpoint write was in progress on this rank")
        error = error or self.dead or retrieve_error
        if error is None:
            error = dcp_plan.check_layout(results, sums)
        if error:
            self._failed()
        self.collected = None if error else save
        return LocalOutcome(self.rank, error, None if error else results, sums)

    def commit_metadata(self) -> Optional[tuple[str, Any]]:
        save, self.collected = self.collected, None
        metadata = save.plan[1] if save is not None else None
        if metadata is None:
            raise RuntimeError("no global metadata was planned for this save on the coordinator")
        if self._metadata_key[1] is not metadata:  # a validated plan cache gives the same object
            self._metadata_key = (uuid.uuid4().hex, metadata)
        return self._metadata_key

    def forget(self) -> None:
        super().forget()
        self.save, self.collected = None, None

    def job_ended(self) -> None:
        self.plans.remove_kept()


class TorchAsyncEngine(StagedEngine):
    """One ``torch.save`` file per rank, written by the writer of NVRx's ``TorchAsyncCheckpoint`` and
    fsynced before it reports completion."""

    mode = "torch-async"
    reshardable = False
    torch_save = True

    def __init__(self, rank: int):
        super().__init__(rank)
        self.name: Optional[str] = None  # the file this rank's save writes

    def start(
        self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH, fault: Optional[str] = None
    ) -> None:
        unavailable, report = self._begin(token)
        local = to_local(sd)
        self.name = f"rank{self.rank:05d}.pt"
        staged = self._stage(local)
        if staged is None:
            return
        registry = self.registry
        path = partial_dir / self.name

        def schedule() -> None:  # on the staging thread, once the copy is done
            if unavailable:
                raise RuntimeError(unavailable)
            buffers = registry.payload_for(self.writer.pid)
            self.writer.send(
                report,
                buffers,
                partial(worker_torch_save_staged, report, fault, registry.key),
                (registry.pack(staged), str(path)),
            )
            registry.sent_to = self.writer.pid

        self.job = self.stager.start_copy(local, schedule)

    def collect(self) -> LocalOutcome:
        name, self.name = self.name, None
        if name is None:
            return LocalOutcome(self.rank, "no checkpoint write was in progress on this rank")
        sums, error, report = self._take()
        if report is not None:
            report.discard()
        error = error or self.dead
        if error is None and name not in sums:
            error = f"no checksum was recorded for {name}"
        if error:
            self._failed()
        return LocalOutcome(self.rank, error, None, sums)

    def forget(self) -> None:
        super().forget()
        self.name = None


def build_engine(mode: str, rank: int, thread_count: int, planning: str = "decentralized") -> Engine:
    if mode == "sync":
        return SyncEngine(rank)
    if mode == "torch-async":
        return TorchAsyncEngine(rank)
    return AsyncEngine(rank, thread_count, planning)
