"""The S3 tier: durable copies of committed checkpoints, and restore from them.

Layout under ``checkpoint.s3.uri`` (``s3://bucket/prefix``) mirrors ``checkpoint.dir``::

    prefix/step_00000040/<data files>   one object per local file, same relative names
    prefix/step_00000040/COMPLETE       uploaded last: the local manifest plus the file list

Upload: after a checkpoint commits on shared storage, rank 0 alone hands it to an
:class:`Uploader`, whose thread sends the data files with boto3's managed transfer (multipart,
parallel requests, botocore retries) and then the ``COMPLETE`` marker. A prefix without a marker
is never taken for a checkpoint, so an upload cut off anywhere leaves nothing a restore would
load. Retention under the prefix runs only after a newer checkpoint is complete there and deletes
each victim's marker before its data, so a concurrent reader never sees a marker without its files.

Restore: :func:`download_checkpoint` writes into ``step_N.incomplete-<id>`` and commits through
:mod:`checkpoint_store` (marker, fsync, atomic rename), exactly like a freshly written checkpoint.

boto3 is imported inside functions: ``resilient-fsdp config`` and the trainer without an S3 tier
never pay for it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from . import atomic
from . import checkpoint_store as store
from .config import S3Config, split_s3_uri

Progress = Optional[Callable[[int], None]]  # called with bytes moved since the last call

# Object metadata naming the checkpoint a file belongs to: a retried upload skips files that
# are already there for the same checkpoint, and never keeps ones of another checkpoint.
ID_METADATA = "checkpoint-id"
# Inside a partial download: marks it as a copy of S3 data, which a later restore may delete.
DOWNLOAD_MARK = ".s3-download"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
MIB = 1024 * 1024


# ---- where: the URI, the client, the transfer settings ------------------------------------------

@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # without a trailing slash; "" for the bucket's root

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def uri(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"


def parse_s3_uri(uri: str, key: str = "checkpoint.s3.uri") -> S3Location:
    """``s3://bucket/prefix`` -> :class:`S3Location`; a ConfigError naming ``key`` otherwise."""
    return S3Location(*split_s3_uri(uri, key))


def make_client(cfg: S3Config, max_attempts: Optional[int] = None) -> Any:
    """An S3 client: credentials from boto3's default chain only, never from the configuration."""
    import boto3
    from botocore.config import Config as BotoConfig

    config = BotoConfig(
        retries={"mode": cfg.retry_mode, "max_attempts": max_attempts or cfg.max_attempts},
        connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.read_timeout_s,
        # One pooled connection per concurrent request of a transfer, plus a few for listing.
        max_pool_connections=cfg.max_concurrency + 4,
        s3={"addressing_style": cfg.addressing_style})
    # A session per client: boto3's default session is not safe to share between threads.
    return boto3.session.Session().client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                                          config=config)


def transfer_config(cfg: S3Config, limit_bandwidth: bool = False) -> Any:
    from boto3.s3.transfer import TransferConfig

    bandwidth = int(cfg.max_bandwidth_mb_s * 1e6) if (limit_bandwidth and cfg.max_bandwidth_mb_s) else None
    # Threads, not the CRT client: it is optional in boto3 and would bypass the retry settings.
    return TransferConfig(multipart_threshold=cfg.multipart_threshold_mb * MIB,
                          multipart_chunksize=cfg.multipart_chunksize_mb * MIB,
                          max_concurrency=cfg.max_concurrency, use_threads=True, max_bandwidth=bandwidth,
                          preferred_transfer_client="classic")


def describe_error(exc: BaseException) -> str:
    """One line for logs and ``summary.json``: the S3 error code when there is one."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        err = response["Error"]
        text = f"{err.get('Code', type(exc).__name__)}: {err.get('Message', '') or exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def checkpoint_id(manifest: dict) -> str:
    """Identifies one commit of a checkpoint (the same step may be committed again after a
    rewind); the file list the S3 marker adds is left out, so a restored copy keeps its id."""
    core = {k: v for k, v in manifest.items() if k != "files"}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]


def local_files(path: Path) -> dict[str, int]:
    """Relative POSIX names and sizes of a checkpoint's data files (its marker excluded)."""
    files = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name != store.MARKER and f.name != DOWNLOAD_MARK:
            files[f.relative_to(path).as_posix()] = f.stat().st_size
    return files


# ---- what is there ----------------------------------------------------------------------------

@dataclass
class RemoteCheckpoint:
    step: int
    files: dict[str, int]  # every object under step_N/ except the marker: name -> size
    complete: bool  # has a COMPLETE marker
    last_modified: float = 0.0


def list_remote(client: Any, loc: S3Location) -> list[RemoteCheckpoint]:
    """Every ``step_N/`` under the prefix, oldest first, complete or not (one paginated listing)."""
    found: dict[int, RemoteCheckpoint] = {}
    base = loc.key() + "/" if loc.prefix else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=base):
        for obj in page.get("Contents", []):
            step_dir, _, rel = obj["Key"][len(base):].partition("/")
            m = _STEP_DIR.match(step_dir)
            if not m or not rel:
                continue
            entry = found.setdefault(int(m.group(1)), RemoteCheckpoint(int(m.group(1)), {}, False))
            entry.last_modified = max(entry.last_modified, obj["LastModified"].timestamp())
            if rel == store.MARKER:
                entry.complete = True
            else:
                entry.files[rel] = obj["Size"]
    return [found[s] for s in sorted(found)]


def read_remote_manifest(client: Any, loc: S3Location, step: int) -> Optional[dict]:
    """The marker of ``step_N`` if there is a usable one: JSON naming that step and its files."""
    try:
        body = client.get_object(Bucket=loc.bucket, Key=loc.key(store.committed_name(step), store.MARKER))["Body"]
        manifest = json.loads(body.read())
    except ValueError:
        return None
    except Exception as exc:
        if error_code(exc) in ("NoSuchKey", "404"):
            return None
        raise
    if not isinstance(manifest, dict) or manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def newest_complete(client: Any, loc: S3Location, step: Optional[int] = None,
                    say: Callable[[str], None] = lambda _m: None) -> Optional[tuple[RemoteCheckpoint, dict]]:
    """The newest complete checkpoint under the prefix (or ``step``), with its manifest.

    Prefixes without a marker (uploads in progress or cut off) are skipped and named; so is a
    marker that cannot be read, and then the next older checkpoint is taken.
    """
    remote = list_remote(client, loc)
    for entry in reversed(remote):
        if step is not None and entry.step != step:
            continue
        if not entry.complete:
            say(f"skipping {loc.uri(store.committed_name(entry.step))}/: no {store.MARKER} marker "
                "(an upload in progress or cut off)")
            continue
        manifest = read_remote_manifest(client, loc, entry.step)
        if manifest is None:
            say(f"skipping {loc.uri(store.committed_name(entry.step))}/: unreadable {store.MARKER} marker")
            continue
        missing = [n for n, size in manifest["files"].items() if entry.files.get(n) != size]
        if missing:
            say(f"skipping {loc.uri(store.committed_name(entry.step))}/: marker lists {len(missing)} file(s) "
                f"that are missing or of another size, e.g. {missing[0]}")
            continue
        return entry, manifest
    return None


# ---- moving checkpoints -----------------------------------------------------------------------

def _progress_subscribers(progress: Progress) -> list:
    if progress is None:
        return []
    from boto3.s3.transfer import ProgressCallbackInvoker

    return [ProgressCallbackInvoker(progress)]


def _object_matches(client: Any, loc: S3Location, key: str, size: int, ident: str) -> bool:
    try:
        head = client.head_object(Bucket=loc.bucket, Key=key)
    except Exception as exc:
        if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return head["ContentLength"] == size and head.get("Metadata", {}).get(ID_METADATA) == ident


def upload_checkpoint(client: Any, cfg: S3Config, loc: S3Location, path: Path, *, replace: bool = True,
                      resume: bool = False, progress: Progress = None, limit_bandwidth: bool = False,
                      say: Callable[[str], None] = lambda _m: None) -> dict:
    """Upload the committed checkpoint at ``path``: data files first, the marker last.

    ``replace``: a complete checkpoint of the same step but another commit under the prefix is
    replaced (its marker is deleted first, so it is never a mix of two); otherwise it is kept and
    nothing is uploaded. ``resume``: skip files already uploaded for this checkpoint (a retry).
    Returns ``{"step", "bytes", "skipped_files", "status"}``; status is ``uploaded``,
    ``already-there`` or ``kept-remote``.
    """
    from boto3.s3.transfer import create_transfer_manager

    manifest = store.read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no readable {store.MARKER})")
    step, ident = int(manifest["step"]), checkpoint_id(manifest)
    name = store.committed_name(step)
    remote = read_remote_manifest(client, loc, step)
    if remote is not None:
        if checkpoint_id(remote) == ident:
            return {"step": step, "bytes": 0, "skipped_files": 0, "status": "already-there"}
        if not replace:
            return {"step": step, "bytes": 0, "skipped_files": 0, "status": "kept-remote"}
        say(f"replacing {loc.uri(name)}/ (another commit of step {step}): its marker goes first")
        client.delete_object(Bucket=loc.bucket, Key=loc.key(name, store.MARKER))
    files = local_files(path)
    extra = {"Metadata": {ID_METADATA: ident}}
    todo = {rel: size for rel, size in files.items()
            if not (resume and _object_matches(client, loc, loc.key(name, rel), size, ident))}
    with create_transfer_manager(client, transfer_config(cfg, limit_bandwidth)) as manager:
        futures = [manager.upload(str(path / rel), loc.bucket, loc.key(name, rel), extra_args=extra,
                                  subscribers=_progress_subscribers(progress)) for rel in todo]
        for future in futures:
            future.result()  # the first failure raises; leaving the block cancels the rest
    # The checkpoint may have been committed again at this path meanwhile: never mark a mix.
    if (store.read_manifest(path) or {}).get("created_unix") != manifest.get("created_unix") \
            or local_files(path) != files:
        raise RuntimeError(f"{path} changed while it was uploaded; it will be uploaded again")
    marker = json.dumps({**manifest, "files": files}, indent=2, sort_keys=True).encode()
    client.put_object(Bucket=loc.bucket, Key=loc.key(name, store.MARKER), Body=marker,
                      ContentType="application/json", Metadata={ID_METADATA: ident})
    return {"step": step, "bytes": sum(todo.values()), "skipped_files": len(files) - len(todo), "status": "uploaded"}


def remove_stale_downloads(root: Path) -> list[Path]:
    """Delete partial downloads a previous restore left (copies of S3 data, never the only copy);
    partial checkpoints written by training are left alone."""
    removed = []
    if root.is_dir():
        for entry in sorted(root.glob("step_*.incomplete-*")):
            if (entry / DOWNLOAD_MARK).is_file():
                shutil.rmtree(entry)
                removed.append(entry)
    return removed


def download_checkpoint(client: Any, cfg: S3Config, loc: S3Location, remote: RemoteCheckpoint, manifest: dict,
                        root: Path, progress: Progress = None) -> store.CheckpointInfo:
    """Download a complete checkpoint into ``root`` with the local commit discipline: files go
    into ``step_N.incomplete-<id>/``, sizes are checked, then the marker and the atomic rename."""
    from boto3.s3.transfer import create_transfer_manager

    step = remote.step
    name = store.committed_name(step)
    partial = root / store.partial_name(step, uuid.uuid4().hex[:8])
    partial.mkdir(parents=True)
    (partial / DOWNLOAD_MARK).write_text(loc.uri(name) + "\n")
    files: dict[str, int] = manifest["files"]
    for rel in files:
        (partial / rel).parent.mkdir(parents=True, exist_ok=True)
    with create_transfer_manager(client, transfer_config(cfg)) as manager:
        futures = [manager.download(loc.bucket, loc.key(name, rel), str(partial / rel),
                                    subscribers=_progress_subscribers(progress)) for rel in files]
        for future in futures:
            future.result()
    for rel, size in files.items():
        got = (partial / rel).stat().st_size
        if got != size:
            raise RuntimeError(f"{loc.uri(name, rel)}: downloaded {got} bytes, the marker says {size}; "
                               f"the partial download stays at {partial}")
        atomic.fsync_file(partial / rel)
    (partial / DOWNLOAD_MARK).unlink()
    final = store.commit(partial, manifest)
    return store.CheckpointInfo(step, final, manifest)


def apply_remote_retention(client: Any, loc: S3Location, keep_last: int) -> list[int]:
    """Delete complete checkpoints older than the newest ``keep_last`` under the prefix.

    Incomplete ones are never touched, so the newest complete checkpoint is never deleted. Each
    victim loses its marker first: a reader racing the deletion sees no checkpoint, never a torn one.
    """
    if keep_last <= 0:
        return []
    complete = [r for r in list_remote(client, loc) if r.complete]
    deleted = []
    for victim in complete[:-keep_last]:
        name = store.committed_name(victim.step)
        client.delete_object(Bucket=loc.bucket, Key=loc.key(name, store.MARKER))
        keys = [loc.key(name, rel) for rel in victim.files]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            client.delete_objects(Bucket=loc.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                             "Quiet": True})
        deleted.append(victim.step)
    return deleted


def restore_newest(cfg: S3Config, root: Path, say: Callable[[str], None]) -> Optional[store.CheckpointInfo]:
    """Download the newest complete checkpoint under ``cfg.uri`` into ``root``; None if there is none."""
    loc = parse_s3_uri(cfg.uri)
    client = make_client(cfg)
    for stale in remove_stale_downloads(root):
        say(f"removed {stale}: a partial download from S3 left by an earlier start")
    found = newest_complete(client, loc, say=say)
    if found is None:
        say(f"no complete checkpoint under {cfg.uri}: starting from scratch")
        return None
    remote, manifest = found
    total = sum(manifest["files"].values())
    say(f"no complete checkpoint in {root}: restoring step {remote.step} from {loc.uri(store.committed_name(remote.step))}/ "
        f"({len(manifest['files'])} files, {total / 1e6:.1f} MB)")
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    info = download_checkpoint(client, cfg, loc, remote, manifest, root)
    seconds = time.perf_counter() - t0
    say(f"restored step {remote.step} from S3 in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.1f} MB/s) "
        f"-> {info.path}")
    return info


def check_access(cfg: S3Config) -> Optional[str]:
    """Start-up check of the bucket. Returns a configuration error to stop the job with (no
    credentials, no such bucket, access denied), or None; an unreachable endpoint is only a
    warning here, printed by the caller from the raised exception."""
    from botocore.exceptions import NoCredentialsError

    loc = parse_s3_uri(cfg.uri)
    try:
        make_client(cfg, max_attempts=2).head_bucket(Bucket=loc.bucket)
    except NoCredentialsError:
        return ("checkpoint.s3.uri is set but boto3 found no credentials in its default chain: in the cluster, "
                "annotate the job's ServiceAccount for IRSA (eks.amazonaws.com/role-arn) or use EKS Pod Identity; "
                "locally, set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    except Exception as exc:
        code = error_code(exc)
        where = f" at {cfg.endpoint_url}" if cfg.endpoint_url else ""
        if code in ("404", "NoSuchBucket"):
            return (f"checkpoint.s3.uri={cfg.uri!r}: bucket {loc.bucket!r} does not exist{where}; create it "
                    "(the job never creates buckets) or fix the uri")
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return (f"checkpoint.s3.uri={cfg.uri!r}: access to bucket {loc.bucket!r} denied{where} ({code}); grant "
                    "the job's role s3:ListBucket on the bucket and s3:GetObject, s3:PutObject, s3:DeleteObject "
                    "on the prefix")
        raise
    return None


# ---- the background uploader (rank 0) -----------------------------------------------------------

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
    def submit(self, step: int, path: Path, adopt: bool = False) -> None:
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
