"""Checkpoint writers forked from the pod: a fork server that belongs to the pod starts every
rank's writer process, already imported, in milliseconds.

A spawned writer imports torch, NVRx and this package (3-4 CPU-seconds) on every pod at every
in-job restart, and the rank's first saves wait for it. The pod's pre-warmed server
(:mod:`resilient_fsdp.resilience.prewarm`) made those imports once; it forks the standard
library's fork server (:func:`start`) before any rank, and every writer of the pod's ranks is
forked from that (:func:`writer_context`, used by :mod:`.process`). Every writer is thus the fork
of a one-thread process that never touched a GPU. Where it is not there, a writer is spawned.
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
    """In the pre-warmed server, after its imports, before it forks a rank (one thread, no CUDA
    context, no process group: the pre-warmed server checks them first): fork the pod's writer
    fork server, which never starts a thread itself, and record it for the ranks to come. It lives
    as long as the pod's server or any of its ranks or writers (the standard library's "alive"
    pipe), so a restarted rank finds it running. ``close_fds``: the server's own descriptors,
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
        print(
            f"[resilient-fsdp] the checkpoint writers' fork server could not be started ({exc}); writers are spawned",
            file=sys.stderr,
            flush=True,
        )
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
    environment, the umask and the standard streams (``multiprocessing.reduction.DupFd``). Its
    niceness, I/O priority and blocked SIGTERM are set once, in the fork server, and inherited;
    it exits when its rank is gone, watched through a pidfd (its parent is the fork server)."""

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
