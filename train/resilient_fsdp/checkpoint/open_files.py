"""A process's open-files limit (``RLIMIT_NOFILE``): its soft limit raised to the hard limit at start.

The rank's process (:mod:`resilient_fsdp.train.resources`) and its checkpoint writer
(:mod:`.writer.worker`) call :func:`raise_soft_limit` first thing and say once what they found:
many container runtimes start a container with a soft limit of 1024 and a far higher hard one,
and an unprivileged process may raise its soft limit up to the hard one. Where the hard limit is
1024 too, the checkpoint's staging still fits (one descriptor per rank and writer, :mod:`.arena`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Optional

# Where the hard limit is unlimited, the kernel still caps descriptors at fs.nr_open.
_NR_OPEN = "/proc/sys/fs/nr_open"


@dataclass(frozen=True)
class OpenFilesLimit:
    """What :func:`raise_soft_limit` found and left: the soft limit before and after, the hard
    limit, and why the soft one could not be raised, if it could not."""

    before: int
    soft: int
    hard: int
    error: Optional[str] = None

    def describe(self) -> str:
        found = f"open files (RLIMIT_NOFILE): soft limit {_text(self.before)}, hard limit {_text(self.hard)}"
        if self.error:
            return f"{found}; raising the soft limit failed: {self.error}"
        if self.soft != self.before:
            return f"{found}; soft limit raised to {_text(self.soft)}"
        return f"{found}; nothing to raise"


_FIRST: Optional[OpenFilesLimit] = None


def raise_soft_limit() -> tuple[OpenFilesLimit, bool]:
    """Raise this process's soft ``nofile`` limit to its hard limit; (what was found and left,
    whether this was the process's first call: later calls change nothing and return the first
    call's result)."""
    global _FIRST
    if _FIRST is not None:
        return _FIRST, False
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    result = OpenFilesLimit(soft, soft, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            result = OpenFilesLimit(soft, target, hard)
        except (OSError, ValueError) as exc:
            result = OpenFilesLimit(soft, soft, hard, f"{type(exc).__name__}: {exc}")
    _FIRST = result
    return result, True


def _nr_open() -> int:
    try:
        with open(_NR_OPEN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's default fs.nr_open


def _text(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)
