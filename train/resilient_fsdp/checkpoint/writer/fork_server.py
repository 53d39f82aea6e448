"""Checkpoint writers forked from the pod: a fork server that belongs to the pod starts every
rank's writer process, already imported, in milliseconds.

**Why.** A rank's writer is NVRx's persistent worker, which NVRx starts in a ``spawn`` context: a
new interpreter that imports torch, NVRx and this package (3-4 CPU-seconds). Every new rank pays it,
on every pod at every in-job restart, and the rank's first saves wait for it. The pod's pre-warmed
server (:mod:`resilient_fsdp.resilience.prewarm`) has made those imports once; after them, and
before it forks any rank, it forks one more process: the standard library's multiprocessing fork
server (:func:`multiprocessing.forkserver.main`), which from then on forks every writer of the
pod's ranks. It lives as long as the pod's server or any of its ranks or writers (the standard
library's "alive" pipe), so a restarted rank finds it running.

**How a rank uses it.** Ranks are forks of the server, so each inherits the standard library's
record of the fork server (its address and the "alive" pipe). :func:`writer_context` gives a rank
the ``forkserver`` context while that fork server is alive, which :mod:`.process` makes NVRx's
persistent worker start in. The standard library checks that a fork server is alive with
``waitpid``, which only its parent (the server) may call: in a rank that check is made on the
process itself (:func:`_adopt`).

**What a forked writer keeps of a spawned one.** Its first request (:func:`.worker.writer_started`)
hands it the rank's environment, umask and standard streams (:func:`inheritance`), which a spawned
writer would have inherited; its CPU niceness, I/O priority and blocked SIGTERM are set once, in
the fork server, and inherited by every writer; it exits when its rank is gone, watched through a
pidfd (its parent is the fork server, not the rank).

**Fork safety.** The fork server is forked from the pre-warmed server under the same conditions as
a rank (one thread, no CUDA context, no process group: the pre-warmed server checks them first),
and it never starts a thread itself, so every writer is the fork of a one-thread process that has
never touched a GPU. A writer hides the GPUs before anything in it could initialise CUDA.

**When it is not there** (ranks that import their own, a fork server that could not start or has
died), a writer is spawned, as NVRx does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing import connection, forkserver, resource_tracker
from typing import Any, Optional

from .priority import lower_this_thread

# The pod's fork server: its pid, and the pid of the pre-warmed server that forked it. Set in the
# server; inherited by its forks, the ranks.
_POD_FORK_SERVER: Optional[int] = None
_STARTED_BY: Optional[int] = None


def start(close_fds: tuple[int, ...] = ()) -> Optional[int]:
    """In the pre-warmed server, after its imports, before it forks a rank: fork the pod's writer
    fork server and record it for the ranks to come. ``close_fds``: the server's own descriptors,
    closed in the fork. Returns its pid; None when it could not be started (writers are spawned)."""
    global _POD_FORK_SERVER, _STARTED_BY
    try:
        address = connection.arbitrary_address("AF_UNIX")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
    except OSError as exc:
        print(f"[resilient-fsdp] the checkpoint writers' fork server could not be started ({exc}); "
              "writers are spawned", file=sys.stderr, flush=True)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the fork server: never returns
        code = 0
        try:
            for fd in (alive_w, *close_fds):
                os.close(fd)
            _serve(listener.fileno(), alive_r)
        except SystemExit:  # the standard library's loop ends so when every holder has gone
            pass
        except BaseException:  # noqa: BLE001 - said, then this process ends; writers are spawned
            sys.excepthook(*sys.exc_info())
            code = 1
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    record = forkserver._forkserver
    record._forkserver_address, record._forkserver_alive_fd, record._forkserver_pid = address, alive_w, pid
    _POD_FORK_SERVER, _STARTED_BY = pid, os.getpid()
    return pid


def _serve(listener_fd: int, alive_r: int) -> None:
    """The fork server's life: writer priority and blocked SIGTERM for every writer it forks,
    then the standard library's fork server loop (nothing more to import: preload is empty)."""
    lower_this_thread()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    forkserver.main(listener_fd, alive_r, [])


def pod_fork_server() -> Optional[int]:
    """The pid of the pod's writer fork server when this process is a rank forked beside it, else None."""
    if _POD_FORK_SERVER is None or os.getpid() in (_STARTED_BY, _POD_FORK_SERVER):
        return None
    return _POD_FORK_SERVER


def writer_context() -> Optional[Any]:
    """The ``forkserver`` context this rank's writers start in, or None: spawn them (no pod fork
    server, or it is gone)."""
    pid = pod_fork_server()
    if pid is None or not _alive(pid):
        return None
    _adopt(pid)
    return multiprocessing.get_context("forkserver")


def _adopt(pid: int) -> None:
    """Make the inherited record of the fork server usable here: the standard library checks its
    fork server with ``waitpid``, which fails in any process but its parent."""
    record = forkserver._forkserver

    def ensure_running() -> None:
        resource_tracker.ensure_running()
        if not _alive(pid):
            raise RuntimeError(f"the pod's checkpoint writer fork server (pid {pid}) is gone")

    record.ensure_running = ensure_running


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by the server, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@dataclass
class Inheritance:
    """What a spawned writer would have inherited from its rank and a forked one is handed: the
    environment, the umask and the standard streams (``multiprocessing.reduction.DupFd``)."""

    environ: dict
    umask: int
    streams: tuple


def inheritance() -> Inheritance:
    """This rank's :class:`Inheritance`, for its forked writer's first request."""
    from multiprocessing.reduction import DupFd

    umask = os.umask(0)
    os.umask(umask)
    return Inheritance(dict(os.environ), umask, tuple(DupFd(fd) for fd in (1, 2)))


def take(given: Inheritance) -> None:
    """In a forked writer: become what :func:`inheritance` describes."""
    os.environ.clear()
    os.environ.update(given.environ)
    os.umask(given.umask)
    sys.stdout.flush()
    sys.stderr.flush()
    for target, dup in zip((1, 2), given.streams):
        fd = dup.detach()
        os.dup2(fd, target)
        os.close(fd)
