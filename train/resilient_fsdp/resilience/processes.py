"""Process-tree helpers shared by the node agent and the local launcher (and the GPU check).

Linux: a child subreaper inherits the orphans of its descendants, so it can always reap them and
end them at the close.
"""

from __future__ import annotations

import ctypes
import sys

import psutil


def become_subreaper() -> None:
    # PR_SET_CHILD_SUBREAPER = 36: orphaned descendants re-parent to us, so we can always reap them.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def kill_descendants(timeout: float = 5.0) -> None:
    """Terminate, then kill, every process descended from this one (re-parented ones included)."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
