"""What a rank's process holds at the start of an attempt: its threads, open descriptors, TCP
connections, child processes and blocked helper threads (:data:`FIGURES`).

A process that outlives its attempts (an in-process restart re-enters training in it) must hold
as much at its tenth start as at its second: what an aborted attempt left behind would grow with
every restart. Every rank measures at the same point of each start (:func:`gather`); rank 0
records the figures in the ``start`` event, where the tests and the campaign compare them, and a
rank whose threads or descriptors grew names them (:func:`grown`). The trainer calls it.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from ..resilience import nvrx

# helpers_blocked: a failed attempt's helper threads still blocked on a group past its abort (gloo
# never wakes a message posted on a pair the abort's shutdown did not reach); each holds its group,
# whose threads and sockets count in the other figures, until the group's timeout.
FIGURES = ("threads", "open_files", "tcp_connections", "child_processes", "helpers_blocked")


def measure(process: Optional[psutil.Process] = None) -> dict[str, int]:
    """This process's figures now (or ``process``'s)."""
    process = process or psutil.Process()
    with process.oneshot():
        figures = {"threads": process.num_threads(), "open_files": process.num_fds()}
        try:
            figures["tcp_connections"] = len(process.net_connections(kind="tcp"))
        except (psutil.Error, OSError):
            figures["tcp_connections"] = -1  # not readable here: never equal to a real count
        figures["child_processes"] = len(process.children(recursive=True))
    figures["helpers_blocked"] = len(nvrx.blocked_helpers())
    return figures


def gather(device: torch.device) -> dict[str, list[int]]:
    """Collective: every rank's :func:`measure`, by figure, in rank order."""
    mine = measure()
    local = torch.tensor([mine[name] for name in FIGURES], dtype=torch.int64, device=device)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    rows = [t.tolist() for t in every]
    return {name: [row[i] for row in rows] for i, name in enumerate(FIGURES)}


# This process's threads and descriptors at its previous measured start (None until then).
_previous: Optional[Counter] = None


def thread_names() -> Counter:
    """This process's threads by name: a Python thread by its Python name, a native one (gloo's,
    the store's) by the kernel's."""
    python = {t.native_id: t.name for t in threading.enumerate()}
    names = []
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return Counter(python.values())
    for task in tasks:
        if int(task.name) in python:
            names.append(python[int(task.name)])
            continue
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue  # the thread ended while being read
    return Counter(names)


def descriptor_kinds() -> Counter:
    """This process's open descriptors by what they are: a file by its path, a socket, pipe or
    anonymous inode by its kind."""
    kinds = []
    try:
        fds = list(Path("/proc/self/fd").iterdir())
    except OSError:
        return Counter()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed while being read (the listing's own descriptor among them)
        kinds.append(target.split(":[")[0] if ":[" in target else target)
    return Counter(kinds)


def grown() -> Counter:
    """The threads (``thread NAME``) and descriptors (``fd KIND``) this process holds beyond those
    at its previous call (none at the first)."""
    global _previous
    now = Counter({f"thread {k}": n for k, n in thread_names().items()})
    now.update({f"fd {k}": n for k, n in descriptor_kinds().items()})
    before, _previous = _previous, now
    return Counter() if before is None else now - before
