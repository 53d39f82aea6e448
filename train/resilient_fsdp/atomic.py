"""Atomic, durable file writes: a reader sees the old file or the new one, never a torn one.

Every file this project replaces in place (``summary.json``, fault recovery records, the GPU
check's reports, a checkpoint's ``COMPLETE`` marker) goes through :func:`write_bytes`: the data is
written to a hidden temporary file beside the target, fsynced, renamed over the target (atomic on
POSIX file systems, Lustre included), and the directory is fsynced so the rename survives a
crash. :func:`create_exclusive` claims a name once (the fault ledger), :func:`rename` makes a
directory rename durable (a checkpoint's commit). Standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (a rename or a new file in it) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else (a download) to stable storage."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_stream(stream: Any) -> None:
    """Flush an open file (a checkpoint file a writer is still writing) to stable storage."""
    stream.flush()
    os.fsync(stream.fileno())


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(
    path: Path,
    data: Any,
    *,
    indent: Optional[int] = 2,
    sort_keys: bool = True,
    default: Optional[Callable[[Any], Any]] = None,
    newline: bool = True,
) -> None:
    """:func:`write_bytes` of ``data`` as JSON (by default indented, sorted, one final newline)."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=default)
    write_text(path, text + "\n" if newline else text)


def create_exclusive(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists; False if it did. Durable on return: the
    caller may be killed next (a fault it records), and the record must survive it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True


def rename(src: Path, dst: Path) -> None:
    """Rename ``src`` (a file or a directory) to ``dst`` and make the rename durable."""
    os.rename(src, dst)
    fsync_dir(Path(dst).parent)
