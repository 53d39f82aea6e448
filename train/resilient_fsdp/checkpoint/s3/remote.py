"""What is under the prefix: checkpoints complete or not, their markers, retention there, and the
sweep of prefixes that torn uploads left without a marker."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .. import store
from .client import S3Location, error_code

# Object metadata naming the checkpoint a file belongs to: a retried upload skips files that
# are already there for the same checkpoint, and never keeps ones of another checkpoint.
ID_METADATA = "checkpoint-id"
# Inside a partial download: marks it as a copy of S3 data, which a later restore may delete.
DOWNLOAD_MARK = ".s3-download"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


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
            step_dir, _, rel = obj["Key"][len(base) :].partition("/")
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


def newest_complete(
    client: Any, loc: S3Location, step: Optional[int] = None, say: Callable[[str], None] = lambda _m: None
) -> Optional[tuple[RemoteCheckpoint, dict]]:
    """The newest complete checkpoint under the prefix (or ``step``), with its manifest.

    Prefixes without a marker (uploads in progress or cut off) are skipped and named; so is a
    marker that cannot be read, and then the next older checkpoint is taken.
    """
    remote = list_remote(client, loc)
    for entry in reversed(remote):
        if step is not None and entry.step != step:
            continue
        if not entry.complete:
            say(
                f"skipping {loc.uri(store.committed_name(entry.step))}/: no {store.MARKER} marker "
                "(an upload in progress or cut off)"
            )
            continue
        manifest = read_remote_manifest(client, loc, entry.step)
        if manifest is None:
            say(f"skipping {loc.uri(store.committed_name(entry.step))}/: unreadable {store.MARKER} marker")
            continue
        missing = [n for n, size in manifest["files"].items() if entry.files.get(n) != size]
        if missing:
            say(
                f"skipping {loc.uri(store.committed_name(entry.step))}/: marker lists {len(missing)} file(s) "
                f"that are missing or of another size, e.g. {missing[0]}"
            )
            continue
        return entry, manifest
    return None


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
            client.delete_objects(
                Bucket=loc.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            )
        deleted.append(victim.step)
    return deleted


# Marker-less prefixes deleted per sweep; the rest go after the next upload.
SWEEP_CAP = 4


def sweep_torn_remote(client: Any, loc: S3Location, cap: int = SWEEP_CAP) -> list[tuple[int, int]]:
    """Delete ``step_N/`` prefixes without a marker that are older than the newest marked one
    (uploads cut off or superseded: a marker never follows once a newer one is put), at most
    ``cap``; returns their (step, bytes). Rank 0's uploader calls it, under the job's lease.

    A prefix newer than the newest marked one may be an upload in progress and is never touched.
    """
    remote = list_remote(client, loc)
    marked = [r.step for r in remote if r.complete]
    if not marked:
        return []
    swept = []
    for torn in [r for r in remote if not r.complete and r.step < marked[-1]][:cap]:
        keys = [loc.key(store.committed_name(torn.step), rel) for rel in torn.files]
        for i in range(0, len(keys), 1000):
            client.delete_objects(
                Bucket=loc.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            )
        swept.append((torn.step, sum(torn.files.values())))
    return swept
