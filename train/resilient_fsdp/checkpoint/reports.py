"""What the checkpointer says in the run's log: committed checkpoints, memory saves and
replication, S3 uploads.

Used by :class:`.checkpointer.Checkpointer`; the log (:class:`RunLog`) is rank 0's, and what one rank
alone sees goes to its stderr (:func:`say_any_rank`).
"""

from __future__ import annotations

import sys
import time
from typing import Optional, Protocol

from .group import RankGroup
from .memory.tier import MemoryTier
from .s3.uploader import Uploader


class RunLog(Protocol):
    """Where the checkpointer reports: progress lines and ``metrics.jsonl`` records (rank 0's)."""

    def info(self, message: str) -> None: ...

    def event(self, record: dict) -> None: ...


class SilentLog:
    """A :class:`RunLog` that reports nothing (benchmarks, probes)."""

    def info(self, message: str) -> None:
        pass

    def event(self, record: dict) -> None:
        pass


def say_any_rank(message: str) -> None:
    print(f"[resilient-fsdp] {message}", file=sys.stderr, flush=True)


def committed(record: Optional[dict], log: RunLog) -> None:
    """A committed checkpoint's record and line (nothing for None)."""
    if record is None:
        return
    log.event({"event": "checkpoint", "t": time.time(), **record})
    log.info(
        f"checkpoint step {record['step']} committed ({record['mode']}): stall "
        f"{record['stall_s'] * 1000:.1f} ms, write {record['write_s']:.2f} s, "
        f"{record['bytes'] / 1e6:.1f} MB -> {record['path']}"
    )


def memory_records(memory: Optional[MemoryTier], group: RankGroup, log: RunLog) -> None:
    """Rank 0 records its memory saves and replicas sent; any rank says one that failed
    (training goes on)."""
    if memory is None:
        return
    for record in memory.poll():
        if group.is_coordinator:
            log.event(record)
        if record["error"] and record["event"] == "memory_replica":
            say_any_rank(
                f"rank {group.rank}: warning: memory replication stopped ({record['error']}); "
                "this attempt's newer snapshots have no replica on another pod, so a lost pod "
                "resumes from the durable checkpoint; the next restart makes it again"
            )
        elif record["error"]:
            say_any_rank(
                f"rank {group.rank}: warning: memory checkpoint of step {record['step']} "
                f"failed ({record['error']}); the previous one stays, training goes on"
            )


def uploads(uploader: Optional[Uploader], log: RunLog) -> None:
    """What the S3 uploader did since the last call."""
    if uploader is not None:
        for event, message in uploader.take_events():
            log.event(event)
            log.info(message)


class ReplicationHealth:
    """How many ranks' memory replication has stopped, as last agreed (the summed votes)."""

    def __init__(self) -> None:
        self.stopped = 0

    def update(self, stopped: int, step: int, coordinator: bool, log: RunLog) -> None:
        """Rank 0 records each change (a ``memory_replication`` record, served as the
        ``memory_replication_stopped_ranks`` metric) and says it: snapshots taken since have no
        replica, so a lost pod's ranks resume from the durable checkpoint."""
        if stopped == self.stopped:
            return
        self.stopped = stopped
        if coordinator:
            log.event({"event": "memory_replication", "t": time.time(), "step": step, "stopped_ranks": stopped})
            if stopped:
                log.info(
                    f"warning: memory replication has stopped on {stopped} rank(s) (each rank's log says why); "
                    "a lost pod's ranks resume from the durable checkpoint until the next restart makes it again"
                )
