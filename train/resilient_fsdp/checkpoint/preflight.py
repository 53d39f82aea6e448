"""What a start checks before it trains, on every rank: :func:`preflight`.

The checkpoint directory must be writable, the lease on it this job's (waited for while an
earlier install of the job holds it), and the S3 bucket, when set, there and allowed. Called
by :meth:`.checkpointer.Checkpointer.preflight`, which raises a refusal as a ConfigError.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from ..config import CheckpointConfig, ConfigError
from .group import RankGroup
from .lease import Lease
from .s3 import client as s3_client
from .shared_volume import not_writable_message

LEASE_WAIT = "lease-wait"
LEASE_POLL_S = 2.0  # how often rank 0 looks at a held lease again (each look a collective)
LEASE_SAY_S = 30.0  # how often it says that it waits


def preflight(
    group: RankGroup,
    cfg: CheckpointConfig,
    root: Path,
    job: str,
    say: Callable[[str], None],
    under_lease: Callable[[Lease], None],
) -> tuple[Optional[Lease], Optional[str]]:
    """Collective: (rank 0's lease, or None on the other ranks; why the start is refused, the same
    on every rank, or None). Rank 0 calls ``under_lease(lease)`` once it holds the lease (its work
    before anything is in flight)."""
    error = _not_writable(root) if group.is_coordinator else None
    error, lease = _take_lease(group, cfg, root, job, say, error)
    if group.is_coordinator:
        if error is None and lease is not None:
            under_lease(lease)
        if error is None and cfg.s3.uri:
            error = _check_s3(cfg, say)
    return lease, group.broadcast(error)


def _not_writable(root: Path) -> Optional[str]:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        return not_writable_message("checkpoint.dir", root, exc)
    return None


def _take_lease(
    group: RankGroup, cfg: CheckpointConfig, root: Path, job: str, say: Callable[[str], None], error: Optional[str]
) -> tuple[Optional[str], Optional[Lease]]:
    """Rank 0 takes the lease (``error``: rank 0's, from before); collective. While an earlier
    install of the job holds it, rank 0 polls, and every rank learns each poll's outcome in a
    short collective of its own, so that no collective waits out the whole of
    ``checkpoint.lease_wait_s``. Returns (rank 0's error on every rank, rank 0's lease)."""
    lease = Lease(root, job, say) if group.is_coordinator and error is None else None
    start = time.monotonic()
    said = -LEASE_SAY_S
    while True:
        state = error
        if lease is not None:
            try:
                waiting = lease.try_acquire()
            except ConfigError as exc:
                state = str(exc)
            else:
                waited = time.monotonic() - start
                if waiting is not None and waited >= cfg.lease_wait_s:
                    state = lease.refusal_after_wait(waited)
                elif waiting is not None:
                    if waited - said >= LEASE_SAY_S:
                        say(f"{waiting} ({waited:.0f} of {cfg.lease_wait_s:g} s)")
                        said = waited
                    state = LEASE_WAIT
        state = group.broadcast(state)
        if state != LEASE_WAIT:
            break
        time.sleep(LEASE_POLL_S)
    return state, lease if state is None else None


def _check_s3(cfg: CheckpointConfig, say: Callable[[str], None]) -> Optional[str]:
    """A bucket that is missing or forbidden stops the job now; an unreachable one does not
    (uploads retry; a restore that needs it fails on its own)."""
    try:
        return s3_client.check_access(cfg.s3)
    except Exception as exc:
        say(
            f"warning: S3 is not reachable at start ({s3_client.describe_error(exc)}); training goes on "
            "and uploads are retried"
        )
        return None
