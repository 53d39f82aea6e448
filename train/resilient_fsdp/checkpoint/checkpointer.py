"""The checkpointer the trainer uses: saves on schedule, commits atomically, resumes exactly.

The loop calls :meth:`Checkpointer.after_step` after every step (with the step's summed
:class:`.votes.Votes`) and :meth:`Checkpointer.finish` at the end or on a graceful stop, inside
the attempt's hang-detection sections. Every public method is collective: every rank returns
the same record or raises the same :class:`CheckpointError`. Saving starts a write with the
configured engine (:mod:`.engines`); between steps rank 0 commits in a process of its own
(:mod:`.commit`), and a wait commits on the training thread. Alongside: :mod:`.pending` (the
save in flight), :mod:`.retention`, :mod:`.preflight`, :mod:`.reports`, :mod:`.resume`.
"""

from __future__ import annotations

import pickle
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import CheckpointConfig, ConfigError
from ..resilience.attempt import NoHooks
from . import commit, failures, preflight as preflight_, reports, resume as resume_, store
from .engines import NVRX_VERSION, PLAN_NAMES, Engine, build_engine
from .failures import Failure, FailureStreak, SaveFailed
from .group import RankGroup
from .lease import Lease, job_id
from .memory.prefetch import Prefetch
from .memory.peers import ranks_per_pod
from .memory.slots import kept_plan_file, remove_empty_job_root
from .memory.tier import MemoryTier
from .pending import PendingSave, add_broadcast, commit_job, commit_record
from .reports import RunLog, SilentLog
from .retention import Retention
from .run_identity import run_identity
from .s3.uploader import Uploader
from .state import CheckpointState
from .votes import Votes


class Checkpointer:
    """Saves on schedule, finalizes in the background, commits atomically, resumes exactly.

    With an S3 tier every rank hands its files of each committed checkpoint to its ``uploader``.
    ``batch``: this run's ``grad_accum_steps``, ``micro_batch_size`` and ``global_batch_target``,
    recorded in every manifest. ``choose_batch(manifest, world_size, batch)``: the batch a resume
    from a checkpoint trains with (:func:`.resume.resume`). ``memory_prefetch``: this start's
    read-ahead of its newest memory snapshot (:mod:`.memory.prefetch`).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        group: RankGroup,
        state: CheckpointState,
        identity: dict,
        log: Optional[RunLog] = None,
        hooks: Optional[NoHooks] = None,
        engine_factory: Optional[Callable[[], Engine]] = None,
        uploader: Optional[Uploader] = None,
        batch: Optional[dict] = None,
        choose_batch: Optional[resume_.ChooseBatch] = None,
        memory_prefetch: Optional[Prefetch] = None,
    ):
        self.cfg, self.root, self.group, self.state = cfg, root, group, state
        self.log = log or SilentLog()
        # The attempt's resilience hooks: hang-detection sections, the drain budget, fault injection.
        self.hooks = hooks or NoHooks()
        self.uploader = uploader
        self.identity = identity  # what a resumed run must match: model shape, preset
        self.batch = batch or {}
        self.grad_accum_steps: Optional[int] = self.batch.get("grad_accum_steps")
        self.choose_batch = choose_batch
        # An engine from a factory belongs to the caller (it outlives in-process restarts).
        self.owns_engine = engine_factory is None
        self._engine_factory = engine_factory or (
            lambda: build_engine(cfg.mode, group.rank, cfg.writer_threads, cfg.planning)
        )
        self._engine: Optional[Engine] = None
        self.pending: Optional[PendingSave] = None
        self.records: list[dict] = []
        self.last_save_time = time.monotonic()
        self.last_saved_step: Optional[int] = None  # the newest save started
        self.last_committed_step: Optional[int] = None
        self.streak = FailureStreak(cfg.max_consecutive_failures)
        self.replication = reports.ReplicationHealth()
        self.resumed_from: Optional[dict] = None
        self.restored_from_s3: Optional[dict] = None  # {"step", "uri"} when this start downloaded one
        self.job = job_id(cfg)
        # Which run of the job this is (what the pod's memory is keyed by with the job): read, or at
        # a directory's first start written, by rank 0 alone and broadcast. Collective.
        run = None
        if group.is_coordinator:
            try:
                run = run_identity(root)
            except OSError:
                run = "unwritable"  # the preflight refuses the start, naming checkpoint.dir and the fix
        self.run = group.broadcast(run)
        self.lease: Optional[Lease] = None
        self.retention = Retention(root, cfg.keep_last, active=group.is_coordinator)
        # Rank 0's commits between steps run in a process of its own (:mod:`.commit`).
        self.commits = commit.BackgroundCommit(cfg.write_timeout_s) if group.is_coordinator else None
        # Snapshots in the pod's memory between durable saves (checkpoint.memory; off at 0).
        self.memory = (
            MemoryTier(
                cfg.memory.interval_steps,
                Path(cfg.memory.dir),
                self.job,
                self.run,
                group.rank,
                group.world_size,
                cfg.memory.replicas,
                ranks_per_pod(group.world_size),
                reports.say_any_rank,
                durable_copies=0 if cfg.mode == "sync" else 1,
                prefetch=memory_prefetch,
            )
            if cfg.memory.interval_steps > 0
            else None
        )

    def say(self, message: str) -> None:
        self.log.info(message)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._engine_factory()
            # A new attempt: it starts from the save plan the pod kept for this rank, if any.
            self._engine.attach(
                self.group.world_size,
                self.group.rank,
                kept_plan_file(Path(self.cfg.memory.dir), self.job, self.run, self.group.rank),
            )
        return self._engine

    # -- what the loop calls -----------------------------------------------------------------------

    def votes(self) -> Votes:
        """This rank's votes for the step's loss all-reduce, which sums them for :meth:`after_step`."""
        committing = self.pending is not None and self.pending.committing
        writing = self.pending is not None and not committing and not self.engine.local_status()[0]
        stopped = self.memory is not None and not self.memory.replicating
        return Votes(
            interval_passed=1.0 if self._interval_passed() else 0.0,
            writing=1.0 if writing else 0.0,
            committing=1.0 if self._commit_running() else 0.0,
            unreplicated=1.0 if stopped else 0.0,
        )

    def _commit_running(self) -> bool:
        return self.commits is not None and self.commits.running()  # rank 0 alone commits

    def _interval_passed(self) -> bool:
        return self.cfg.interval_s > 0 and time.monotonic() - self.last_save_time >= self.cfg.interval_s

    def after_step(self, step: int, agreed: Optional[Votes] = None) -> float:
        """After step ``step``: commit a write that finished, start a save if one is due, log what
        was committed and what S3 did; the seconds it took. Collective. ``agreed``: every rank's
        :meth:`votes` of this step, summed; without it the ranks agree in collectives here."""
        t0 = time.perf_counter()
        if agreed is not None:
            self.replication.update(int(agreed.unreplicated), step, self.group.is_coordinator, self.log)
        self.hooks.start_section("checkpoint")
        committed = self._periodic(lambda: self.poll(agreed))
        self._log(committed)
        learn = committed is not None  # only calls that saved or committed teach its timeout
        if self.due(step, agreed_time=agreed.interval_passed if agreed is not None else None):
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
        reports.memory_records(self.memory, self.group, self.log)
        reports.uploads(self.uploader, self.log)
        return time.perf_counter() - t0

    def finish(self, step: int, save: bool, stopping: bool = False) -> None:
        """The end of training (``save``: ``checkpoint.save_final``) or a graceful stop (``save``,
        ``stopping``): a committed checkpoint of ``step`` unless it has one, every write waited
        for. Collective. A save of an earlier step still in flight counts as a periodic one; with
        ``save``, the checkpoint of ``step`` failing raises (permanent at the end of training, not
        in a graceful stop, whose restart trains the steps again)."""
        with self.hooks.draining():
            if self.pending is not None and not (save and self.pending.step == step):
                self._log(self._periodic(self.wait))
            if save:
                try:
                    if self.last_committed_step != step and self.pending is None:
                        self._log(self.save(step))
                    self._log(self.wait())
                except SaveFailed as exc:
                    self._save_failed(exc, final=True, stopping=stopping)
        reports.uploads(self.uploader, self.log)

    def _periodic(self, call: Callable[[], Optional[dict]]) -> Optional[dict]:
        """``call``'s record; a save it reports failed is counted instead (:meth:`_save_failed`)."""
        try:
            return call()
        except SaveFailed as exc:
            self._save_failed(exc)
            return None

    def _save_failed(self, exc: SaveFailed, final: bool = False, stopping: bool = False) -> None:
        """Count and report a failed save, or raise the job's end (:meth:`.failures.FailureStreak.judge`)."""
        self._replace_hung_engine()
        self.streak.judge(exc, self.last_committed_step, self.log.event, self.say, final, stopping)

    def _replace_hung_engine(self) -> None:
        """A writer that outlived checkpoint.write_timeout_s may never take another write: the next
        save gets a new engine (a caller's factory closes the hung one itself)."""
        if self._engine is not None and self._engine.hung:
            if self.owns_engine:
                self._engine.close(abort=True)
            self._engine = None

    def _log(self, record: Optional[dict]) -> None:
        reports.committed(record, self.log)

    def prepare(self) -> None:
        """Get the engine ready now rather than at the first save: its writer process and, in the
        background, its staging buffers for this state. Called after the first step, when the
        optimizer's state exists, so the buffers match what the first save stages."""
        if self.cfg.interval_steps > 0 or self.cfg.interval_s > 0 or self.cfg.save_final:
            self.engine.warm(self.state.state_dict())  # buffers only for a job that will save

    def preflight(self) -> None:
        """Fail at start, on every rank, if the checkpoint directory cannot be written or another
        job holds it; complete commits a crash cut short."""

        def under_lease(lease: Lease) -> None:
            for path in store.recover(self.root):
                self.say(f"completed the commit of {path} that a crash had cut short")
            # Nothing in flight yet: torn writes of earlier attempts are listed now and removed once
            # the job trains (:meth:`started`; a crash loop can leave several whole checkpoints).
            self.retention.sweep(lease, in_flight=None, at_start=True)

        self.lease, error = preflight_.preflight(self.group, self.cfg, self.root, self.job, self.say, under_lease)
        if error:
            raise ConfigError(error)

    def started(self) -> None:
        """The job trains from here: the start's sweep of torn writes begins."""
        self.retention.started()

    def resume(self, suspect: Optional[tuple[int, int]] = None) -> Optional[int]:
        """Load the newest complete checkpoint (or ``resume_from`` at the job's first start); its
        step or None. ``suspect``: steps never resumed from (:func:`.resume.resume`)."""
        self.before_optimizer_step()  # loading changes the live state: no copy may be reading it
        done = resume_.resume(
            self.group,
            self.cfg,
            self.root,
            self.job,
            self.state,
            self.identity,
            self.batch,
            self.say,
            self.choose_batch,
            self.memory,
            self.hooks.restoring,
            suspect,
        )
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
        """Whether a save of ``step`` is due; ``agreed_time``: the ranks' summed
        ``interval_passed`` votes, else they agree here."""
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
        """Start a checkpoint of the current state, named ``step``: its structure now, its tensors
        copied into host buffers while training goes on, until :meth:`before_optimizer_step`. The
        record committed by this call: this one for ``sync``, else the previous one if it had to
        be waited for."""
        t0 = time.perf_counter()
        # One write in flight at a time: the staging buffers are reused. Waiting for the previous
        # write is this save's stall (its ``previous_s``), not the previous save's as well.
        previous = self._wait(charge=False) if self.pending is not None else None
        t_state = time.perf_counter()
        sd = self.state.state_dict()
        vote = self.engine.vote(sd)
        token, error = None, None
        if self.group.is_coordinator:
            token = uuid.uuid4().hex[:8]
            try:
                (self.root / store.partial_name(step, token)).mkdir(parents=True)
            except OSError as exc:
                error = self._failure(
                    f"checkpoint of step {step} failed: cannot create a checkpoint directory under "
                    f"checkpoint.dir={str(self.root)!r}: {exc.strerror or exc}",
                    failures.MKDIR,
                    step,
                    exc,
                )
        # One collective: rank 0's directory, and whether every rank can use its plan cache.
        t_agree = time.perf_counter()
        gathered = self.group.all_gather((token, error, vote))
        t_start = time.perf_counter()
        token, error = gathered[0][0], gathered[0][1]
        if error:
            self.last_save_time = time.monotonic()  # checkpoint.interval_s: not again at the next step
            raise error.error()
        partial_dir = self.root / store.partial_name(step, token)
        self.hooks.save_started(
            step, partial_dir, lambda: store.written_bytes(partial_dir), self.expected_written_bytes
        )
        plan = self.engine.agree([v[2] for v in gathered])
        self.engine.start(sd, partial_dir, step, token, plan, self.hooks.writer_fault(step))
        for note in self.engine.take_notes():
            self.say(note)
        t_end = time.perf_counter()
        call = t_end - t0
        # Where the call's time went: waiting for the previous write, taking the state, agreeing
        # with every rank (the slowest to arrive), starting the write (planning, unless cached).
        parts = {
            "previous_s": t_state - t0,
            "state_s": t_agree - t_state,
            "agree_s": t_start - t_agree,
            "start_s": t_end - t_start,
        }
        self.pending = PendingSave(
            step,
            partial_dir,
            started_unix=time.time() - (time.perf_counter() - t0),
            stall_s=call,
            save_call_s=call,
            save_call_parts_s=parts,
            plan=PLAN_NAMES[plan] if self.engine.mode == "async" else None,
        )
        self.last_save_time = time.monotonic()
        self.last_saved_step = step
        return self.wait() if self.engine.mode == "sync" else previous

    def before_optimizer_step(self) -> float:
        """Wait until the pending save's copy of the state is done (just before ``optimizer.step()``,
        the first change to the state); that wait is stall. Rank-local; the seconds waited."""
        memory = self.memory.before_optimizer_step() if self.memory is not None else 0.0
        if self.pending is None or self.pending.staged or self._engine is None:
            return memory
        waited = self._engine.staged()
        self.pending.staged = True
        self.pending.staging_wait_s += waited
        self.pending.stall_s += waited
        return waited + memory

    # -- committing: poll between steps, wait at a save or the end --

    def poll(self, votes: Optional[Votes] = None) -> Optional[dict]:
        """Between steps, never blocking: once every rank's write finished, hand the commit to rank
        0's commit process; once that finished, learn its outcome. The record when this call
        learned a commit. ``votes``: the ranks' summed votes of this step, else they agree here."""
        self.retention.report(self.log)
        if self.pending is None:
            return None
        if self.pending.committing:
            running = votes.committing if votes is not None else self.group.max(1.0 if self._commit_running() else 0.0)
            return None if running > 0 else self._committed(charge=True)
        self.before_optimizer_step()
        done = self._written_here()
        writing = votes.writing if votes is not None else self.group.max(0.0 if done else 1.0)
        if writing != 0.0:
            return None
        job, gather_s = self._gather()
        self.pending.committing, self.pending.gather_s = True, gather_s
        if job is not None:
            t_submit = time.perf_counter()
            unavailable = self.commits.submit(job)
            if unavailable:
                # Committed here, on the training thread: its time is this checkpoint's stall.
                self.pending.inline_commit_s = time.perf_counter() - t_submit
                self.say(
                    f"warning: rank 0's commit process could not be started ({unavailable}); checkpoint "
                    f"step {job.step} was committed on the training thread, and the next commit tries a new "
                    "process"
                )
        return None

    def wait(self) -> Optional[dict]:
        """Wait for the pending checkpoint's write (up to ``checkpoint.write_timeout_s``) and commit
        it here, or the rest of a commit in flight; the wait is its stall. Its record, or None."""
        return self._wait(charge=True)

    def _wait(self, charge: bool) -> Optional[dict]:
        self.retention.report(self.log)
        if self.pending is None:
            return None
        if self.pending.committing:
            return self._committed(charge)
        self.before_optimizer_step()
        t_wait = time.perf_counter()
        while True:
            done = self._written_here()
            late = time.perf_counter() - t_wait > self.cfg.write_timeout_s
            # One collective: is any rank still writing, has any rank run out of time.
            writing, out_of_time = self.group.max_of(0.0 if done else 1.0, 1.0 if late else 0.0)
            if writing == 0.0 or out_of_time > 0:
                break
            time.sleep(0.01)
        if charge:
            self.pending.stall_s += time.perf_counter() - t_wait
        if writing != 0.0:
            pending, self.pending = self.pending, None
            self.engine.abandon()
            raise SaveFailed(
                f"checkpoint of step {pending.step} failed: its write did not finish within "
                f"checkpoint.write_timeout_s={self.cfg.write_timeout_s:g} on every rank; it stays "
                f"incomplete at {pending.dir} and will not be loaded",
                failures.TIMEOUT,
                step=pending.step,
            )
        job, gather_s = self._gather()
        # The commit runs on the training thread: its time (rank 0's gather, metadata, manifest and
        # rename, then the broadcast) is this checkpoint's commit_s and, when charged, stall.
        pending, self.pending = self.pending, None
        result = self._commit_record(pending, commit.run(job), gather_s) if job is not None else (None, None)
        return self._learn_commit(result, charge)

    def _written_here(self) -> bool:
        done, _ = self.engine.local_status()
        if done:
            self.hooks.save_written(self.pending.step)
        return done

    def _gather(self) -> tuple[Optional[commit.CommitJob], float]:
        """Every rank's outcome of the pending write, gathered to rank 0: (rank 0's commit job, the
        gather's seconds)."""
        t_gather = time.perf_counter()
        # Each rank pickles its own outcome: rank 0's training thread receives bytes, and the
        # unpickling (at scale most of a commit's work, tens of MB of small objects) is the commit's.
        outcomes = self.group.gather(pickle.dumps(self.engine.collect(), protocol=pickle.HIGHEST_PROTOCOL))
        gather_s = time.perf_counter() - t_gather
        if not self.group.is_coordinator:
            return None, gather_s
        manifest = {
            **self.identity,
            "step": self.pending.step,
            "mode": self.engine.mode,
            "world_size": self.group.world_size,
            **self.batch,
            "nvrx_version": NVRX_VERSION,
            "torch_version": torch.__version__,
            "job": self.job,
        }
        return commit_job(self.pending, outcomes, manifest, self.engine, self.lease, self.hooks), gather_s

    def _committed(self, charge: bool) -> Optional[dict]:
        """The outcome of the pending checkpoint's commit in rank 0's commit process, waited for."""
        t0 = time.perf_counter()
        pending, self.pending = self.pending, None
        if pending.inline_commit_s is not None:
            # Rank 0 committed on its training thread (no commit process could start): the step
            # that handed it over waited for all of it, so it is stall, not background work.
            pending.stall_s += pending.inline_commit_s
        done = self.commits.result() if self.commits is not None else None
        result = self._commit_record(pending, done, pending.gather_s) if done is not None else (None, None)
        if result[0] is not None and pending.inline_commit_s is not None:
            result[0]["committed_inline_s"] = pending.inline_commit_s  # rank 0 alone knows: it travels
        return self._learn_commit(result, charge, on_thread_s=pending.gather_s + time.perf_counter() - t0)

    def _commit_record(
        self, pending: PendingSave, result: commit.CommitResult, gather_s: float
    ) -> tuple[Optional[dict], Optional[Failure]]:
        return commit_record(pending, result, gather_s, self.engine.mode, self.lease, self._failure)

    def _learn_commit(self, result: tuple, charge: bool, on_thread_s: Optional[float] = None) -> dict:
        """Every rank: rank 0's commit outcome ``result``, broadcast; raises its failure."""
        t_broadcast = time.perf_counter()
        record, error = self.group.broadcast(result)
        if error:
            raise error.error()
        broadcast_s = time.perf_counter() - t_broadcast
        inline = record.pop("committed_inline_s", None)
        add_broadcast(record, broadcast_s, charge, None if on_thread_s is None else on_thread_s + broadcast_s)
        if inline is not None:
            record["commit_background"] = False
            record["commit_on_thread_s"] += inline
        self._after_commit(record)
        return {k: v for k, v in record.items() if k != "manifest"}

    def _failure(self, message: str, cause: str, step: int, error: object) -> Failure:
        """Rank 0: the failure of the save of ``step`` (:func:`.failures.save_failure`)."""
        needed = (
            self.expected_written_bytes() if cause in (failures.WRITER, failures.FINALIZE, failures.MKDIR) else None
        )
        return failures.save_failure(message, cause, step, error, self.root, needed, self.cfg.keep_last)

    def _after_commit(self, record: dict) -> None:
        """Every rank: uploads of its files; rank 0: retention, off the training thread."""
        self.records.append({k: v for k, v in record.items() if k != "manifest"})
        self.last_committed_step = record["step"]
        self.streak.committed()
        if self.uploader is not None:
            self.uploader.submit(record["step"], Path(record["path"]), manifest=record["manifest"])
        self.retention.after_commit(
            self.uploader.holds if self.uploader is not None else (lambda _p: False), self.lease
        )

    def expected_written_bytes(self) -> Optional[int]:
        return store.expected_written_bytes(self.root, self.group.world_size, self.engine.mode)

    def settle(self) -> None:
        """Wait for the retention thread's queued passes and a memory save in flight, and report
        them: before the run's last records are written, so they are in ``metrics.jsonl`` too."""
        self.retention.settle(self.log)
        if self.memory is not None:
            self.memory.settle()
            reports.memory_records(self.memory, self.group, self.log)

    def close(self, abort: bool = False, drain: bool = True) -> None:
        """``abort``: the attempt failed. An engine shared with the process (``engine_factory``) is
        then drained for the next in-process attempt if ``drain``; without one the process exits
        and closes the engine (waiting for its write would only delay the exit ``ft_launcher``
        learns of the failure by)."""
        # A commit in flight finishes first: before the lease is released, and before an in-process
        # restart's start sweeps torn directories, this one among them.
        if self.commits is not None and not self.commits.close():
            self.say(
                f"the commit of checkpoint step {self.pending.step if self.pending else '?'} did not finish "
                f"within checkpoint.write_timeout_s={self.cfg.write_timeout_s:g}; it is left incomplete and "
                "will not be loaded"
            )
        self.retention.close(self.log)
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
                reports.memory_records(self.memory, self.group, self.log)
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
