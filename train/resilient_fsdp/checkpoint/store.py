"""Checkpoint directory layout (the name patterns below), atomic commits, recovery, discovery and
retention. Used by the checkpointer, resume, the S3 tier and ``resilient-fsdp checkpoints``.

**Commit** (:func:`commit`): ``COMPLETE`` (the manifest, every file's size and checksum) is
written and fsynced inside the partial directory, which is then renamed to ``step_N``: a reader
sees no ``step_N`` or a complete one. **Retention** (:func:`apply_retention`) marks a victim
``.deleting-<id>`` before it deletes, so a crash mid-delete never leaves a ``step_N`` that scans as
good. **Torn writes** are swept by rank 0 under the lease (:func:`sweep_torn`), so any number of
kills during saves leaves at most one incomplete directory. Never deleted: a committed checkpoint
kept by ``keep_last``, a set-aside (``.abandoned-*``, ``.suspect-*``: the operator's), a
``step_N`` without a readable manifest. On the volume: at most ``keep_last`` committed
checkpoints, one write in flight, one torn write, superseded copies of kept steps.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .. import atomic

MARKER = "COMPLETE"  # the manifest inside a committed checkpoint
# The commit's index of DCP's .metadata, which a resume reads instead (metadata_index).
INDEX_FILE = ".metadata-index"
_COMMITTED = re.compile(r"^step_(\d{8})$")  # a committed checkpoint: data files + COMPLETE
# Being written, or torn by a failed, timed-out or killed write: never loaded.
_PARTIAL = re.compile(r"^step_(\d{8})\.incomplete-([0-9a-f]+)$")
# An older commit of a step, moved aside by a newer one (a rewound timeline commits a step again).
_SUPERSEDED = re.compile(r"^step_(\d{8})\.superseded-\d+(?:-[0-9a-f]+)?$")
# Newer than ``resume_from`` at a job's first start; saved after the replicas last agreed.
_ABANDONED = re.compile(r"^step_(\d{8})\.abandoned-\d+(?:-[0-9a-f]+)?$")
_SUSPECT = re.compile(r"^step_(\d{8})\.suspect-\d+-[0-9a-f]+$")
_DELETING = re.compile(r"^step_\d{8}.*\.deleting-[0-9a-f]+$")  # being deleted by retention or the sweep
# Torn and leftover directories removed per sweep: a sweep after a crash loop must not hold up
# the retention thread for long; the rest go at the next pass.
SWEEP_CAP = 4


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


def _token() -> str:
    return uuid.uuid4().hex[:8]


def commit(partial: Path, manifest: dict) -> Path:
    """Mark ``partial`` complete and rename it to its final name; returns the final path.

    A committed checkpoint of the same step that is already there (a rewound timeline, a
    checkpoint skipped as unreadable) is moved aside to ``<name>.superseded-<time>-<id>``.
    """
    atomic.write_json(partial / MARKER, manifest, newline=False)
    final = partial.parent / committed_name(manifest["step"])
    if final.exists():
        m = _PARTIAL.match(partial.name)
        ident = m.group(2) if m else _token()
        atomic.rename(final, final.with_name(f"{final.name}.superseded-{int(time.time())}-{ident}"))
    atomic.rename(partial, final)
    return final


def read_manifest(path: Path) -> Optional[dict]:
    try:
        manifest = json.loads((path / MARKER).read_text())
        return manifest if isinstance(manifest, dict) and "step" in manifest else None
    except (OSError, ValueError):
        return None


def recover(root: Path) -> list[Path]:
    """Complete commits that a crash cut between their two renames: a partial directory whose
    ``COMPLETE`` names its step, where no ``step_N`` exists, becomes ``step_N``. Returns them."""
    done = []
    if not root.is_dir():
        return done
    for entry in sorted(root.iterdir()):
        m = _PARTIAL.match(entry.name)
        if not m or not entry.is_dir():
            continue
        manifest = read_manifest(entry)
        final = root / committed_name(int(m.group(1)))
        if manifest is not None and manifest.get("step") == int(m.group(1)) and not final.exists():
            atomic.rename(entry, final)
            done.append(final)
    return done


def scan(root: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """Committed checkpoints (oldest first) and the paths that are not usable checkpoints.

    A ``step_N`` directory without a readable ``COMPLETE`` manifest, or whose manifest names
    another step, counts as unusable, as does every ``.incomplete-*`` directory. Superseded,
    abandoned and ``.deleting`` directories are neither (see :func:`aside`).
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


def aside(root: Path) -> dict[str, list[tuple[int, Path]]]:
    """Directories set aside, by kind (``superseded``, ``abandoned``, ``suspect``, ``deleting``):
    (step, path)."""
    found: dict[str, list[tuple[int, Path]]] = {"superseded": [], "abandoned": [], "suspect": [], "deleting": []}
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        step = int(entry.name[5:13]) if entry.name[5:13].isdigit() else -1
        if _DELETING.match(entry.name):
            found["deleting"].append((step, entry))
        elif _SUPERSEDED.match(entry.name):
            found["superseded"].append((step, entry))
        elif _ABANDONED.match(entry.name):
            found["abandoned"].append((step, entry))
        elif _SUSPECT.match(entry.name):
            found["suspect"].append((step, entry))
    return found


def set_aside_newer(root: Path, step: int, kind: str = "abandoned", up_to: Optional[int] = None) -> list[Path]:
    """Rename every committed checkpoint newer than ``step`` (and at most ``up_to``) to
    ``<name>.<kind>-<time>-<id>``: ``abandoned`` at a job's first start with ``resume_from``,
    ``suspect`` after a replica mismatch. Never deleted, never picked again."""
    moved = []
    stamp = f"{int(time.time())}-{_token()}"
    for info in scan(root)[0]:
        if info.step > step and (up_to is None or info.step <= up_to):
            target = info.path.with_name(f"{info.path.name}.{kind}-{stamp}")
            atomic.rename(info.path, target)
            moved.append(target)
    return moved


def retention_victims(committed: list[CheckpointInfo], keep_last: int) -> list[CheckpointInfo]:
    """Committed checkpoints older than the newest ``keep_last`` (0 keeps all)."""
    if keep_last <= 0 or len(committed) <= keep_last:
        return []
    return committed[:-keep_last]


def apply_retention(
    root: Path,
    keep_last: int,
    held: Callable[[Path], bool] = lambda _p: False,
    say: Callable[[str], None] = lambda _m: None,
    lease_lost: Callable[[], Optional[str]] = lambda: None,
) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep_last``, and superseded copies of
    steps older than the oldest one kept, except ``held`` ones (an upload still reads them);
    returns what was deleted. Never the newest (what a resume decision depends on: a
    ``resume_from`` target is kept while it is the newest its job can resume from), never an
    incomplete or abandoned one.

    Best-effort: a failure is reported through ``say`` and the rest goes on. Each victim is
    renamed to ``.deleting-<id>`` before anything inside it is removed. ``lease_lost`` is asked
    before each: once it gives a reason (the lease is another job's) nothing more is deleted,
    since what this job took for old may be the other job's newest.
    """
    committed, _ = scan(root)
    victims = [v.path for v in retention_victims(committed, keep_last)]
    if keep_last > 0 and committed:
        oldest_kept = committed[-min(keep_last, len(committed))].step
        victims += [p for step, p in aside(root)["superseded"] if step < oldest_kept]
    deleted, removed = [], set()
    for path in victims:
        if held(path):
            continue
        if _lease_lost(lease_lost, say, "retention"):
            return deleted
        try:
            marked = path.with_name(f"{path.name}.deleting-{_token()}")
            atomic.rename(path, marked)
        except OSError as exc:
            say(f"warning: retention could not remove {path} ({exc.strerror or exc}); training goes on")
            continue
        deleted.append(path)
        removed.add(marked)
        _remove(marked, say)
    for _step, leftover in aside(root)["deleting"]:
        if leftover not in removed:
            _remove(leftover, say)
    return deleted


def torn_names(root: Path) -> list[str]:
    """Names of the incomplete and leftover ``.deleting`` directories in ``root`` now: what a sweep
    may consider. Listed on the thread that starts writes, while none is in flight, so a write that
    starts later can never be among them."""
    try:
        return sorted(e.name for e in root.iterdir() if _PARTIAL.match(e.name) or _DELETING.match(e.name))
    except OSError:
        return []


def sweep_victims(
    root: Path,
    names: list[str],
    newest_committed: Optional[int],
    stale: frozenset[str] = frozenset(),
    in_flight: Optional[Path] = None,
) -> list[Path]:
    """Which of ``names`` (:func:`torn_names`) a sweep removes, by name: leftover deletions,
    incomplete directories at or below ``newest_committed`` (a later commit reached their step:
    never resumable), and those in ``stale`` (listed at the job's start, before it had a write in
    flight: a write is committed only by the process that started it, which is gone); never
    ``in_flight``."""
    torn = []
    for name in names:
        if in_flight is not None and name == in_flight.name:
            continue
        m = _PARTIAL.match(name)
        if m is None or name in stale or (newest_committed is not None and int(m.group(1)) <= newest_committed):
            torn.append(root / name)
    return torn


def _lease_lost(lease_lost: Callable[[], Optional[str]], say: Callable[[str], None], what: str) -> bool:
    why = lease_lost()
    if why:
        say(f"warning: {what} stopped, nothing more deleted: {why}")
    return bool(why)


def sweep_torn(
    root: Path,
    names: list[str],
    stale: frozenset[str] = frozenset(),
    in_flight: Optional[Path] = None,
    say: Callable[[str], None] = lambda _m: None,
    record: Callable[[dict], None] = lambda _r: None,
    cap: int = SWEEP_CAP,
    lease_lost: Callable[[], Optional[str]] = lambda: None,
) -> list[Path]:
    """Remove torn writes and leftover ``.deleting`` directories among ``names`` (at most ``cap``,
    the rest at the next pass); each removal is said and recorded (a ``checkpoint_swept`` event).
    Returns what was removed. Run by rank 0 while it holds the lease: no other job writes here.
    ``lease_lost`` is asked before each removal, as in :func:`apply_retention`: a write torn for
    this job may be another job's write in progress once the lease is that job's."""
    committed, _ = scan(root)
    newest = committed[-1].step if committed else None
    removed = []
    for path in sweep_victims(root, names, newest, stale, in_flight)[:cap]:
        if not path.is_dir():
            continue
        if _lease_lost(lease_lost, say, "the sweep of torn writes"):
            return removed
        kind = "deleting" if _DELETING.match(path.name) else "incomplete"
        try:
            nbytes = dir_bytes(path)
            marked = path if kind == "deleting" else path.with_name(f"{path.name}.deleting-{_token()}")
            if marked != path:
                atomic.rename(path, marked)
        except OSError as exc:
            say(
                f"warning: could not remove torn checkpoint directory {path} ({exc.strerror or exc}); "
                "tried again at the next pass; training goes on"
            )
            continue
        _remove(marked, say)
        removed.append(path)
        why = (
            "a leftover of an interrupted deletion"
            if kind == "deleting"
            else (
                "an incomplete write of an earlier attempt"
                if path.name in stale
                else f"an incomplete write; step {newest} is committed"
            )
        )
        say(f"removed torn checkpoint directory {path} ({nbytes / 1e6:.1f} MB, {why})")
        record(
            {
                "event": "checkpoint_swept",
                "t": time.time(),
                "path": str(path),
                "kind": kind,
                "bytes": nbytes,
                "newest_committed": newest,
            }
        )
    return removed


def _remove(path: Path, say: Callable[[str], None]) -> None:
    errors: list[str] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, p, exc: errors.append(f"{p}: {exc}"))
    else:
        shutil.rmtree(path, onerror=lambda _fn, p, info: errors.append(f"{p}: {info[1]}"))
    if errors:
        say(
            f"warning: retention could not delete everything in {path} ({errors[0]}"
            + (f", and {len(errors) - 1} more" if len(errors) > 1 else "")
            + "); it is not a checkpoint any more "
            "and is tried again after the next commit; training goes on"
        )


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# Written after the writers finish: DCP's metadata and its index (finalize) and the manifest (commit).
_NOT_WRITTEN_BY_WRITERS = (".metadata", INDEX_FILE, MARKER)


def written_bytes(path: Path) -> int:
    """Bytes the checkpoint writers put in ``path``, metadata and manifest not counted."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name not in _NOT_WRITTEN_BY_WRITERS)


def expected_written_bytes(root: Path, world_size: int, mode: str) -> Optional[int]:
    """What the writers of a save put on disk, taken from the newest committed checkpoint of
    ``world_size`` and ``mode`` under ``root`` (a save of the same state writes the same files);
    None if there is none."""
    for ckpt in reversed(scan(root)[0]):
        m = ckpt.manifest
        if m.get("world_size") == world_size and m.get("mode") == mode:
            return written_bytes(ckpt.path)
    return None
