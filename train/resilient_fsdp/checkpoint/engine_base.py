"""What every checkpoint engine (:mod:`.engines`) is: :class:`Engine`, the outcome a rank hands over
(:class:`LocalOutcome`), the plan-cache votes, the writer fault hook of tests and drills, and the
check that write results match the files written."""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# Test and drill hook: ``KIND@STEP[:rank=R]`` makes the async writer of rank R (every rank without
# ``:rank=``) fail while writing step STEP's checkpoint. KIND: ``exit`` (the writer dies after
# writing the data, before the save is finalized), ``raise`` (the write fails), ``hang`` (it never
# finishes), ``slow=SECONDS`` (it takes that much longer). A bare ``STEP`` means ``exit@STEP``.
FAULT_WRITER_ENV = "RESILIENT_FSDP_FAULT_WRITER"
FAULT_WRITER_EXIT_ENV = "RESILIENT_FSDP_FAULT_WRITER_EXIT_AT_STEP"  # the older spelling: exit@STEP
_FAULT = re.compile(r"^(?:(exit|raise|hang|slow=\d+(?:\.\d+)?)@)?(\d+)(?::rank=(\d+))?$")


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


# Plan-cache votes, agreed as the minimum over the ranks (:meth:`Engine.vote`).
PLAN_FRESH, PLAN_KEEP, PLAN_CACHED = 0, 1, 2


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

    def attach(self, world_size: int) -> None:
        """A new attempt (a new checkpointer, process group, model) starts using this engine."""

    def warm(self, sd: dict) -> None:
        """Get ready, in the background, for saves of ``sd``'s structure (staging buffers)."""

    def vote(self, sd: dict) -> int:
        """What this rank can do with its plan cache for ``sd``: ``PLAN_CACHED`` (skip planning),
        ``PLAN_KEEP`` (plan, keep the cache), ``PLAN_FRESH``. The checkpointer passes the minimum
        over the ranks to :meth:`start`."""
        return PLAN_CACHED

    def start(self, sd: dict, partial_dir: Path, step: int, token: str, plan: int = PLAN_FRESH) -> None:
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
