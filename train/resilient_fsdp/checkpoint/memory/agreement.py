"""Where a start restores from, decided once for every rank: memory or the durable checkpoint.

Every rank reports (:class:`Report`) the steps of its own complete memory snapshots and, per rank
whose replica it keeps, that replica's steps, all of the state structure this start builds (a
snapshot of another model, mesh or world size is not reported). The reports are gathered to every
rank and :func:`decide` runs on each, on the same input, so each reaches the same answer without a
second collective: the newest step that every rank can get, from its own slot or else from the
rank that keeps its replica, provided it is no older than the newest durable commit; otherwise the
durable checkpoint (and, where the shared volume has none, the S3 tier behind it).

A step equal to the durable commit's is restored from memory: the same state, read by a memory
copy instead of a shared-volume read.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Report:
    """What one rank has in memory, of the structure this start builds."""

    rank: int
    own: tuple[int, ...] = ()
    """Steps of its own complete snapshots."""
    replicas: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Per source rank whose replica it keeps, the steps of those replicas."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """Restore every rank from memory at ``step`` (``sources[r]``: None for its own slot, else the
    rank keeping its replica), or, with ``step`` None, from the durable checkpoint."""

    step: Optional[int]
    sources: dict[int, Optional[int]]
    why: str

    @property
    def from_memory(self) -> bool:
        return self.step is not None

    def replicas_to_send(self) -> list[tuple[int, int]]:
        """(holder, rank) pairs: which rank sends which rank its replica before the load."""
        return sorted((holder, rank) for rank, holder in self.sources.items() if holder is not None)


def decide(reports: list[Report], world_size: int, durable_step: Optional[int]) -> Decision:
    """The restore every rank makes, from every rank's report (``reports``: one per rank of
    ``world_size``) and the newest durable commit's step (None: none)."""
    by_rank = {r.rank: r for r in reports}
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        return Decision(None, {}, f"no memory report from rank(s) {_ranks(missing)}")
    holders: dict[int, dict[int, list[int]]] = {}  # source rank -> step -> ranks keeping it
    for report in reports:
        for source, steps in report.replicas.items():
            for step in steps:
                holders.setdefault(source, {}).setdefault(step, []).append(report.rank)
    candidates = sorted({s for r in reports for s in r.own} | {s for h in holders.values() for s in h}, reverse=True)
    floor = -1 if durable_step is None else durable_step
    best_gap: Optional[tuple[int, list[int]]] = None
    for step in candidates:
        if step < floor:
            break
        sources: dict[int, Optional[int]] = {}
        lacking = []
        for rank in range(world_size):
            if step in by_rank[rank].own:
                sources[rank] = None
            elif holders.get(rank, {}).get(step):
                sources[rank] = min(holders[rank][step])
            else:
                lacking.append(rank)
        if not lacking:
            replicas = sum(h is not None for h in sources.values())
            how = f", {replicas} rank(s) from the replica a peer keeps" if replicas else ""
            return Decision(step, sources, f"step {step} from memory on every rank{how}")
        if best_gap is None:
            best_gap = (step, lacking)
    if best_gap is not None:
        step, lacking = best_gap
        why = f"step {step} is in memory but not for rank(s) {_ranks(lacking)}, nor in any replica of them"
    elif candidates:
        why = f"memory holds only steps older than the durable checkpoint's ({durable_step})"
    else:
        why = "no memory checkpoint on any rank"
    return Decision(None, {}, why)


def _ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
