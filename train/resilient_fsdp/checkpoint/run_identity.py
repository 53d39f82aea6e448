"""Which run a checkpoint directory belongs to: ``<checkpoint.dir>/RUN``, a random id that the
directory's first start writes and every later start (a restart at any layer, a relaunch, another
install of the same job) reads back.

A job's name (``checkpoint.job_id``, the rendezvous id) says which job a process belongs to, not
which run: the same name is given again to a new run in a new, empty directory (a workstation's
fixed ``job_id``, a chart installed again with a fresh volume). What outlives a process beside the
checkpoint directory and is keyed by the job, the memory tier's snapshots and the save plans a pod
keeps in ``/dev/shm``, is keyed by the run too, so that a new run never loads the state an earlier
run of the same name left in a pod's memory.

Created exclusively, so that two starts creating it at once agree on one id (the trainer's rank 0
reads or writes it and broadcasts it to the other ranks); a new process's read-ahead reads it
before the process group exists, and finds none in a directory never started.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Optional

from .. import atomic

RUN = "RUN"


def run_identity(checkpoint_dir: Path) -> str:
    """The run id of ``checkpoint_dir``, written first when it has none."""
    found = read_run_identity(checkpoint_dir)
    if found is not None:
        return found
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    atomic.create_exclusive(checkpoint_dir / RUN, uuid.uuid4().hex[:12] + "\n")  # False: another start's won
    for _ in range(100):  # another start's may be between its create and its write
        found = read_run_identity(checkpoint_dir)
        if found is not None:
            return found
        time.sleep(0.01)
    raise OSError(f"{checkpoint_dir / RUN} is empty: remove it and start again")


def read_run_identity(checkpoint_dir: Path) -> Optional[str]:
    """The run id of ``checkpoint_dir``, or None before its first start wrote one."""
    try:
        text = (checkpoint_dir / RUN).read_text().strip()
    except FileNotFoundError:
        return None
    return text or None
