"""What a rank's process holds at the start of an attempt: its threads, open descriptors, TCP
connections and child processes.

A process that outlives its attempts (an in-process restart re-enters training in it) must hold
as much at its tenth start as at its second: a group, a thread or a connection an aborted attempt
left behind grows with every restart, for the life of the job. Every rank measures at the same
point of each start (built and resumed, before its first step); rank 0 records every rank's
figures in the ``start`` event (``footprint``: one list per figure, by rank), where the tests
and the campaign compare them across restarts.
"""

from __future__ import annotations

from typing import Optional

import psutil
import torch
import torch.distributed as dist

FIGURES = ("threads", "open_files", "tcp_connections", "child_processes")


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
    return figures


def gather(device: torch.device) -> dict[str, list[int]]:
    """Collective: every rank's :func:`measure`, by figure, in rank order."""
    mine = measure()
    local = torch.tensor([mine[name] for name in FIGURES], dtype=torch.int64, device=device)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    rows = [t.tolist() for t in every]
    return {name: [row[i] for row in rows] for i, name in enumerate(FIGURES)}
