"""Rank 0's retention thread: ``checkpoint.keep_last`` and the sweep of torn writes.

:class:`.checkpointer.Checkpointer` hands it a pass after every commit and the start's sweep
before the first save; the passes run off the training thread, and what they say (lines and
``metrics.jsonl`` records) is said on the training thread at the next step.
"""

from __future__ import annotations

import concurrent.futures
import functools
from pathlib import Path
from typing import Callable, Optional

from . import store
from .lease import Lease, taken_over
from .reports import RunLog


def lease_check(lease: Optional[Lease]) -> Callable[[], Optional[str]]:
    """Why the lease is no longer this job's, or None; asked before each deletion (by value: the
    file, read again each time)."""
    if lease is None:
        return lambda: None
    return functools.partial(taken_over, lease.path, lease.holder)


class Retention:
    """Rank 0's retention passes (``active``); on the other ranks every call does nothing."""

    def __init__(self, root: Path, keep_last: int, active: bool):
        self.root, self.keep_last = root, keep_last
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "checkpoint-retention") if active else None
        self._said: list[str] = []
        self._events: list[dict] = []  # metrics.jsonl records of the retention thread
        self._stale_torn: frozenset[str] = frozenset()  # incomplete at start: none can be committed
        self._start_sweep: Optional[Callable[[], None]] = None  # submitted once the job trains

    def after_commit(self, held: Callable[[Path], bool], lease: Optional[Lease]) -> None:
        """Local retention in the background; a checkpoint ``held`` (its S3 upload pending) is
        kept. Best-effort: what fails is said at the next step."""
        if self._pool is None:
            return
        self._pool.submit(store.apply_retention, self.root, self.keep_last, held, self._said.append, lease_check(lease))
        self.sweep(lease, in_flight=None, at_start=False)

    def sweep(self, lease: Optional[Lease], in_flight: Optional[Path], at_start: bool) -> None:
        """Holding the lease: remove torn writes (:func:`.store.sweep_torn`). The names are listed
        here, on the thread that starts writes, while none is in flight (after a commit, or
        before the first save), so a write started later is never among them. The start's
        sweep waits for :meth:`started`."""
        if self._pool is None or lease is None:
            return
        names = store.torn_names(self.root)
        if at_start:
            self._stale_torn = frozenset(names)
            self._start_sweep = functools.partial(self._submit_sweep, names, in_flight, lease)
            return
        self._submit_sweep(names, in_flight, lease)

    def started(self) -> None:
        """The job trains from here: the start's sweep goes to the thread now, after the start's
        measurements (its deletions would count in them)."""
        sweep, self._start_sweep = self._start_sweep, None
        if sweep is not None:
            sweep()

    def _submit_sweep(self, names: list[str], in_flight: Optional[Path], lease: Optional[Lease]) -> None:
        self._pool.submit(
            store.sweep_torn,
            self.root,
            names,
            self._stale_torn,
            in_flight,
            self._said.append,
            self._events.append,
            lease_lost=lease_check(lease),
        )

    def report(self, log: RunLog) -> None:
        """Say what the passes said since the last call ."""
        while self._events:
            log.event(self._events.pop(0))
        while self._said:
            log.info(self._said.pop(0))

    def settle(self, log: RunLog) -> None:
        """Wait for the queued passes, then say what they said."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()
        self.report(log)

    def close(self, log: RunLog) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self.report(log)
