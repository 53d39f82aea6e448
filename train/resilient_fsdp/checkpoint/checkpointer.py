"""The checkpointer the trainer uses: saves on schedule, commits atomically, resumes exactly.

Every public method is collective. :meth:`Checkpointer.save` starts a write with the configured
engine (:mod:`.engines`); :meth:`~Checkpointer.poll` agrees across ranks that every rank's write
finished, finalizes it and commits it through :mod:`.store`: nothing is visible until every
rank's data and the metadata are written. :meth:`~Checkpointer.resume` loads the checkpoint
:mod:`.resume` picks. DCP checkpoints (``async``, ``sync``) can be resumed at another world size
(DCP reshards model and optimizer; RNG streams are then re-seeded).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..config import CheckpointConfig, ConfigError
from ..train.distributed import DistInfo
from . import nvrx, resume, store
from .engines import Engine, build_engine
from .s3 import client as s3_client
from .s3.uploader import Uploader
from .state import CheckpointState
from .store import CheckpointError


class Checkpointer:
    """Saves on schedule, finalizes in the background, commits atomically, resumes exactly.

    Every public method is collective: all ranks call it at the same step. With an S3 tier, rank
    0 hands each committed checkpoint to ``uploader`` (the other ranks have none) and, at resume,
    restores from S3 when ``root`` holds no complete checkpoint.
    """

    def __init__(self, cfg: CheckpointConfig, root: Path, info: DistInfo, state: CheckpointState,
                 identity: dict, say: Callable[[str], None],
                 engine_factory: Optional[Callable[[], Engine]] = None,
                 uploader: Optional[Uploader] = None, faults: Optional[Any] = None):
        self.cfg, self.root, self.info, self.state = cfg, root, info, state
        # Fault injection (resilience.faults.FaultInjector): told when a write starts and ends.
        self.faults = faults
        self.uploader = uploader
        self.identity = identity  # what a resumed run must match: model shape, preset
        self.say = say
        # An engine from a factory belongs to the caller (it outlives in-process restarts).
        self.owns_engine = engine_factory is None
        self._engine_factory = engine_factory or (lambda: build_engine(cfg.mode, info.rank, cfg.writer_threads))
        self._engine: Optional[Engine] = None
        self.pending: Optional[dict] = None
        self.records: list[dict] = []
        self.last_save_time = time.monotonic()
        self.last_saved_step: Optional[int] = None
        self.resumed_from: Optional[dict] = None
        self.restored_from_s3: Optional[dict] = None  # {"step", "uri"} when this start downloaded one

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._engine_factory()
        return self._engine

    def prepare(self) -> None:
        """Create the engine (and start its writer process) now rather than at the first save.

        The trainer calls it after its first step: a writer process importing torch competes
        for the CPU with start-up and restore, which is the time a restart is measured by.
        """
        _ = self.engine

    # -- collectives on the job's backend (tensors on the training device) --
    def _all_reduce_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def preflight(self) -> None:
        """Fail at start, on every rank, if the checkpoint directory cannot be written."""
        error = None
        if self.info.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-test-{uuid.uuid4().hex[:8]}"
                probe.write_bytes(b"ok")
                probe.unlink()
            except OSError as exc:
                error = f"checkpoint.dir={str(self.root)!r} is not writable ({exc.strerror or exc}); " \
                        "point checkpoint.dir at a writable shared directory"
            if error is None and self.cfg.s3.uri:
                error = self._check_s3()
        error = self._broadcast(error)
        if error:
            raise ConfigError(error)

    def _check_s3(self) -> Optional[str]:
        """A bucket that is missing or forbidden stops the job now; an unreachable one does not
        (uploads retry; a restore that needs it fails on its own)."""
        try:
            return s3_client.check_access(self.cfg.s3)
        except Exception as exc:
            self.say(f"warning: S3 is not reachable at start ({s3_client.describe_error(exc)}); training goes on "
                     "and uploads are retried")
            return None

    # -- resume (the choice and the loading are in resume.py) --
    def resume(self) -> Optional[int]:
        """Load the newest complete checkpoint (or ``resume_from``); returns its step or None.

        A checkpoint that fails to load is reported and the next older one is tried.
        """
        self._maybe_restore_from_s3()
        candidate = resume.find_resume_point(self.cfg, self.root, self.info.rank, self.say)
        tried: list[str] = []
        while candidate is not None:
            resume.check_compatible(candidate, self.identity, self.info.world_size)
            error = self._try_load(candidate)
            if error is None:
                self.resumed_from = {"step": candidate.step, "path": str(candidate.path)}
                self.last_saved_step = candidate.step
                self.say(f"resumed from step {candidate.step} ({candidate.path}, {candidate.manifest['mode']}, "
                         f"saved at world size {candidate.manifest['world_size']})")
                self._adopt_local()
                return candidate.step
            tried.append(f"{candidate.path}: {error}")
            self.say(f"warning: cannot load {candidate.path} ({error}); trying an older checkpoint")
            if self.cfg.resume_from:
                break
            candidate = resume.older_than(self.root, candidate.step)
        if tried:
            raise CheckpointError("no loadable checkpoint; tried:\n  " + "\n  ".join(tried))
        self._adopt_local()
        return None

    def _maybe_restore_from_s3(self) -> None:
        """Collective. Rank 0 alone downloads (``checkpoint.dir`` is shared by every node); the
        others wait in the broadcast, whose start-up timeout is ``dist.init_timeout_s``."""
        if not resume.restores_from_s3(self.cfg):
            return
        outcome = resume.restore_from_s3(self.cfg, self.root, self.say) if self.info.rank == 0 else None
        outcome = self._broadcast(outcome)
        if outcome and "error" in outcome:
            raise CheckpointError(outcome["error"])
        self.restored_from_s3 = outcome

    def _adopt_local(self) -> None:
        """Rank 0: queue local checkpoints an earlier run may not have uploaded (not when this run
        ignores them: ``checkpoint.resume=false``)."""
        if self.uploader is not None and self.cfg.resume:
            self.uploader.adopt(store.scan(self.root)[0])

    def _try_load(self, ckpt: store.CheckpointInfo) -> Optional[str]:
        """Collective: load ``ckpt`` on every rank; the error, if any rank failed."""
        same_world = ckpt.manifest["world_size"] == self.info.world_size
        error = resume.load(self.state, ckpt, self.info.rank, same_world)
        failed = self._all_reduce_max(1.0 if error else 0.0)
        if failed and error is None:
            error = "another rank could not load it"
        if not same_world and not failed and self.info.rank == 0:
            self.say(f"resharded from world size {ckpt.manifest['world_size']} to {self.info.world_size}; "
                     "RNG streams re-seeded")
        return error

    # -- saving --
    def due(self, step: int) -> bool:
        if step == self.last_saved_step:
            return False
        by_steps = self.cfg.interval_steps > 0 and step % self.cfg.interval_steps == 0
        if self.cfg.interval_s > 0:
            # Ranks' clocks disagree slightly: agree, so every rank saves at the same step.
            elapsed = time.monotonic() - self.last_save_time
            by_time = self._all_reduce_max(1.0 if elapsed >= self.cfg.interval_s else 0.0) > 0
            return by_steps or by_time
        return by_steps

    def save(self, step: int) -> Optional[dict]:
        """Start a checkpoint of the current state, named ``step``.

        Returns the record of a checkpoint committed by this call: this one for ``sync``, else
        the previous one if it was still in flight and had to be waited for.
        """
        t0 = time.perf_counter()
        # One write in flight at a time: the staging buffers are reused.
        previous = self.wait() if self.pending is not None else None
        token, error = None, None
        if self.info.rank == 0:
            token = uuid.uuid4().hex[:8]
            try:
                (self.root / store.partial_name(step, token)).mkdir(parents=True)
            except OSError as exc:
                error = f"cannot create a checkpoint directory under checkpoint.dir={str(self.root)!r}: " \
                        f"{exc.strerror or exc}"
        token, error = self._broadcast((token, error))
        if error:
            raise CheckpointError(error)
        partial_dir = self.root / store.partial_name(step, token)
        if self.faults is not None:
            self.faults.save_started(step, partial_dir, lambda: store.written_bytes(partial_dir),
                                     self.expected_written_bytes)
        self.engine.start(self.state, partial_dir, step)
        stall = time.perf_counter() - t0
        self.pending = {"step": step, "dir": partial_dir, "t0": t0, "stall_s": stall}
        self.last_save_time = time.monotonic()
        self.last_saved_step = step
        return self.poll(block=True) if self.engine.mode == "sync" else previous

    def poll(self, block: bool = False) -> Optional[dict]:
        """Finalize and commit the pending checkpoint once every rank's write finished.

        Returns the checkpoint's record when it was committed by this call.
        """
        if self.pending is None:
            return None
        t_wait = time.perf_counter()
        while True:
            done, error = self.engine.local_status()
            if done and self.faults is not None:
                self.faults.save_written(self.pending["step"])
            # Agree: 0 = still writing somewhere, 1 = all done, 2 = all done and someone failed.
            code = 0.0 if not done else (2.0 if error else 1.0)
            t = torch.tensor([code, -code], dtype=torch.float64, device=self.info.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            all_done = -t[1].item() >= 1.0  # the minimum over ranks
            any_failed = t[0].item() >= 2.0
            if all_done or not block:
                break
            time.sleep(0.01)
        if block:
            self.pending["stall_s"] += time.perf_counter() - t_wait
        if not all_done:
            return None
        pending, self.pending = self.pending, None
        if any_failed:
            where = f"rank {self.info.rank}: {error}" if error else "another rank's writer failed"
            raise CheckpointError(f"checkpoint of step {pending['step']} failed ({where}); it stays incomplete at "
                                  f"{pending['dir']} and will not be loaded; the previous checkpoint is intact")
        try:
            self.engine.finalize()
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"checkpoint of step {pending['step']} failed while finalizing: {exc}; it stays "
                                  f"incomplete at {pending['dir']}") from exc
        record = None
        if self.info.rank == 0:
            record = self._commit(pending)
        record = self._broadcast(record)
        self.records.append(record)
        return record

    def _commit(self, pending: dict) -> dict:
        nbytes = store.dir_bytes(pending["dir"])
        write_s = time.perf_counter() - pending["t0"]
        manifest = {**self.identity, "step": pending["step"], "mode": self.engine.mode,
                    "world_size": self.info.world_size, "bytes": nbytes, "write_s": write_s,
                    "created_unix": time.time(), "nvrx_version": nvrx.NVRX_VERSION,
                    "torch_version": torch.__version__}
        final = store.commit(pending["dir"], manifest)
        if self.uploader is not None:
            self.uploader.submit(pending["step"], final)
        self.apply_retention()
        return {"step": pending["step"], "mode": self.engine.mode, "stall_s": pending["stall_s"],
                "write_s": write_s, "bytes": nbytes, "path": str(final)}

    def expected_written_bytes(self) -> Optional[int]:
        """What the writers of a save put on disk, taken from the newest committed checkpoint of
        this world size and mode (a save of the same state writes the same files); None if none."""
        for ckpt in reversed(store.scan(self.root)[0]):
            m = ckpt.manifest
            if m.get("world_size") == self.info.world_size and m.get("mode") == self.engine.mode:
                return store.written_bytes(ckpt.path)
        return None

    def apply_retention(self) -> None:
        """Rank 0: local retention; a checkpoint still waiting for its S3 upload is kept."""
        store.apply_retention(self.root, self.cfg.keep_last,
                              held=self.uploader.holds if self.uploader is not None else lambda _p: False)

    def wait(self) -> Optional[dict]:
        return self.poll(block=True)

    def close(self, abort: bool = False) -> None:
        if self._engine is None:
            return
        if self.owns_engine:
            self._engine.close(abort=abort)
        elif abort:
            self._engine.drain()
