"""A rank's memory checkpoints in the step loop (``checkpoint.memory``): a save when one is due, its
copy overlapped with the next step's forward and backward, its commit off the training thread,
and, at a start, the restore from memory when every rank can make it (:class:`MemoryTier`).

Saving follows the durable save's staging into the slot being written (:mod:`.slots`); a memory
save never coincides with a durable one (the durable save is taken). Restoring checks each slot
first; the decision (:mod:`.agreement`, made in :mod:`..resume`) falls back to a peer's replica
(:mod:`.replicas`) or the durable checkpoint. A pod whose ``/dev/shm`` cannot hold every rank's
slots beside the durable staging keeps the tier off (:func:`shm_needed`). Used by
:class:`..checkpointer.Checkpointer`.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Container, Optional

import torch
from torch.distributed.tensor import DTensor

from ..staging import StagingJob, local_tensors, replace_tensors, structure
from . import peers
from .agreement import Decision, Report
from .replicas import Replicator, exchange, pairs_group, replica_slots
from ..state import canonical_name
from .slots import MemorySlots, Record, SlotInvalid, job_root, owner_name, remove_empty_job_root, structure_digest
from .values import tensor_paths, with_values, without_tensors

if TYPE_CHECKING:
    from .prefetch import Prefetch, ReadAhead


class MemoryTier:
    """Rank ``rank``'s memory checkpoints of run ``run`` (``run_identity``) of job ``job``, every
    ``interval_steps`` steps, in ``shm`` (``checkpoint.memory.dir``)."""

    def __init__(
        self,
        interval_steps: int,
        shm: Path,
        job: str,
        run: str,
        rank: int,
        world_size: int,
        replicas: int = 0,
        ranks_per_pod: int = 1,
        say: Callable[[str], None] = lambda _m: None,
        durable_copies: int = 0,
        prefetch: Optional[Prefetch] = None,
    ):
        self.interval_steps = interval_steps
        self.shm, self.ranks_per_pod, self.replicas = Path(shm), ranks_per_pod, replicas
        # Copies of the state the durable checkpoint stages in shared memory per rank (1 for the
        # async engines, 0 for sync); they count where they share the slots' file system.
        self.durable_copies = durable_copies
        self.off: Optional[str] = None  # why the tier is off for this job, once found
        self.say = say
        # The newest own snapshot, its checksums checked when this start reported it, and its views.
        self._checked: Optional[tuple[Record, list[torch.Tensor]]] = None
        # This start's read-ahead of that snapshot (:mod:`.prefetch`), until the restore takes it.
        self.prefetch = prefetch
        self._ahead: Optional[ReadAhead] = None
        # Seconds of this start's restore by phase (report's checks, then the restore's), said with it.
        self.restore_phases: dict[str, float] = {}
        # How long the read-ahead this start's restore uses took, beside the build (None: none).
        self.read_ahead_s: Optional[float] = None
        # The CPU time the restore's phases took on the training thread (None: no restore yet).
        self.restore_cpu_s: Optional[float] = None
        self.root = job_root(Path(shm), job, run)
        self.job, self.run, self.rank, self.world_size = job, run, rank, world_size
        self.slots = MemorySlots(self.root, owner_name(rank), pin=torch.cuda.is_available())
        self.replicator: Optional[Replicator] = None
        self.group = None
        self.source = None
        self.kept: Optional[MemorySlots] = None  # the replica slots of ``source`` this rank keeps
        if replicas:
            # Collective: every rank builds its checkpointer, and so its memory tier, at one point.
            self.group = pairs_group()
            holder = peers.replica_holder(rank, world_size, ranks_per_pod)
            self.source = peers.replica_source(rank, world_size, ranks_per_pod)
            self.kept = replica_slots(self.root, self.source) if self.source is not None else None
            self.replicator = Replicator(self.group, self.slots, self.kept, rank, holder, self.source, say)
        self.cuda = torch.cuda.is_available()
        self._copy: Optional[StagingJob] = None
        self.pending: Optional[dict] = None
        self._finished: list[dict] = []
        self._errors_polled = 0  # the replicator's errors already returned by poll

    def due(self, step: int) -> bool:
        return self.interval_steps > 0 and step % self.interval_steps == 0

    # -- saving --------------------------------------------------------------------------------

    def save(self, step: int, sd: dict, attempt: int = 0, batch: Optional[dict] = None) -> None:
        """Start the memory checkpoint of ``step`` from ``sd`` (the state now): the non-tensor values
        taken now, the tensors copied on a helper thread (``staging.StagingJob``) until
        :meth:`before_optimizer_step`, then the checksums and the record on the same thread (the
        next memory save waits for them: one in flight, two slots). ``batch``: the run's
        ``grad_accum_steps`` and global batch target now, restored with the state."""
        if self.off is not None:
            return
        t0 = time.perf_counter()
        self.settle()
        tensors = local_tensors(sd)
        digest = structure_digest(structure(sd))
        slot = self.slots.next_slot()
        pending = {"step": step, "slot": slot, "t0": t0, "stall_s": 0.0, "staged": False}
        if not self.slots.mapped():
            self.off = self._short_of_room(sum(t.numel() * t.element_size() for t in tensors))
            if self.off is not None:
                self._finished.append(self._event(pending, error=self.off))
                return
        try:
            spans, views = self.slots.open(slot, tensors)
            extra = pickle.dumps(without_tensors(sd), protocol=pickle.HIGHEST_PROTOCOL)
        except (OSError, RuntimeError, pickle.PicklingError) as exc:
            self._finished.append(self._event(pending, error=f"{type(exc).__name__}: {exc}"))
            return
        if self.slots.pin_error is not None:
            self.say(
                f"rank {self.rank}: warning: {self.slots.pin_error}; each memory save's copy waits for all of "
                "it at the pageable rate"
            )
            self.slots.pin_error = None

        def commit() -> None:
            t = time.perf_counter()
            pending["record"] = self.slots.commit(
                slot,
                spans,
                step,
                digest,
                world_size=self.world_size,
                rank=self.rank,
                job=self.job,
                attempt=attempt,
                extra=extra,
                meta={"batch": dict(batch or {})},
            )
            pending["commit_s"] = time.perf_counter() - t
            if self.replicator is not None:
                self.replicator.committed(pending["record"])

        self._copy = StagingJob(sd, replace_tensors(sd, iter(views)), self.cuda, commit)
        pending["nbytes"] = sum(t.numel() * t.element_size() for t in tensors)
        pending["stall_s"] = time.perf_counter() - t0
        self.pending = pending

    def _short_of_room(self, state_bytes: int) -> Optional[str]:
        """Why ``checkpoint.memory.dir`` cannot hold this pod's slots beside the durable staging,
        or None. Counted for every rank of the pod, each with a state the size of this one's:
        the file system's size must hold all of it, and its free space (with what this run's
        slots already hold, which the saves reuse) the slots. What other runs left there (a
        killed run on a reused ``/dev/shm``) is named, never removed: only that run can use it."""
        try:
            fs = os.statvfs(self.shm)
            durable = self.durable_copies if os.stat(self.shm).st_dev == os.stat("/dev/shm").st_dev else 0
        except OSError as exc:
            return f"checkpoint.memory.dir={str(self.shm)!r} is not usable ({exc.strerror or exc})"
        size, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
        need = shm_needed(state_bytes, self.ranks_per_pod, self.replicas, durable)
        slots_need = shm_needed(state_bytes, self.ranks_per_pod, self.replicas, 0)
        usable = free + _held(self.root)
        if need <= size and slots_need <= usable:
            return None
        slots = 2 * (1 + self.replicas)
        if need <= size:
            others = _other_runs(self.shm, self.root)
            held = "; ".join(f"{path} holds {_size(n)}" for path, n in others[:3]) or "none of it by this tool"
            return (
                f"the memory tier is off for this job: {self.shm} has {_size(usable)} free and the pod's "
                f"{self.ranks_per_pod} rank(s) need {_size(slots_need)} for their slots ({slots} of "
                f"{_size(state_bytes)} each, per rank); what else holds it: {held}. Other runs' snapshots "
                "serve only their own restarts: remove the ones no run will resume, or raise shm.sizeLimit "
                f"by {_quantity(slots_need - usable)}. Durable checkpoints go on"
            )
        return (
            f"the memory tier is off for this job: {self.shm} holds {_size(size)}, and the pod's "
            f"{self.ranks_per_pod} rank(s) need {_size(need)} ({slots} slots of {_size(state_bytes)} each"
            f"{' and the durable checkpoint staging copy' if durable else ''}, per rank); raise shm.sizeLimit to "
            f"at least {_quantity(need)} (resilient-fsdp advise --memory sizes it), or set "
            "checkpoint.memory.interval_steps=0. Durable checkpoints go on"
        )

    def before_optimizer_step(self) -> float:
        """Wait for the pending memory save's copy (rank-local); the seconds waited, its stall."""
        if self.pending is None or self.pending["staged"] or self._copy is None:
            return 0.0
        waited = self._copy.wait()
        self.pending["staged"] = True
        self.pending["stall_s"] += waited
        return waited

    def poll(self) -> list[dict]:
        """The ``memory_checkpoint`` records of saves finished since the last call, and the
        ``memory_replica`` records of replicas sent since then (``send_s``: the replica's time)."""
        if self.pending is not None and self._copy is not None and self._copy.done():
            self._finish()
        done, self._finished = self._finished, []
        if self.replicator is not None:
            sent, self.replicator.timings = self.replicator.timings, []
            done += [
                {
                    "event": "memory_replica",
                    "t": time.time(),
                    "rank": self.rank,
                    "to": self.replicator.holder,
                    **timing,
                    "error": None,
                }
                for timing in sent
            ]
            failed = self.replicator.errors[self._errors_polled :]
            self._errors_polled += len(failed)
            done += [
                {
                    "event": "memory_replica",
                    "t": time.time(),
                    "rank": self.rank,
                    "to": self.replicator.holder,
                    "step": None,
                    "error": error,
                }
                for error in failed
            ]
        return done

    @property
    def replicating(self) -> bool:
        """False when this rank keeps replicas and its replication stopped (:attr:`.Replicator.healthy`)."""
        return self.replicator is None or self.replicator.healthy

    def settle(self) -> None:
        """Wait for the save in flight, its commit included."""
        if self.pending is not None and self._copy is not None:
            self.before_optimizer_step()
            self._copy.join()
            self._finish()

    def _finish(self) -> None:
        pending, self.pending = self.pending, None
        copy, self._copy = self._copy, None
        error = copy.error if copy is not None else None
        if error is None and "record" not in pending:
            error = "its commit did not finish"
        self._finished.append(self._event(pending, error=error, copy_s=copy.copy_s if copy else 0.0))

    def _event(self, pending: dict, error: Optional[str] = None, copy_s: float = 0.0) -> dict:
        return {
            "event": "memory_checkpoint",
            "t": time.time(),
            "step": pending["step"],
            "slot": pending["slot"],
            "rank": self.rank,
            "stall_s": pending["stall_s"],
            "copy_s": copy_s,
            "commit_s": pending.get("commit_s", 0.0),
            "bytes": pending.get("nbytes", 0),
            "pinned": self.slots.pinned,
            "error": error,
        }

    # -- restoring -------------------------------------------------------------------------------

    def report(self) -> Report:
        """This rank's complete snapshots at this world size, and the replicas it keeps. The newest
        own snapshot's checksums are checked here, once (the restore uses what was checked): one
        that fails is set aside and not reported, so the decision takes the replica a peer keeps of
        it, else an older step, else the durable checkpoint. The structure is checked when a
        snapshot is loaded: taking the live state's structure here would initialise an empty
        optimizer's state, which a fresh start must not have."""
        t0 = time.perf_counter()
        own = [r for r in self.slots.records() if r.world_size == self.world_size]
        self._checked = self._ahead = None
        self.restore_phases = {}
        prefetch, self.prefetch = self.prefetch, None  # one read-ahead, for this start's first report
        if own:
            try:
                self._ahead = prefetch.take(own[0]) if prefetch is not None else None
                if prefetch is not None and prefetch.error:
                    self.say(
                        f"rank {self.rank}: the read-ahead of its memory checkpoint failed ({prefetch.error}); "
                        "the restore reads the slot"
                    )
                self._checked = (own[0], self._ahead.views if self._ahead is not None else self.slots.read(own[0]))
            except SlotInvalid as exc:
                aside = self.slots.set_aside(own[0])
                self.say(f"rank {self.rank}: warning: {exc}; set aside as {aside.name}, the restore does without it")
                own = own[1:]
        elif prefetch is not None:
            prefetch.drop()
        self.read_ahead_s = self._ahead.seconds if self._ahead is not None else None
        replicas = {}
        if self.kept is not None:
            replicas[self.source] = tuple(
                sorted(r.step for r in self.kept.records() if r.world_size == self.world_size)
            )
        self.restore_phases["checks"] = time.perf_counter() - t0
        return Report(self.rank, tuple(sorted(r.step for r in own)), replicas)

    def exchange(self, decision: Decision) -> Optional[str]:
        """Collective: move the replicas ``decision`` needs into their ranks' own slots."""
        if self.group is None:
            return "this job keeps no replicas (checkpoint.memory.replicas=0)"
        return exchange(self.group, decision, self.rank, self.slots, lambda source: replica_slots(self.root, source))

    def restore(self, state: Any, step: int) -> Optional[str]:
        """Load this rank's snapshot of ``step`` into ``state`` (a ``CheckpointState``); the reason
        it cannot, or None. The slot's checksums are checked before the live state is touched,
        its structure before anything is copied."""
        record = self.newest_of(step)
        if record is None:
            return f"rank {self.rank} has no memory checkpoint of step {step}"
        phases, t, cpu = self.restore_phases, time.perf_counter(), time.thread_time()

        def phase(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - t
            t = now

        try:
            return self._restore(state, record, phase)
        finally:
            # Beside the phases' wall time: a restore slower than its CPU time waited for the CPU.
            self.restore_cpu_s = time.thread_time() - cpu
            self.release()

    def _restore(self, state: Any, record: Record, phase: Callable[[str], None]) -> Optional[str]:
        step = record.step
        checked = self._checked is not None and self._checked[0] == record
        ahead = self._ahead if checked else None
        if not checked:
            # Another step (a replica moved in, an older one): what was read of the newest goes
            # before this one's moments are allocated, so the two never hold memory together.
            self._checked = self._ahead = None
        try:
            views = self._checked[1] if checked else self.slots.read(record)
            values = ahead.values if ahead is not None else pickle.loads(self.slots.extra(record))
        except SlotInvalid as exc:
            return str(exc)
        phase("checks")
        allocated = not state.optimizer.state and allocate_optimizer_state(
            state.model, state.optimizer, values, views, adopt=ahead.moved if ahead is not None else frozenset()
        )
        phase("allocation")
        sd = state.state_dict()
        phase("state_dict")
        problem = None
        if record.digest != structure_digest(structure(sd)):
            problem = (
                f"memory checkpoint {self.slots.dir} of step {step}: it holds a state of another structure "
                "(model, mesh or world size)"
            )
        live = local_tensors(sd)
        if problem is None and len(live) != len(views):
            problem = f"memory checkpoint of step {step} holds {len(views)} tensors, the state {len(live)}"
        if problem is not None:
            if allocated:
                state.optimizer.state.clear()  # as it was: the durable load initialises it its own way
            return problem
        for dst, src in zip(live, views):
            if dst.data_ptr() != src.data_ptr():  # an adopted read-ahead copy is the live tensor itself
                dst.copy_(src)
        phase("copy")
        state.load_state_dict(with_values(sd, values))
        phase("load_state_dict")
        return None

    def release(self) -> None:
        """Free what this start read of its snapshots and did not load (a read-ahead, checked
        views): the durable checkpoint's load must not find that memory taken."""
        if self.prefetch is not None:
            self.prefetch.drop()
            self.prefetch = None
        self._checked = self._ahead = None

    def discard_newer_than(self, step: int) -> list[int]:
        removed = self.slots.discard_newer_than(step)
        if self.kept is not None:
            self.kept.discard_newer_than(step)
        return removed

    def newest_of(self, step: int) -> Optional[Record]:
        """This rank's snapshot of ``step``, if it has one."""
        return next((r for r in self.slots.records() if r.step == step), None)

    def byte_to_corrupt(self, replica: bool, timeout_s: float = 30.0) -> Optional[tuple[Path, int, int]]:
        """Where the ``memory-corrupt`` and ``replica-corrupt`` faults flip a byte: the file,
        offset and step of this rank's newest snapshot, once its replica has left (so the flip is
        in this copy alone), or, with ``replica``, of the newest replica this rank keeps, once the
        replica of this rank's own newest step has arrived; None when there is none."""
        self.settle()
        own = self.slots.newest()
        if not replica:
            if own is None:
                return None
            if self.replicator is not None:
                self.replicator.wait_sent(own.step, timeout_s)
            return (*self.slots.byte_of(own), own.step)
        if self.kept is None:
            return None
        deadline = time.monotonic() + timeout_s
        kept = self.kept.newest()
        while (kept is None or (own is not None and kept.step < own.step)) and time.monotonic() < deadline:
            time.sleep(0.05)
            kept = self.kept.newest()
        return None if kept is None else (*self.kept.byte_of(kept), kept.step)

    def close(self, remove: bool, abort: bool = False) -> None:
        """Wait for the save in flight; ``remove``: the job has ended, its slots go (a failed
        attempt leaves them for the restart that follows). ``abort``: the attempt failed, and the
        replicas are not waited for (see :meth:`.Replicator.close`)."""
        if self._copy is not None:
            self._copy.join()
        self.pending, self._copy = None, None
        if self.replicator is not None:
            self.replicator.close(wait=not abort)
        if remove:
            self.slots.remove()
            if self.kept is not None:
                self.kept.remove()
            remove_empty_job_root(self.shm, self.job, self.run)  # once no rank's files are left in it


def shm_needed(state_bytes: int, ranks_per_pod: int, replicas: int, durable_copies: int) -> int:
    """Bytes a pod's shared memory needs for its ranks' memory slots (two each, and a peer's two
    with ``replicas``) and the durable checkpoint's staging (``durable_copies`` of each state)."""
    return ranks_per_pod * state_bytes * (2 * (1 + replicas) + durable_copies)


def _held(root: Path) -> int:
    """Bytes the files under ``root`` take on their file system (a sparse slot takes what was written)."""
    total = 0
    for path in root.rglob("*") if root.is_dir() else ():
        try:
            st = path.lstat()
        except OSError:
            continue  # removed while counted
        if not path.is_dir():
            total += st.st_blocks * 512
    return total


def _other_runs(shm: Path, root: Path) -> list[tuple[Path, int]]:
    """The folders of other jobs' and runs' slots beside ``root`` in ``shm``, largest first."""
    tool = Path(shm) / "resilient-fsdp"
    found = [
        (run, _held(run))
        for job in (tool.iterdir() if tool.is_dir() else ())
        if job.is_dir()
        for run in job.iterdir()
        if run.is_dir() and run != root
    ]
    return sorted(found, key=lambda item: item[1], reverse=True)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _quantity(nbytes: float) -> str:
    """``nbytes`` rounded up as a Kubernetes quantity (``Mi`` below a GiB, else ``Gi``)."""
    return f"{-(-int(nbytes) // 2**20)}Mi" if nbytes < 2**30 else f"{-(-int(nbytes) // 2**30)}Gi"


def allocate_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    values: Any,
    views: list[torch.Tensor],
    adopt: Container[int] = frozenset(),
) -> bool:
    """Give an optimizer without state (a new process's) empty tensors shaped as the snapshot's
    ``optim.state``, so that taking the live state does not initialise it with a whole step on zero
    gradients (torch's ``get_state_dict`` does that for an empty optimizer: allocating, zeroing and
    updating every moment, most of a restore's time); the copy from the slot fills them. A tensor
    shaped as its parameter's shard becomes a tensor like the parameter (a DTensor on its mesh),
    any other (a step count) a plain one. A tensor whose index is in ``adopt`` (a read-ahead's
    copy, in memory of its own) is taken as it is, already filled, where it lies on the
    parameter's device in its shard's shape. False, and nothing changed, when a name is not a
    parameter of ``model``."""
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    planned: dict = {}
    # Deterministic mode fills new tensors (NaN): a whole pass over the moments' memory, and the
    # copy from the slot overwrites every byte anyway.
    fill, torch.utils.deterministic.fill_uninitialized_memory = (
        torch.utils.deterministic.fill_uninitialized_memory,
        False,
    )
    try:
        ok = _plan_optimizer_state(params, values, views, planned, adopt)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
    if not ok:
        return False
    optimizer.state.update(planned)
    return bool(planned)


def _plan_optimizer_state(
    params: dict, values: Any, views: list[torch.Tensor], planned: dict, adopt: Container[int]
) -> bool:
    for i, (path, view) in enumerate(zip(tensor_paths(values), views)):
        if len(path) != 4 or path[:2] != ("optim", "state"):
            continue
        param = params.get(path[2])
        if param is None:
            return False
        local = param._local_tensor if isinstance(param, DTensor) else param
        if view.shape == local.shape and view.dtype == local.dtype:
            adopted = i in adopt and view.device == local.device and local.is_contiguous()
            tensor = view if adopted else torch.empty_like(local)
            if isinstance(param, DTensor):  # from its shard: DTensor's own empty_like costs ms a tensor
                tensor = DTensor.from_local(
                    tensor,
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                    run_check=False,
                )
        else:
            tensor = torch.empty(view.shape, dtype=view.dtype)
        planned.setdefault(param, {})[path[3]] = tensor
    return True
