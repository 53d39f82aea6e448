"""A store host that vanished is given up after ``--store-timeout`` seconds, not after TCP's.

When pod 0's node stops, nothing closes its connections, and a store client's request in flight
waits until the kernel gives the connection up (``tcp_retries2``: about 15 minutes, not a sysctl
a pod may set). So the node agent of each pod that is not the store host watches the store from
a thread while its launcher runs (:class:`StoreWatch`): a store that accepted no TCP connection
for ``limit_s`` in a row is lost, and the agent joins again (:mod:`.rejoin`). A slow store still
accepts connections; only a host that does not answer at all is given up.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Callable, Optional

from .rejoin import store_listens

PROBE_INTERVAL_S = 5.0
# Longest single probe: a SYN that gets no answer within it counts as no answer.
PROBE_TIMEOUT_S = 2.0


class StoreWatch(threading.Thread):
    """Probes the store at ``endpoint`` until :meth:`stop`; :attr:`lost` says why once it has not
    accepted a connection for ``limit_s`` in a row."""

    def __init__(
        self,
        endpoint: tuple[str, int],
        limit_s: float,
        probe: Callable[[str, int], bool] = lambda h, p: store_listens(h, p, PROBE_TIMEOUT_S),
        interval_s: float = PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(name="store-watch", daemon=True)
        self.endpoint, self.limit_s, self.probe, self.interval_s, self.clock = (
            endpoint,
            limit_s,
            probe,
            interval_s,
            clock,
        )
        self.lost: Optional[str] = None
        self.on_lost: Callable[[str], None] = lambda message: None
        self._stopping = threading.Event()

    def run(self) -> None:
        host, port = self.endpoint
        answered = self.clock()
        while not self._stopping.wait(self.interval_s * (0.75 + random.random() / 2)):
            if self.probe(host, port):
                answered = self.clock()
                continue
            silent = self.clock() - answered
            if silent >= self.limit_s and not self._stopping.is_set():
                self.lost = (
                    f"the rendezvous store at {host}:{port} accepted no connection for {silent:.0f} s "
                    f"(rendezvous.storeTimeoutSeconds={self.limit_s:g}): its host is gone without closing "
                    "its connections; ending ft_launcher"
                )
                self.on_lost(self.lost)
                return

    def stop(self) -> None:
        self._stopping.set()
