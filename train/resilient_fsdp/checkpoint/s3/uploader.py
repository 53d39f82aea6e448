"""Every rank's background uploader: committed checkpoints to S3 while training goes on.

Each rank uploads the files it wrote (the manifest names the writer of every file; at another
world size, for a checkpoint adopted at start, the files are split by size instead), then puts a
receipt under the checkpoint's prefix. Rank 0 waits for every rank's receipt, checks that every
file is there at its size and uploads the ``COMPLETE`` marker last; S3 itself is the meeting
point, so no collective and no store is involved, and a rank that restarts finds its files
already there.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ...config import S3Config
from .. import integrity, store
from .client import describe_error, make_client, parse_s3_uri
from .remote import apply_remote_retention, checkpoint_id, sweep_torn_remote
from .transfer import file_sizes, put_marker, receipt_ranks, upload_share

_AWAIT_POLL_S = 1.0


@dataclass
class _Job:
    step: int
    path: Path
    manifest: dict
    names: list[str]
    adopt: bool = False  # found at start: keep a complete remote copy of the step instead
    attempts: int = 0
    not_before: float = 0.0


@dataclass
class _Awaiting:
    """Rank 0: a checkpoint whose files are being uploaded by every rank; its marker goes last."""

    step: int
    path: Path
    manifest: dict
    ranks: int
    since: float = field(default_factory=time.monotonic)
    missing: list[int] = field(default_factory=list)  # ranks without a receipt at the last look


@dataclass
class UploadStatus:
    uploaded: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # awaited too long: never marked, not held
    deleted: list[int] = field(default_factory=list)
    failed: int = 0  # failed attempts, each retried unless superseded
    last_error: Optional[str] = None
    bytes_uploaded: int = 0


class Uploader:
    """Uploads this rank's files of committed checkpoints on a background thread, one checkpoint
    at a time (its files in parallel), so a step never waits for S3. Failed uploads are retried
    with backoff; the backlog is bounded by ``max_pending``. Rank 0 also puts each checkpoint's
    marker once every rank's receipt is there; checkpoints waiting or in flight are held: local
    retention must not delete them (:meth:`holds`). At most ``max_awaiting`` checkpoints wait for
    other ranks' receipts: past that the oldest is released (a rank whose uploads keep failing
    must not keep every checkpoint on disk), and the ranks it waited for are named.

    Events (``metrics.jsonl`` records with a message for the log) are queued here and written by
    the training loop's thread through :meth:`take_events` (rank 0; the other ranks print their
    errors to stderr).
    """

    def __init__(self, cfg: S3Config, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.loc = parse_s3_uri(cfg.uri)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._current: Optional[_Job] = None
        self._awaiting: list[_Awaiting] = []
        self._lagging: list[int] = []  # ranks missing from the oldest of several awaiting checkpoints
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
        manifest = manifest or store.read_manifest(path)
        if manifest is None:
            return
        names = self._my_files(path, manifest)
        with self._cond:
            self._waiting = collections.deque(j for j in self._waiting if j.path != path)
            self._waiting.append(_Job(step, path, manifest, names, adopt=adopt))
            self._bound()
            self._cond.notify_all()

    def _my_files(self, path: Path, manifest: dict) -> list[str]:
        sums = manifest.get("checksums")
        if sums and manifest.get("world_size") == self.world_size:
            return sorted(n for n, e in sums.items() if e.get("writer") == self.rank)
        sizes = file_sizes(path, manifest)
        return integrity.share({n: {"bytes": b} for n, b in sizes.items()}, self.world_size, self.rank)

    def adopt(self, committed: list[store.CheckpointInfo]) -> None:
        """Once per process: queue the newest local checkpoints, which an earlier run may not have
        uploaded (cut off, S3 down, stopped); each is skipped if S3 already has its step complete."""
        if self._adopted:
            return
        self._adopted = True
        for info in committed[-self.cfg.max_pending :]:
            self.submit(info.step, info.path, adopt=True, manifest=info.manifest)

    def holds(self, path: Path) -> bool:
        path = path.resolve()
        with self._cond:
            return any(j.path == path for j in self._jobs()) or any(a.path == path for a in self._awaiting)

    def pending(self) -> list[int]:
        with self._cond:
            return sorted({j.step for j in self._jobs()} | {a.step for a in self._awaiting})

    def take_events(self) -> list[tuple[dict, str]]:
        with self._cond:
            events, self._events = list(self._events), collections.deque()
        return events

    def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is pending (failed uploads keep being retried meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs() or self._awaiting:
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
            return {
                "uri": self.cfg.uri,
                "uploaded": list(s.uploaded),
                "pending": self._pending_locked(),
                "superseded": list(s.superseded),
                "released": list(s.released),
                "lagging_ranks": list(self._lagging),
                "deleted": list(s.deleted),
                "failed": s.failed,
                "last_error": s.last_error,
                "bytes_uploaded": s.bytes_uploaded,
            }

    # -- internals: the methods below that touch shared state run with the lock held --
    def _pending_locked(self) -> list[int]:
        return sorted({j.step for j in self._jobs()} | {a.step for a in self._awaiting})

    def _jobs(self) -> list[_Job]:
        return list(self._waiting) + ([self._current] if self._current else [])

    def _bound(self) -> None:
        while len(self._waiting) > self.cfg.max_pending:
            dropped = self._waiting.popleft()
            newest = self._waiting[-1].step
            self.status.superseded.append(dropped.step)
            self._event(
                {"event": "s3_superseded", "step": dropped.step, "by": newest},
                f"S3 upload backlog full (checkpoint.s3.max_pending={self.cfg.max_pending}): step "
                f"{dropped.step} will not be uploaded, step {newest} supersedes it",
            )

    def _event(self, record: dict, message: str) -> None:
        if self.rank != 0:
            if record["event"] == "s3_error":
                print(f"[resilient-fsdp] rank {self.rank}: {message}", file=sys.stderr, flush=True)
            return
        self._events.append(({**record, "t": time.time()}, message))

    def _next_job(self, client_ready: bool) -> Optional[_Job]:
        with self._cond:
            while not self._closing:
                now = time.monotonic()
                if self._waiting and self._waiting[0].not_before <= now:
                    self._current = self._waiting.popleft()
                    return self._current
                if self._awaiting and client_ready:
                    return None  # time to look at the receipts
                wait = (self._waiting[0].not_before - now) if self._waiting else None
                if self._awaiting:
                    wait = _AWAIT_POLL_S if wait is None else min(wait, _AWAIT_POLL_S)
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        client = None
        while True:
            job = self._next_job(client is not None)
            with self._cond:
                if self._closing:
                    return
            if job is None:
                self._mark_ready(client)
                time.sleep(_AWAIT_POLL_S)
                continue
            t0 = time.perf_counter()
            try:
                client = client or make_client(self.cfg)
                result = self._upload(client, job)
            except Exception as exc:  # every failure is retried; none may end the thread
                self._failed(job, exc)
                continue
            try:
                self._sent(job, result, time.perf_counter() - t0)
                if self.rank == 0:
                    self._mark_ready(client)
            finally:
                # Only now: drain() must not return before the outcome is recorded.
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _upload(self, client: Any, job: _Job) -> dict:
        if not job.path.is_dir():
            return {"status": "vanished", "bytes": 0}
        return upload_share(
            client,
            self.cfg,
            self.loc,
            job.path,
            job.manifest,
            job.names,
            self.rank,
            replace=not job.adopt,
            limit_bandwidth=True,
        )

    def _sent(self, job: _Job, result: dict, seconds: float) -> None:
        where = self.loc.uri(store.committed_name(job.step)) + "/"
        with self._cond:
            if result["status"] == "sent":
                self.status.bytes_uploaded += result["bytes"]
                if self.rank == 0:
                    ranks = self.world_size
                    self._awaiting = [a for a in self._awaiting if a.path != job.path]
                    self._awaiting.append(_Awaiting(job.step, job.path, job.manifest, ranks))
                    self._release_oldest()
            elif result["status"] == "vanished":
                self._event(
                    {"event": "s3_skipped", "step": job.step, "reason": "deleted locally"},
                    f"S3 upload of step {job.step} skipped: {job.path} no longer exists",
                )
            else:
                self._event(
                    {"event": "s3_skipped", "step": job.step, "reason": result["status"]},
                    f"S3 already holds a complete step {job.step} ({where}); not uploaded again",
                )

    def _mark_ready(self, client: Any) -> None:
        """Rank 0: put the marker of every checkpoint whose files all ranks uploaded; a newer one
        marked supersedes older ones still waiting."""
        with self._cond:
            awaiting = list(self._awaiting)
        for entry in awaiting:
            try:
                present = receipt_ranks(client, self.loc, entry.manifest)
                entry.missing = sorted(set(range(entry.ranks)) - present)
                if entry.missing:
                    continue
                put_marker(client, self.loc, entry.path, entry.manifest)
            except Exception as exc:  # noqa: BLE001 - retried at the next look
                with self._cond:
                    self.status.failed += 1
                    self.status.last_error = describe_error(exc)
                    self._event(
                        {"event": "s3_error", "step": entry.step, "error": self.status.last_error},
                        f"warning: S3 marker of step {entry.step} failed ({self.status.last_error}); "
                        "tried again shortly",
                    )
                continue
            self._marked(client, entry)
        with self._cond:
            self._say_lagging()

    def _release_oldest(self) -> None:
        """Rank 0: past ``max_awaiting`` checkpoints waiting for receipts, the oldest stops waiting."""
        while len(self._awaiting) > self.cfg.max_awaiting:
            entry = self._awaiting.pop(0)
            self.status.released.append(entry.step)
            waited = ", ".join(map(str, entry.missing)) or "unknown (not looked at yet)"
            self._event(
                {
                    "event": "s3_released",
                    "step": entry.step,
                    "waiting_for": entry.missing,
                    "awaiting": len(self._awaiting),
                },
                f"warning: S3 upload of step {entry.step} released after "
                f"checkpoint.s3.max_awaiting={self.cfg.max_awaiting} newer checkpoints waited too: rank(s) "
                f"{waited} did not upload their files; it gets no marker on S3 (never restored from there) "
                "and local retention no longer holds it. Check those ranks' S3 errors in their logs",
            )
            self._cond.notify_all()
        self._say_lagging()

    def _say_lagging(self) -> None:
        """Rank 0: report a change of the ranks holding up markers (those missing from the oldest
        awaiting checkpoint while a newer one waits as well; one awaiting is an upload in progress)."""
        lagging = self._awaiting[0].missing if len(self._awaiting) > 1 else []
        if lagging == self._lagging:
            return
        self._lagging = list(lagging)
        if lagging:
            message = (
                f"warning: S3 markers wait for rank(s) {', '.join(map(str, lagging))}: "
                f"{len(self._awaiting)} checkpoint(s) await their uploads (the oldest, step "
                f"{self._awaiting[0].step}, is released past checkpoint.s3.max_awaiting={self.cfg.max_awaiting})"
            )
        else:
            message = "S3 markers no longer wait for a lagging rank"
        self._event({"event": "s3_lagging", "ranks": list(lagging), "awaiting": len(self._awaiting)}, message)

    def _marked(self, client: Any, entry: _Awaiting) -> None:
        where = self.loc.uri(store.committed_name(entry.step)) + "/"
        nbytes = sum(file_sizes(entry.path, entry.manifest).values()) if entry.path.is_dir() else 0
        seconds = time.monotonic() - entry.since
        with self._cond:
            older = [a for a in self._awaiting if a.step < entry.step]
            self._awaiting = [a for a in self._awaiting if a.step > entry.step]
            for a in older:
                self.status.superseded.append(a.step)
                self._event(
                    {"event": "s3_superseded", "step": a.step, "by": entry.step},
                    f"S3 upload of step {a.step} did not complete before step {entry.step}'s; it is "
                    "not marked complete",
                )
            self.status.uploaded.append(entry.step)
            self._event(
                {
                    "event": "s3_upload",
                    "step": entry.step,
                    "bytes": nbytes,
                    "seconds": seconds,
                    "uri": where,
                    "ranks": entry.ranks,
                    "id": checkpoint_id(entry.manifest),
                    "awaiting": len(self._awaiting),
                },
                f"checkpoint step {entry.step} uploaded to {where} ({nbytes / 1e6:.1f} MB from "
                f"{entry.ranks} rank(s), marker last)",
            )
            self._say_lagging()  # before drain() can return: the summary then holds the ranks still lagging
            self._cond.notify_all()
        try:
            deleted = apply_remote_retention(client, self.loc, self.cfg.keep_last)
            swept = sweep_torn_remote(client, self.loc)
        except Exception as exc:
            with self._cond:
                self.status.last_error = f"retention: {describe_error(exc)}"
                self._event(
                    {"event": "s3_error", "step": entry.step, "error": self.status.last_error},
                    f"warning: S3 retention after step {entry.step} failed ({self.status.last_error}); "
                    "it is tried again after the next upload",
                )
            return
        for step, nbytes in swept:
            with self._cond:
                self._event(
                    {"event": "s3_swept", "step": step, "bytes": nbytes},
                    f"deleted {self.loc.uri(store.committed_name(step))}/ ({nbytes / 1e6:.1f} MB): an upload "
                    f"that never got its marker, older than step {entry.step}'s",
                )
        if deleted:
            with self._cond:
                self.status.deleted += deleted
                self._event(
                    {"event": "s3_retention", "deleted": deleted},
                    f"S3 retention (checkpoint.s3.keep_last={self.cfg.keep_last}): deleted step(s) "
                    f"{', '.join(map(str, deleted))} under {self.cfg.uri}",
                )

    def _failed(self, job: _Job, exc: Exception) -> None:
        error = describe_error(exc)
        job.attempts += 1
        delay = min(self.cfg.retry_backoff_s * 2 ** (job.attempts - 1), self.cfg.retry_backoff_max_s)
        with self._cond:
            self.status.failed += 1
            self.status.last_error = error
            self._event(
                {"event": "s3_error", "step": job.step, "attempt": job.attempts, "error": error, "retry_in_s": delay},
                f"warning: S3 upload of step {job.step} failed (attempt {job.attempts}: {error}); training "
                f"goes on, retrying in {delay:.0f} s",
            )
            job.not_before = time.monotonic() + delay
            self._current = None
            if not any(j.path == job.path for j in self._waiting):  # not committed again meanwhile
                self._waiting.appendleft(job)
                self._bound()
            self._cond.notify_all()
