"""The three ways of writing a checkpoint (``checkpoint.mode``); each starts a write, reports
when this rank's part is done, and finalizes.

- ``async`` (default): NVRx ``FileSystemWriterAsync`` + ``AsyncCallsQueue`` (persistent worker).
  The loop stalls only to stage the state into reused host buffers and plan the write; the
  worker writes a standard DCP checkpoint; the loop finalizes it at a later step.
- ``torch-async``: NVRx ``TorchAsyncCheckpoint``: ``async_save`` of each rank's shard (one file
  per rank), committed after ``finalize_async_save``. Resumes only at the same world size.
- ``sync``: plain ``torch.distributed.checkpoint.save``; the baseline.

Everything NVRx-specific they call is in :mod:`.nvrx`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch.distributed.checkpoint as dcp

from . import nvrx
from .staging import StateStager
from .state import CheckpointState, to_local

# Test and drill hook: the async writer of this rank dies right after writing step N's data,
# before the save is finalized (see nvrx.worker_write).
FAULT_WRITER_EXIT_ENV = "RESILIENT_FSDP_FAULT_WRITER_EXIT_AT_STEP"


class Engine:
    """One way of writing a checkpoint. ``start`` blocks the loop; the rest happens later."""

    mode = ""
    reshardable = True

    def start(self, state: CheckpointState, partial_dir: Path, step: int) -> None:
        raise NotImplementedError

    def local_status(self) -> tuple[bool, Optional[str]]:
        """(this rank's write finished, its error if any); never blocks."""
        return True, None

    def finalize(self) -> None:
        """Collective, after every rank's write finished: write metadata (DCP) and clean up."""

    def drain(self, timeout_s: float = 120.0) -> None:
        """Rank-local: let a write left by a failed attempt finish, so an in-process restart can
        reuse this engine. That write stays an incomplete checkpoint; it is never committed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done, _ = self.local_status()
            if done:
                break
            time.sleep(0.05)
        self.forget()

    def forget(self) -> None:
        """Drop the plan of a save that will never be finalized."""

    def close(self, abort: bool = False) -> None:
        pass


class SyncEngine(Engine):
    mode = "sync"

    def start(self, state: CheckpointState, partial_dir: Path, step: int) -> None:
        dcp.save(state.state_dict(), checkpoint_id=str(partial_dir))


class AsyncEngine(Engine):
    """NVRx async DCP: ``FileSystemWriterAsync`` planned here, written by the persistent worker."""

    mode = "async"

    def __init__(self, thread_count: int):
        self.thread_count = thread_count
        self.queue = nvrx.make_calls_queue()
        nvrx.warm_up(self.queue)
        self.results_queue_ready = nvrx.start_results_queue()
        self.stager = StateStager()
        self.plan: Optional[tuple] = None
        self.error_path: Optional[str] = None

    def start(self, state: CheckpointState, partial_dir: Path, step: int) -> None:
        self.results_queue_ready.join()
        staged = self.stager.stage(state.state_dict())
        fault = os.environ.get(FAULT_WRITER_EXIT_ENV) == str(step)
        self.plan, self.error_path = nvrx.schedule_dcp_save(self.queue, staged, partial_dir, self.thread_count, fault)

    def local_status(self) -> tuple[bool, Optional[str]]:
        done, error = nvrx.poll_queue(self.queue)
        if done and error is None and self.error_path:
            error = nvrx.take_worker_error(self.error_path)
        return done, error

    def forget(self) -> None:
        self.plan = None

    def finalize(self) -> None:
        plan, self.plan = self.plan, None
        if plan is not None:
            nvrx.finalize_save(plan)

    def close(self, abort: bool = False) -> None:
        nvrx.close_queue(self.queue, abort=abort)
        self.stager.close()


class TorchAsyncEngine(Engine):
    """NVRx ``TorchAsyncCheckpoint``: each rank's shard through ``async_save`` into one file."""

    mode = "torch-async"
    reshardable = False

    def __init__(self, rank: int):
        self.rank = rank
        self.ckpt = nvrx.make_torch_async_checkpoint()
        nvrx.warm_up(nvrx.calls_queue_of(self.ckpt))
        self.stager = StateStager()

    def start(self, state: CheckpointState, partial_dir: Path, step: int) -> None:
        staged = self.stager.stage(to_local(state.state_dict()))
        nvrx.torch_async_save(self.ckpt, staged, partial_dir / f"rank{self.rank:05d}.pt")

    def local_status(self) -> tuple[bool, Optional[str]]:
        return nvrx.poll_queue(nvrx.calls_queue_of(self.ckpt), finalize=self.ckpt.finalize_async_save)

    def close(self, abort: bool = False) -> None:
        nvrx.close_queue(nvrx.calls_queue_of(self.ckpt), abort=abort)
        self.stager.close()


def build_engine(mode: str, rank: int, thread_count: int) -> Engine:
    if mode == "sync":
        return SyncEngine()
    if mode == "torch-async":
        return TorchAsyncEngine(rank)
    return AsyncEngine(thread_count)
