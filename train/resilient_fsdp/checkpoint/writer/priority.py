"""The checkpoint writer's priority: it yields to training.

Its CPU niceness and I/O priority (best effort, lowest level: it yields to training's I/O but is
never starved the way the idle class can be on a busy disk), set on the thread that starts a
spawned writer, or once in the pod's writer fork server (:mod:`.fork_server`); every process and
thread started from there inherits them.
"""

from __future__ import annotations

import os
import threading

WRITER_NICE = 10
WRITER_IO_LEVEL = 7


def lower_this_thread() -> None:
    """This thread's CPU niceness to :data:`WRITER_NICE` and I/O priority to best effort, lowest
    level: what a process or thread started from it inherits. Best effort: a failure is ignored."""
    import psutil

    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
    except OSError:
        pass
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, WRITER_IO_LEVEL)
    except (psutil.Error, OSError, AttributeError, ValueError):
        pass
