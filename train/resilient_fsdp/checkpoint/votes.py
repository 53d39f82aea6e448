"""The checkpointer's votes: what each rank says once a step, summed over the ranks.

The trainer carries them on the step's loss all-reduce (:meth:`Votes.to_floats`, then
:meth:`Votes.from_floats` of the sums), so that :meth:`.checkpointer.Checkpointer.after_step`
agrees on a due save and a finished write without a collective of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Votes:
    """One rank's votes (each 0 or 1), or every rank's summed (how many ranks said so)."""

    interval_passed: float = 0.0  # checkpoint.interval_s has passed since the last save, by the rank's clock
    writing: float = 0.0  # the rank still writes the pending checkpoint
    committing: float = 0.0  # rank 0's commit process is still on the pending checkpoint
    unreplicated: float = 0.0  # the rank's memory replication has stopped

    def to_floats(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> Votes:
        if len(values) != len(dataclasses.fields(cls)):
            raise ValueError(f"{len(values)} values for the {len(dataclasses.fields(cls))} checkpoint votes")
        return cls(*(float(v) for v in values))
