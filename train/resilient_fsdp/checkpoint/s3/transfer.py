"""Moving one checkpoint's files: upload (data files, then the marker), download (checked,
resumable, committed like a freshly written checkpoint)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from ... import atomic
from ...config import S3Config
from .. import integrity, store
from .client import S3Location, error_code, transfer_config
from .remote import DOWNLOAD_MARK, ID_METADATA, RemoteCheckpoint, checkpoint_id, local_files, read_remote_manifest

Progress = Optional[Callable[[int], None]]  # called with bytes moved since the last call
RECEIPTS = ".uploads"  # step_N/.uploads/<checkpoint id>/rank<R>: rank R uploaded its files


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


def file_sizes(path: Path, manifest: dict) -> dict[str, int]:
    """A committed checkpoint's data files and sizes: from its checksums, else from the directory."""
    sums = manifest.get("checksums")
    return {n: int(e["bytes"]) for n, e in sorted(sums.items())} if sums else local_files(path)


def _check_remote(
    client: Any, loc: S3Location, manifest: dict, replace: bool, say: Callable[[str], None]
) -> Optional[str]:
    """``already-there`` / ``kept-remote`` when nothing is to be uploaded; None otherwise (an older
    commit of the step, when replaced, loses its marker first, so it is never a mix of two)."""
    step, ident = int(manifest["step"]), checkpoint_id(manifest)
    remote = read_remote_manifest(client, loc, step)
    if remote is None:
        return None
    if checkpoint_id(remote) == ident:
        return "already-there"
    if not replace:
        return "kept-remote"
    say(f"replacing {loc.uri(store.committed_name(step))}/ (another commit of step {step}): its marker goes first")
    client.delete_object(Bucket=loc.bucket, Key=loc.key(store.committed_name(step), store.MARKER))
    return None


def upload_files(
    client: Any,
    cfg: S3Config,
    loc: S3Location,
    path: Path,
    manifest: dict,
    names: list[str],
    *,
    progress: Progress = None,
    limit_bandwidth: bool = False,
) -> tuple[int, int]:
    """Upload ``names`` of the committed checkpoint at ``path``; (bytes sent, files skipped because
    S3 already holds them for this checkpoint). S3 checks each request's CRC32 on receipt."""
    from boto3.s3.transfer import create_transfer_manager

    step, ident = int(manifest["step"]), checkpoint_id(manifest)
    name, sizes = store.committed_name(step), file_sizes(path, manifest)
    extra = {"Metadata": {ID_METADATA: ident}, "ChecksumAlgorithm": "CRC32"}
    todo = {rel: sizes[rel] for rel in names if not _object_matches(client, loc, loc.key(name, rel), sizes[rel], ident)}
    with create_transfer_manager(client, transfer_config(cfg, limit_bandwidth)) as manager:
        futures = [
            manager.upload(
                str(path / rel),
                loc.bucket,
                loc.key(name, rel),
                extra_args=extra,
                subscribers=_progress_subscribers(progress),
            )
            for rel in todo
        ]
        for future in futures:
            future.result()  # the first failure raises; leaving the block cancels the rest
    # The checkpoint may have been committed again at this path meanwhile: never mark a mix.
    if (store.read_manifest(path) or {}).get("created_unix") != manifest.get("created_unix"):
        raise RuntimeError(f"{path} changed while it was uploaded; it will be uploaded again")
    return sum(todo.values()), len(names) - len(todo)


def receipt_prefix(loc: S3Location, manifest: dict) -> str:
    return loc.key(store.committed_name(int(manifest["step"])), RECEIPTS, checkpoint_id(manifest)) + "/"


def put_receipt(client: Any, loc: S3Location, manifest: dict, rank: int, names: list[str]) -> None:
    """Record under the checkpoint's prefix that ``rank`` uploaded its files of this commit."""
    client.put_object(
        Bucket=loc.bucket,
        Key=f"{receipt_prefix(loc, manifest)}rank{rank:05d}",
        Body=json.dumps({"files": names}).encode(),
    )


def receipt_ranks(client: Any, loc: S3Location, manifest: dict) -> set[int]:
    """The ranks whose receipt of this commit is there (each put by :func:`put_receipt`)."""
    prefix = receipt_prefix(loc, manifest)
    ranks = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            name = o["Key"][len(prefix) :]
            if name.startswith("rank") and name[4:].isdigit():
                ranks.add(int(name[4:]))
    return ranks


def put_marker(client: Any, loc: S3Location, path: Path, manifest: dict) -> None:
    """The marker, last: the local manifest plus the file list. Every file must be there already,
    at its size; the receipts are removed after it."""
    step, ident = int(manifest["step"]), checkpoint_id(manifest)
    name, files = store.committed_name(step), file_sizes(path, manifest)
    base = loc.key(name) + "/"
    present: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=base):
        present.update({o["Key"][len(base) :]: o["Size"] for o in page.get("Contents", [])})
    missing = [rel for rel, size in files.items() if present.get(rel) != size]
    if missing:
        raise RuntimeError(f"{loc.uri(name)}/ lacks {len(missing)} file(s) of this checkpoint, e.g. {missing[0]}")
    marker = json.dumps({**manifest, "files": files}, indent=2, sort_keys=True).encode()
    client.put_object(
        Bucket=loc.bucket,
        Key=loc.key(name, store.MARKER),
        Body=marker,
        ContentType="application/json",
        Metadata={ID_METADATA: ident},
    )
    receipts = [{"Key": k} for k in present if k.startswith(f"{RECEIPTS}/")]
    if receipts:
        client.delete_objects(
            Bucket=loc.bucket, Delete={"Objects": [{"Key": base + r["Key"]} for r in receipts], "Quiet": True}
        )


def upload_checkpoint(
    client: Any,
    cfg: S3Config,
    loc: S3Location,
    path: Path,
    *,
    replace: bool = True,
    resume: bool = False,
    progress: Progress = None,
    limit_bandwidth: bool = False,
    say: Callable[[str], None] = lambda _m: None,
) -> dict:
    """Upload the committed checkpoint at ``path`` from this process alone: data files first, the
    marker last (``resilient-fsdp checkpoints push``, the benchmark; a job spreads the files over
    its ranks, see :class:`.uploader.Uploader`).

    ``replace``: a complete checkpoint of the same step but another commit under the prefix is
    replaced (its marker is deleted first, so it is never a mix of two); otherwise it is kept and
    nothing is uploaded. Files S3 already holds for this checkpoint are skipped (a retry).
    Returns ``{"step", "bytes", "skipped_files", "status"}``; status is ``uploaded``,
    ``already-there`` or ``kept-remote``.
    """
    manifest = store.read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no readable {store.MARKER})")
    step = int(manifest["step"])
    status = _check_remote(client, loc, manifest, replace, say)
    if status:
        return {"step": step, "bytes": 0, "skipped_files": 0, "status": status}
    names = list(file_sizes(path, manifest))
    sent, skipped = upload_files(
        client, cfg, loc, path, manifest, names, progress=progress, limit_bandwidth=limit_bandwidth
    )
    put_marker(client, loc, path, manifest)
    return {"step": step, "bytes": sent, "skipped_files": skipped, "status": "uploaded"}


def upload_share(
    client: Any,
    cfg: S3Config,
    loc: S3Location,
    path: Path,
    manifest: dict,
    names: list[str],
    rank: int,
    *,
    replace: bool,
    limit_bandwidth: bool = False,
    say: Callable[[str], None] = lambda _m: None,
) -> dict:
    """One rank's part of a job's upload: its files, then its receipt (rank 0 puts the marker once
    every rank's receipt is there). Returns ``{"bytes", "skipped_files", "status"}``; status is
    ``sent``, ``already-there`` or ``kept-remote``."""
    status = _check_remote(client, loc, manifest, replace, say)
    if status:
        return {"bytes": 0, "skipped_files": 0, "status": status}
    sent, skipped = upload_files(client, cfg, loc, path, manifest, names, limit_bandwidth=limit_bandwidth)
    put_receipt(client, loc, manifest, rank, names)
    return {"bytes": sent, "skipped_files": skipped, "status": "sent"}


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
                same = json.loads(mark.read_text()).get("id") == ident and entry.name.startswith(
                    store.committed_name(step)
                )
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


def download_files(
    client: Any,
    cfg: S3Config,
    loc: S3Location,
    manifest: dict,
    names: list[str],
    partial: Path,
    verify: bool,
    progress: Progress = None,
) -> int:
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
            return f"{loc.uri(name, rel)}: {problems[0].split(': ', 1)[1]}" if problems else None
        return None

    todo = [rel for rel in names if good(rel) is not None]
    for rel in todo:
        (partial / rel).parent.mkdir(parents=True, exist_ok=True)
    with create_transfer_manager(client, transfer_config(cfg)) as manager:
        futures = [
            manager.download(
                loc.bucket, loc.key(name, rel), str(partial / rel), subscribers=_progress_subscribers(progress)
            )
            for rel in todo
        ]
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


def download_checkpoint(
    client: Any,
    cfg: S3Config,
    loc: S3Location,
    remote: RemoteCheckpoint,
    manifest: dict,
    root: Path,
    progress: Progress = None,
    verify: bool = True,
) -> store.CheckpointInfo:
    """Download a complete checkpoint into ``root`` in this process, with the local commit
    discipline: files go into ``step_N.incomplete-<id>/`` (resumed if an earlier download of the
    same checkpoint was cut off), are checked, then the marker and the atomic rename."""
    partial, _ = prepare_download(
        root, remote.step, checkpoint_id(manifest), loc.uri(store.committed_name(remote.step))
    )
    download_files(client, cfg, loc, manifest, list(manifest["files"]), partial, verify, progress)
    return commit_download(partial, manifest)
