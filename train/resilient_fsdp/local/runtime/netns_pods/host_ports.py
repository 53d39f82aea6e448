"""A TCP port of this machine's loopback, reachable from inside every pod at the same address.

A pod's loopback is its own, so a service this machine runs on ``127.0.0.1`` (the S3-API server a
local run's checkpoints go to) is out of a pod's reach, and the pods' traffic never leaves their
/24. :class:`HostPort` binds ``127.0.0.1:<port>`` inside each pod's network namespace (the socket
made by a thread that entered it: ``plumbing.socket_in_netns``) and relays every connection a pod
opens there, in threads of the run's owner, to ``127.0.0.1:<port>`` here: the same URL works in the
pods and on this machine, and no address of this machine ever appears on the pods' bridge.

A partitioned pod (``NetnsPod.partition``) loses its link to everything: its relayed connections
are cut and new ones are closed at once, as they would be for a node cut off from the network.
``close`` (the run's ``PodNetwork.close`` calls it) stops every relay.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from typing import Protocol

from . import plumbing

LOOPBACK = "127.0.0.1"
POLL_S = 0.2  # how often a relay looks at its pod's partition and at close
CHUNK = 1 << 16


class Pod(Protocol):
    """What a relay needs of a pod (a ``network.NetnsPod``)."""

    hostname: str
    netns: str

    @property
    def partitioned(self) -> bool: ...


class HostPort:
    """``port`` of this machine's loopback, listened on in every pod of ``pods`` (``add`` takes later ones)."""

    def __init__(self, port: int, pods: list[Pod]):
        self.port = port
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._listeners: dict[str, socket.socket] = {}
        self._conns: set[socket.socket] = set()
        self.relayed = 0
        """Connections relayed so far, over every pod."""
        for pod in pods:
            self.add(pod)

    def add(self, pod: Pod) -> None:
        sock = plumbing.socket_in_netns(
            str(plumbing.NETNS_DIR / pod.netns),
            LOOPBACK,
            self.port,
            socket.SOCK_STREAM,
            what=f"the relay of this machine's port {self.port} in pod {pod.hostname}",
        )
        sock.settimeout(POLL_S)
        with self._lock:
            self._listeners[pod.hostname] = sock
        threading.Thread(
            target=self._accept, args=(pod, sock), name=f"host-port-{self.port}-{pod.hostname}", daemon=True
        ).start()

    def _accept(self, pod: Pod, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            if pod.partitioned:
                _reset(conn)
                continue
            try:
                upstream = socket.create_connection((LOOPBACK, self.port), timeout=10)
            except OSError:
                _reset(conn)  # nothing listens here: the pod sees its connection reset
                continue
            with self._lock:
                self._conns.update((conn, upstream))
                self.relayed += 1
            threading.Thread(
                target=self._pump, args=(pod, conn, upstream), name=f"host-port-{self.port}-relay", daemon=True
            ).start()

    def _pump(self, pod: Pod, a: socket.socket, b: socket.socket) -> None:
        """Copy both ways until either side closes, the pod is cut off, or the relay closes."""
        sel = selectors.DefaultSelector()
        try:
            for s in (a, b):
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            while not self._closed.is_set() and not pod.partitioned:
                for key, _ in sel.select(POLL_S):
                    src = key.fileobj
                    dst = b if src is a else a
                    try:
                        data = src.recv(CHUNK)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    dst.setblocking(True)
                    try:
                        dst.sendall(data)
                    except OSError:
                        return
                    finally:
                        dst.setblocking(False)
        finally:
            sel.close()
            with self._lock:
                self._conns.difference_update((a, b))
            if pod.partitioned:
                _reset(a)
            for s in (a, b):
                s.close()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for sock in [*self._listeners.values(), *self._conns]:
                try:
                    sock.close()
                except OSError:
                    pass
            self._listeners.clear()


def _reset(conn: socket.socket) -> None:
    """Close with a reset, not an orderly end: the pod's side fails, as across a cut link, instead
    of reading an empty answer."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()
