"""Failed saves: why one failed (its cause), how many failed in a row, and what a full volume says.

A failed periodic save is not a failed job: the checkpointer reports it and the next due save
tries again, until ``checkpoint.max_consecutive_failures`` saves in a row failed (:class:`FailureStreak`).
Every rank sees the same failures in the same order (the checkpointer broadcasts them), so every
rank's streak has the same length and every rank takes the same branch.
"""

from __future__ import annotations

import errno
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .store import CheckpointError

# Causes of a failed save, as the log and the ``checkpoint_failed`` records name them.
WRITER = "writer"  # a rank's writer failed (raised, died, could not write a file)
TIMEOUT = "write_timeout"  # a write outlived checkpoint.write_timeout_s
FINALIZE = "finalize"  # rank 0 could not write the metadata or commit
MKDIR = "mkdir"  # rank 0 could not create the checkpoint's directory
VOLUME_FULL = "volume_full"  # ENOSPC in any of the above
LEASE = "lease_lost"  # another job took checkpoint.dir: never retried

_ENOSPC_TEXT = ("No space left on device", f"[Errno {errno.ENOSPC}]")


class SaveFailed(CheckpointError):
    """A save that failed on every rank, with its ``cause`` (one of the names above). ``fatal``:
    it ends the attempt (the lease is lost, ``checkpoint.max_consecutive_failures`` saves failed in
    a row, or the save that ends the run failed). ``permanent``: no restart fixes it either, so no
    layer retries it (:func:`resilient_fsdp.resilience.exit_codes.is_configuration_failure`): every
    fatal failure but a graceful stop's, whose restart resumes from the newest committed checkpoint."""

    def __init__(
        self,
        message: str,
        cause: str,
        step: Optional[int] = None,
        fatal: bool = False,
        permanent: Optional[bool] = None,
    ):
        super().__init__(message)
        self.cause, self.step, self.fatal = cause, step, fatal
        self.permanent = fatal if permanent is None else permanent


@dataclass
class Failure:
    """What rank 0 broadcasts about a failed save (every rank raises it as :class:`SaveFailed`)."""

    message: str
    cause: str
    step: Optional[int] = None
    fatal: bool = False

    def error(self) -> SaveFailed:
        return SaveFailed(self.message, self.cause, self.step, self.fatal)


def is_volume_full(error: object) -> bool:
    """An ``OSError`` with ENOSPC, or a writer's error text that carries one."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    return any(t in str(error) for t in _ENOSPC_TEXT)


def short_of_space(root: Path, needed_bytes: Optional[int]) -> bool:
    """Less free space under ``root`` than a checkpoint needs (False when either is unknown)."""
    try:
        return needed_bytes is not None and shutil.disk_usage(root).free < needed_bytes
    except OSError:
        return False


def volume_full_message(root: Path, needed_bytes: Optional[int], keep_last: int) -> str:
    """What to tell a user whose checkpoint volume is full: how full, what a checkpoint needs, the fix."""
    try:
        free_bytes = shutil.disk_usage(root).free
        free = f"{free_bytes / 1e6:.1f} MB free ({free_bytes:,} bytes)"
    except OSError:
        free = "free space unknown"
    need = (
        f"a checkpoint needs about {needed_bytes / 1e6:.1f} MB (the newest committed one)"
        if needed_bytes
        else "no checkpoint was committed yet to tell what one needs"
    )
    return (
        f"the checkpoint volume is full (checkpoint.dir={str(root)!r}: {free}; {need}). Grow the volume, lower "
        f"checkpoint.keep_last (now {keep_last}; 0 keeps all), or delete set-aside directories "
        "(*.incomplete-*, *.abandoned-*, *.superseded-*) you no longer need. Committed checkpoints are never "
        "deleted to make room"
    )


def save_failure(
    message: str, cause: str, step: int, error: object, root: Path, needed_bytes: Optional[int], keep_last: int
) -> Failure:
    """Rank 0: the failure of the save of ``step``; a full volume is said as such. A writer's
    error does not always carry the ENOSPC (torch's zip writer reports a short write as a
    position mismatch), so less free space than a checkpoint needs counts as full too."""
    if is_volume_full(error) or short_of_space(root, needed_bytes):
        return Failure(f"{message}: {volume_full_message(root, needed_bytes, keep_last)}", VOLUME_FULL, step)
    return Failure(message, cause, step)


class FailureStreak:
    """Saves that failed in a row; a commit ends the streak. ``limit``:
    ``checkpoint.max_consecutive_failures``, the failure that reaches it ends the job."""

    def __init__(self, limit: int):
        self.limit, self.count, self.total = limit, 0, 0

    def committed(self) -> None:
        self.count = 0

    def failed(self, error: SaveFailed) -> int:
        """Count ``error``; raise the job's end if it is fatal or the streak reached the limit;
        else the streak's length."""
        self.count += 1
        self.total += 1
        if error.fatal:
            raise error
        if self.count >= self.limit:
            raise SaveFailed(
                f"{self.count} checkpoint save(s) in a row failed "
                f"(checkpoint.max_consecutive_failures={self.limit}); the last: {error}. Fix the cause "
                "or raise checkpoint.max_consecutive_failures",
                error.cause,
                error.step,
                fatal=True,
            ) from error
        return self.count

    def judge(
        self,
        exc: SaveFailed,
        newest: Optional[int],
        event: Callable[[dict], None],
        say: Callable[[str], None],
        final: bool = False,
        stopping: bool = False,
    ) -> None:
        """A save failed on every rank: record it (``event``) and go on (``say``), or raise the job's
        end (a lost lease, ``final``, the streak at the limit; permanent unless ``stopping``, a
        graceful stop's). ``newest``: the newest committed step. Every rank gets the same failure,
        so every rank takes the same branch."""
        end: Optional[SaveFailed] = None
        if final:
            self.count += 1
            committed = f"step {newest}" if newest is not None else "none"
            what = (
                "A graceful stop's checkpoint"
                if stopping
                else "The checkpoint that ends this run (checkpoint.save_final)"
            )
            end = SaveFailed(
                f"{exc}. {what} was not committed; the newest committed checkpoint: {committed}",
                exc.cause,
                exc.step,
                fatal=True,
                permanent=not stopping,
            )
        else:
            try:
                self.failed(exc)
            except SaveFailed as limit:
                end = limit
        event(
            {
                "event": "checkpoint_failed",
                "t": time.time(),
                "step": exc.step,
                "cause": exc.cause,
                "consecutive": self.count,
                "limit": self.limit,
                "fatal": end is not None,
                "error": str(exc),
            }
        )
        if end is not None:
            raise end from exc
        say(
            f"warning: {exc}; training goes on and the next due save tries again ({self.count} in a row; the job "
            f"fails at checkpoint.max_consecutive_failures={self.limit})"
        )
