"""One event, one counted pod failure: a node whose launcher ended because of another node joins again.

Most of a job's nodes end because of something that happened to another (the store host lost, a
peer's fault that spent the job-wide in-job restarts, a peer late to join); if each exited, one
event would cost N-1 pod failures of ``backoffLimit``. So the node agent (:mod:`.agent`) starts
``ft_launcher`` again in the same pod after the codes :data:`.exit_codes.REJOINED_CODES` lists
(:class:`Rejoin`), within ``timeout_s`` of the event, waiting for the store rather than a fixed
time (:func:`await_store`). Only the store host exits on them, so each event is counted once.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import exit_codes

# Longest wait for the old store to close: longer than NVRx 0.7's 3 s grace after its launcher
# ends. Also the whole wait when the endpoint is unknown.
GONE_LIMIT_S = 5.0
# Longest wait for the replacement's store to listen; past it the launcher starts anyway and
# waits in its own way (NVRx 0.7: ``store_connect_wait_seconds``; older: its connect timeout).
UP_LIMIT_S = 60.0
# Between probes, with up to half again at random: at 1,000 nodes about 4,000 connects a second
# reach the store host while its pod is replaced, each a TCP open and close.
PROBE_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 1.0


def store_listens(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` now. A name that does not
    resolve (the old pod's DNS record is gone, the new one not yet published) is not listening."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:  # refused, unreachable, unresolvable, timed out
        return False


def _probe_until(
    listening: bool,
    host: str,
    port: int,
    limit_s: float,
    stopped: Callable[[], bool],
    probe: Callable[[str, int], bool],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> Optional[float]:
    """Probe ``host:port`` until it does (``listening``) or does not listen; the seconds that took,
    or None once ``limit_s`` passed or ``stopped()``."""
    began = clock()
    while probe(host, port) != listening:
        if stopped() or clock() - began >= limit_s:
            return None
        sleep(PROBE_INTERVAL_S * (1 + random.random() / 2))
    return clock() - began


def await_store(
    endpoint: Optional[tuple[str, int]],
    stopped: Callable[[], bool] = lambda: False,
    window_s: float = UP_LIMIT_S,
    probe: Callable[[str, int], bool] = store_listens,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait until the store at ``endpoint`` has closed and then listens again (the store host's
    replacement), each within its limit and all within ``window_s`` (what is left of the rejoin
    window), or until ``stopped()`` (the node got a signal); says what it waited for. Without an
    endpoint, waits :data:`GONE_LIMIT_S`. A launcher started before the old store closed would join
    it and end again (NVRx 0.7's store host keeps it open 3 s so that peers read its final state);
    one started before the new store listens would, on 0.7, probe again only every 2-3 s."""
    start = clock()
    if endpoint is None:
        while not stopped() and clock() - start < min(GONE_LIMIT_S, window_s):
            sleep(PROBE_INTERVAL_S)
        return f"no --rdzv-endpoint to watch: waited {clock() - start:.1f} s"
    host, port = endpoint

    def wait(listening: bool, limit_s: float) -> Optional[float]:
        waited = _probe_until(
            listening, host, port, min(limit_s, window_s - (clock() - start)), stopped, probe, clock, sleep
        )
        return None if waited is None else clock() - start

    closed = wait(False, GONE_LIMIT_S)
    opened = wait(True, UP_LIMIT_S)
    if stopped():
        return f"stopped while waiting for the store at {host}:{port}"
    where = f"{host}:{port}"
    first = (
        f"the old store at {where} closed after {closed:.1f} s"
        if closed is not None
        else f"the store at {where} still answered after {GONE_LIMIT_S:g} s"
    )
    second = (
        f"a store listened after {opened:.1f} s"
        if opened is not None
        else f"none listened within {min(UP_LIMIT_S, window_s):g} s; starting anyway"
    )
    return f"{first}; {second}"


def await_first_store(
    endpoint: Optional[tuple[str, int]],
    limit_s: float,
    stopped: Callable[[], bool] = lambda: False,
    probe: Callable[[str, int], bool] = store_listens,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Optional[str]:
    """Before a node that is not the store host starts its first launcher: wait, up to ``limit_s``
    (``store_connect_wait_seconds``, else ``join_timeout``), until the store listens; says what it
    waited for, None when there was nothing to wait for.

    Pods start minutes apart (an image pull, pod 0 scheduled last). NVRx 0.7 probes for the store
    itself, but 0.4.1's store client spends ``read_timeout`` connecting, and ``read_timeout`` is
    also every store operation's timeout: the wait lives here so that ``read_timeout`` can stay what
    an operation takes, and a store host that vanishes is noticed in that time, not the join's."""
    if endpoint is None or limit_s <= 0:
        return None
    host, port = endpoint
    waited = _probe_until(True, host, port, limit_s, stopped, probe, clock, sleep)
    if waited is None:
        if stopped():
            return f"stopped while waiting for the store at {host}:{port}"
        return f"no store listened at {host}:{port} within {limit_s:g} s; starting the launcher anyway"
    return f"the store at {host}:{port} listens (waited {waited:.1f} s)" if waited >= 1 else None


@dataclass
class Rejoin:
    """Decides, after each ``ft_launcher`` ending, whether the node joins again or exits."""

    store_host: bool
    """This node hosts the rendezvous store (pod 0, or a node run outside a controller)."""
    timeout_s: float
    """Longest time from an event to a completed rendezvous; past it the node exits."""
    clock: Callable[[], float] = time.monotonic
    since: Optional[float] = field(default=None, init=False)
    """When the current event began: the first ending after a rendezvous completed."""
    count: int = field(default=0, init=False)
    """Times this node joined again."""

    def decide(self, code: int, completed_rendezvous: bool) -> Optional[str]:
        """None: exit with ``code``. Otherwise the reason to start ``ft_launcher`` again.

        ``completed_rendezvous``: the attempt that just ended started ranks (a rendezvous of
        every node completed), which begins a new event; an attempt that never got that far
        belongs to the event before it."""
        now = self.clock()
        if completed_rendezvous or self.since is None:
            self.since = now
        if self.store_host or code not in exit_codes.REJOINED_CODES or self.timeout_s <= 0:
            return None
        waited = now - self.since
        if waited > self.timeout_s:
            return None
        self.count += 1
        ending = exit_codes.describe_code(code).split(",")[0]
        return (
            f"ft_launcher ended ({ending}), which another node's failure causes; "
            f"joining again in this pod, not counted by the job level ({waited:.0f} of "
            f"{self.timeout_s:.0f} s since the event; join {self.count})"
        )

    def remaining_s(self) -> float:
        """What is left of the current event's window."""
        return max(0.0, self.timeout_s - (self.clock() - self.since)) if self.since is not None else self.timeout_s

    def gave_up(self) -> str:
        return (
            f"no rendezvous completed within {self.timeout_s:.0f} s of the event "
            "(rendezvous.rejoinTimeoutSeconds): exiting, so the job level counts it"
        )
