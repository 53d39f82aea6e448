"""Which checkpoint a start resumes from, its verification, and loading it.

**One decision.** Rank 0 alone looks at ``checkpoint.dir`` (and S3) and broadcasts what to load;
the other ranks never list the directory, so a file system with client caching (EFS, NFS, a
restore that just finished on rank 0) cannot make them disagree.

**``resume_from`` at the job's first start only.** The first start of a job (:mod:`.lease`'s job
id) with ``checkpoint.resume_from`` loads that checkpoint, renames every checkpoint in
``checkpoint.dir`` newer than it to ``*.abandoned-*`` (never deleted, never picked again) and
records this in ``<checkpoint.dir>/RESUME_FROM``. Every later start of the same job resumes from
its newest checkpoint (``resume_from`` itself while nothing newer was committed).

**Verification** (``checkpoint.verify: load``): before loading, every rank checks its share of the
files against the checksums in ``COMPLETE``. A checkpoint that fails verification or loading is
reported, naming the file, and the next older one is tried (not when it was ``resume_from``).

**At another world size** (DCP checkpoints reshard): the global batch is kept by changing
``train.grad_accum_steps``, or the start is refused; each rank's saved RNG streams belong to the
old layout, so they start fresh.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import atomic
from ..config import CheckpointConfig, ConfigError
from . import integrity, store
from .s3 import restore as s3_restore
from .state import CheckpointState, from_local
from .store import CheckpointError

RESUME_RECORD = "RESUME_FROM"


def run(ck: Any) -> Optional[int]:
    """Collective: decide (rank 0), restore from S3 if needed, verify and load; the step or None."""
    rank0 = ck.info.rank == 0
    plan = ck._broadcast(decide(ck.cfg, ck.root, ck.job, ck.say) if rank0 else None)
    if plan.get("error"):
        raise CheckpointError(plan["error"])
    if plan.get("s3"):
        ck.restored_from_s3 = s3_restore.restore_collectively(ck, plan["s3"])
        plan = ck._broadcast(decide(ck.cfg, ck.root, ck.job, ck.say) if rank0 else None)
    candidate = _info(plan.get("candidate"))
    tried: list[str] = []
    while candidate is not None:
        check_compatible(candidate, ck.identity, ck.info.world_size)
        accum = elastic_grad_accum(candidate.manifest, ck.info.world_size, ck.batch)
        error = _verify(ck, candidate) or _load(ck, candidate)
        if error is None:
            _adopt(ck, candidate, accum)
            return candidate.step
        tried.append(f"{candidate.path}: {error}")
        ck.say(f"warning: cannot load {candidate.path} ({error}); trying an older checkpoint")
        if plan.get("pinned"):
            break
        candidate = _info(ck._broadcast(_as_dict(older_than(ck.root, candidate.step)) if rank0 else None))
    if tried:
        raise CheckpointError("no loadable checkpoint; tried:\n  " + "\n  ".join(tried))
    _adopt_local(ck)
    return None


def _as_dict(info: Optional[store.CheckpointInfo]) -> Optional[dict]:
    return None if info is None else {"step": info.step, "path": str(info.path), "manifest": info.manifest}


def _info(d: Optional[dict]) -> Optional[store.CheckpointInfo]:
    return None if d is None else store.CheckpointInfo(int(d["step"]), Path(d["path"]), d["manifest"])


def decide(cfg: CheckpointConfig, root: Path, job: str, say: Callable[[str], None]) -> dict:
    """Rank 0: ``{"candidate": ..., "pinned": bool}``, ``{"s3": ...}`` (restore first) or ``{"error"}``."""
    try:
        if cfg.resume_from:
            return _resume_from(cfg, root, job, say)
        if not cfg.resume:
            return {"candidate": None}
        committed, unusable = store.scan(root)
        for path in unusable:
            say(f"warning: skipping {path}: not a complete checkpoint (left in place; "
                "delete it once you no longer need it)")
        if not committed and s3_restore.restores_from_s3(cfg):
            found = s3_restore.plan_restore(cfg, root, say)
            if found is not None:
                return found
        return {"candidate": _as_dict(committed[-1] if committed else None)}
    except ConfigError:
        raise
    except Exception as exc:  # an S3 failure: the start fails, the restart layers retry it
        return {"error": str(exc)}


def _resume_from(cfg: CheckpointConfig, root: Path, job: str, say: Callable[[str], None]) -> dict:
    path = Path(cfg.resume_from).resolve()
    manifest = store.read_manifest(path)
    if manifest is None:
        raise ConfigError(f"checkpoint.resume_from={cfg.resume_from!r} is not a complete checkpoint "
                          f"(no readable {store.MARKER} manifest); name a step_N directory")
    step = int(manifest["step"])
    try:
        record = json.loads((root / RESUME_RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("job") == job and record.get("resume_from") == str(path):
        committed = store.scan(root)[0]
        newest = committed[-1] if committed else None
        if newest is not None and newest.step >= step and newest.path != path:
            say(f"checkpoint.resume_from={cfg.resume_from} was applied at this job's first start; resuming "
                f"from the job's newest checkpoint, step {newest.step}")
            return {"candidate": _as_dict(newest)}
        return {"candidate": _as_dict(store.CheckpointInfo(step, path, manifest)), "pinned": True}
    moved = store.set_aside_newer(root, step)
    for p in moved:
        say(f"set aside {p}: newer than checkpoint.resume_from (step {step}); kept, never resumed from")
    atomic.write_json(root / RESUME_RECORD, {"job": job, "resume_from": str(path), "step": step,
                                             "applied_unix": time.time(), "set_aside": [str(p) for p in moved]})
    return {"candidate": _as_dict(store.CheckpointInfo(step, path, manifest)), "pinned": True}


def older_than(root: Path, step: int) -> Optional[store.CheckpointInfo]:
    """The newest committed checkpoint before ``step``: the fallback when one fails to load."""
    older = [c for c in store.scan(root)[0] if c.step < step]
    return older[-1] if older else None


def check_compatible(ckpt: store.CheckpointInfo, identity: dict, world_size: int) -> None:
    """Refuse a checkpoint of another model, or a one-file-per-rank one at another world size."""
    m = ckpt.manifest
    if m.get("shape_digest") != identity["shape_digest"]:
        raise ConfigError(
            f"checkpoint {ckpt.path} holds a different model ({m.get('model')}, {m.get('num_params'):,} "
            f"parameters) than this run ({identity['model']}, {identity['num_params']:,}); "
            "use the same model settings, or a fresh checkpoint.dir")
    if m["world_size"] != world_size and m["mode"] == "torch-async":
        raise ConfigError(
            f"checkpoint {ckpt.path} was written by checkpoint.mode=torch-async at world size "
            f"{m['world_size']}; it can only be resumed at that world size (this run has "
            f"{world_size}). Resume at {m['world_size']} ranks, or use async/sync checkpoints, "
            "which reshard")


def elastic_grad_accum(manifest: dict, world_size: int, batch: dict) -> Optional[int]:
    """At another world size: the ``grad_accum_steps`` that keeps the checkpoint's global batch
    (samples per optimizer step), or a ConfigError saying why none does. None: nothing to change."""
    w0, a0, mb0 = manifest.get("world_size"), manifest.get("grad_accum_steps"), manifest.get("micro_batch_size")
    mb, accum = batch.get("micro_batch_size"), batch.get("grad_accum_steps")
    if w0 == world_size or None in (w0, a0, mb0, mb, accum):
        return None
    global_batch = w0 * a0 * mb0
    if global_batch % (world_size * mb):
        fits = [w for w in range(1, global_batch + 1) if global_batch % (w * mb) == 0]
        raise ConfigError(
            f"cannot resume at world size {world_size} with the same global batch: the checkpoint's is "
            f"{global_batch} samples per step (world size {w0} x train.grad_accum_steps={a0} x "
            f"data.micro_batch_size={mb0}), not divisible by {world_size} ranks x data.micro_batch_size={mb}. "
            f"Resume at a world size in {fits[:12]}, or set data.micro_batch_size so that world size x "
            f"data.micro_batch_size divides {global_batch}")
    return global_batch // (world_size * mb)


def _verify(ck: Any, ckpt: store.CheckpointInfo) -> Optional[str]:
    """Collective: every rank checks its share of the files; the first problem, named, or None."""
    files = ckpt.manifest.get("checksums")
    if ck.cfg.verify != "load" or not files:
        return None
    try:
        problems = integrity.verify(ckpt.path, files, integrity.share(files, ck.info.world_size, ck.info.rank))
    except Exception as exc:  # noqa: BLE001
        problems = [f"verification failed: {type(exc).__name__}: {exc}"]
    found = [p for part in ck._all_gather(problems) for p in part]
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"integrity check failed: {found[0]}{more}"


def _load(ck: Any, ckpt: store.CheckpointInfo) -> Optional[str]:
    """Collective: load ``ckpt`` on every rank; the error, if any rank failed."""
    same_world = ckpt.manifest["world_size"] == ck.info.world_size
    error = load(ck.state, ckpt, ck.info.rank, same_world)
    failed = ck._all_reduce_max(1.0 if error else 0.0)
    if failed and error is None:
        error = "another rank could not load it"
    return error


def _adopt(ck: Any, ckpt: store.CheckpointInfo, accum: Optional[int]) -> None:
    m = ckpt.manifest
    ck.resumed_from = {"step": ckpt.step, "path": str(ckpt.path)}
    ck.last_saved_step = ckpt.step
    ck.say(f"resumed from step {ckpt.step} ({ckpt.path}, {m['mode']}, saved at world size {m['world_size']})")
    if m["world_size"] != ck.info.world_size:
        ck.say(f"resharded from world size {m['world_size']} to {ck.info.world_size}; RNG streams start fresh "
               "(each rank's saved random state belongs to the old layout)")
    if accum is not None and accum != ck.batch.get("grad_accum_steps"):
        ck.say(f"train.grad_accum_steps={accum} instead of {ck.batch.get('grad_accum_steps')}: keeps the "
               f"checkpoint's global batch of {m['world_size'] * m['grad_accum_steps'] * m['micro_batch_size']} "
               f"samples per step at world size {ck.info.world_size}")
        ck.grad_accum_steps = accum
        ck.batch = {**ck.batch, "grad_accum_steps": accum}
    _adopt_local(ck)


def _adopt_local(ck: Any) -> None:
    """Queue local checkpoints an earlier run may not have uploaded (not when this run ignores
    them: ``checkpoint.resume=false``)."""
    if ck.uploader is not None and ck.cfg.resume:
        ck.uploader.adopt(ck._broadcast(store.scan(ck.root)[0] if ck.info.rank == 0 else None))


def load(state: CheckpointState, ckpt: store.CheckpointInfo, rank: int, with_rng: bool) -> Optional[str]:
    """Load ``ckpt`` into ``state`` on this rank (RNG only at the same world size); the error as
    one line, or None."""
    try:
        sd = state.state_dict(with_rng=with_rng)
        if ckpt.manifest["mode"] == "torch-async":
            loaded = torch.load(ckpt.path / f"rank{rank:05d}.pt", map_location="cpu", weights_only=False)
            sd = from_local(loaded, sd)
        else:
            dcp.load(sd, checkpoint_id=str(ckpt.path))
        state.load_state_dict(sd)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return None
