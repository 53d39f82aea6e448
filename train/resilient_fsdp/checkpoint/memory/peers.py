"""Which rank keeps which rank's replica: a ring over the pods.

Rank ``r`` sends its memory checkpoint to rank ``(r + J) mod W`` and keeps the replica of rank
``(r - J) mod W``, with ``J`` the ranks per pod and ``W`` the world: the same local rank on the
next pod, so a rank and its replica never share a pod, whatever the number of pods (two or more).
NVRx's clique rule (cliques ``n, n+J, ...`` of the replication factor, ``W mod (J x F) = 0``) gives
the same pairs on an even number of pods; the ring also serves an odd one (a job relaunched on 63
pods of 64). One lost pod loses its ranks' own slots and the replicas it kept of the pod
before it; the next pod keeps its ranks' replicas and the pod before keeps its own slots, so every
rank's newest snapshot survives. Two neighbouring pods lost at once leave the first one's ranks to
the durable checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional


def _check(world: int, ranks_per_pod: int) -> None:
    if ranks_per_pod < 1 or world < 1 or world % ranks_per_pod:
        raise ValueError(f"a world of {world} ranks is not whole pods of {ranks_per_pod} ranks")


def replica_holder(rank: int, world: int, ranks_per_pod: int) -> Optional[int]:
    """The rank on another pod that keeps ``rank``'s replica; None with a single pod."""
    _check(world, ranks_per_pod)
    if world == ranks_per_pod:
        return None
    return (rank + ranks_per_pod) % world


def replica_source(rank: int, world: int, ranks_per_pod: int) -> Optional[int]:
    """The rank whose replica ``rank`` keeps; None with a single pod."""
    _check(world, ranks_per_pod)
    if world == ranks_per_pod:
        return None
    return (rank - ranks_per_pod) % world


def ranks_per_pod(world_size: int) -> int:
    """The ranks each pod runs: the launcher's ``LOCAL_WORLD_SIZE``; the whole world when unset
    (a trainer without a launcher is one pod)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        local = world_size
    return local if local > 0 and world_size % local == 0 else world_size
