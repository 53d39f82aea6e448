"""A store host that vanished is given up after ``--store-timeout`` seconds, not after TCP's.

When pod 0's node stops (a kernel hang, a wedged network driver, a partition, an instance gone)
nothing closes its connections. A store client's operation then waits for a reply that never
comes: torch's ``TCPStore`` applies its timeout (NVRx's ``read_timeout``) to waiting for a key,
not to a request in flight, so it ends only when the kernel gives the connection up after its
retransmissions (``net.ipv4.tcp_retries2``: about 15 minutes by default, and not a sysctl a pod
may set). Every other pod's launcher, and every GPU, waits that long.

So the node agent of each pod that is not the store host watches the store from a thread while
its launcher runs: a TCP connect every :data:`PROBE_INTERVAL_S` (with jitter), each bounded by
:data:`PROBE_TIMEOUT_S`. A store that accepted no connection for ``limit_s`` in a row is lost:
the agent ends its launcher and joins again (:mod:`.rejoin`), exactly as when the store host's
connections close. A slow store (one serving 1,000 pods at once) still accepts connections; only
a host that does not answer at all is given up.
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

    def __init__(self, endpoint: tuple[str, int], limit_s: float,
                 probe: Callable[[str, int], bool] = lambda h, p: store_listens(h, p, PROBE_TIMEOUT_S),
                 interval_s: float = PROBE_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        super().__init__(name="store-watch", daemon=True)
        self.endpoint, self.limit_s, self.probe, self.interval_s, self.clock = endpoint, limit_s, probe, interval_s, clock
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
                self.lost = (f"the rendezvous store at {host}:{port} accepted no connection for {silent:.0f} s "
                             f"(rendezvous.storeTimeoutSeconds={self.limit_s:g}): its host is gone without closing "
                             "its connections; ending ft_launcher")
                self.on_lost(self.lost)
                return

    def stop(self) -> None:
        self._stopping.set()
