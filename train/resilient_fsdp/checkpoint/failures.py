"""Failed saves: why one failed (its cause), how many failed in a row, and what a full volume says.

A failed periodic save is not a failed job: the checkpointer reports it and the next due save
tries again, until ``checkpoint.max_consecutive_failures`` saves in a row failed (:class:`FailureStreak`).
Every rank sees the same failures in the same order (the checkpointer broadcasts them), so every
rank's streak has the same length and every rank takes the same branch.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .store import CheckpointError

# Causes of a failed save, as the log and the ``checkpoint_failed`` records name them.
WRITER = "writer"            # a rank's writer failed (raised, died, could not write a file)
TIMEOUT = "write_timeout"    # a write outlived checkpoint.write_timeout_s
FINALIZE = "finalize"        # rank 0 could not write the metadata or commit
MKDIR = "mkdir"              # rank 0 could not create the checkpoint's directory
VOLUME_FULL = "volume_full"  # ENOSPC in any of the above
LEASE = "lease_lost"         # another job took checkpoint.dir: never retried

_ENOSPC_TEXT = ("No space left on device", f"[Errno {errno.ENOSPC}]")


class SaveFailed(CheckpointError):
    """A save that failed on every rank, with its ``cause`` (one of the names above). ``fatal``:
    it ends the attempt (the lease is lost, ``checkpoint.max_consecutive_failures`` saves failed in
    a row, or the save that ends the run failed). ``permanent``: no restart fixes it either, so no
    layer retries it (:func:`resilient_fsdp.resilience.exit_codes.is_configuration_failure`): every
    fatal failure but a graceful stop's, whose restart resumes from the newest committed checkpoint."""

    def __init__(self, message: str, cause: str, step: Optional[int] = None, fatal: bool = False,
                 permanent: Optional[bool] = None):
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
    need = f"a checkpoint needs about {needed_bytes / 1e6:.1f} MB (the newest committed one)" \
        if needed_bytes else "no checkpoint was committed yet to tell what one needs"
    return (f"the checkpoint volume is full (checkpoint.dir={str(root)!r}: {free}; {need}). Grow the volume, lower "
            f"checkpoint.keep_last (now {keep_last}; 0 keeps all), or delete set-aside directories "
            "(*.incomplete-*, *.abandoned-*, *.superseded-*) you no longer need. Committed checkpoints are never "
            "deleted to make room")


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
            raise SaveFailed(f"{self.count} checkpoint save(s) in a row failed "
                             f"(checkpoint.max_consecutive_failures={self.limit}); the last: {error}. Fix the cause "
                             "or raise checkpoint.max_consecutive_failures", error.cause, error.step, fatal=True) from error
        return self.count
