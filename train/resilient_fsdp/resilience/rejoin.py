"""One event, one counted pod failure: a node whose launcher ended because of another node joins again.

The job level counts pod exits: a Job counts every exit of 128-255 without ``DisruptionTarget``
against ``backoffLimit``, and a JobSet restarts whole (every pod) when that is spent. Most of a
job's nodes end because of something that happened to another: the store host's pod was lost
(every other agent loses the store: :data:`.exit_codes.RENDEZVOUS_LOST`), a peer's fault spent
NVRx 0.7's job-wide in-job restart budget (every agent ends), or a peer did not arrive within the
join timeout. If each of those nodes exited, one event would cost N-1 or N of ``backoffLimit``.

So the node agent keeps such a node in its pod: it starts ``ft_launcher`` again, which joins the
store pod 0 hosts (its replacement, or the same one), with no pod recreation, no image pull and
nothing counted. Only the store host (pod 0) exits on those failures, so each event is counted
once, on one pod, and a store host that is recreated brings a fresh store (a fresh in-job
budget). It is bounded: a node that has not rejoined a completed rendezvous within
``timeout_s`` of the event exits with its code, so a job whose store never returns still fails.

A node that reports its own configuration-type failure, one stopped by a signal, and one whose
launcher was killed exit as before: :class:`Rejoin` only ever turns "exit" into "join again".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import exit_codes

# What a node that is not the store host joins again after: failures another node causes.
REJOINED_CODES = (exit_codes.RENDEZVOUS_LOST, exit_codes.INFRASTRUCTURE)
PAUSE_S = 5.0  # between one ending and the next start: the store host's pod is being replaced


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
        if self.store_host or code not in REJOINED_CODES or self.timeout_s <= 0:
            return None
        waited = now - self.since
        if waited > self.timeout_s:
            return None
        self.count += 1
        ending = exit_codes.describe_code(code).split(",")[0]
        return (f"ft_launcher ended ({ending}), which another node's failure causes; "
                f"joining again in this pod, not counted by the job level ({waited:.0f} of "
                f"{self.timeout_s:.0f} s since the event; join {self.count})")

    def gave_up(self) -> str:
        return (f"no rendezvous completed within {self.timeout_s:.0f} s of the event "
                "(rendezvous.rejoinTimeoutSeconds): exiting, so the job level counts it")
