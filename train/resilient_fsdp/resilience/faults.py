"""Fault injection: ``KIND@STEP[:rank=R]``, fired once per job, for tests, demos and cluster drills.

Kinds, and the layer expected to recover from each:

==========================  ===================================================  =================
kind                        what happens on rank R at step STEP                  recovered by
==========================  ===================================================  =================
``exception``               the step raises                                      in-process, else in-job
``hang``                    the rank stops making progress (sleeps forever)      in-process, else in-job
``sigkill``                 the rank's process is killed                         in-job
``sigkill-during-save``     killed while its checkpoint write is in flight       in-job (previous checkpoint)
``sigterm``                 its node (agent) gets SIGTERM, as on eviction        graceful stop + job level
``node-loss``               its whole node dies: agent, workers, helpers         job level (node recreated)
==========================  ===================================================  =================

"Once per job" is kept by a ledger on shared storage (``<run_dir>/faults/``): a rank claims a fault
by creating its record exclusively before firing it, so the restart the fault causes passes the
same step again without firing it twice. The ledger also receives each fault's recovery record.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import psutil

from .. import atomic
from ..config import FaultSpec

# Set by the node agent wrapper (resilient_fsdp.resilience.agent): the process that stands for the node (pod).
NODE_PID_ENV = "RESILIENT_FSDP_NODE_PID"
NODE_START_ENV = "RESILIENT_FSDP_NODE_START"


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault."""


class FaultLedger:
    """Fired faults and their recoveries, one JSON file each, on storage every rank shares."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "faults"

    def claim(self, spec: FaultSpec, record: dict) -> bool:
        """Record ``spec`` as fired; False if it already was (by any rank, in any earlier attempt)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        # Durable before the fault fires: it may kill this process next.
        return atomic.create_exclusive(self.dir / f"{spec.key}.json", json.dumps(record, sort_keys=True))

    def fired(self) -> list[dict]:
        """Every fired fault, oldest first."""
        records = []
        for path in self.dir.glob("*.json") if self.dir.is_dir() else []:
            if path.name.endswith(".recovery.json"):
                continue
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # a record torn by the fault itself: nothing to account for
        return sorted(records, key=lambda r: r["t_fault"])

    def recoveries(self) -> dict[str, dict]:
        found = {}
        for path in self.dir.glob("*.recovery.json") if self.dir.is_dir() else []:
            try:
                found[path.name[: -len(".recovery.json")]] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return found

    def record_recovery(self, key: str, record: dict) -> None:
        atomic.write_json(self.dir / f"{key}.recovery.json", record, indent=None, newline=False)


def node_root_pid() -> int:
    """The process that stands for this rank's node: the agent wrapper, else the launcher agent."""
    return int(os.environ.get(NODE_PID_ENV) or os.getppid())


def kill_node() -> None:
    """SIGKILL this rank's whole node: every process under the node's root, then the root, then us.

    In a container the root is PID 1, which the kernel protects from signals sent from inside;
    killing everything under it makes it exit (the agent wrapper then exits 137).
    """
    me = os.getpid()
    try:
        root = psutil.Process(node_root_pid())
        victims = [p for p in root.children(recursive=True) if p.pid != me]
    except psutil.NoSuchProcess:
        root, victims = None, []
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    if root is not None and root.pid != 1:
        try:
            root.kill()
        except psutil.NoSuchProcess:
            pass
    os.kill(me, signal.SIGKILL)


class FaultInjector:
    """Fires this rank's faults at their steps, each at most once per job."""

    PRE_STEP = ("exception", "hang", "sigkill", "sigterm", "node-loss")

    def __init__(self, specs: list[FaultSpec], rank: int, ledger: FaultLedger,
                 on_fire: Optional[Callable[[FaultSpec], None]] = None):
        self.mine = [s for s in specs if s.rank == rank]
        self.rank, self.ledger, self.on_fire = rank, ledger, on_fire

    def at_step_start(self, step: int, completed_step: int) -> None:
        """Called inside the step section before step ``step`` (``completed_step`` = step - 1) runs."""
        for spec in self.mine:
            if spec.kind in self.PRE_STEP and spec.step == step:
                self._fire(spec, completed_step)

    def after_checkpoint(self, step: int, write_in_flight: bool) -> None:
        """Called after the checkpoint calls of step ``step``."""
        for spec in self.mine:
            if spec.kind == "sigkill-during-save" and step >= spec.step and write_in_flight:
                self._fire(spec, step)

    def _fire(self, spec: FaultSpec, completed_step: int) -> None:
        record = {**asdict(spec), "fault": str(spec), "key": spec.key, "completed_step": completed_step,
                  "t_fault": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
        if not self.ledger.claim(spec, record):
            return
        print(f"[resilient-fsdp] rank {self.rank}: injecting fault {spec} (after step {completed_step})",
              file=sys.stderr, flush=True)
        if self.on_fire is not None:
            self.on_fire(spec)
        sys.stdout.flush()
        if spec.kind == "exception":
            raise InjectedFault(f"injected fault {spec}: an exception at step {spec.step} on rank {self.rank}")
        if spec.kind in ("sigkill", "sigkill-during-save"):
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind == "node-loss":
            kill_node()
        if spec.kind == "sigterm":
            # What the kubelet does to a pod it evicts: SIGTERM to the container's main process,
            # which forwards it to every rank of the node. This rank goes on to the graceful stop.
            os.kill(node_root_pid(), signal.SIGTERM)
            return
        if spec.kind == "hang":
            while True:  # Python-level, so an in-process restart can interrupt it
                time.sleep(0.05)
