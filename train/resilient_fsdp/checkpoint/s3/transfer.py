"""Moving one checkpoint: upload (data files, then the marker), download (committed like a
freshly written checkpoint), and the restore of the newest complete one at start."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from ... import atomic
from ...config import S3Config
from .. import store
from .client import S3Location, error_code, make_client, parse_s3_uri, transfer_config
from .remote import (DOWNLOAD_MARK, ID_METADATA, RemoteCheckpoint, checkpoint_id, local_files, newest_complete,
                     read_remote_manifest)

Progress = Optional[Callable[[int], None]]  # called with bytes moved since the last call


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
