"""The three ways of writing a checkpoint (``checkpoint.mode``); each starts a write, reports
when this rank's part is done, hands over this rank's outcome, and (on the coordinator) finishes.

- ``async`` (default): NVRx ``FileSystemWriterAsync`` + ``AsyncCallsQueue`` (persistent worker).
  The save takes the state's structure and non-tensor values, plans (with a plan cache; from the
  third save of a structure on, in the background) and returns; the tensors are copied into reused
  host buffers while the next forward and backward run, and the trainer waits for that copy just
  before ``optimizer.step()`` (:meth:`Engine.staged`). The copy's helper thread then hands the
  write to the worker (:mod:`.handoff`: buffers once, references per save); the worker writes a
  standard DCP checkpoint; the loop collects it at a later step.
- ``torch-async``: the same staging; NVRx's persistent worker writes each rank's shard with
  ``torch.save`` (one file per rank), fsynced before it reports completion. Resumes only at the
  same world size.
- ``sync``: plain ``torch.distributed.checkpoint.save``; the baseline.

Every file is checksummed while it is written (:mod:`.integrity`). Nothing here raises for a
failed write: :meth:`Engine.collect` returns it in a :class:`LocalOutcome`, which the checkpointer
gathers so that every rank reports the same failure. Everything NVRx-specific is in :mod:`.nvrx`
and :mod:`.nvrx_dcp`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from . import handoff, integrity, nvrx, nvrx_dcp
from .engine_base import (PLAN_CACHED, PLAN_FRESH, PLAN_KEEP, Engine, LocalOutcome, _discard, check_layout,
                          writer_fault)
from .staging import StagingJob, StateStager, local_tensors, structure
from .state import to_local

__all__ = ["Engine", "LocalOutcome", "build_engine", "writer_fault", "PLAN_CACHED", "PLAN_FRESH", "PLAN_KEEP"]


class SyncEngine(Engine):
    mode = "sync"

    def __init__(self, rank: int):
        super().__init__(rank)
        self.recorder = integrity.Recorder()
        self.error: Optional[str] = None

    def start(self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH) -> None:
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
    """What ``async`` and ``torch-async`` share: the persistent NVRx worker, started at construction
    in the background, and staging into reused buffers that the worker receives once."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.stager = StateStager()
        self.registry: Optional[handoff.Registry] = None
        self.job: Optional[StagingJob] = None
        self.dead: Optional[str] = None
        self.starting = nvrx.start_worker(self.calls_queue(), rank)

    def calls_queue(self) -> Any:
        raise NotImplementedError

    def replace_calls_queue(self) -> None:
        raise NotImplementedError

    def _worker(self) -> Any:
        """The calls queue, once its worker was started; a worker that died is replaced (said).
        Raises what kept a worker from starting (the caller records it as the save's error)."""
        self.starting.join()
        if self.starting.error:
            error = self.starting.error
            nvrx.close_queue(self.calls_queue(), abort=True)
            self.replace_calls_queue()
            self.starting = nvrx.start_worker(self.calls_queue(), self.rank)  # tried again at the next save
            raise RuntimeError(error)
        code = nvrx.worker_died(self.calls_queue())
        if code is not None:
            self.notes.append(f"rank {self.rank}: the checkpoint writer process had exited (code {code}) since "
                              "the last save; a new one is started")
            nvrx.close_queue(self.calls_queue(), abort=True)
            self.replace_calls_queue()
            self.starting = nvrx.start_worker(self.calls_queue(), self.rank)
            self.starting.join()
        return self.calls_queue()

    def _worker_or_error(self) -> tuple[Any, Optional[str]]:
        try:
            return self._worker(), None
        except RuntimeError as exc:  # failed by every rank together, at the commit
            return self.calls_queue(), str(exc)

    def _stage(self, sd: Any, key: Optional[tuple] = None) -> Any:
        staged = self.stager.prepare(sd, key)
        name = f"{os.getpid()}-{id(self):x}-{self.stager.generation}"
        if self.registry is None or self.registry.key != name:
            self.registry = handoff.Registry(name, local_tensors(self.stager.buffers))
        return staged

    def warm(self, sd: Any) -> None:
        self.stager.allocate_in_background(sd)

    def staged(self) -> float:
        return self.job.wait() if self.job is not None else 0.0

    def local_status(self) -> tuple[bool, Optional[str]]:
        if self.job is not None and not self.job.done():
            return False, None  # still copying or handing over: nothing to poll yet
        done, error = nvrx.poll_queue(self.calls_queue(), finalize=self.finalize_fn())
        self.dead = self.dead or error
        return done, error

    def finalize_fn(self) -> Optional[Callable[..., Any]]:
        return None

    def _job_error(self) -> Optional[str]:
        job, self.job = self.job, None
        if job is not None:
            job.join()
            if job.error and self.registry is not None:
                self.registry.sent_to = None  # the worker may lack the buffers: send them again
            return job.error
        return None

    def drain(self, timeout_s: float = 120.0) -> None:
        """As :meth:`Engine.drain`; a write still running at the deadline is killed with its worker,
        and a new worker is started, so the next attempt does not queue behind it."""
        deadline = time.monotonic() + timeout_s
        while not self.hung and not self.local_status()[0]:
            if time.monotonic() > deadline:
                self.stager.wait()
                nvrx.close_queue(self.calls_queue(), abort=True)
                self.replace_calls_queue()
                self.starting = nvrx.start_worker(self.calls_queue(), self.rank)  # gets the buffers again
                break
            time.sleep(0.05)
        self.forget()

    def forget(self) -> None:
        self.stager.wait()  # a copy or hand-off still running finishes first
        self.job = None

    def close(self, abort: bool = False) -> None:
        self.starting.join()
        self.stager.wait()
        nvrx.close_queue(self.calls_queue(), abort=abort)
        self.forget()
        self.stager.close()


class AsyncEngine(StagedEngine):
    """NVRx async DCP: ``FileSystemWriterAsync`` planned here (or by the staging thread, with a
    validated plan cache), written by the persistent worker."""

    mode = "async"

    def __init__(self, rank: int, thread_count: int):
        self.thread_count = thread_count
        self.queue = nvrx.make_calls_queue()
        super().__init__(rank)
        self.plans = nvrx_dcp.PlanCache()
        self.world_size = 1
        self.voted_key: Optional[tuple] = None
        self.save: Optional[nvrx_dcp.DcpSave] = None
        self.collected: Optional[nvrx_dcp.DcpSave] = None
        self.channel: Optional[str] = None

    def calls_queue(self) -> Any:
        return self.queue

    def replace_calls_queue(self) -> None:
        self.queue = nvrx.make_calls_queue()

    def attach(self, world_size: int) -> None:
        self.world_size = world_size
        self.plans.forget()  # a new process group: plans are made again

    def vote(self, sd: dict) -> int:
        self.voted_key = (structure(sd), self.world_size)
        if not self.plans.valid_for(self.voted_key):
            return PLAN_FRESH
        return PLAN_CACHED if self.plans.validated() else PLAN_KEEP

    def start(self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH) -> None:
        queue, unavailable = self._worker_or_error()
        key = self.voted_key if self.voted_key is not None else (structure(sd), self.world_size)
        self.voted_key = None
        staged = self._stage(sd, key[0])
        registry, channel = self.registry, integrity.new_channel(token, self.rank)
        fault = writer_fault(step, self.rank)
        cache = self.plans.use(key, keep=plan >= PLAN_KEEP)
        self.dead, self.save = None, None

        def schedule(planned: tuple) -> None:
            if unavailable:
                raise RuntimeError(unavailable)
            self.save = nvrx_dcp.schedule_dcp_save(queue, planned, registry, token, channel, fault)

        if plan == PLAN_CACHED:  # no collective left in planning: all of it off the loop
            then = lambda: schedule(nvrx_dcp.plan_dcp_save(staged, partial_dir, self.thread_count, channel,  # noqa: E731
                                                           registry, cache))
        else:  # planning gathers every rank's plan: here, while every rank is in this call
            planned = nvrx_dcp.plan_dcp_save(staged, partial_dir, self.thread_count, channel, registry, cache)
            then = lambda: schedule(planned)  # noqa: E731
        self.channel = channel
        self.job = self.stager.start_copy(sd, then)

    def collect(self) -> LocalOutcome:
        job_error = self._job_error()
        save, self.save = self.save, None
        channel, self.channel = self.channel, None
        sums, error = integrity.read_channel(channel) if channel else ({}, None)
        if error:
            error = integrity.error_summary(error)
        results, retrieve_error = (None, None)
        if save is not None and not self.dead:
            results, retrieve_error = nvrx_dcp.collect_save(save)
        _discard(channel)
        if save is None:
            return LocalOutcome(self.rank, job_error or error or "no checkpoint write was in progress on this rank")
        error = job_error or error or self.dead or retrieve_error
        if error is None:
            error = check_layout(results, sums)
        if error and self.registry is not None:
            self.registry.sent_to = None
        self.collected = None if error else save
        return LocalOutcome(self.rank, error, None if error else results, sums)

    def finish(self, outcomes: list[LocalOutcome]) -> dict[str, dict]:
        save, self.collected = self.collected, None
        return nvrx_dcp.write_dcp_metadata(save, [o.results or [] for o in outcomes], integrity.Recorder())

    def forget(self) -> None:
        super().forget()
        self.save, self.collected = None, None
        channel, self.channel = self.channel, None
        _discard(channel)


class TorchAsyncEngine(StagedEngine):
    """One ``torch.save`` file per rank, written by the persistent worker of NVRx's
    ``TorchAsyncCheckpoint``."""

    mode = "torch-async"
    reshardable = False

    def __init__(self, rank: int):
        self.ckpt = nvrx.make_torch_async_checkpoint()
        super().__init__(rank)
        self.pending: Optional[tuple[str, str]] = None  # (channel, file name)

    def calls_queue(self) -> Any:
        return nvrx.calls_queue_of(self.ckpt)

    def replace_calls_queue(self) -> None:
        nvrx.set_calls_queue(self.ckpt, nvrx.make_calls_queue())

    def finalize_fn(self) -> Optional[Callable[..., Any]]:
        return self.ckpt.finalize_async_save

    def start(self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH) -> None:
        _, unavailable = self._worker_or_error()
        local = to_local(sd)
        staged = self._stage(local)
        registry, channel = self.registry, integrity.new_channel(token, self.rank)
        name = f"rank{self.rank:05d}.pt"
        fault = writer_fault(step, self.rank)
        self.dead = None
        self.pending = (channel, name)
        def schedule() -> None:
            if unavailable:
                raise RuntimeError(unavailable)
            nvrx.torch_async_save(self.ckpt, registry, staged, partial_dir / name, channel, fault)

        self.job = self.stager.start_copy(local, schedule)

    def collect(self) -> LocalOutcome:
        job_error = self._job_error()
        pending, self.pending = self.pending, None
        if pending is None:
            return LocalOutcome(self.rank, "no checkpoint write was in progress on this rank")
        channel, name = pending
        sums, error = integrity.read_channel(channel)
        _discard(channel)
        error = job_error or (integrity.error_summary(error) if error else self.dead)
        if error is None and name not in sums:
            error = f"no checksum was recorded for {name}"
        if error and self.registry is not None:
            self.registry.sent_to = None
        return LocalOutcome(self.rank, error, None, sums)

    def forget(self) -> None:
        super().forget()
        pending, self.pending = self.pending, None
        if pending is not None:
            _discard(pending[0])


def build_engine(mode: str, rank: int, thread_count: int) -> Engine:
    if mode == "sync":
        return SyncEngine(rank)
    if mode == "torch-async":
        return TorchAsyncEngine(rank)
    return AsyncEngine(rank, thread_count)
