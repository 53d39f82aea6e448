"""Checkpoint directory layout, atomic commits, discovery and retention.

Layout under ``checkpoint.dir``::

    step_00000040/                  a committed checkpoint: data files + COMPLETE
    step_00000050.incomplete-<id>/  being written, or abandoned by a crash: never loaded

A checkpoint becomes visible in two steps, both on rank 0 after every rank's data and the
metadata are on disk: ``COMPLETE`` (a JSON manifest) is written and fsynced inside the
directory, then the directory is renamed to its final name (atomic on POSIX file systems,
Lustre included). A reader therefore sees either no ``step_N`` or a complete one. Nothing here
deletes an incomplete or unreadable checkpoint: it is reported and left for the operator.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .. import atomic

MARKER = "COMPLETE"
_COMMITTED = re.compile(r"^step_(\d{8})$")
_PARTIAL = re.compile(r"^step_(\d{8})\.incomplete-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the previous committed one is intact."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    manifest: dict


def committed_name(step: int) -> str:
    return f"step_{step:08d}"


def partial_name(step: int, token: str) -> str:
    return f"step_{step:08d}.incomplete-{token}"


def commit(partial: Path, manifest: dict) -> Path:
    """Mark ``partial`` complete and rename it to its final name; returns the final path.

    If a committed checkpoint of the same step already exists (a run resumed from an older one
    with ``checkpoint.resume_from``), it is moved aside to ``<name>.superseded-<time>``, not deleted.
    """
    atomic.write_json(partial / MARKER, manifest, newline=False)
    final = partial.parent / committed_name(manifest["step"])
    if final.exists():
        atomic.rename(final, final.with_name(f"{final.name}.superseded-{int(time.time())}"))
    atomic.rename(partial, final)
    return final


def read_manifest(path: Path) -> Optional[dict]:
    try:
        manifest = json.loads((path / MARKER).read_text())
        return manifest if isinstance(manifest, dict) and "step" in manifest else None
    except (OSError, ValueError):
        return None


def scan(root: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """Committed checkpoints (oldest first) and the paths that are not usable checkpoints.

    A ``step_N`` directory without a readable ``COMPLETE`` manifest, or whose manifest names
    another step, counts as unusable, as does every ``.incomplete-*`` directory.
    """
    good, bad = [], []
    if not root.is_dir():
        return good, bad
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        m = _COMMITTED.match(entry.name)
        if m:
            manifest = read_manifest(entry)
            if manifest is not None and manifest.get("step") == int(m.group(1)):
                good.append(CheckpointInfo(int(m.group(1)), entry, manifest))
            else:
                bad.append(entry)
        elif _PARTIAL.match(entry.name):
            bad.append(entry)
    good.sort(key=lambda c: c.step)
    return good, bad


def retention_victims(committed: list[CheckpointInfo], keep_last: int) -> list[CheckpointInfo]:
    """Committed checkpoints older than the newest ``keep_last`` (0 keeps all)."""
    if keep_last <= 0 or len(committed) <= keep_last:
        return []
    return committed[:-keep_last]


def apply_retention(root: Path, keep_last: int, held: Callable[[Path], bool] = lambda _p: False) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep_last``, except ``held`` ones (an
    upload to the S3 tier still reads them); returns what was deleted. Only committed checkpoints:
    never the newest, never an incomplete one (those are the operator's to inspect)."""
    committed, _ = scan(root)
    deleted = []
    for victim in retention_victims(committed, keep_last):
        if held(victim.path):
            continue
        for f in sorted(victim.path.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        victim.path.rmdir()
        deleted.append(victim.path)
    return deleted


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# Written after the writers finish: DCP's metadata (finalize) and the manifest (commit).
_NOT_WRITTEN_BY_WRITERS = (".metadata", MARKER)


def written_bytes(path: Path) -> int:
    """Bytes the checkpoint writers put in ``path``, metadata and manifest not counted."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name not in _NOT_WRITTEN_BY_WRITERS)
