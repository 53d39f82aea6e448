"""A new process's read-ahead of its rank's newest snapshot, made while the process builds its model.

A new process restores into an optimizer without state, and filling that new memory is most of
a restore from memory; the seconds before a start can restore (the process group, the model's
build, the slowest rank) leave the host's spare cores and the GPU's copy engine idle.
:class:`Prefetch` uses them. Started by the trainer (``checkpoint.memory.prefetch``), taken by
:meth:`.tier.MemoryTier.report`.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ...config import CheckpointConfig
from ..lease import job_id
from ..run_identity import read_run_identity
from .slots import MemorySlots, Record, SlotInvalid, job_root, owner_name
from .values import tensor_paths


@dataclass
class ReadAhead:
    """A snapshot read ahead: its record, its tensors (checked) and its non-tensor values."""

    record: Record
    views: list[torch.Tensor]
    """Every tensor of the slot in order: the ones in ``moved`` in new memory of their own on the
    training device, the rest views of the mapped slot."""
    moved: frozenset[int]
    values: Any
    seconds: float
    """How long the read-ahead took, in the helper thread."""


class Prefetch:
    """The read-ahead of ``slots``' newest snapshot at ``world_size``, into ``device``'s memory,
    started at construction on a helper thread: it checks the snapshot (every CRC32C) and copies
    its optimizer-state tensors into new memory on the device; the restore adopts those copies and
    copies only the rest. A guess made before the decision (:mod:`.agreement`): a corrupt snapshot
    is set aside by the report; when the decision takes another step, the copies are dropped
    before that load starts, so a read-ahead never holds memory a load needs. A restore that finds
    it still running waits for it, and the wait counts in the restore's time."""

    def __init__(self, slots: MemorySlots, world_size: int, device: torch.device):
        self.slots, self.world_size, self.device = slots, world_size, device
        self._ahead: Optional[ReadAhead] = None
        self._invalid: Optional[tuple[Record, SlotInvalid]] = None
        self.error: Optional[str] = None
        """Why the read-ahead failed other than on the snapshot's checks (the restore reads then)."""
        self._thread = threading.Thread(target=self._run, name="memory-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            own = [r for r in self.slots.records() if r.world_size == self.world_size]
            if not own:
                return
            record = own[0]
            try:
                values = pickle.loads(self.slots.extra(record))
                moved = optimizer_state_indices(values, record)
                views = self.slots.read(record, moved=moved, device=self.device)
            except SlotInvalid as exc:
                self._invalid = (record, exc)
                return
            self._ahead = ReadAhead(record, views, moved, values, time.perf_counter() - t0)
        except Exception as exc:  # out of memory, a device error: the restore reads the slot itself
            self.error = f"{type(exc).__name__}: {exc}"

    def take(self, record: Record) -> Optional[ReadAhead]:
        """Wait for the read-ahead; hand over what it read when that is ``record``, raise the
        :class:`SlotInvalid` it met when ``record`` failed its checks, else None. The prefetch
        keeps nothing after this."""
        self._thread.join()
        ahead, invalid = self._ahead, self._invalid
        self._ahead = self._invalid = None
        if invalid is not None and invalid[0] == record:
            raise invalid[1]
        return ahead if ahead is not None and ahead.record == record else None

    def drop(self) -> None:
        """Wait for the read-ahead and free what it read (the restore does not take it)."""
        self._thread.join()
        self._ahead = self._invalid = None


def start(
    cfg: CheckpointConfig, checkpoint_dir: Path, rank: int, world_size: int, device: torch.device
) -> Optional[Prefetch]:
    """The read-ahead for a start that may restore from memory (the memory tier on, ``resume``
    on, ``checkpoint_dir`` started before: it has a run id); None for any other."""
    run = read_run_identity(checkpoint_dir) if cfg.memory.interval_steps > 0 and cfg.resume else None
    if run is None:
        return None
    return Prefetch(MemorySlots(job_root(Path(cfg.memory.dir), job_id(cfg), run), owner_name(rank)), world_size, device)


def optimizer_state_indices(values: Any, record: Record) -> frozenset[int]:
    """The indices of a snapshot's optimizer-state tensors that the restore can adopt: every
    ``optim.state`` tensor but the scalars (the step counts stay where torch keeps them)."""
    return frozenset(
        i
        for i, (path, span) in enumerate(zip(tensor_paths(values), record.spans))
        if len(path) == 4 and path[:2] == ("optim", "state") and tuple(span[2]) != ()
    )
