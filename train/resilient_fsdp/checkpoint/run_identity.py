"""Which run a checkpoint directory belongs to: ``<checkpoint.dir>/RUN``, a random id that the
directory's first start writes and every later start reads back.

A job's name says which job a process belongs to, not which run: the same name is given again to
a new run in a new, empty directory. What a pod keeps beside the directory and keys by the job
(the memory tier's snapshots, kept save plans) is keyed by the run too, so that a new run never
loads the state an earlier run of the same name left in a pod's memory. Read or written by the
trainer's rank 0 and broadcast; read by a new process's read-ahead before the process group exists.
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
    # Created exclusively: two starts creating it at once agree on one id (False: another start's won).
    atomic.create_exclusive(checkpoint_dir / RUN, uuid.uuid4().hex[:12] + "\n")
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
