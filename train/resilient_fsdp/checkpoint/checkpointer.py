"""The checkpointer the trainer uses: saves on schedule, commits atomically, resumes exactly.

The loop makes two calls: :meth:`Checkpointer.after_step` after every step (collect and commit a
finished write, start a save when one is due, log both, report S3 uploads) and
:meth:`Checkpointer.finish` at the end of training and on a graceful stop (the final save, and
waiting for it). Both run inside the attempt's hang-detection sections (``checkpoint``, ``drain``)
through the resilience hooks the checkpointer receives (:class:`~resilient_fsdp.resilience.attempt.Attempt`).

Every public method is collective. :meth:`~Checkpointer.save` starts a write with the configured
engine (:mod:`.engines`); :meth:`~Checkpointer.poll` agrees across ranks that every rank's write
finished, gathers every rank's outcome to rank 0, which writes the metadata and commits through
:mod:`.store` (nothing is visible until every rank's data and the metadata are written), and
broadcasts the result: every rank returns the same record or raises the same
:class:`CheckpointError`. Between steps rank 0 commits in a process of its own (:mod:`.commit`)
while training goes on, and the ranks learn the outcome at the first step after it finished
(rank 0's vote on the step's loss all-reduce); a wait for the write (the next save, the end)
commits on the training thread. :meth:`~Checkpointer.resume` is :mod:`.resume`'s: rank 0 decides, every
rank verifies its share of the files and loads.

A periodic save that fails (:class:`~.failures.SaveFailed`) is reported and training goes on, up
to ``checkpoint.max_consecutive_failures`` in a row (:mod:`.failures`); the final save fails the
job, as a lost lease does, all three permanently (exit 2, retried by no layer); a graceful stop's
failed save fails the attempt, which the restart resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import pickle
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from ..config import CheckpointConfig, ConfigError
from ..resilience.attempt import NoHooks
from .shared_volume import not_writable_message
from . import commit, resume as resume_, store
from .engines import NVRX_VERSION, PLAN_NAMES, Engine, build_engine
from . import failures
from .failures import Failure, FailureStreak, SaveFailed
from .group import RankGroup
from .lease import Lease, job_id, taken_over
from .run_identity import run_identity
from .memory.slots import job_root, remove_empty_job_root
from .memory.prefetch import Prefetch
from .memory.tier import MemoryTier
from .s3 import client as s3_client
from .s3.uploader import Uploader
from .state import CheckpointState


# While an earlier install holds the lease: how often rank 0 looks again (each look a collective),
# and how often it says so.
LEASE_WAIT = "lease-wait"
LEASE_POLL_S = 2.0
LEASE_SAY_S = 30.0


class RunLog(Protocol):
    """Where the checkpointer reports: progress lines and ``metrics.jsonl`` records (rank 0's)."""

    def info(self, message: str) -> None: ...

    def event(self, record: dict) -> None: ...


class SilentLog:
    """A :class:`RunLog` that reports nothing (benchmarks, probes)."""

    def info(self, message: str) -> None:
        pass

    def event(self, record: dict) -> None:
        pass


def _add_broadcast(record: dict, broadcast_s: float, charge: bool, on_thread_s: Optional[float] = None) -> None:
    """Complete a committed record on every rank: the broadcast's time (this rank's) joins
    ``commit_s``, and the commit joins ``stall_s`` where it is charged to this checkpoint (a
    commit waited for by the next save is that save's ``previous_s`` instead). A commit made in
    rank 0's commit process (``on_thread_s``: what the training thread spent on it, the gather and
    the broadcast) charges only that; ``commit_on_thread_s`` is what the training thread spent on
    the commit either way."""
    parts = dict(record["commit_parts_s"], broadcast_s=broadcast_s)
    record["commit_parts_s"] = parts
    record["commit_s"] = sum(parts.values())
    record["commit_background"] = on_thread_s is not None
    record["commit_on_thread_s"] = record["commit_s"] if on_thread_s is None else on_thread_s
    if charge:
        record["stall_s"] += record["commit_s"] if on_thread_s is None else on_thread_s


def ranks_per_pod(world_size: int) -> int:
    """The ranks each pod (node) runs: the launcher's ``LOCAL_WORLD_SIZE``; the whole world when
    unset (a trainer without a launcher is one pod)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        local = world_size
    return local if local > 0 and world_size % local == 0 else world_size


class Checkpointer:
    """Saves on schedule, finalizes in the background, commits atomically, resumes exactly.

    Every public method is collective: all ranks call it at the same step. With an S3 tier, every
    rank hands its files of each committed checkpoint to its ``uploader``; rank 0's also uploads
    the marker. ``batch``: this run's ``grad_accum_steps``, ``micro_batch_size`` and
    ``global_batch_target``, recorded so that a resume at another world size chooses its
    :attr:`grad_accum_steps` by the ``elastic_batch`` policy (``train.elastic_batch``).
    ``memory_prefetch``: this start's read-ahead of its newest memory snapshot
    (:mod:`.memory.prefetch`), started before the model was built.
    """

    def __init__(self, cfg: CheckpointConfig, root: Path, group: RankGroup, state: CheckpointState,
                 identity: dict, log: Optional[RunLog] = None, hooks: Optional[NoHooks] = None,
                 engine_factory: Optional[Callable[[], Engine]] = None,
                 uploader: Optional[Uploader] = None, batch: Optional[dict] = None,
                 elastic_batch: str = "nearest", memory_prefetch: Optional[Prefetch] = None):
        self.cfg, self.root, self.group, self.state = cfg, root, group, state
        self.log = log or SilentLog()
        # The attempt's resilience hooks: hang-detection sections, the drain budget, fault injection.
        self.hooks = hooks or NoHooks()
        self.uploader = uploader
        self.identity = identity  # what a resumed run must match: model shape, preset
        self.batch = batch or {}
        self.grad_accum_steps: Optional[int] = self.batch.get("grad_accum_steps")
        self.elastic_batch = elastic_batch
        # An engine from a factory belongs to the caller (it outlives in-process restarts).
        self.owns_engine = engine_factory is None
        self._engine_factory = engine_factory or (lambda: build_engine(cfg.mode, group.rank, cfg.writer_threads, cfg.planning))
        self._engine: Optional[Engine] = None
        self.pending: Optional[dict] = None
        self.records: list[dict] = []
        self.last_save_time = time.monotonic()
        self.last_saved_step: Optional[int] = None  # the newest save started
        self.last_committed_step: Optional[int] = None
        self.streak = FailureStreak(cfg.max_consecutive_failures)
        self._replication_stopped = 0  # ranks whose memory replication has stopped, as last agreed
        self.resumed_from: Optional[dict] = None
        self.restored_from_s3: Optional[dict] = None  # {"step", "uri"} when this start downloaded one
        self.job = job_id(cfg)
        # Which run of the job this is: what the pod's memory keeps is keyed by both.
        # Read (or, at a directory's first start, written) by rank 0 alone and broadcast: a thousand
        # ranks never each write a draft of it into the shared directory. Collective.
        run = None
        if group.is_coordinator:
            try:
                run = run_identity(root)
            except OSError:
                run = "unwritable"  # the preflight refuses the start, naming checkpoint.dir and the fix
        self.run = group.broadcast(run)
        self.lease: Optional[Lease] = None
        # Rank 0 applies retention off the training thread; its messages are said by this one.
        self._retention = concurrent.futures.ThreadPoolExecutor(1, "checkpoint-retention") \
            if group.is_coordinator else None
        # Rank 0's commits between steps run in a process of its own (:mod:`.commit`); the one in flight.
        self._commits = commit.CommitProcess() if group.is_coordinator else None
        self._commit_future: Optional[concurrent.futures.Future] = None
        # When the commit in flight is given up (checkpoint.write_timeout_s after it was handed over).
        self._commit_deadline = math.inf
        self._retention_said: list[str] = []
        self._retention_events: list[dict] = []  # metrics.jsonl records of the retention thread
        self._stale_torn: frozenset[str] = frozenset()  # incomplete at start: none can be committed
        self._start_sweep: Optional[Callable[[], None]] = None  # submitted once the job trains
        # Snapshots in the pod's memory between durable saves (checkpoint.memory; off at 0).
        self.memory = MemoryTier(cfg.memory.interval_steps, Path(cfg.memory.dir), self.job, self.run, group.rank,
                                 group.world_size, cfg.memory.replicas, ranks_per_pod(group.world_size),
                                 self._say_any_rank, durable_copies=0 if cfg.mode == "sync" else 1,
                                 prefetch=memory_prefetch) \
            if cfg.memory.interval_steps > 0 else None

    def say(self, message: str) -> None:
        self.log.info(message)

    def _say_any_rank(self, message: str) -> None:
        """A line from any rank (the log is rank 0's): what one rank alone sees."""
        print(f"[resilient-fsdp] {message}", file=sys.stderr, flush=True)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._engine_factory()
            # A new attempt: it starts from the save plan the pod kept for this rank, if any.
            self._engine.attach(self.group.world_size, self.group.rank, kept_plan_file(self.cfg, self.job, self.run, self.group.rank))
        return self._engine

    # -- what the loop calls -----------------------------------------------------------------------

    def votes(self) -> list[float]:
        """What this rank says before the step's loss all-reduce sums it over the ranks, for
        :meth:`after_step` to agree on without a collective of its own: whether
        ``checkpoint.interval_s`` has passed since the last save, whether this rank still
        writes the pending checkpoint, (rank 0) whether its commit is still running, and
        whether its memory replication has stopped."""
        committing = self.pending is not None and self.pending.get("committing", False)
        writing = self.pending is not None and not committing and not self.engine.local_status()[0]
        stopped = self.memory is not None and not self.memory.replicating
        return [1.0 if self._interval_passed() else 0.0, 1.0 if writing else 0.0,
                1.0 if self._commit_running() else 0.0, 1.0 if stopped else 0.0]

    def _commit_running(self) -> bool:
        """Rank 0: its commit process is still on the pending checkpoint, within its deadline
        (False on other ranks). Past the deadline rank 0 votes it finished, so that every rank
        learns, in :meth:`_committed`, the failure that a hung commit is."""
        return self._commit_future is not None and not self._commit_future.done() \
            and time.monotonic() < self._commit_deadline

    def _interval_passed(self) -> bool:
        """``checkpoint.interval_s`` has passed since the last save, by this rank's clock."""
        return self.cfg.interval_s > 0 and time.monotonic() - self.last_save_time >= self.cfg.interval_s

    def after_step(self, step: int, agreed: Optional[list[float]] = None) -> float:
        """After step ``step``: commit a write that finished, start a save if one is due, log what
        was committed and what S3 did; the seconds it took. Collective. ``agreed``: every rank's
        :meth:`votes` of this step, summed; without it the ranks agree in collectives here."""
        t0 = time.perf_counter()
        time_due, writing, committing, unreplicated = agreed if agreed is not None else (None, None, None, None)
        if unreplicated is not None:
            self._replication_health(step, int(unreplicated))
        self.hooks.start_section("checkpoint")
        committed = self._periodic(lambda: self.poll(agreed_writing=writing, agreed_committing=committing))
        self._log(committed)
        learn = committed is not None  # only calls that saved or committed teach its timeout
        if self.due(step, agreed_time=time_due):
            if self.pending is not None:
                # The save would wait for the previous write: that wait has the drain budget.
                self.hooks.end_section("checkpoint", learn=learn)
                with self.hooks.draining():
                    self._log(self._periodic(self.wait))
                self.hooks.start_section("checkpoint")
            self._log(self._periodic(lambda: self.save(step)))
            learn = True
        elif self.memory is not None and self.memory.due(step):
            self.memory.save(step, self.state.state_dict(), batch=self.batch)
        self.hooks.end_section("checkpoint", learn=learn)
        self._log_memory()
        self._report_uploads()
        return time.perf_counter() - t0

    def _replication_health(self, step: int, stopped: int) -> None:
        """Rank 0 records each change in how many ranks' memory replication has stopped (a
        ``memory_replication`` record, served as the ``memory_replication_stopped_ranks`` metric)
        and says it: snapshots taken since have no replica, so a lost pod's ranks resume from the
        durable checkpoint."""
        if stopped == self._replication_stopped:
            return
        self._replication_stopped = stopped
        if self.group.is_coordinator:
            self.log.event({"event": "memory_replication", "t": time.time(), "step": step, "stopped_ranks": stopped})
            if stopped:
                self.say(f"warning: memory replication has stopped on {stopped} rank(s) (each rank's log says why); "
                         "a lost pod's ranks resume from the durable checkpoint until the next restart makes it again")

    def _log_memory(self) -> None:
        """Rank 0 records its memory saves and replicas sent; any rank says a save that failed
        (training goes on)."""
        if self.memory is None:
            return
        for record in self.memory.poll():
            if self.group.is_coordinator:
                self.log.event(record)
            if record["error"] and record["event"] == "memory_replica":
                self._say_any_rank(f"rank {self.group.rank}: warning: memory replication stopped ({record['error']}); "
                                   "this attempt's newer snapshots have no replica on another pod, so a lost pod "
                                   "resumes from the durable checkpoint; the next restart makes it again")
            elif record["error"]:
                self._say_any_rank(f"rank {self.group.rank}: warning: memory checkpoint of step {record['step']} "
                                   f"failed ({record['error']}); the previous one stays, training goes on")

    def finish(self, step: int, save: bool, stopping: bool = False) -> None:
        """The end of training (``save``: ``checkpoint.save_final``) or a graceful stop (``save``,
        ``stopping``): a committed checkpoint of ``step`` unless it has one, and every write waited
        for. Collective.

        A save of an earlier step still in flight counts as a periodic one (its failure is one
        more in the streak). With ``save``, the checkpoint of ``step`` failing raises: the caller
        promised it, and no later save will make up for it. At the end of training that is
        permanent (the job fails, exit 2); in a graceful stop it is not (the restart resumes from the
        newest committed checkpoint and trains the steps again)."""
        with self.hooks.draining():
            if self.pending is not None and not (save and self.pending["step"] == step):
                self._log(self._periodic(self.wait))
            if save:
                try:
                    if self.last_committed_step != step and self.pending is None:
                        self._log(self.save(step))
                    self._log(self.wait())
                except SaveFailed as exc:
                    self._save_failed(exc, final=True, stopping=stopping)
        self._report_uploads()

    def _periodic(self, call: Callable[[], Optional[dict]]) -> Optional[dict]:
        """``call``'s record; a save it reports failed is counted instead (:meth:`_save_failed`)."""
        try:
            return call()
        except SaveFailed as exc:
            self._save_failed(exc)
            return None

    def _save_failed(self, exc: SaveFailed, final: bool = False, stopping: bool = False) -> None:
        """A save failed on every rank: report it and go on, or raise the job's end (a lost lease,
        ``final``, the streak at ``checkpoint.max_consecutive_failures``; permanent unless
        ``stopping``, a graceful stop's). Every rank gets here with the same failure, so every rank
        takes the same branch."""
        self._replace_hung_engine()
        end: Optional[SaveFailed] = None
        if final:
            self.streak.count += 1
            newest = f"step {self.last_committed_step}" if self.last_committed_step is not None else "none"
            what = "A graceful stop's checkpoint" if stopping else "The checkpoint that ends this run (checkpoint.save_final)"
            end = SaveFailed(f"{exc}. {what} was not committed; the newest committed checkpoint: {newest}", exc.cause,
                             exc.step, fatal=True, permanent=not stopping)
        else:
            try:
                self.streak.failed(exc)
            except SaveFailed as limit:
                end = limit
        self.log.event({"event": "checkpoint_failed", "t": time.time(), "step": exc.step, "cause": exc.cause,
                        "consecutive": self.streak.count, "limit": self.streak.limit, "fatal": end is not None,
                        "error": str(exc)})
        if end is not None:
            raise end from exc
        self.say(f"warning: {exc}; training goes on and the next due save tries again ({self.streak.count} in a "
                 f"row; the job fails at checkpoint.max_consecutive_failures={self.streak.limit})")

    def _replace_hung_engine(self) -> None:
        """A writer that outlived checkpoint.write_timeout_s may never take another write: the next
        save gets a new engine (a caller's factory closes the hung one itself)."""
        if self._engine is not None and self._engine.hung:
            if self.owns_engine:
                self._engine.close(abort=True)
            self._engine = None

    def _log(self, record: Optional[dict]) -> None:
        if record is None:
            return
        self.log.event({"event": "checkpoint", "t": time.time(), **record})
        self.log.info(f"checkpoint step {record['step']} committed ({record['mode']}): stall "
                      f"{record['stall_s'] * 1000:.1f} ms, write {record['write_s']:.2f} s, "
                      f"{record['bytes'] / 1e6:.1f} MB -> {record['path']}")

    def _report_uploads(self) -> None:
        """What the S3 uploader did since the last call (logged where the log is rank 0's)."""
        if self.uploader is not None:
            for event, message in self.uploader.take_events():
                self.log.event(event)
                self.log.info(message)

    def prepare(self) -> None:
        """Get the engine ready now rather than at the first save: its writer process (started
        with the rank's process, :class:`~resilient_fsdp.train.resources.ProcessResources`) and,
        in the background, its staging buffers for this state (reused across in-process attempts).

        The trainer calls it after its first step, when the optimizer's state exists, so the
        buffers match what the first save will stage; allocating them is most of the cost of a
        process's first save (a page fault per page, pinning on GPUs).
        """
        if self.cfg.interval_steps > 0 or self.cfg.interval_s > 0 or self.cfg.save_final:
            self.engine.warm(self.state.state_dict())  # buffers only for a job that will save

    def preflight(self) -> None:
        """Fail at start, on every rank, if the checkpoint directory cannot be written or another
        job holds it; complete commits a crash cut short."""
        error = None
        if self.group.is_coordinator:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-test-{uuid.uuid4().hex[:8]}"
                probe.write_bytes(b"ok")
                probe.unlink()
            except OSError as exc:
                error = not_writable_message("checkpoint.dir", self.root, exc)
        error = self._take_lease(error)
        if self.group.is_coordinator:
            if error is None:
                for path in store.recover(self.root):
                    self.say(f"completed the commit of {path} that a crash had cut short")
                # Under the lease, nothing in flight yet: torn writes of earlier attempts are listed
                # now and go in the background once the job trains (:meth:`started`; a crash loop
                # can leave several whole checkpoints).
                self._sweep(at_start=True)
            if error is None and self.cfg.s3.uri:
                error = self._check_s3()
        error = self.group.broadcast(error)
        if error:
            raise ConfigError(error)

    def _take_lease(self, error: Optional[str]) -> Optional[str]:
        """Rank 0 takes the lease (``error``: rank 0's, from before); collective. While an earlier
        install of the job holds it, rank 0 polls, and every rank learns each poll's outcome in a
        short collective of its own, so that no collective waits out the whole of
        ``checkpoint.lease_wait_s``. Returns rank 0's error, on every rank."""
        lease = Lease(self.root, self.job, self.say) if self.group.is_coordinator and error is None else None
        start = time.monotonic()
        said = -LEASE_SAY_S
        while True:
            state = error
            if lease is not None:
                try:
                    waiting = lease.try_acquire()
                except ConfigError as exc:
                    state = str(exc)
                else:
                    waited = time.monotonic() - start
                    if waiting is not None and waited >= self.cfg.lease_wait_s:
                        state = lease.refusal_after_wait(waited)
                    elif waiting is not None:
                        if waited - said >= LEASE_SAY_S:
                            self.say(f"{waiting} ({waited:.0f} of {self.cfg.lease_wait_s:g} s)")
                            said = waited
                        state = LEASE_WAIT
            state = self.group.broadcast(state)
            if state != LEASE_WAIT:
                break
            time.sleep(LEASE_POLL_S)
        if state is None and lease is not None:
            self.lease = lease
        return state

    def _check_s3(self) -> Optional[str]:
        """A bucket that is missing or forbidden stops the job now; an unreachable one does not
        (uploads retry; a restore that needs it fails on its own)."""
        try:
            return s3_client.check_access(self.cfg.s3)
        except Exception as exc:
            self.say(f"warning: S3 is not reachable at start ({s3_client.describe_error(exc)}); training goes on "
                     "and uploads are retried")
            return None

    # -- resume (the decision, verification, S3 restore and loading are in resume.py) --
    def resume(self, suspect: Optional[tuple[int, int]] = None) -> Optional[int]:
        """Load the newest complete checkpoint (or ``resume_from`` at the job's first start);
        returns its step or None. One that fails verification or loading is reported and the
        next older one is tried. ``suspect``: steps never resumed from (:func:`.resume_.resume`)."""
        self.before_optimizer_step()  # loading changes the live state: no copy may be reading it
        done = resume_.resume(self.group, self.cfg, self.root, self.job, self.state, self.identity, self.batch,
                              self.say, self.elastic_batch, self.memory, self.hooks.restoring, suspect)
        if self.memory is not None:
            # Snapshots past the step this start trains on belong to a line it no longer follows.
            self.memory.discard_newer_than(done.step if done.step is not None else -1)
        self.restored_from_s3 = done.restored_from_s3.as_dict() if done.restored_from_s3 else None
        if done.step is not None:
            tier = "memory" if done.from_memory else "s3" if done.restored_from_s3 else "durable"
            self.resumed_from = {"step": done.step, "path": done.path, "tier": tier}
            self.last_saved_step = self.last_committed_step = done.step
        if done.grad_accum_steps is not None:
            self.grad_accum_steps = done.grad_accum_steps
            self.batch = {**self.batch, "grad_accum_steps": done.grad_accum_steps}
        if done.global_batch_target is not None:
            self.batch = {**self.batch, "global_batch_target": done.global_batch_target}
        # Local checkpoints an earlier run may not have uploaded (not when this run ignores them).
        if self.uploader is not None and self.cfg.resume:
            self.uploader.adopt(self.group.broadcast(store.scan(self.root)[0] if self.group.is_coordinator else None))
        return done.step

    # -- saving --
    def due(self, step: int, agreed_time: Optional[float] = None) -> bool:
        """Whether a save of ``step`` is due; ``agreed_time``: the ranks' summed votes that
        ``checkpoint.interval_s`` has passed (:meth:`votes`), else they agree here."""
        if step == self.last_saved_step:
            return False
        by_steps = self.cfg.interval_steps > 0 and step % self.cfg.interval_steps == 0
        if self.cfg.interval_s > 0:
            # Ranks' clocks disagree slightly: agree, so every rank saves at the same step.
            if agreed_time is None:
                agreed_time = self.group.max(1.0 if self._interval_passed() else 0.0)
            return by_steps or agreed_time > 0
        return by_steps

    def save(self, step: int) -> Optional[dict]:
        """Start a checkpoint of the current state, named ``step``.

        Takes the state's structure and non-tensor values now; its tensors are copied into host
        buffers while training goes on, until :meth:`before_optimizer_step`. Returns the record
        of a checkpoint committed by this call: this one for ``sync``, else the previous one if it
        was still in flight and had to be waited for.
        """
        t0 = time.perf_counter()
        # One write in flight at a time: the staging buffers are reused. Waiting for the previous
        # write is this save's stall (its ``previous_s``), not the previous save's as well.
        previous = self.poll(block=True, charge=False) if self.pending is not None else None
        t_state = time.perf_counter()
        sd = self.state.state_dict()
        vote = self.engine.vote(sd)
        token, error = None, None
        if self.group.is_coordinator:
            token = uuid.uuid4().hex[:8]
            try:
                (self.root / store.partial_name(step, token)).mkdir(parents=True)
            except OSError as exc:
                error = self._mkdir_failure(step, exc)
        # One collective: rank 0's directory, and whether every rank can use its plan cache.
        t_agree = time.perf_counter()
        votes = self.group.all_gather((token, error, vote))
        t_start = time.perf_counter()
        token, error = votes[0][0], votes[0][1]
        if error:
            self.last_save_time = time.monotonic()  # checkpoint.interval_s: not again at the next step
            raise error.error()
        partial_dir = self.root / store.partial_name(step, token)
        self.hooks.save_started(step, partial_dir, lambda: store.written_bytes(partial_dir),
                                self.expected_written_bytes)
        plan = self.engine.agree([v[2] for v in votes])
        self.engine.start(sd, partial_dir, step, token, plan, self.hooks.writer_fault(step))
        for note in self.engine.take_notes():
            self.say(note)
        t_end = time.perf_counter()
        call = t_end - t0
        # Where the call's time went: waiting for the previous write, taking the state (and its
        # structure), agreeing with every rank (which waits for the slowest to arrive), starting
        # the write (planning, which is collective unless a cached plan is used).
        parts = {"previous_s": t_state - t0, "state_s": t_agree - t_state, "agree_s": t_start - t_agree,
                 "start_s": t_end - t_start}
        self.pending = {"step": step, "dir": partial_dir, "t0": t0, "t0_unix": time.time() - (time.perf_counter() - t0),
                        "stall_s": call, "save_call_s": call,
                        "save_call_parts_s": parts, "staging_wait_s": 0.0, "staged": False,
                        "plan": PLAN_NAMES[plan] if self.engine.mode == "async" else None}
        self.last_save_time = time.monotonic()
        self.last_saved_step = step
        return self.poll(block=True) if self.engine.mode == "sync" else previous

    def before_optimizer_step(self) -> float:
        """Wait until the pending save's copy of the state is done (the trainer calls it just
        before ``optimizer.step()``, the first change to parameters and optimizer state); that wait
        counts as stall. Rank-local; returns the seconds waited."""
        memory = self.memory.before_optimizer_step() if self.memory is not None else 0.0
        if self.pending is None or self.pending["staged"] or self._engine is None:
            return memory
        waited = self._engine.staged()
        self.pending["staged"] = True
        self.pending["staging_wait_s"] += waited
        self.pending["stall_s"] += waited
        return waited + memory

    def poll(self, block: bool = False, charge: bool = True, agreed_writing: Optional[float] = None,
             agreed_committing: Optional[float] = None) -> Optional[dict]:
        """Collect and commit the pending checkpoint once every rank's write finished; with
        ``block``, wait for that up to ``checkpoint.write_timeout_s``, and with ``charge`` count
        that wait as the pending checkpoint's stall. ``agreed_writing`` / ``agreed_committing``
        (without ``block``): the ranks' summed votes (:meth:`votes`) that they still write and
        that rank 0 still commits, else they agree here.

        Without ``block`` rank 0 commits in its commit process and a later call returns the
        record, at the first step after the commit finished; with it, the commit (or the rest
        of one in flight) is waited for here. Returns the checkpoint's record when this call
        completed its commit.
        """
        self._say_retention()
        if self.pending is None:
            return None
        if self.pending.get("committing"):
            return self._committed(block, charge, agreed_committing)
        self.before_optimizer_step()
        t_wait = time.perf_counter()
        while True:
            done, _ = self.engine.local_status()
            if done:
                self.hooks.save_written(self.pending["step"])
            late = block and time.perf_counter() - t_wait > self.cfg.write_timeout_s
            if agreed_writing is not None and not block:
                writing, out_of_time = agreed_writing, 0.0
            else:
                # Agree, in one collective: is any rank still writing, has any rank run out of time.
                writing, out_of_time = self.group.max_of(0.0 if done else 1.0, 1.0 if late else 0.0)
            all_done, any_late = writing == 0.0, out_of_time > 0
            if all_done or any_late or not block:
                break
            time.sleep(0.01)
        if block and charge:
            self.pending["stall_s"] += time.perf_counter() - t_wait
        if not (all_done or any_late):
            return None
        if not all_done:
            pending, self.pending = self.pending, None
            self.engine.abandon()
            raise SaveFailed(f"checkpoint of step {pending['step']} failed: its write did not finish within "
                             f"checkpoint.write_timeout_s={self.cfg.write_timeout_s:g} on every rank; it stays "
                             f"incomplete at {pending['dir']} and will not be loaded", failures.TIMEOUT,
                             step=pending["step"])
        t_gather = time.perf_counter()
        # Each rank pickles its own outcome: rank 0's training thread receives bytes, and the
        # unpickling (at scale most of a commit's work, tens of MB of small objects) is the commit's.
        outcomes = self.group.gather(pickle.dumps(self.engine.collect(), protocol=pickle.HIGHEST_PROTOCOL))
        gather_s = time.perf_counter() - t_gather
        job = self._commit_job(self.pending, outcomes) if self.group.is_coordinator else None
        if block:
            # The commit runs on the training thread: its time (rank 0's gather, metadata, manifest
            # and rename, then the broadcast) is this checkpoint's commit_s and, when charged, stall.
            pending, self.pending = self.pending, None
            result = self._commit_outcome(pending, commit.run(job), gather_s) if job is not None else (None, None)
            return self._learn_commit(result, charge)
        # Between steps rank 0 commits in its commit process while training goes on; every rank
        # learns the outcome at the first step after it finished (:meth:`votes`).
        self.pending.update(committing=True, gather_s=gather_s)
        if job is not None:
            t_submit = time.perf_counter()
            self._commit_future = self._commits.submit(job)
            self._commit_deadline = time.monotonic() + self.cfg.write_timeout_s
            if self._commits.unavailable:
                # Committed here, on the training thread: its time is this checkpoint's stall.
                self.pending["inline_commit_s"] = time.perf_counter() - t_submit
                self.say(f"warning: rank 0's commit process could not be started ({self._commits.unavailable}); "
                         f"checkpoint step {job.step} was committed on the training thread, and the next commit "
                         "tries a new process")
                self._commits.unavailable = None
        return None

    def _committed(self, block: bool, charge: bool, agreed_committing: Optional[float]) -> Optional[dict]:
        """The pending checkpoint's commit in rank 0's commit process: its record once every rank
        learned it finished (``block``: waited for here), else None."""
        if not block:
            running = agreed_committing if agreed_committing is not None else \
                self.group.max(1.0 if self._commit_running() else 0.0)
            if running > 0:
                return None
        t0 = time.perf_counter()
        future, self._commit_future = self._commit_future, None
        pending, self.pending = self.pending, None
        if "inline_commit_s" in pending:
            # Rank 0 committed on its training thread (no commit process could start): the step
            # that handed it over waited for all of it, so it is stall, not background work.
            pending["stall_s"] += pending["inline_commit_s"]
        result = self._commit_outcome(pending, self._commit_result(future, pending["step"]), pending["gather_s"]) \
            if future is not None else (None, None)
        if result[0] is not None and "inline_commit_s" in pending:
            # Rank 0 alone knows: it travels in the broadcast record.
            result[0]["committed_inline_s"] = pending["inline_commit_s"]
        return self._learn_commit(result, charge, on_thread_s=pending["gather_s"] + time.perf_counter() - t0)

    def _commit_result(self, future: concurrent.futures.Future, step: int) -> commit.CommitResult:
        """Rank 0: the commit process's result, waited for until the commit's deadline at most; a
        commit that outlives it is a failed save (its process killed, the checkpoint left
        incomplete and swept later), never a wait without end."""
        try:
            return self._commits.result(future, timeout=max(0.0, self._commit_deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self._commits.close(kill=True)
            return commit.CommitResult(error=f"rank 0's commit did not finish within checkpoint.write_timeout_s="
                                             f"{self.cfg.write_timeout_s:g}; its commit process was killed, and the "
                                             f"next save commits in a new one", timed_out=True)

    def _learn_commit(self, result: tuple, charge: bool, on_thread_s: Optional[float] = None) -> dict:
        """Every rank: rank 0's commit outcome ``result``, broadcast; raises its failure."""
        t_broadcast = time.perf_counter()
        record, error = self.group.broadcast(result)
        if error:
            raise error.error()
        broadcast_s = time.perf_counter() - t_broadcast
        inline = record.pop("committed_inline_s", None)
        _add_broadcast(record, broadcast_s, charge, None if on_thread_s is None else on_thread_s + broadcast_s)
        if inline is not None:
            record["commit_background"] = False
            record["commit_on_thread_s"] += inline
        self._after_commit(record)
        return {k: v for k, v in record.items() if k != "manifest"}

    def _commit_job(self, pending: dict, gathered: list[bytes]) -> commit.CommitJob:
        """Rank 0: the commit of ``pending`` (:mod:`.commit`), from every rank's pickled outcome."""
        job = commit.CommitJob(
            step=pending["step"], where=str(pending["dir"]), gathered=gathered, started_unix=pending["t0_unix"],
            manifest={**self.identity, "step": pending["step"], "mode": self.engine.mode,
                      "world_size": self.group.world_size, **self.batch, "nvrx_version": NVRX_VERSION,
                      "torch_version": torch.__version__, "job": self.job},
            lease_path=str(self.lease.path) if self.lease is not None else None,
            lease_holder=self.lease.holder if self.lease is not None else None)
        try:
            keyed = self.engine.commit_metadata()
        except Exception as exc:  # noqa: BLE001 - the commit reports it as its failure
            job.error = f"{type(exc).__name__}: {exc}"
            keyed = None
        if keyed is not None:
            job.metadata_key, job.metadata = keyed
        job.fault = self.hooks.commit_fault(job.step, Path(job.where) / commit.FAULT_MARKER)
        return job

    def _commit_outcome(self, pending: dict, result: commit.CommitResult,
                        gather_s: float) -> tuple[Optional[dict], Optional[Failure]]:
        """Rank 0: ``result`` of the commit of ``pending`` as (record, None) or (None, the failure
        every rank raises). ``gather_s``: how long gathering every rank's outcome took."""
        step, where = pending["step"], pending["dir"]
        if result.failed:
            rank, error = next(((r, e) for r, e in result.failed if failures.is_volume_full(e)), result.failed[0])
            others = f"; {len(result.failed) - 1} other rank(s) failed too" if len(result.failed) > 1 else ""
            message = (f"checkpoint of step {step} failed (rank {rank}: {error.strip()}{others}); it "
                       f"stays incomplete at {where} and will not be loaded; the previous checkpoint is intact")
            return None, self._failure(message, failures.WRITER, step, error)
        if result.lease_lost:
            if self.lease is not None:
                self.lease.lost = result.lease_lost
            return None, Failure(result.lease_lost, failures.LEASE, step, fatal=True)
        if result.error:
            return None, self._failure(f"checkpoint of step {step} failed while finalizing: {result.error}; it stays "
                                       f"incomplete at {where}", failures.TIMEOUT if result.timed_out
                                       else failures.FINALIZE, step, result.error)
        # Where the commit's time went: gathering every rank's outcome, the engine's metadata
        # (DCP's .metadata, pickled), the manifest and the rename, and the rest (outcomes, lease).
        commit_parts = {"gather_s": gather_s, "finalize_s": result.finalize_s, "manifest_s": result.manifest_s,
                        "other_s": max(0.0, result.total_s - result.finalize_s - result.manifest_s),
                        "broadcast_s": 0.0}
        return {"step": step, "mode": self.engine.mode, "stall_s": pending["stall_s"],
                "save_call_s": pending["save_call_s"], "save_call_parts_s": pending["save_call_parts_s"],
                "staging_wait_s": pending["staging_wait_s"], "plan": pending["plan"], "write_s": result.write_s,
                "commit_s": sum(commit_parts.values()), "commit_parts_s": commit_parts,
                "bytes": result.nbytes, "path": result.path, "manifest": result.manifest}, None

    def _mkdir_failure(self, step: int, exc: OSError) -> Failure:
        return self._failure(f"checkpoint of step {step} failed: cannot create a checkpoint directory under "
                             f"checkpoint.dir={str(self.root)!r}: {exc.strerror or exc}", failures.MKDIR, step, exc)

    def _failure(self, message: str, cause: str, step: int, error: object) -> Failure:
        """Rank 0: the failure of the save of ``step``; a full volume is said as such. A writer's
        error does not always carry the ENOSPC (torch's zip writer reports a short write as a
        position mismatch), so less free space than a checkpoint needs counts as full too."""
        needed = self.expected_written_bytes() if cause in (failures.WRITER, failures.FINALIZE, failures.MKDIR) \
            else None
        if failures.is_volume_full(error) or failures.short_of_space(self.root, needed):
            return Failure(f"{message}: {failures.volume_full_message(self.root, needed, self.cfg.keep_last)}",
                           failures.VOLUME_FULL, step)
        return Failure(message, cause, step)

    def _after_commit(self, record: dict) -> None:
        """Every rank: uploads of its files; rank 0: retention, off the training thread."""
        self.records.append({k: v for k, v in record.items() if k != "manifest"})
        self.last_committed_step = record["step"]
        self.streak.committed()
        if self.uploader is not None:
            self.uploader.submit(record["step"], Path(record["path"]), manifest=record["manifest"])
        self.apply_retention()

    def expected_written_bytes(self) -> Optional[int]:
        """What the writers of a save put on disk, taken from the newest committed checkpoint of
        this world size and mode (a save of the same state writes the same files); None if none."""
        for ckpt in reversed(store.scan(self.root)[0]):
            m = ckpt.manifest
            if m.get("world_size") == self.group.world_size and m.get("mode") == self.engine.mode:
                return store.written_bytes(ckpt.path)
        return None

    def apply_retention(self) -> None:
        """Rank 0: local retention in the background; a checkpoint still waiting for its S3
        upload is kept. Best-effort: what fails is said at the next step."""
        if self._retention is None:
            return
        held = self.uploader.holds if self.uploader is not None else (lambda _p: False)
        self._retention.submit(store.apply_retention, self.root, self.cfg.keep_last, held,
                               self._retention_said.append, self._lease_check())
        self._sweep(at_start=False)

    def _sweep(self, at_start: bool) -> None:
        """Rank 0, holding the lease: remove torn writes (:func:`.store.sweep_torn`) on the
        retention thread. The names are listed here, on the thread that starts writes, while none
        is in flight (after a commit, or before the first save), so a write started later is never
        among them."""
        if self._retention is None or self.lease is None:
            return
        in_flight = self.pending["dir"] if self.pending is not None else None
        names = store.torn_names(self.root)
        if at_start:
            self._stale_torn = frozenset(names)
            self._start_sweep = functools.partial(self._submit_sweep, names, in_flight)
            return
        self._submit_sweep(names, in_flight)

    def started(self) -> None:
        """The job trains from here: the start's sweep of torn writes goes to the retention
        thread now, after the start's measurements (its deletions would count in them)."""
        sweep, self._start_sweep = self._start_sweep, None
        if sweep is not None:
            sweep()

    def _submit_sweep(self, names: list[str], in_flight: Optional[Path]) -> None:
        self._retention.submit(store.sweep_torn, self.root, names, self._stale_torn, in_flight,
                               self._retention_said.append, self._retention_events.append,
                               lease_lost=self._lease_check())

    def _lease_check(self) -> Callable[[], Optional[str]]:
        """Why the lease is no longer this job's, or None; asked by the retention thread before
        each deletion (by value: the file, read again each time)."""
        lease = self.lease
        if lease is None:
            return lambda: None
        return functools.partial(taken_over, lease.path, lease.holder)

    def settle(self) -> None:
        """Wait for the retention thread's queued passes and a memory save in flight, and report
        them: before the run's last records are written, so they are in ``metrics.jsonl`` too."""
        if self._retention is not None:
            self._retention.submit(lambda: None).result()
        self._say_retention()
        if self.memory is not None:
            self.memory.settle()
            self._log_memory()

    def _say_retention(self) -> None:
        while self._retention_events:
            self.log.event(self._retention_events.pop(0))
        while self._retention_said:
            self.say(self._retention_said.pop(0))

    def wait(self) -> Optional[dict]:
        return self.poll(block=True)

    def close(self, abort: bool = False, drain: bool = True) -> None:
        """``abort``: the attempt failed. An engine shared with the process (``engine_factory``) is
        then drained for the next in-process attempt if ``drain``; without one the process exits
        and closes the engine, and waiting for its write would only delay that exit, which is how
        ``ft_launcher`` learns of the failure."""
        if self._commit_future is not None:
            # A commit in flight in rank 0's commit process is let finish (every write is whole;
            # the commit is atomic), up to checkpoint.write_timeout_s: before the lease is released,
            # and before an in-process restart's start sweeps torn directories, this one among them.
            try:
                self._commits.result(self._commit_future, timeout=self.cfg.write_timeout_s)
            except concurrent.futures.TimeoutError:
                self.say(f"the commit of checkpoint step {self.pending['step'] if self.pending else '?'} did not "
                         f"finish within checkpoint.write_timeout_s={self.cfg.write_timeout_s:g}; it is left "
                         "incomplete and will not be loaded")
                self._commits.close(kill=True)
            self._commit_future = None
        if self._commits is not None:
            self._commits.close()
        if self._retention is not None:
            self._retention.shutdown(wait=True)
            self._say_retention()
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        # A failed attempt leaves the rank's slots and kept plan to the restart that follows; an
        # ended job removes them, then the job's folder in the pod's memory once empty.
        if not abort and self._engine is not None:
            self._engine.job_ended()
        if self.memory is not None:
            if not abort:
                self.memory.settle()
                self._log_memory()
            self.memory.close(remove=not abort, abort=abort)
        elif not abort:
            remove_empty_job_root(Path(self.cfg.memory.dir), self.job, self.run)
        if self._engine is None:
            return
        if self.owns_engine:
            self._engine.close(abort=abort)
        elif abort and drain:
            # A write still running gets checkpoint.write_timeout_s (at most 2 minutes) to finish;
            # a hung one (abandoned at its deadline) is not waited for at all.
            self._engine.drain(timeout_s=min(120.0, self.cfg.write_timeout_s))


def kept_plan_file(cfg: CheckpointConfig, job: str, run: str, rank: int) -> Optional[Path]:
    """Where the pod keeps ``rank``'s validated save plan for the rank's next process: beside the
    memory tier's slots (``checkpoint.memory.dir``, the pod's memory), under the job's run. None for a
    process that is its own job (``standalone-``: no restart of it would find the plan)."""
    if job.startswith("standalone-"):
        return None
    return job_root(Path(cfg.memory.dir), job, run) / "plans" / f"rank-{rank}.pickle"
