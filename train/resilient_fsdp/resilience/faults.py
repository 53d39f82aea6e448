"""Fault injection: ``KIND@STEP[:rank=R | :node=N][:for=SECONDS][:factor=F]``, for tests, demos and
cluster drills; fired once per job (:mod:`.ledger`) unless its kind says otherwise.

The kinds, where each fires and which layer is expected to recover, are one table,
:data:`resilient_fsdp.config.FAULT_KINDS` (``resilient-fsdp config --describe`` lists it). The
target is ``rank=R`` (default 0) or ``node=N``, the local rank 0 of pod N (:func:`node_index`).
``node-loss`` and ``partition`` act on a pod, which a rank cannot do to itself on every
platform: where a cluster executes fault requests (:data:`REQUESTS_ENV`) the rank asks it. The
attempt (:mod:`.attempt`) and the checkpoint writer fire them.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import psutil

from .. import atomic
from ..config import CUT_OFF_KINDS, NODE_FAULT_KINDS, ConfigError, FaultSpec
from .ledger import FaultLedger
from .node_rank import INDEX_SOURCES

if TYPE_CHECKING:  # the node agent imports this module, without torch
    import torch

# Set by the node agent wrapper (resilient_fsdp.resilience.agent): the process that stands for the node (pod).
NODE_PID_ENV = "RESILIENT_FSDP_NODE_PID"
NODE_START_ENV = "RESILIENT_FSDP_NODE_START"
# The index of this rank's node (pod), set by resilient-fsdp local for each simulated node.
NODE_INDEX_ENV = "RESILIENT_FSDP_NODE"
# Where node-level faults are requested from the cluster that can execute them (the local cluster
# sets it in every pod): the firing rank writes <kind>-step<STEP>-node<N>.json there. Without it
# (a real cluster, the chart's chaos drill) node-loss kills the pod's process tree from inside and
# partition is refused before training starts.
REQUESTS_ENV = "RESILIENT_FSDP_FAULT_REQUESTS"
NODE_LOSS_WAIT_S = 60.0
# How often a sigkill-during-save looks at the bytes its checkpoint has on disk.
SAVE_POLL_S = 0.0005
# How often a sigkill-during-commit looks for the commit that stopped for it.
COMMIT_POLL_S = 0.01


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault."""


def node_index() -> int:
    """This rank's node (pod) index: ``RESILIENT_FSDP_NODE``, then the pod's index as its controller
    says it (:data:`.node_rank.INDEX_SOURCES`), then ``GROUP_RANK``, else 0. The pod's index, not
    the node rank: with hot spares a pod's node rank is whatever place it took, and ``node=N``
    names the pod (the one a ``node-loss`` takes down)."""
    for name in (NODE_INDEX_ENV, *INDEX_SOURCES, "GROUP_RANK"):
        raw = os.environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0


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


def own_helpers() -> list[psutil.Process]:
    """This rank's helper processes in its own process group (the checkpoint writer, the results
    Manager); not NVRx's in-process monitor, which runs in a session of its own."""
    pgid = os.getpgid(0)
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
        except (OSError, psutil.NoSuchProcess):
            continue
    return found


def kill_rank_and_helpers(helpers: Optional[list[psutil.Process]] = None) -> None:
    """SIGKILL this rank together with its helpers (the writer dies mid-write with it)."""
    for proc in own_helpers() if helpers is None else helpers:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def requests_dir() -> Optional[Path]:
    raw = os.environ.get(REQUESTS_ENV)
    return Path(raw) if raw else None


def check_executable(specs: list[FaultSpec]) -> None:
    """Refuse, before training, a fault nothing here can execute: a ``partition`` needs a cluster
    that reads requests (``RESILIENT_FSDP_FAULT_REQUESTS``)."""
    for spec in specs:
        if spec.kind in CUT_OFF_KINDS and requests_dir() is None:
            raise ConfigError(_partition_refusal(spec))


def _partition_refusal(spec: FaultSpec) -> str:
    return (
        f"resilience.inject {str(spec)!r}: a {spec.kind} takes a pod's network link down, which a rank cannot do "
        f"to its own pod; it runs where a cluster executes fault requests ({REQUESTS_ENV} is set in every pod "
        "by `resilient-fsdp local`'s network-namespace cluster). Here it is not set: use node-loss, or cut the "
        "network with the cluster's own tools"
    )


class SaveWatch(threading.Thread):
    """``sigkill-during-save``: kills the rank and its writer once the checkpoint being written has
    some but not all of its bytes on disk.

    A thread, because the write happens elsewhere (the async writer process) or in the main thread
    itself (``sync``). Once the bytes are in range it stops (SIGSTOP) this rank's helpers, so what
    it records is what stays on disk, and kills them and the rank. If the write finishes first,
    :meth:`finish` fires the fault before the checkpoint commits and the record says so.
    """

    def __init__(
        self,
        injector: "FaultInjector",
        spec: FaultSpec,
        step: int,
        partial_dir: Path,
        measure: Callable[[], int],
        expected: Optional[int],
    ):
        super().__init__(daemon=True, name="fault-sigkill-during-save")
        self.injector, self.spec, self.step, self.partial_dir = injector, spec, step, partial_dir
        self.measure, self.expected = measure, expected
        self.written = threading.Event()
        self.cancelled = False

    def cancel(self) -> None:
        """The attempt ended without this save finishing (in-process restart): never fire."""
        self.cancelled = True
        self.written.set()

    def in_range(self, nbytes: int) -> bool:
        return nbytes > 0 and (self.expected is None or nbytes < self.expected)

    def run(self) -> None:
        while not self.written.is_set():
            if self.in_range(self._bytes()):
                helpers = own_helpers()
                for proc in helpers:
                    _signal(proc, signal.SIGSTOP)
                nbytes = self._bytes()
                if self.in_range(nbytes) and not self.written.is_set() and not self.cancelled:
                    self.injector.fire(
                        self.spec,
                        self.step,
                        {
                            "during_write": True,
                            "bytes_on_disk": nbytes,
                            "expected_bytes": self.expected,
                            "checkpoint_step": self.step,
                            "checkpoint_dir": str(self.partial_dir),
                            "helpers_stopped": [p.pid for p in helpers],
                        },
                        helpers=helpers,
                    )
                for proc in helpers:
                    _signal(proc, signal.SIGCONT)
            time.sleep(SAVE_POLL_S)

    def finish(self) -> None:
        """The main thread saw this rank's write finish: fire now, before the checkpoint commits."""
        self.written.set()
        self.join()
        nbytes = self._bytes()
        note = (
            f"the write had finished ({nbytes:,} bytes on disk) before the fault could land while it was "
            "writing; killed before the commit instead"
        )
        self.injector.fire(
            self.spec,
            self.step,
            {
                "during_write": False,
                "bytes_on_disk": nbytes,
                "expected_bytes": self.expected,
                "checkpoint_step": self.step,
                "checkpoint_dir": str(self.partial_dir),
                "note": note,
            },
        )

    def _bytes(self) -> int:
        try:
            return self.measure()
        except OSError:
            return 0


class CommitWatch(threading.Thread):
    """``sigkill-during-commit``: waits for rank 0's commit of a checkpoint to stop inside itself
    for the fault (:data:`~resilient_fsdp.checkpoint.commit.FAULT_MARKER`, naming the process
    that commits: the commit process, or this rank on the training thread), then kills that
    process, this rank and its helpers: the commit cut short between the engine's metadata and the
    manifest, asserted by the marker rather than timed."""

    def __init__(self, injector: "FaultInjector", spec: FaultSpec, step: int, marker: Path):
        super().__init__(daemon=True, name="fault-sigkill-during-commit")
        self.injector, self.spec, self.step, self.marker = injector, spec, step, marker
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self) -> None:
        while not self.cancelled.wait(COMMIT_POLL_S):
            try:
                pid = int(self.marker.read_text())
            except (OSError, ValueError):
                continue
            self.injector.fire(
                self.spec,
                self.injector.completed_step,
                {
                    "during_commit": True,
                    "commit_pid": pid,
                    "commit_in_own_process": pid != os.getpid(),
                    "checkpoint_step": self.step,
                    "checkpoint_dir": str(self.marker.parent),
                },
            )
            return


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


class CorruptibleMemory(Protocol):
    """What the memory faults need of the memory tier (``checkpoint.memory.tier.MemoryTier``)."""

    def byte_to_corrupt(self, replica: bool) -> Optional[tuple[Path, int, int]]: ...


class FaultInjector:
    """Fires this rank's faults at their steps, each at most once per job."""

    def __init__(
        self,
        specs: list[FaultSpec],
        rank: int,
        ledger: FaultLedger,
        on_fire: Optional[Callable[[FaultSpec], None]] = None,
    ):
        check_executable(specs)
        self.node, local_rank = node_index(), int(os.environ.get("LOCAL_RANK", "0"))
        self.mine = [
            s for s in specs if (s.node is None and s.rank == rank) or (s.node == self.node and local_rank == 0)
        ]
        self.rank, self.ledger, self.on_fire = rank, ledger, on_fire
        self.watch: Optional[SaveWatch] = None
        self.commit_watch: Optional[CommitWatch] = None
        self.completed_step = 0  # the newest step this attempt started after (a helper thread's faults)
        # The memory tier the ``memory-corrupt`` and ``replica-corrupt`` faults act on, once built.
        self.memory: Optional[CorruptibleMemory] = None
        self.partitions: list[tuple[FaultSpec, float]] = []  # fired here, (spec, t_fault)
        self.local_rank = local_rank
        # A ``slow`` fault: seconds added to each of this rank's steps, in its own optimizer step.
        # Its pod stays slow: a fault fired on this pod and local rank, in any attempt, applies.
        self.slowdown_s = max(
            (
                r.get("slowdown_s", 0.0)
                for r in ledger.fired()
                if r.get("kind") == "slow" and r.get("node_index") == self.node and r.get("local_rank") == local_rank
            ),
            default=0.0,
        )
        self._last_step_start: Optional[float] = None
        self._step_times: collections.deque = collections.deque(maxlen=8)  # before any slowdown

    def at_step_start(self, step: int, completed_step: int) -> None:
        """Called inside the step section before step ``step`` (``completed_step`` = step - 1) runs."""
        now = time.perf_counter()
        if self._last_step_start is not None and not self.slowdown_s:
            self._step_times.append(now - self._last_step_start)
        self._last_step_start = now
        self._note_healed_partitions(completed_step)
        self.completed_step = completed_step
        for spec in self.mine:
            if spec.kind_info.when == "step" and spec.step == step:
                self.fire(spec, completed_step)
            elif spec.kind_info.when == "restore" and spec.step == step:
                self.ledger.arm(spec)

    def after_optimizer_step(self, step: int, shards: Callable[[], list[torch.Tensor]]) -> None:
        """Called just after step ``step``'s optimizer step with this rank's parameter shards: a
        ``bitflip`` flips one bit of one of them in place."""
        import torch

        for spec in self.mine:
            if spec.kind_info.when == "optimizer" and spec.step == step:
                target = next((t for t in shards() if t.numel() and t.element_size() == 4), None)
                if target is None:
                    continue
                details = {"bit": BITFLIP_BIT, "element": 0, "shape": list(target.shape)}
                if self.ledger.claim(spec, self._record(spec, step, details)):
                    print(
                        f"[resilient-fsdp] rank {self.rank}: injecting fault {spec}: bit {BITFLIP_BIT} of the "
                        "first element of its first parameter shard flips",
                        file=sys.stderr,
                        flush=True,
                    )
                    with torch.no_grad():
                        word = target.view(-1)[:1].view(torch.int32)
                        word ^= 1 << BITFLIP_BIT

    def local_compute(self) -> None:
        """Called inside the rank's own optimizer step, where no peer waits: a ``slow`` fault's
        extra time, as a slow GPU's kernels would take it."""
        if self.slowdown_s:
            time.sleep(self.slowdown_s)

    def before_collective(self, step: int) -> None:
        """Called inside step ``step`` just before the trainer's own all-reduce (the loss)."""
        for spec in self.mine:
            if spec.kind_info.when == "collective" and spec.step == step:
                self.fire(spec, step - 1)

    def local_loss(self, step: int, loss: torch.Tensor) -> None:
        """Called with this rank's loss of step ``step`` before it enters the loss all-reduce: a
        ``nan-loss`` fault makes it NaN in place (the job's loss is then non-finite on every rank)."""
        for spec in self.mine:
            if spec.kind_info.when == "loss" and spec.step == step:
                record = self._record(spec, step - 1)
                if self.ledger.claim(spec, record) or not spec.kind_info.once_per_job:
                    print(
                        f"[resilient-fsdp] rank {self.rank}: injecting fault {spec}: this rank's loss of step "
                        f"{step} is NaN",
                        file=sys.stderr,
                        flush=True,
                    )
                    loss.fill_(float("nan"))

    def save_started(
        self, step: int, partial_dir: Path, measure: Callable[[], int], expected: Callable[[], Optional[int]]
    ) -> None:
        """Called as the checkpoint of ``step`` starts writing into ``partial_dir``; ``measure()``:
        the bytes its writers have put there; ``expected()``: the same for a finished write (the
        newest committed checkpoint of this world size and mode), None if unknown."""
        for spec in self.mine:
            if (
                spec.kind_info.when == "save"
                and step >= spec.step
                and self.watch is None
                and not self.ledger.claimed(spec)
            ):
                self.watch = SaveWatch(self, spec, step, partial_dir, measure, expected())
                self.watch.start()

    def writer_fault(self, step: int) -> Optional[str]:
        """What this rank's checkpoint writer is to do wrong while writing step ``step``'s
        checkpoint (claimed in the ledger now, so it fires once per job): ``exit``, ``raise``,
        ``hang`` or ``slow=SECONDS``, carried out inside the writer; None for a plain write."""
        for spec in self.mine:
            if spec.kind_info.when == "write" and spec.step == step:
                action = spec.kind.removeprefix("writer-")
                if action == "slow":
                    action = f"slow={spec.for_s:g}"
                if self.ledger.claim(spec, self._record(spec, step - 1, {"writer": action})):
                    print(
                        f"[resilient-fsdp] rank {self.rank}: injecting fault {spec} into the checkpoint writer",
                        file=sys.stderr,
                        flush=True,
                    )
                    return action
        return None

    def commit_fault(self, step: int, marker: Path) -> Optional[str]:
        """Rank 0, as it hands over the commit of ``step``'s checkpoint: ``stop`` when a
        ``sigkill-during-commit`` is to land inside it (the commit then writes ``marker`` and
        waits; a :class:`CommitWatch` kills it there), else None."""
        for spec in self.mine:
            if spec.kind_info.when == "commit" and step >= spec.step and not self.ledger.claimed(spec):
                if self.commit_watch is not None:  # a commit that failed before it stopped
                    self.commit_watch.cancel()
                self.commit_watch = CommitWatch(self, spec, step, marker)
                self.commit_watch.start()
                return "stop"
        return None

    def replica_sending(self, step: int) -> None:
        """Called by the memory tier's sender thread between the record and the bytes of the
        replica of ``step``: a ``sigkill-during-replication`` kills the rank and its helpers here."""
        for spec in self.mine:
            if spec.kind_info.when == "replicate" and step >= spec.step and not self.ledger.claimed(spec):
                self.fire(spec, self.completed_step, {"during_replication": True, "replica_step": step})

    def restoring(self, step: int, tier: str) -> None:
        """Called as this rank's restore of ``step`` from ``tier`` (``memory``, ``durable``) is
        about to load the live state: an armed ``sigkill-during-restore`` kills the rank here."""
        for spec in self.mine:
            if spec.kind_info.when == "restore" and self.ledger.armed(spec) and not self.ledger.claimed(spec):
                self.fire(spec, step, {"during_restore": True, "restore_step": step, "restore_tier": tier})

    def save_written(self, step: int) -> None:
        """Called when this rank's write of ``step`` finished, before the checkpoint commits."""
        if self.watch is not None and self.watch.step == step:
            watch, self.watch = self.watch, None
            watch.finish()

    def close(self) -> None:
        """End of an attempt: a save still watched will not be finished by this attempt."""
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        if self.commit_watch is not None:
            self.commit_watch.cancel()
            self.commit_watch = None

    def fire(
        self,
        spec: FaultSpec,
        completed_step: int,
        details: Optional[dict] = None,
        helpers: Optional[list[psutil.Process]] = None,
    ) -> None:
        record = self._record(spec, completed_step, details)
        request = None
        if spec.kind in NODE_FAULT_KINDS and requests_dir() is not None:
            request = requests_dir() / f"{spec.kind}-step{spec.step}-node{self.node}.json"
            record["request"] = str(request)
        elif spec.kind in CUT_OFF_KINDS:
            raise ConfigError(_partition_refusal(spec))
        if not self.ledger.claim(spec, record) and spec.kind_info.once_per_job:
            return
        print(
            f"[resilient-fsdp] rank {self.rank}: injecting fault {spec} (after step {completed_step})"
            + (f": {details['note']}" if details and "note" in details else ""),
            file=sys.stderr,
            flush=True,
        )
        if self.on_fire is not None:
            self.on_fire(spec)
        sys.stdout.flush()
        if request is not None:
            request.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(
                request,
                {
                    "kind": spec.kind,
                    "node": self.node,
                    "step": spec.step,
                    "for_s": spec.for_s,
                    "rank": self.rank,
                    "time": record["t_fault"],
                },
            )
            if spec.kind == "partition":
                self.partitions.append((spec, record["t_fault"]))
                return  # the cluster cuts the link; training goes on until it notices
            self._await_node_loss(spec, request)
        if spec.kind in ("memory-corrupt", "replica-corrupt"):
            self._flip_memory_byte(spec)
            return
        if spec.kind == "slow":
            self.slowdown_s = record["slowdown_s"]
            return
        if spec.kind == "slow-exit":
            _EXIT_DELAYS.append(spec.for_s if spec.for_s is not None else SLOW_EXIT_DEFAULT_S)
            return
        if spec.kind in ("exception", "exception-repeat"):
            raise InjectedFault(f"injected fault {spec}: an exception at step {spec.step} on rank {self.rank}")
        if spec.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind in ("sigkill-during-save", "sigkill-during-replication", "sigkill-during-restore"):
            kill_rank_and_helpers(helpers)
        if spec.kind == "sigkill-during-commit":
            if details["commit_in_own_process"]:
                try:
                    os.kill(details["commit_pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kill_rank_and_helpers()
        if spec.kind in ("node-loss", "node-freeze"):  # past the wait: nothing executed the request
            kill_node()
        if spec.kind == "sigterm":
            # What the kubelet does to a pod it evicts: SIGTERM to the container's main process,
            # which forwards it to every rank of the node. This rank goes on to the graceful stop.
            os.kill(node_root_pid(), signal.SIGTERM)
            return
        if spec.kind in ("hang", "hang-in-collective"):
            while True:  # Python-level, so an in-process restart can interrupt it
                time.sleep(0.05)

    def _flip_memory_byte(self, spec: FaultSpec) -> None:
        found = self.memory.byte_to_corrupt(replica=spec.kind == "replica-corrupt") if self.memory else None
        if found is None:
            print(
                f"[resilient-fsdp] rank {self.rank}: {spec}: no memory checkpoint to corrupt",
                file=sys.stderr,
                flush=True,
            )
            return
        path, offset, step = found
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))
        print(
            f"[resilient-fsdp] rank {self.rank}: {spec}: flipped a bit of {path} (step {step}) at byte {offset}",
            file=sys.stderr,
            flush=True,
        )

    def _record(self, spec: FaultSpec, completed_step: int, details: Optional[dict] = None) -> dict:
        if spec.kind == "slow":
            # The rank's step before the fault: the median of its last steps (0 at step 1).
            base = statistics.median(self._step_times) if self._step_times else 0.0
            details = {
                "local_rank": self.local_rank,
                "base_step_s": base,
                "slowdown_s": ((spec.factor or SLOW_DEFAULT_FACTOR) - 1) * base,
                **(details or {}),
            }
        return {
            **asdict(spec),
            "fault": str(spec),
            "key": spec.key,
            "completed_step": completed_step,
            "t_fault": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": self.rank,
            "node_index": self.node,
            **(details or {}),
        }

    def _note_healed_partitions(self, completed_step: int) -> None:
        """A step completed after a partition's ``for`` seconds were over: it healed without a
        restart (or nothing executed it), so the next restart is not its recovery."""
        now = time.time()
        for spec, t_fault in list(self.partitions):
            if spec.for_s is not None and now - t_fault > spec.for_s:
                self.ledger.record_went_on(
                    spec.key, {"fault": str(spec), "step": completed_step, "after_s": now - t_fault}
                )
                self.partitions.remove((spec, t_fault))

    def _await_node_loss(self, spec: FaultSpec, request: Path) -> None:
        """After a node-loss request: the cluster kills this pod. If it has not within
        :data:`NODE_LOSS_WAIT_S`, say so and kill the pod's processes from inside."""
        deadline = time.monotonic() + NODE_LOSS_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        print(
            f"[resilient-fsdp] rank {self.rank}: {spec}: nothing executed the request {request} within "
            f"{NODE_LOSS_WAIT_S:.0f} s; killing this node's processes from inside",
            file=sys.stderr,
            flush=True,
        )


# ``slow-exit``: seconds this process waits once training has finished, before it exits.
SLOW_EXIT_DEFAULT_S = 30.0
SLOW_DEFAULT_FACTOR = 2.0
BITFLIP_BIT = 20  # a mantissa bit of a float32: the value moves by about 1e-1 of itself, nothing fails
_EXIT_DELAYS: list[float] = []


def delay_exit() -> None:
    """After training finished: wait out every ``slow-exit`` fault this rank fired."""
    if _EXIT_DELAYS:
        seconds = sum(_EXIT_DELAYS)
        print(f"[resilient-fsdp] training finished; slow-exit: exiting in {seconds:g} s", file=sys.stderr, flush=True)
        time.sleep(seconds)
