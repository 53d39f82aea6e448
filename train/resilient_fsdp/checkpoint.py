"""Checkpointing of the full training state, asynchronous by default, with exact resume.

What is saved (one sharded checkpoint per step): model and optimizer as FSDP2 DTensor state
(``get_state_dict``), the LR schedule, the trainer's counters, the sampler position and each
rank's RNG state. Resuming restores all of it, so the resumed run continues bit for bit.

Engines (``checkpoint.mode``):

- ``async`` (default): NVRx ``FileSystemWriterAsync`` + ``AsyncCallsQueue`` (persistent worker).
  The loop stalls only to stage the state into reused host buffers and plan the write; the
  worker writes a standard DCP checkpoint; the loop finalizes it at a later step.
- ``torch-async``: NVRx ``TorchAsyncCheckpoint``: ``async_save`` of each rank's shard (one file
  per rank), committed after ``finalize_async_save``. Resumes only at the same world size.
- ``sync``: plain ``torch.distributed.checkpoint.save``; the baseline.

All three share the commit protocol in :mod:`checkpoint_store`: nothing is visible until every
rank's data and the metadata are written. DCP checkpoints (``async``, ``sync``) can be resumed at
another world size (DCP reshards model and optimizer; RNG streams are then re-seeded).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from . import checkpoint_store as store
from . import nvrx_compat as compat
from . import s3_tier
from .config import CheckpointConfig, ConfigError
from .distributed import DistInfo
from .parallelize import canonical_name

log = logging.getLogger(__name__)

# Test and drill hook: the async writer of this rank dies right after writing step N's data,
# before the save is finalized (see nvrx_compat.worker_write).
FAULT_WRITER_EXIT_ENV = "RESILIENT_FSDP_FAULT_WRITER_EXIT_AT_STEP"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the previous committed one is intact."""


# ---- what goes into a checkpoint ---------------------------------------------------------------

class TrainingState:
    """Gathers and restores everything a checkpoint holds, for one rank."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                 counters: Any, data: Any, rank: int, resilience: Any = None):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.counters, self.data, self.rank = counters, data, rank
        self.resilience = resilience  # learned hang-detection timeouts (resilience.ProgressMonitor)

    def state_dict(self, with_rng: bool = True) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {
            "model": model_sd,
            "optim": optim_sd,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "trainer": self.counters.state_dict(),
            "data": self.data.state_dict(),
            # JSON text: its shape changes once timeouts are learned, and DCP loads by shape.
            "resilience": json.dumps(self.resilience.state_dict() if self.resilience else {}, sort_keys=True),
        }
        if with_rng:
            sd["rng"] = {f"rank{self.rank}": rng_state()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        self.counters.load_state_dict(sd["trainer"])
        self.data.load_state_dict(sd["data"])
        if self.resilience is not None:
            self.resilience.load_state_dict(json.loads(sd["resilience"]))
        if "rng" in sd:
            set_rng_state(sd["rng"][f"rank{self.rank}"])

    def shape_digest(self) -> str:
        """Identifies the model's architecture: names and global shapes of every parameter."""
        h = hashlib.sha256()
        for name, p in self.model.named_parameters():
            h.update(f"{canonical_name(name)}:{tuple(p.shape)};".encode())
        return h.hexdigest()


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def to_local(sd: Any) -> Any:
    """The same nested structure with every DTensor replaced by this rank's shard."""
    if isinstance(sd, DTensor):
        return sd.to_local()
    if isinstance(sd, dict):
        return {k: to_local(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [to_local(v) for v in sd]
    return sd


def from_local(loaded: Any, like: Any) -> Any:
    """Inverse of :func:`to_local`: rebuild DTensors shaped like ``like`` from local shards."""
    if isinstance(like, DTensor):
        return DTensor.from_local(loaded.to(like.device), like.device_mesh, like.placements,
                                  shape=like.shape, stride=like.stride(), run_check=False)
    if isinstance(like, dict):
        return {k: from_local(loaded[k], v) if k in loaded else v for k, v in like.items()}
    return loaded


class StateStager:
    """Copies state into host buffers that are allocated once and reused, so the file holds
    exactly the state of the step it is named for while the loop goes on changing the live
    tensors (NVRx 0.4 would otherwise write live CPU tensors).

    Buffers live in shared memory (NVRx's worker receives them without a copy), pinned on GPUs
    for fast device-to-host copies. Reuse is what keeps the stall small: a fresh buffer costs a
    page fault per page, about as long as a whole synchronous save on a CPU-only machine.
    """

    def __init__(self) -> None:
        self.pin = compat.cuda_present()
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu").share_memory_()
            if self.pin:
                torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
            self.buffers[key] = buf
        return buf

    def stage(self, sd: Any) -> Any:
        """A copy of ``sd`` whose tensors live in this stager's buffers (DTensors stay DTensors)."""
        staged = self._stage(sd, "")
        if self.pin:
            torch.cuda.synchronize()  # one wait for every non-blocking device-to-host copy
        return staged

    def _stage(self, sd: Any, key: str) -> Any:
        if isinstance(sd, DTensor):
            local = self._stage(sd.to_local(), key)
            return DTensor.from_local(local, sd.device_mesh, sd.placements, shape=sd.shape, stride=sd.stride(),
                                      run_check=False)
        if isinstance(sd, torch.Tensor):
            buf = self._buffer(key, sd)
            buf.copy_(sd.detach(), non_blocking=self.pin)
            return buf
        if isinstance(sd, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in sd.items()}
        if isinstance(sd, (list, tuple)):
            return type(sd)(self._stage(v, f"{key}/{i}") for i, v in enumerate(sd))
        return copy.deepcopy(sd)

    def close(self) -> None:
        self.buffers.clear()


# ---- engines -----------------------------------------------------------------------------------

class Engine:
    """One way of writing a checkpoint. ``start`` blocks the loop; the rest happens later."""

    mode = ""
    reshardable = True

    def start(self, state: TrainingState, partial_dir: Path, step: int) -> None:
        raise NotImplementedError

    def local_status(self) -> tuple[bool, Optional[str]]:
        """(this rank's write finished, its error if any); never blocks."""
        return True, None

    def finalize(self) -> None:
        """Collective, after every rank's write finished: write metadata (DCP) and clean up."""

    def drain(self, timeout_s: float = 120.0) -> None:
        """Rank-local: let a write left by a failed attempt finish, so an in-process restart can
        reuse this engine. That write stays an incomplete checkpoint; it is never committed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done, _ = self.local_status()
            if done:
                break
            time.sleep(0.05)
        self.forget()

    def forget(self) -> None:
        """Drop the plan of a save that will never be finalized."""

    def close(self, abort: bool = False) -> None:
        pass


class SyncEngine(Engine):
    mode = "sync"

    def start(self, state: TrainingState, partial_dir: Path, step: int) -> None:
        dcp.save(state.state_dict(), checkpoint_id=str(partial_dir))


class AsyncEngine(Engine):
    """NVRx async DCP: ``FileSystemWriterAsync`` planned here, written by the persistent worker."""

    mode = "async"

    def __init__(self, thread_count: int):
        self.thread_count = thread_count
        self.queue = compat.make_calls_queue()
        compat.warm_up(self.queue)
        self.results_queue_ready = compat.start_results_queue()
        self.stager = StateStager()
        self.plan: Optional[tuple] = None
        self.error_path: Optional[str] = None

    def start(self, state: TrainingState, partial_dir: Path, step: int) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        self.results_queue_ready.join()
        staged = self.stager.stage(state.state_dict())
        writer = FileSystemWriterAsync(str(partial_dir), thread_count=self.thread_count)
        with compat.cpu_shim():
            self.plan = save_state_dict_async_plan(staged, writer, None, 0, planner=DefaultSavePlanner(),
                                                   enable_cache=compat.plan_cache_enabled())
            save_fn, preload_fn, save_args = writer.get_save_function_and_args()
            self.error_path = compat.new_error_path()
            if save_fn is None:
                return  # nothing to write on this rank; it still takes part in finalize
            fault = os.environ.get(FAULT_WRITER_EXIT_ENV) == str(step)
            request = AsyncRequest(partial(compat.worker_write, self.error_path, fault, save_fn), save_args, [],
                                   async_fn_kwargs={},
                                   preload_fn=partial(compat.worker_preload, preload_fn) if preload_fn else None)
            self.queue.schedule_async_request(request)

    def local_status(self) -> tuple[bool, Optional[str]]:
        if self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        if self.queue.get_num_unfinalized_calls():
            proc = compat.worker_process(self.queue)
            if proc is not None and not proc.is_alive():
                return True, f"the checkpoint writer process exited with code {proc.exitcode} before finishing"
            return False, None
        if self.error_path and os.path.exists(self.error_path):
            text = Path(self.error_path).read_text()
            os.unlink(self.error_path)
            return True, text.strip().splitlines()[-1] + "\n" + text
        return True, None

    def forget(self) -> None:
        self.plan = None

    def finalize(self) -> None:
        plan, self.plan = self.plan, None
        if plan is not None:
            with compat.cpu_shim():
                compat.finalize_save(plan)

    def close(self, abort: bool = False) -> None:
        compat.close_queue(self.queue, abort=abort)
        self.stager.close()


class TorchAsyncEngine(Engine):
    """NVRx ``TorchAsyncCheckpoint``: each rank's shard through ``async_save`` into one file."""

    mode = "torch-async"
    reshardable = False

    def __init__(self, rank: int):
        self.rank = rank
        self.ckpt = compat.make_torch_async_checkpoint()
        compat.warm_up(self.ckpt._async_calls_queue)
        self.stager = StateStager()

    def start(self, state: TrainingState, partial_dir: Path, step: int) -> None:
        staged = self.stager.stage(to_local(state.state_dict()))
        with compat.cpu_shim():
            self.ckpt.async_save(staged, str(partial_dir / f"rank{self.rank:05d}.pt"))

    def local_status(self) -> tuple[bool, Optional[str]]:
        queue = self.ckpt._async_calls_queue
        if queue.get_num_unfinalized_calls():
            self.ckpt.finalize_async_save(blocking=False, no_dist=True)
        if queue.get_num_unfinalized_calls():
            proc = compat.worker_process(queue)
            if proc is not None and not proc.is_alive():
                return True, f"the checkpoint writer process exited with code {proc.exitcode} before finishing"
            return False, None
        return True, None

    def close(self, abort: bool = False) -> None:
        compat.close_queue(self.ckpt._async_calls_queue, abort=abort)
        self.stager.close()


def build_engine(mode: str, rank: int, thread_count: int) -> Engine:
    if mode == "sync":
        return SyncEngine()
    if mode == "torch-async":
        return TorchAsyncEngine(rank)
    return AsyncEngine(thread_count)


# ---- the checkpointer the trainer uses ---------------------------------------------------------

class Checkpointer:
    """Saves on schedule, finalizes in the background, commits atomically, resumes exactly.

    Every public method is collective: all ranks call it at the same step. With an S3 tier, rank
    0 hands each committed checkpoint to ``uploader`` (the other ranks have none) and, at resume,
    restores from S3 when ``root`` holds no complete checkpoint.
    """

    def __init__(self, cfg: CheckpointConfig, root: Path, info: DistInfo, state: TrainingState,
                 identity: dict, say: Callable[[str], None],
                 engine_factory: Optional[Callable[[], Engine]] = None,
                 uploader: Optional[s3_tier.Uploader] = None):
        self.cfg, self.root, self.info, self.state = cfg, root, info, state
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
            return s3_tier.check_access(self.cfg.s3)
        except Exception as exc:
            self.say(f"warning: S3 is not reachable at start ({s3_tier.describe_error(exc)}); training goes on "
                     "and uploads are retried")
            return None

    # -- resume --
    def find_resume_point(self) -> Optional[store.CheckpointInfo]:
        if self.cfg.resume_from:
            path = Path(self.cfg.resume_from)
            manifest = store.read_manifest(path)
            if manifest is None:
                raise ConfigError(f"checkpoint.resume_from={str(path)!r} is not a complete checkpoint "
                                  f"(no readable {store.MARKER} manifest); name a step_N directory")
            return store.CheckpointInfo(int(manifest["step"]), path, manifest)
        if not self.cfg.resume:
            return None
        committed, unusable = store.scan(self.root)
        if self.info.rank == 0:
            for path in unusable:
                self.say(f"warning: skipping {path}: not a complete checkpoint (left in place; "
                         "delete it once you no longer need it)")
        return committed[-1] if committed else None

    def resume(self) -> Optional[int]:
        """Load the newest complete checkpoint (or ``resume_from``); returns its step or None.

        A checkpoint that fails to load is reported and the next older one is tried.
        """
        self._maybe_restore_from_s3()
        candidate = self.find_resume_point()
        tried: list[str] = []
        while candidate is not None:
            self._check_compatible(candidate)
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
            older = [c for c in store.scan(self.root)[0] if c.step < candidate.step]
            candidate = older[-1] if older else None
        if tried:
            raise CheckpointError("no loadable checkpoint; tried:\n  " + "\n  ".join(tried))
        self._adopt_local()
        return None

    def _maybe_restore_from_s3(self) -> None:
        """Collective. Rank 0 alone downloads (``checkpoint.dir`` is shared by every node); the
        others wait in the broadcast, whose start-up timeout is ``dist.init_timeout_s``."""
        s3 = self.cfg.s3
        if not (s3.uri and s3.restore and self.cfg.resume and not self.cfg.resume_from):
            return
        outcome: Optional[dict] = None
        if self.info.rank == 0 and not store.scan(self.root)[0]:
            try:
                info = s3_tier.restore_newest(s3, self.root, self.say)
                outcome = {"step": info.step, "uri": s3_tier.parse_s3_uri(s3.uri).uri(info.path.name)} if info else None
            except Exception as exc:
                outcome = {"error": f"no complete checkpoint in {self.root} and restoring from checkpoint.s3.uri="
                                    f"{s3.uri!r} failed: {s3_tier.describe_error(exc)}. The start is retried by the "
                                    "restart layers; set checkpoint.s3.restore=false to start without S3"}
        outcome = self._broadcast(outcome)
        if outcome and "error" in outcome:
            raise CheckpointError(outcome["error"])
        self.restored_from_s3 = outcome

    def _adopt_local(self) -> None:
        """Rank 0: queue local checkpoints an earlier run may not have uploaded (not when this run
        ignores them: ``checkpoint.resume=false``)."""
        if self.uploader is not None and self.cfg.resume:
            self.uploader.adopt(store.scan(self.root)[0])

    def _check_compatible(self, ckpt: store.CheckpointInfo) -> None:
        m = ckpt.manifest
        if m.get("shape_digest") != self.identity["shape_digest"]:
            raise ConfigError(
                f"checkpoint {ckpt.path} holds a different model ({m.get('model')}, {m.get('num_params'):,} "
                f"parameters) than this run ({self.identity['model']}, {self.identity['num_params']:,}); "
                "use the same model settings, or a fresh checkpoint.dir")
        if m["world_size"] != self.info.world_size and m["mode"] == "torch-async":
            raise ConfigError(
                f"checkpoint {ckpt.path} was written by checkpoint.mode=torch-async at world size "
                f"{m['world_size']}; it can only be resumed at that world size (this run has "
                f"{self.info.world_size}). Resume at {m['world_size']} ranks, or use async/sync checkpoints, "
                "which reshard")

    def _try_load(self, ckpt: store.CheckpointInfo) -> Optional[str]:
        same_world = ckpt.manifest["world_size"] == self.info.world_size
        error = None
        try:
            sd = self.state.state_dict(with_rng=same_world)
            if ckpt.manifest["mode"] == "torch-async":
                loaded = torch.load(ckpt.path / f"rank{self.info.rank:05d}.pt", map_location="cpu", weights_only=False)
                sd = from_local(loaded, sd)
            else:
                dcp.load(sd, checkpoint_id=str(ckpt.path))
            self.state.load_state_dict(sd)
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
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
                    "created_unix": time.time(), "nvrx_version": compat.NVRX_VERSION,
                    "torch_version": torch.__version__}
        final = store.commit(pending["dir"], manifest)
        if self.uploader is not None:
            self.uploader.submit(pending["step"], final)
        self.apply_retention()
        return {"step": pending["step"], "mode": self.engine.mode, "stall_s": pending["stall_s"],
                "write_s": write_s, "bytes": nbytes, "path": str(final)}

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
