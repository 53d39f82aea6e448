"""One attempt at the training function, and every resilience hook it runs: one object the loop
and the checkpointer talk to, instead of a monitor, a ping, a ledger, an injector and marks.

An attempt is one start of the training function in a process (the first, or one after any
restart). :class:`Attempt` holds the in-job hang detection (:mod:`.rank_monitor`), the in-process
restart's progress ping (:mod:`.inprocess`), fault injection (:mod:`.faults`) and its ledger
(:mod:`.ledger`), the place it has reached (:mod:`.deterministic`), and its accounting
(:mod:`.accounting`). :class:`NoHooks` is the same interface doing nothing, for a checkpointer
used on its own (benchmarks, probes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ..config import ResilienceConfig, parse_faults
from . import accounting, deterministic
from .exit_codes import is_configuration_failure
from .faults import CorruptibleMemory, FaultInjector, node_index
from .inprocess import InProcessAttempt
from .ledger import FaultLedger
from .rank_monitor import ProgressMonitor


class NoHooks:
    """No sections, no ping, no faults."""

    def start_section(self, name: str) -> None:
        """Open hang-detection section ``name``."""

    def end_section(self, name: str, learn: bool = True) -> None:
        """Close it; ``learn=False``: its duration is no sample for learning its timeout."""

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """The block waits for checkpoint writes or the end of the job (the ``drain`` budget)."""
        yield

    def save_started(
        self, step: int, partial_dir: Path, measure: Callable[[], int], expected: Callable[[], Optional[int]]
    ) -> None:
        """A checkpoint of ``step`` started writing into ``partial_dir``."""

    def save_written(self, step: int) -> None:
        """This rank's write of ``step`` finished, before the checkpoint commits."""

    def writer_fault(self, step: int) -> Optional[str]:
        """What the checkpoint writer is to do wrong while writing ``step``; None: nothing."""
        return None

    def commit_fault(self, step: int, marker: Path) -> Optional[str]:
        """Rank 0: what the commit of ``step`` is to do for a fault (``stop`` at ``marker``); None: nothing."""
        return None

    def restoring(self, step: int, tier: str) -> None:
        """The restore of ``step`` from ``tier`` is about to load the live state."""


class Attempt(NoHooks):
    """The resilience side of one attempt.

    Built before the process group (its ``init`` section covers building it); :meth:`joined`
    once the group exists, since finding the layer is collective.
    """

    def __init__(
        self,
        cfg: ResilienceConfig,
        run_dir: Path,
        monitor: ProgressMonitor,
        in_process: Optional[InProcessAttempt] = None,
    ):
        self.cfg, self.run_dir, self.monitor = cfg, run_dir, monitor
        self.number = in_process.number if in_process else 0
        self.store = in_process.store if in_process else None
        # A failed attempt is followed by another in this process only under in-process restart.
        self.retried_in_process = in_process is not None
        self._ping = in_process.ping if in_process else (lambda: None)
        self.ledger = FaultLedger(run_dir)
        self.injector: Optional[FaultInjector] = None
        self.layer = "start"
        self.rank = 0
        self.id: Optional[str] = None  # agreed once the process group exists (joined)
        self.position = deterministic.START
        self.failures = deterministic.FailureRecords(run_dir)
        # Wall-clock marks, for where a recovery's time went (accounting.phases).
        self.marks = {"attempt": time.time()}
        monitor.reset()  # whatever a failed attempt left open
        monitor.start("init")

    def mark(self, name: str) -> None:
        """This attempt reached ``name`` (``group``, ``model``, ``built``, ``resumed``)."""
        self.marks[name] = time.time()

    def joined(self, rank: int, world_size: int, device: torch.device, metrics_path: Path) -> None:
        """Collective, once the process group exists: this rank's faults, and which layer caused
        the attempt."""
        self.rank = rank
        self.injector = FaultInjector(parse_faults(self.cfg.inject, world_size), rank, self.ledger)
        self.layer, self.id = accounting.agree_attempt(metrics_path, self.number, rank, device)

    def memory_built(self, memory: Optional[CorruptibleMemory]) -> None:
        """The checkpointer's memory tier (None: off), which the memory faults act on; its
        replicas' sender calls :meth:`.FaultInjector.replica_sending` between a replica's parts."""
        self.injector.memory = memory
        replicator = getattr(memory, "replicator", None)
        if replicator is not None:
            replicator.before_bytes = self.injector.replica_sending

    def started(self) -> None:
        """Start-up is over (built and resumed): the ``init`` section closes."""
        self.monitor.end("init")

    # -- the step ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Step ``step`` runs in the block: its section, its faults, the progress ping after it."""
        self.position = f"step {step}"
        self.monitor.start("step")
        self.injector.at_step_start(step, step - 1)
        yield
        self.monitor.end("step")
        self.position = f"after step {step}"  # its checkpoint, its records, until the next step
        self._ping()

    @contextlib.contextmanager
    def judging_failures(self) -> Iterator[None]:
        """An exception that leaves the block ends the attempt: it is judged where the attempt
        stands (:func:`.deterministic.judge`), and leaves as :class:`.deterministic.RepeatedFailure`
        when an earlier attempt failed the same way there. Before the process group exists
        (no attempt id yet) nothing is judged: that is the rendezvous' and the network's."""
        try:
            yield
        except Exception as exc:
            if self.id is None or is_configuration_failure(exc):
                raise
            said = deterministic.judge(
                exc,
                self.position,
                self.id,
                self.failures,
                {
                    "rank": self.rank,
                    "node": node_index(),
                    "layer": self.layer,
                    "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                },
            )
            if said:
                print(f"[resilient-fsdp] rank {self.rank}: {said}", file=sys.stderr, flush=True)
            raise

    def after_optimizer_step(self, step: int, shards: Callable[[], list[torch.Tensor]]) -> None:
        """Just after step ``step``'s optimizer step: where a ``bitflip`` fault changes a parameter."""
        self.injector.after_optimizer_step(step, shards)

    def local_compute(self) -> None:
        """Inside the rank's own optimizer step: where a ``slow`` fault takes its extra time."""
        self.injector.local_compute()

    def exclude_this_node(self, why: str) -> bool:
        """Ask the launcher to leave this node out of the next rendezvous (:mod:`.stragglers`)."""
        return self.monitor.exclude_this_node(why)

    def before_collective(self, step: int, local_loss: torch.Tensor) -> None:
        """Step ``step`` is about to enter its loss all-reduce with this rank's ``local_loss``
        (which a ``nan-loss`` fault poisons in place)."""
        self.injector.local_loss(step, local_loss)
        self.injector.before_collective(step)

    def after_first_step(self, resumed_step: int, log: Callable[[dict, str], None]) -> None:
        """Rank 0, after the first step of an attempt a restart caused: close the recoveries of
        the faults that caused it; ``log(event, message)`` records each."""
        if self.layer == "start" or self.rank != 0:
            return
        now = time.time()
        for r in accounting.record_recoveries(self.ledger, self.layer, resumed_step, now, self.marks, self.id):
            log(
                {"event": "recovery", "t": now, **r},
                f"recovered from {r['fault']} by {r['layer'].replace('_', '-')} restart in {r['recovery_s']:.2f} s; "
                f"{r['lost_steps']} step(s) trained again",
            )

    def maybe_learn(self) -> Optional[dict]:
        """Collective: learn the section timeouts once enough was seen; the timeouts when learned."""
        return self.monitor.maybe_learn()

    # -- the checkpointer's hooks -----------------------------------------------------------------

    def start_section(self, name: str) -> None:
        self.monitor.start(name)

    def end_section(self, name: str, learn: bool = True) -> None:
        self.monitor.end(name, learn=learn)

    def draining(self):
        """The ``drain`` section, with the in-process watchdog pinged meanwhile
        (:meth:`.ProgressMonitor.draining`)."""
        return self.monitor.draining(self._ping)

    def save_started(
        self, step: int, partial_dir: Path, measure: Callable[[], int], expected: Callable[[], Optional[int]]
    ) -> None:
        self.injector.save_started(step, partial_dir, measure, expected)

    def save_written(self, step: int) -> None:
        self.injector.save_written(step)

    def writer_fault(self, step: int) -> Optional[str]:
        return self.injector.writer_fault(step)

    def commit_fault(self, step: int, marker: Path) -> Optional[str]:
        return self.injector.commit_fault(step, marker)

    def restoring(self, step: int, tier: str) -> None:
        self.injector.restoring(step, tier)

    def close(self) -> None:
        """The attempt ends: a save still watched for a fault will not be finished by it."""
        if self.injector is not None:
            self.injector.close()
