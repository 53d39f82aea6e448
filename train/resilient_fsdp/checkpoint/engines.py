"""The three ways of writing a checkpoint (``checkpoint.mode``); each starts a write, reports
when this rank's part is done, hands over this rank's outcome, and (on the coordinator) finishes.

- ``async`` (default): NVRx ``FileSystemWriterAsync`` + ``AsyncCallsQueue`` (persistent worker).
  The loop stalls only to stage the state into reused host buffers and plan the write; the
  worker writes a standard DCP checkpoint; the loop collects it at a later step.
- ``torch-async``: NVRx's persistent worker writes each rank's shard with ``torch.save`` (one file
  per rank), fsynced before it reports completion. Resumes only at the same world size.
- ``sync``: plain ``torch.distributed.checkpoint.save``; the baseline.

Every file is checksummed while it is written (:mod:`.integrity`). Nothing here raises for a
failed write: :meth:`Engine.collect` returns it in a :class:`LocalOutcome`, which the checkpointer
gathers so that every rank reports the same failure. Everything NVRx-specific is in :mod:`.nvrx`.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from . import integrity, nvrx
from .staging import StateStager
from .state import CheckpointState, to_local

# Test and drill hook: ``KIND@STEP[:rank=R]`` makes the async writer of rank R (every rank without
# ``:rank=``) fail while writing step STEP's checkpoint. KIND: ``exit`` (the writer dies after
# writing the data, before the save is finalized), ``raise`` (the write fails), ``hang`` (it never
# finishes). A bare ``STEP`` means ``exit@STEP``.
FAULT_WRITER_ENV = "RESILIENT_FSDP_FAULT_WRITER"
FAULT_WRITER_EXIT_ENV = "RESILIENT_FSDP_FAULT_WRITER_EXIT_AT_STEP"  # the older spelling: exit@STEP
_FAULT = re.compile(r"^(?:(exit|raise|hang)@)?(\d+)(?::rank=(\d+))?$")


def writer_fault(step: int, rank: int) -> Optional[str]:
    for raw in (os.environ.get(FAULT_WRITER_ENV, ""), os.environ.get(FAULT_WRITER_EXIT_ENV, "")):
        m = _FAULT.match(raw.strip())
        if m and int(m.group(2)) == step and (m.group(3) is None or int(m.group(3)) == rank):
            return m.group(1) or "exit"
    return None


@dataclass
class LocalOutcome:
    """What one rank hands over when its write finished: its error, or its DCP write results and
    the checksum of every file it wrote (by name)."""

    rank: int
    error: Optional[str] = None
    results: Optional[list] = None
    checksums: dict[str, dict] = field(default_factory=dict)


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

    def start(self, state: CheckpointState, partial_dir: Path, step: int, token: str) -> None:
        raise NotImplementedError

    def local_status(self) -> tuple[bool, Optional[str]]:
        """(this rank's write finished, why not if its writer died); never blocks."""
        return True, None

    def collect(self) -> LocalOutcome:
        """After every rank's write finished: this rank's outcome. Never raises."""
        return LocalOutcome(self.rank)

    def finish(self, outcomes: list[LocalOutcome]) -> dict[str, dict]:
        """Coordinator, every rank's outcome in hand and none failed: write what only it writes
        (DCP's ``.metadata``) and return the checksums of those files. May raise."""
        return {}

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

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes


def _discard(channel: Optional[str]) -> None:
    if channel:
        shutil.rmtree(channel, ignore_errors=True)


def check_layout(results: list, checksums: dict[str, dict]) -> Optional[str]:
    """Every file the write results point into must have a checksum and end exactly where the
    last item written into it ends: results of another save would not."""
    ends: dict[str, int] = {}
    for r in results:
        info = r.storage_data
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if name not in checksums:
            return f"no checksum was recorded for {name} (its writer bypassed the hashing stream)"
        if checksums[name]["bytes"] != end:
            return (f"the write results do not match {name}: its items end at byte {end} but "
                    f"{checksums[name]['bytes']} bytes were written")
    return None


class SyncEngine(Engine):
    mode = "sync"

    def __init__(self, rank: int):
        super().__init__(rank)
        self.recorder = integrity.Recorder()
        self.error: Optional[str] = None

    def start(self, state: CheckpointState, partial_dir: Path, step: int, token: str) -> None:
        writer = FileSystemWriter(str(partial_dir))
        writer.fs = integrity.HashingFileSystem(self.recorder)
        try:
            # DCP agrees on a failure itself: every rank raises the same exception here.
            dcp.save(state.state_dict(), storage_writer=writer)
            self.error = None
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            self.error = f"{type(exc).__name__}: {exc}"

    def collect(self) -> LocalOutcome:
        sums = self.recorder.take(renames={".metadata.tmp": ".metadata"})
        return LocalOutcome(self.rank, self.error, None, sums)


class AsyncEngine(Engine):
    """NVRx async DCP: ``FileSystemWriterAsync`` planned here, written by the persistent worker."""

    mode = "async"

    def __init__(self, rank: int, thread_count: int):
        super().__init__(rank)
        self.thread_count = thread_count
        self.queue = nvrx.make_calls_queue()
        nvrx.warm_up(self.queue)
        self.results_queue_ready = nvrx.start_results_queue()
        self.stager = StateStager()
        self.save: Optional[nvrx.DcpSave] = None
        self.collected: Optional[nvrx.DcpSave] = None
        self.dead: Optional[str] = None

    def start(self, state: CheckpointState, partial_dir: Path, step: int, token: str) -> None:
        self.results_queue_ready.join()
        code = nvrx.worker_died(self.queue)
        if code is not None:
            self.notes.append(f"rank {self.rank}: the checkpoint writer process had exited (code {code}) since "
                              "the last save; a new one is started")
            nvrx.close_queue(self.queue, abort=True)
            self.queue = nvrx.make_calls_queue()
        staged = self.stager.stage(state.state_dict())
        channel = integrity.new_channel(token, self.rank)
        self.dead = None
        self.save = nvrx.schedule_dcp_save(self.queue, staged, partial_dir, self.thread_count, token, channel,
                                           writer_fault(step, self.rank))

    def local_status(self) -> tuple[bool, Optional[str]]:
        done, error = nvrx.poll_queue(self.queue)
        self.dead = self.dead or error
        return done, error

    def collect(self) -> LocalOutcome:
        save, self.save = self.save, None
        if save is None:
            return LocalOutcome(self.rank, "no checkpoint write was in progress on this rank")
        sums, error = integrity.read_channel(save.channel)
        _discard(save.channel)
        if error:
            error = integrity.error_summary(error)
        results, retrieve_error = nvrx.collect_save(save) if not self.dead else (None, None)
        error = error or self.dead or retrieve_error
        if error is None:
            error = check_layout(results, sums)
        self.collected = None if error else save
        return LocalOutcome(self.rank, error, None if error else results, sums)

    def finish(self, outcomes: list[LocalOutcome]) -> dict[str, dict]:
        save, self.collected = self.collected, None
        return nvrx.write_dcp_metadata(save, [o.results or [] for o in outcomes], integrity.Recorder())

    def forget(self) -> None:
        save, self.save, self.collected = self.save, None, None
        if save is not None:
            _discard(save.channel)
        if not self.queue.get_num_unfinalized_calls():
            nvrx.drop_stale_results()

    def close(self, abort: bool = False) -> None:
        nvrx.close_queue(self.queue, abort=abort)
        self.forget()
        self.stager.close()


class TorchAsyncEngine(Engine):
    """One ``torch.save`` file per rank, written by the persistent worker of NVRx's
    ``TorchAsyncCheckpoint``."""

    mode = "torch-async"
    reshardable = False

    def __init__(self, rank: int):
        super().__init__(rank)
        self.ckpt = nvrx.make_torch_async_checkpoint()
        nvrx.warm_up(nvrx.calls_queue_of(self.ckpt))
        self.stager = StateStager()
        self.pending: Optional[tuple[str, str]] = None  # (channel, file name)
        self.dead: Optional[str] = None

    def start(self, state: CheckpointState, partial_dir: Path, step: int, token: str) -> None:
        code = nvrx.worker_died(nvrx.calls_queue_of(self.ckpt))
        if code is not None:
            self.notes.append(f"rank {self.rank}: the checkpoint writer process had exited (code {code}) since "
                              "the last save; a new one is started")
            nvrx.close_queue(nvrx.calls_queue_of(self.ckpt), abort=True)
            nvrx.set_calls_queue(self.ckpt, nvrx.make_calls_queue())
        staged = self.stager.stage(to_local(state.state_dict()))
        channel = integrity.new_channel(token, self.rank)
        name = f"rank{self.rank:05d}.pt"
        self.dead = None
        self.pending = (channel, name)
        nvrx.torch_async_save(self.ckpt, staged, partial_dir / name, channel, writer_fault(step, self.rank))

    def local_status(self) -> tuple[bool, Optional[str]]:
        done, error = nvrx.poll_queue(nvrx.calls_queue_of(self.ckpt), finalize=self.ckpt.finalize_async_save)
        self.dead = self.dead or error
        return done, error

    def collect(self) -> LocalOutcome:
        pending, self.pending = self.pending, None
        if pending is None:
            return LocalOutcome(self.rank, "no checkpoint write was in progress on this rank")
        channel, name = pending
        sums, error = integrity.read_channel(channel)
        _discard(channel)
        error = integrity.error_summary(error) if error else self.dead
        if error is None and name not in sums:
            error = f"no checksum was recorded for {name}"
        return LocalOutcome(self.rank, error, None, sums)

    def forget(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            _discard(pending[0])

    def close(self, abort: bool = False) -> None:
        nvrx.close_queue(nvrx.calls_queue_of(self.ckpt), abort=abort)
        self.forget()
        self.stager.close()


def build_engine(mode: str, rank: int, thread_count: int) -> Engine:
    if mode == "sync":
        return SyncEngine(rank)
    if mode == "torch-async":
        return TorchAsyncEngine(rank)
    return AsyncEngine(rank, thread_count)
