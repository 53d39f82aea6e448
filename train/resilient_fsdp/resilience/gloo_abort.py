"""Aborting gloo collectives at once: the shared helper of every restart path that must wake ranks
blocked in a collective of a failed job (in-process restart's abort: :mod:`.inprocess`; any other
abort path may call :func:`shutdown_gloo_connections` too).

torch 2.13's gloo backend cannot be aborted: ``ProcessGroupGloo`` has no ``abort`` of its own
(``Backend.abort`` is a no-op for it, ``_abort_process_group`` is NCCL-only), and neither that nor
``destroy_process_group`` or ``shutdown`` wakes a collective already blocked in another thread:
the collective runs to ``dist.timeout_s``. What does end it is its connections going away: a
``shutdown(SHUT_RDWR)`` of the group's TCP connections fails the local blocked collective within
milliseconds, and every peer's collective on those connections sees the connection closed.

The group's connections are told apart from every other socket of the process (the rendezvous
stores, S3 uploads) by recording which TCP connections appeared while the process group was
created (:func:`tracking_gloo_connections`, around ``init_process_group``), minus those to or
from the store ports.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Iterator

_lock = threading.Lock()
_recorded: list[tuple[int, tuple, tuple]] = []  # (fd, local address, remote address)


def _connections() -> set[tuple[int, tuple, tuple]]:
    import psutil

    out = set()
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.fd is not None and c.fd >= 0:
            out.add((c.fd, tuple(c.laddr), tuple(c.raddr)))
    return out


def _store_ports() -> set[int]:
    ports = set()
    for name in ("MASTER_PORT", "TORCHELASTIC_MASTER_PORT"):
        try:
            ports.add(int(os.environ[name]))
        except (KeyError, ValueError):
            pass
    return ports


@contextlib.contextmanager
def tracking_gloo_connections(extra_store_ports: tuple[int, ...] = ()) -> Iterator[None]:
    """Record the TCP connections opened inside the block (creating a process group), except those
    of a rendezvous store, as the group's connections; they replace any recorded before."""
    before = _connections()
    yield
    stores = _store_ports() | set(extra_store_ports)
    found = [c for c in _connections() - before if c[1][1] not in stores and c[2][1] not in stores]
    with _lock:
        _recorded[:] = found


def recorded() -> list[tuple[int, tuple, tuple]]:
    with _lock:
        return list(_recorded)


def shutdown_gloo_connections() -> int:
    """Shut down the recorded connections that are still open with the same addresses (a file
    descriptor reused since is left alone); returns how many. Safe from any thread."""
    with _lock:
        targets, _recorded[:] = list(_recorded), []
    if not targets:
        return 0
    alive = _connections()
    done = 0
    for entry in targets:
        if entry not in alive:
            continue
        sock = socket.socket(fileno=entry[0])
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays gloo's: it closes it
    return done
