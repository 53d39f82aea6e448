"""Rank 0's background uploader: committed checkpoints to S3 while training goes on."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ...config import S3Config
from .. import store
from .client import describe_error, make_client, parse_s3_uri
from .remote import apply_remote_retention
from .transfer import upload_checkpoint


@dataclass
class _Job:
    step: int
    path: Path
    adopt: bool = False  # found at start: keep a complete remote copy of the step instead
    attempts: int = 0
    not_before: float = 0.0


@dataclass
class UploadStatus:
    uploaded: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    failed: int = 0  # failed attempts, each retried unless superseded
    last_error: Optional[str] = None
    bytes_uploaded: int = 0


class Uploader:
    """Uploads committed checkpoints on a background thread, one checkpoint at a time (its files
    in parallel), so a step never waits for S3. Failed uploads are retried with backoff; the
    backlog is bounded by ``max_pending``. Checkpoints waiting or in flight are held: local
    retention must not delete them (:meth:`holds`).

    Events (``metrics.jsonl`` records with a message for the log) are queued here and written by
    the training loop's thread through :meth:`take_events`: only that thread writes the log.
    """

    def __init__(self, cfg: S3Config):
        self.cfg = cfg
        self.loc = parse_s3_uri(cfg.uri)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._current: Optional[_Job] = None
        self._events: collections.deque[tuple[dict, str]] = collections.deque()
        self._closing = False
        self._adopted = False
        self.status = UploadStatus()
        self._thread = threading.Thread(target=self._run, name="s3-uploader", daemon=True)
        self._thread.start()

    # -- the training thread's side --
    def submit(self, step: int, path: Path, adopt: bool = False, manifest: Optional[dict] = None) -> None:
        """Queue a committed checkpoint; with the backlog full, the oldest waiting one is dropped."""
        path = path.resolve()
        with self._cond:
            self._waiting = collections.deque(j for j in self._waiting if j.path != path)
            self._waiting.append(_Job(step, path, adopt=adopt))
            self._bound()
            self._cond.notify_all()

    def adopt(self, committed: list[store.CheckpointInfo]) -> None:
        """Once per process: queue the newest local checkpoints, which an earlier run may not have
        uploaded (cut off, S3 down, stopped); each is skipped if S3 already has its step complete."""
        if self._adopted:
            return
        self._adopted = True
        for info in committed[-self.cfg.max_pending:]:
            self.submit(info.step, info.path, adopt=True)

    def holds(self, path: Path) -> bool:
        path = path.resolve()
        with self._cond:
            return any(j.path == path for j in self._jobs())

    def pending(self) -> list[int]:
        with self._cond:
            return sorted(j.step for j in self._jobs())

    def take_events(self) -> list[tuple[dict, str]]:
        with self._cond:
            events, self._events = list(self._events), collections.deque()
        return events

    def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is pending (failed uploads keep being retried meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def close(self) -> None:
        """Stop taking work; an upload in flight is abandoned (its checkpoint has no marker on S3
        and is uploaded by the next run, see :meth:`adopt`)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=2.0)

    def summary(self) -> dict:
        with self._cond:
            s = self.status
            return {"uri": self.cfg.uri, "uploaded": list(s.uploaded), "pending": sorted(j.step for j in self._jobs()),
                    "superseded": list(s.superseded), "deleted": list(s.deleted), "failed": s.failed,
                    "last_error": s.last_error, "bytes_uploaded": s.bytes_uploaded}

    # -- internals: the methods below that touch shared state run with the lock held --
    def _jobs(self) -> list[_Job]:
        return list(self._waiting) + ([self._current] if self._current else [])

    def _bound(self) -> None:
        while len(self._waiting) > self.cfg.max_pending:
            dropped = self._waiting.popleft()
            newest = self._waiting[-1].step
            self.status.superseded.append(dropped.step)
            self._event({"event": "s3_superseded", "step": dropped.step, "by": newest},
                        f"S3 upload backlog full (checkpoint.s3.max_pending={self.cfg.max_pending}): step "
                        f"{dropped.step} will not be uploaded, step {newest} supersedes it")

    def _event(self, record: dict, message: str) -> None:
        self._events.append(({**record, "t": time.time()}, message))

    def _next_job(self) -> Optional[_Job]:
        with self._cond:
            while not self._closing:
                now = time.monotonic()
                if self._waiting and self._waiting[0].not_before <= now:
                    self._current = self._waiting.popleft()
                    return self._current
                wait = (self._waiting[0].not_before - now) if self._waiting else None
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        client = None
        while True:
            job = self._next_job()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                client = client or make_client(self.cfg)
                result = self._upload(client, job)
            except Exception as exc:  # every failure is retried; none may end the thread
                self._failed(job, exc)
                continue
            try:
                self._succeeded(client, job, result, time.perf_counter() - t0)
            finally:
                # Only now: drain() must not return before the outcome is recorded.
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _upload(self, client: Any, job: _Job) -> dict:
        if not job.path.is_dir():
            return {"step": job.step, "status": "vanished", "bytes": 0}
        return upload_checkpoint(client, self.cfg, self.loc, job.path, replace=not job.adopt,
                                 resume=job.attempts > 0 or job.adopt, limit_bandwidth=True)

    def _succeeded(self, client: Any, job: _Job, result: dict, seconds: float) -> None:
        where = self.loc.uri(store.committed_name(job.step)) + "/"
        with self._cond:
            s = self.status
            if result["status"] == "uploaded":
                s.uploaded.append(job.step)
                s.bytes_uploaded += result["bytes"]
                self._event({"event": "s3_upload", "step": job.step, "bytes": result["bytes"], "seconds": seconds,
                             "attempt": job.attempts + 1, "uri": where},
                            f"checkpoint step {job.step} uploaded to {where} ({result['bytes'] / 1e6:.1f} MB in "
                            f"{seconds:.1f} s" + (f", attempt {job.attempts + 1})" if job.attempts else ")"))
            elif result["status"] == "vanished":
                self._event({"event": "s3_skipped", "step": job.step, "reason": "deleted locally"},
                            f"S3 upload of step {job.step} skipped: {job.path} no longer exists")
            else:
                self._event({"event": "s3_skipped", "step": job.step, "reason": result["status"]},
                            f"S3 already holds a complete step {job.step} ({where}); not uploaded again")
        if result["status"] != "uploaded":
            return
        try:
            deleted = apply_remote_retention(client, self.loc, self.cfg.keep_last)
        except Exception as exc:
            with self._cond:
                self.status.last_error = f"retention: {describe_error(exc)}"
                self._event({"event": "s3_error", "step": job.step, "error": self.status.last_error},
                            f"warning: S3 retention after step {job.step} failed ({self.status.last_error}); "
                            "it is tried again after the next upload")
            return
        if deleted:
            with self._cond:
                self.status.deleted += deleted
                self._event({"event": "s3_retention", "deleted": deleted},
                            f"S3 retention (checkpoint.s3.keep_last={self.cfg.keep_last}): deleted step(s) "
                            f"{', '.join(map(str, deleted))} under {self.cfg.uri}")

    def _failed(self, job: _Job, exc: Exception) -> None:
        error = describe_error(exc)
        job.attempts += 1
        delay = min(self.cfg.retry_backoff_s * 2 ** (job.attempts - 1), self.cfg.retry_backoff_max_s)
        with self._cond:
            self.status.failed += 1
            self.status.last_error = error
            self._event({"event": "s3_error", "step": job.step, "attempt": job.attempts, "error": error,
                         "retry_in_s": delay},
                        f"warning: S3 upload of step {job.step} failed (attempt {job.attempts}: {error}); training "
                        f"goes on, retrying in {delay:.0f} s")
            job.not_before = time.monotonic() + delay
            self._current = None
            if not any(j.path == job.path for j in self._waiting):  # not committed again meanwhile
                self._waiting.appendleft(job)
                self._bound()
            self._cond.notify_all()
