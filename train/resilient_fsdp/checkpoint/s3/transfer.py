"""Moving one checkpoint's files: upload (data files, then the marker), download (checked,
resumable, committed like a freshly written checkpoint)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ... import atomic
from ...config import S3Config
from .. import integrity, store
from .client import S3Location, error_code, transfer_config
from .remote import (DOWNLOAD_MARK, ID_METADATA, RemoteCheckpoint, checkpoint_id, local_files,
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


def prepare_download(root: Path, step: int, ident: str, uri: str) -> tuple[Path, int]:
    """The directory a download of checkpoint ``ident`` (step ``step``) goes into: the partial
    download an earlier start left for the same checkpoint, resumed (returns how many files it
    already holds), else a new one. Partial downloads of other checkpoints are deleted (copies of
    S3 data, never the only copy); partial checkpoints written by training are left alone."""
    reuse = None
    if root.is_dir():
        for entry in sorted(root.glob("step_*.incomplete-*")):
            mark = entry / DOWNLOAD_MARK
            if not mark.is_file():
                continue
            try:
                same = json.loads(mark.read_text()).get("id") == ident and entry.name.startswith(store.committed_name(step))
            except ValueError:
                same = False
            if same and reuse is None:
                reuse = entry
            else:
                shutil.rmtree(entry, ignore_errors=True)
    if reuse is not None:
        return reuse, sum(1 for f in reuse.rglob("*") if f.is_file() and f.name != DOWNLOAD_MARK)
    partial = root / store.partial_name(step, ident[:12])
    partial.mkdir(parents=True)
    (partial / DOWNLOAD_MARK).write_text(json.dumps({"uri": uri, "id": ident}) + "\n")
    return partial, 0


def remove_stale_downloads(root: Path) -> list[Path]:
    """Delete every partial download a previous restore or pull left."""
    removed = []
    if root.is_dir():
        for entry in sorted(root.glob("step_*.incomplete-*")):
            if (entry / DOWNLOAD_MARK).is_file():
                shutil.rmtree(entry)
                removed.append(entry)
    return removed


def download_files(client: Any, cfg: S3Config, loc: S3Location, manifest: dict, names: list[str], partial: Path,
                   verify: bool, progress: Progress = None) -> int:
    """Download ``names`` of the checkpoint ``manifest`` describes into ``partial``, each file
    checked against the marker's size and (``verify``) the checksum recorded when it was written.
    A file already there that passes is not downloaded again (a resumed download); one that fails
    is deleted and the download raises, naming it. Returns the bytes downloaded."""
    from boto3.s3.transfer import create_transfer_manager

    name = store.committed_name(int(manifest["step"]))
    sizes: dict[str, int] = manifest["files"]
    sums = manifest.get("checksums") or {}

    def good(rel: str) -> Optional[str]:
        path = partial / rel
        if not path.is_file() or path.stat().st_size != sizes[rel]:
            return f"{loc.uri(name, rel)}: {path.stat().st_size if path.is_file() else 'no'} bytes, the marker says {sizes[rel]}"
        if verify and rel in sums:
            problems = integrity.verify(partial, sums, [rel])
            return f"{loc.uri(name, rel)}: {problems[0]}" if problems else None
        return None

    todo = [rel for rel in names if good(rel) is not None]
    for rel in todo:
        (partial / rel).parent.mkdir(parents=True, exist_ok=True)
    with create_transfer_manager(client, transfer_config(cfg)) as manager:
        futures = [manager.download(loc.bucket, loc.key(name, rel), str(partial / rel),
                                    subscribers=_progress_subscribers(progress)) for rel in todo]
        for future in futures:
            future.result()
    for rel in names:
        problem = good(rel)
        if problem:
            (partial / rel).unlink(missing_ok=True)
            raise RuntimeError(f"{problem}; the file was deleted and is downloaded again by the next attempt")
        atomic.fsync_file(partial / rel)
    return sum(sizes[rel] for rel in todo)


def commit_download(partial: Path, manifest: dict) -> store.CheckpointInfo:
    """Commit a finished download exactly like a freshly written checkpoint."""
    (partial / DOWNLOAD_MARK).unlink(missing_ok=True)
    final = store.commit(partial, manifest)
    return store.CheckpointInfo(int(manifest["step"]), final, manifest)


def download_checkpoint(client: Any, cfg: S3Config, loc: S3Location, remote: RemoteCheckpoint, manifest: dict,
                        root: Path, progress: Progress = None, verify: bool = True) -> store.CheckpointInfo:
    """Download a complete checkpoint into ``root`` in this process, with the local commit
    discipline: files go into ``step_N.incomplete-<id>/`` (resumed if an earlier download of the
    same checkpoint was cut off), are checked, then the marker and the atomic rename."""
    partial, _ = prepare_download(root, remote.step, checkpoint_id(manifest), loc.uri(store.committed_name(remote.step)))
    download_files(client, cfg, loc, manifest, list(manifest["files"]), partial, verify, progress)
    return commit_download(partial, manifest)
