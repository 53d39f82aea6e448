"""Which checkpoint a start resumes from, its verification, and loading it: :func:`resume`.

Rank 0 alone decides (it lists ``checkpoint.dir`` and S3) and broadcasts what to load, so that
client caching cannot make ranks disagree; ``checkpoint.resume_from`` counts at the job's first
start only (recorded in ``RESUME_FROM``). Every rank verifies its share of the files against
``COMPLETE`` (``checkpoint.verify: load``); one that fails is reported and the next older one
tried. Rank 0 reads the metadata once and broadcasts its bytes (:class:`SharedMetadataReader`);
each rank plans its load alone. At another world size the caller's ``choose_batch`` picks the
batch, and RNG streams start fresh. Called by :meth:`.checkpointer.Checkpointer.resume`.
"""

from __future__ import annotations

import json
import pickle
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, _metadata_fn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import atomic
from ..config import CheckpointConfig, ConfigError
from . import integrity, metadata_index, store
from .group import RankGroup
from .memory import agreement
from .memory.tier import MemoryTier
from .s3 import restore as s3_restore
from .state import CheckpointState, from_local
from .store import CheckpointError

RESUME_RECORD = "RESUME_FROM"


class BatchChoice(Protocol):
    """The batch a resume trains with (``train.elastic_batch``'s choice at this world size)."""

    grad_accum_steps: int
    global_batch: int
    target: int

    @property
    def exact(self) -> bool: ...


# (the checkpoint's manifest, this world size, this run's batch) -> the choice; None: as configured.
ChooseBatch = Callable[[dict, int, dict], Optional[BatchChoice]]


@dataclass(frozen=True)
class Resumed:
    """What a start resumed from (the same on every rank)."""

    step: Optional[int]
    """The step loaded; None: nothing was (a fresh start)."""
    path: Optional[str] = None
    grad_accum_steps: Optional[int] = None
    """The ``train.grad_accum_steps`` the ``train.elastic_batch`` policy chose for this world size,
    when it differs from the configured one."""
    restored_from_s3: Optional[s3_restore.Restored] = None
    """The checkpoint this start downloaded from S3 first, if it did."""
    global_batch_target: Optional[int] = None
    """The run's target global batch, carried by the checkpoint (None: the configured one)."""
    from_memory: bool = False
    """Restored from the memory tier's snapshots, not from a durable checkpoint."""


def resume(
    group: RankGroup,
    cfg: CheckpointConfig,
    root: Path,
    job: str,
    state: CheckpointState,
    identity: dict,
    batch: dict,
    say: Callable[[str], None],
    choose_batch: Optional[ChooseBatch] = None,
    memory: Optional[MemoryTier] = None,
    restoring: Callable[[int, str], None] = lambda _step, _tier: None,
    suspect: Optional[tuple[int, int]] = None,
) -> Resumed:
    """Collective: decide (rank 0), restore from S3 if needed, verify and load; what was loaded.
    ``choose_batch``: the batch a checkpoint resumes with (None: as configured). With ``memory``
    (the memory tier), every rank's snapshots are weighed against the durable choice first.
    ``restoring(step, tier)`` is called as a chosen checkpoint is about to be loaded (a fault's moment).
    ``suspect``: steps ``(after, up_to]`` saved after the replicas last agreed and before they
    differed (:func:`resilient_fsdp.resilience.sdc.suspect_window`): never resumed from."""
    decide_here = (lambda: decide(cfg, root, job, say, suspect)) if group.is_coordinator else (lambda: None)
    plan = _raise_if_error(group.broadcast(decide_here()))
    if memory is not None and suspect is not None:
        dropped = memory.discard_newer_than(suspect[0])
        if dropped and group.is_coordinator:
            say(
                f"memory snapshots of step(s) {', '.join(map(str, dropped))} discarded: saved after the replicas last "
                f"agreed (step {suspect[0]})"
            )
    if memory is not None:
        if cfg.resume and not plan.get("pinned"):
            durable = (plan.get("candidate") or plan.get("s3") or {}).get("step")
            done = from_memory(group, memory, state, durable, batch, say, restoring)
            if done is not None:
                return done
        memory.release()  # what the memory tier read and did not load frees its room for this load
    restored = None
    if plan.get("s3"):
        restored = s3_restore.restore_collectively(group, cfg, plan["s3"], say)
        plan = _raise_if_error(group.broadcast(decide_here()))
    candidate = _info(plan.get("candidate"))
    tried: list[str] = []
    while candidate is not None:
        check_compatible(candidate, identity, group.world_size)
        choice = choose_batch(candidate.manifest, group.world_size, batch) if choose_batch is not None else None
        error = _verify(group, cfg, candidate)
        if error is None:
            restoring(candidate.step, "durable")
            error = _load(group, state, candidate)
        if error is None:
            _say_resumed(say, candidate, group.world_size, choice, batch)
            accum = choice.grad_accum_steps if choice is not None else None
            changed = accum if accum is not None and accum != batch.get("grad_accum_steps") else None
            return Resumed(
                candidate.step,
                str(candidate.path),
                changed,
                restored_from_s3=restored,
                global_batch_target=choice.target if choice is not None else None,
            )
        tried.append(f"{candidate.path}: {error}")
        say(f"warning: cannot load {candidate.path} ({error}); trying an older checkpoint")
        if plan.get("pinned"):  # resume_from: no older checkpoint stands in for the one asked for
            break
        candidate = _info(group.broadcast(_as_dict(older_than(root, candidate.step)) if group.is_coordinator else None))
    if tried:
        raise CheckpointError("no loadable checkpoint; tried:\n  " + "\n  ".join(tried))
    return Resumed(None, restored_from_s3=restored)


def from_memory(
    group: RankGroup,
    memory: MemoryTier,
    state: CheckpointState,
    durable_step: Optional[int],
    batch: dict,
    say: Callable[[str], None],
    restoring: Callable[[int, str], None] = lambda _step, _tier: None,
) -> Optional[Resumed]:
    """Collective: restore every rank from its memory snapshot when :func:`.memory.agreement.decide`
    says every rank can, at a step no older than the durable choice (``durable_step``); None to
    go on to the durable checkpoint (no such step, or a rank whose slot failed its checks)."""
    t0 = time.perf_counter()
    reports = group.all_gather(memory.report())
    decision = agreement.decide(reports, group.world_size, durable_step)
    if not decision.from_memory:
        if any(r.own for r in reports):
            say(f"memory checkpoints not used: {decision.why}; resuming from the durable checkpoint")
        return None
    if decision.replicas_to_send():
        moved = memory.exchange(decision)
        errors = [e for e in group.all_gather(moved) if e]
        if errors:
            say(
                f"memory checkpoints not used: step {decision.step} needs replicas from peers, and {errors[0]}; "
                "resuming from the durable checkpoint"
            )
            return None
    restoring(decision.step, "memory")
    error = memory.restore(state, decision.step)
    outcomes = group.all_gather((error, memory.restore_phases, memory.restore_cpu_s, memory.read_ahead_s))
    errors = [e for e, *_ in outcomes if e]
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        say(
            f"warning: memory checkpoint of step {decision.step} not loaded: {errors[0]}{more}; resuming from the "
            "durable checkpoint"
        )
        return None
    saved = (memory.newest_of(decision.step).meta or {}).get("batch") or {}
    accum = saved.get("grad_accum_steps")
    slowest = max(range(len(outcomes)), key=lambda r: sum(outcomes[r][1].values()))
    where = f"rank {group.rank}: {_phases(*outcomes[group.rank][1:])}"
    if slowest != group.rank:
        where += f"; the slowest, rank {slowest}: {_phases(*outcomes[slowest][1:])}"
    say(
        f"resumed from memory: step {decision.step} on every rank ({decision.why}) in "
        f"{time.perf_counter() - t0:.2f} s ({where})"
    )
    return Resumed(
        decision.step,
        str(memory.slots.dir),
        accum if accum is not None and accum != batch.get("grad_accum_steps") else None,
        global_batch_target=saved.get("global_batch_target"),
        from_memory=True,
    )


def _phases(phases: dict, cpu_s: Optional[float], read_ahead_s: Optional[float]) -> str:
    """A rank's restore from memory by phase, the CPU time of its load (a load slower than that
    waited for the CPU) and its read-ahead beside the build."""
    said = ", ".join(f"{name} {s:.2f} s" for name, s in phases.items())
    if cpu_s is not None:
        said += f" (the load {cpu_s:.2f} s on the CPU)"
    return said if read_ahead_s is None else f"{said}, read ahead beside the build in {read_ahead_s:.2f} s"


def _raise_if_error(plan: dict) -> dict:
    """Every rank raises the error rank 0's decision met, with its type: a ConfigError (bad
    configuration, exit 2) or a CheckpointError (the start fails and is retried)."""
    if plan.get("error"):
        raise (ConfigError if plan.get("config") else CheckpointError)(plan["error"])
    return plan


def _as_dict(info: Optional[store.CheckpointInfo]) -> Optional[dict]:
    return None if info is None else {"step": info.step, "path": str(info.path), "manifest": info.manifest}


def _info(d: Optional[dict]) -> Optional[store.CheckpointInfo]:
    return None if d is None else store.CheckpointInfo(int(d["step"]), Path(d["path"]), d["manifest"])


def decide(
    cfg: CheckpointConfig, root: Path, job: str, say: Callable[[str], None], suspect: Optional[tuple[int, int]] = None
) -> dict:
    """Rank 0: ``{"candidate": ..., "pinned": bool}``, ``{"s3": ...}`` (restore first) or
    ``{"error": message, "config": bool}``. Never raises: the error travels in the broadcast, so
    every rank raises it at once instead of waiting for rank 0's abort or the collective timeout."""
    try:
        if cfg.resume_from:
            return _resume_from(cfg, root, job, say)
        if not cfg.resume:
            return {"candidate": None}
        if suspect is not None:
            for path in store.set_aside_newer(root, suspect[0], kind="suspect", up_to=suspect[1]):
                say(
                    f"set aside {path}: saved after the replicas last agreed (step {suspect[0]}); kept, never "
                    "resumed from"
                )
        committed, unusable = store.scan(root)
        for path in unusable:
            say(
                f"warning: skipping {path}: not a complete checkpoint (left in place; "
                "delete it once you no longer need it)"
            )
        if not committed and s3_restore.restores_from_s3(cfg):
            found = s3_restore.plan_restore(cfg, root, say)
            if found is not None:
                return found
        return {"candidate": _as_dict(committed[-1] if committed else None)}
    except ConfigError as exc:
        return {"error": str(exc), "config": True}
    except Exception as exc:  # an S3 failure: the start fails, the restart layers retry it
        return {"error": str(exc), "config": False}


def _resume_from(cfg: CheckpointConfig, root: Path, job: str, say: Callable[[str], None]) -> dict:
    path = Path(cfg.resume_from).resolve()
    # RESUME_FROM first: once this job applied resume_from, the target may be gone (retention
    # deletes it like any checkpoint once newer ones are committed) and is not needed.
    try:
        record = json.loads((root / RESUME_RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("job") == job and record.get("resume_from") == str(path) and isinstance(record.get("step"), int):
        return _after_rewind(cfg, root, path, record["step"], say)
    manifest = store.read_manifest(path)
    if manifest is None:
        raise ConfigError(
            f"checkpoint.resume_from={cfg.resume_from!r} is not a complete checkpoint "
            f"(no readable {store.MARKER} manifest); name a step_N directory"
        )
    step = int(manifest["step"])
    moved = store.set_aside_newer(root, step)
    for p in moved:
        say(f"set aside {p}: newer than checkpoint.resume_from (step {step}); kept, never resumed from")
    atomic.write_json(
        root / RESUME_RECORD,
        {
            "job": job,
            "resume_from": str(path),
            "step": step,
            "applied_unix": time.time(),
            "set_aside": [str(p) for p in moved],
        },
    )
    return {"candidate": _as_dict(store.CheckpointInfo(step, path, manifest)), "pinned": True}


def _after_rewind(cfg: CheckpointConfig, root: Path, path: Path, step: int, say: Callable[[str], None]) -> dict:
    """A later start of the job that applied ``resume_from`` (step ``step``): the job's newest
    committed checkpoint, or the target itself while nothing newer was committed."""
    committed = store.scan(root)[0]
    newest = committed[-1] if committed else None
    if newest is not None and newest.step >= step and newest.path != path:
        say(
            f"checkpoint.resume_from={cfg.resume_from} was applied at this job's first start; resuming "
            f"from the job's newest checkpoint, step {newest.step}"
        )
        return {"candidate": _as_dict(newest)}
    manifest = store.read_manifest(path)
    if manifest is not None and manifest.get("step") == step:
        return {"candidate": _as_dict(store.CheckpointInfo(step, path, manifest)), "pinned": True}
    raise ConfigError(
        f"checkpoint.resume_from={cfg.resume_from!r} was applied at this job's first start ({root / RESUME_RECORD}), "
        f"but it is no longer a complete checkpoint and this job committed nothing at or after its step {step} "
        f"in checkpoint.dir={str(root)!r}; unset checkpoint.resume_from to resume from the newest checkpoint there, "
        "or name another complete step_N directory"
    )


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
            "use the same model settings, or a fresh checkpoint.dir"
        )
    if m["world_size"] != world_size and m["mode"] == "torch-async":
        raise ConfigError(
            f"checkpoint {ckpt.path} was written by checkpoint.mode=torch-async at world size "
            f"{m['world_size']}; it can only be resumed at that world size (this run has "
            f"{world_size}). Resume at {m['world_size']} ranks, or use async/sync checkpoints, "
            "which reshard"
        )
    # A one-file-per-rank checkpoint holds each rank's shards as that rank's mesh cut them.
    written_group = m.get("shard_group_size", m["world_size"])
    group = identity.get("shard_group_size", world_size)
    if m["mode"] == "torch-async" and written_group != group:
        raise ConfigError(
            f"checkpoint {ckpt.path} was written by checkpoint.mode=torch-async with parameters sharded over "
            f"{written_group} ranks; this run shards them over {group} (dist.shard_group_size). Set "
            f"dist.shard_group_size={written_group if written_group != m['world_size'] else 0} to resume it, or "
            "use async/sync checkpoints, which reshard"
        )


def _verify(group: RankGroup, cfg: CheckpointConfig, ckpt: store.CheckpointInfo) -> Optional[str]:
    """Collective: every rank checks its share of the files; the first problem, named, or None.
    Skipped when every rank remembers verifying ``ckpt`` (or downloading it, checked) already."""
    files = ckpt.manifest.get("checksums")
    if cfg.verify != "load" or not files:
        return None
    # Agreed by every rank: a rank that joined the job since (a fresh process) remembers nothing.
    if group.max(0.0 if (ckpt.path, ckpt.manifest) in integrity.verified_here else 1.0) == 0.0:
        return None
    try:
        # A pass of its own, not a hash of what loading reads: DCP reads only the byte ranges each
        # rank's plan needs (at another world size, slices of many files), so no rank reads whole files.
        problems = integrity.verify(ckpt.path, files, integrity.share(files, group.world_size, group.rank))
    except Exception as exc:  # noqa: BLE001
        problems = [f"verification failed: {type(exc).__name__}: {exc}"]
    found = [p for part in group.all_gather(problems) for p in part]
    if not found:
        integrity.verified_here.remember(ckpt.path, ckpt.manifest)
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"integrity check failed: {found[0]}{more}"


def _load(group: RankGroup, state: CheckpointState, ckpt: store.CheckpointInfo) -> Optional[str]:
    """Collective: load ``ckpt`` on every rank; the error, if any rank failed."""
    same_world = ckpt.manifest["world_size"] == group.world_size
    reader, error = None, None
    if ckpt.manifest["mode"] != "torch-async":
        reader, error = shared_metadata_reader(group, ckpt.path)
    if error is None:
        error = load(state, ckpt, group.rank, same_world, reader)  # each rank's saved RNG: only at its own layout
    failed = group.max(1.0 if error else 0.0)
    if failed and error is None:
        error = "another rank could not load it"
    return error


class SharedMetadataReader(FileSystemReader):
    """torch DCP's file system reader with the checkpoint's metadata read at most once: handed in
    (broadcast by rank 0), or read by the first :meth:`read_metadata` and kept."""

    def __init__(self, path: Path, metadata: Optional[Metadata] = None):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata files: not shared
            return super().read_metadata(*args, **kwargs)
        if self.metadata is None:
            self.metadata = super().read_metadata()
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # this load's id, as torch's reader sets it
        return self.metadata


def shared_metadata_reader(group: RankGroup, path: Path) -> tuple[Optional[SharedMetadataReader], Optional[str]]:
    """Collective: a reader for ``path`` on every rank holding the metadata rank 0 read (the file
    read once for the job), or the same error on every rank.

    Rank 0 broadcasts the file's bytes, not the object: unpickling hundreds of MB of ``Metadata``
    and pickling it again for the broadcast was rank 0's work alone, with every rank waiting on
    it. Each rank unpickles its copy, rank 0 as well, at the same time (a copy that does not
    unpickle is the same error everywhere)."""
    payload = None
    if group.is_coordinator:
        try:
            index = path / metadata_index.INDEX_FILE
            if index.is_file():  # written by the commit beside .metadata: the same places, read in seconds
                payload = {"index": index.read_bytes()}
            else:
                files = FileSystemReader(path)
                with files.fs.create_stream(files.fs.concat_path(files.path, METADATA_FILE), "rb") as f:
                    payload = {"bytes": f.read()}
        except Exception as exc:  # noqa: BLE001 - reported on every rank; the older checkpoint is tried
            payload = {"error": f"cannot read its DCP metadata: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
    payload = group.broadcast(payload)
    if "error" in payload:
        return None, payload["error"]
    try:
        if "index" in payload:
            metadata = metadata_index.decode(payload["index"])
        else:
            metadata = pickle.loads(payload["bytes"])
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    except Exception as exc:  # noqa: BLE001 - the same bytes fail alike on every rank
        what = metadata_index.INDEX_FILE if "index" in payload else "DCP metadata"
        return None, f"cannot read its {what}: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    return SharedMetadataReader(path, metadata), None


METADATA_FILE = _metadata_fn  # DCP's ``.metadata``, as its file system reader names it


def _say_resumed(
    say: Callable[[str], None], ckpt: store.CheckpointInfo, world_size: int, choice: Optional[BatchChoice], batch: dict
) -> None:
    m = ckpt.manifest
    say(f"resumed from step {ckpt.step} ({ckpt.path}, {m['mode']}, saved at world size {m['world_size']})")
    if m["world_size"] != world_size:
        say(
            f"resharded from world size {m['world_size']} to {world_size}; RNG streams start fresh "
            "(each rank's saved random state belongs to the old layout)"
        )
    if choice is None:
        return
    if choice.exact:
        what = f"keeps the run's global batch of {choice.target} samples per step at world size {world_size}"
    else:
        what = (
            f"global batch {choice.global_batch} samples per step instead of the run's {choice.target} "
            f"(train.elastic_batch=nearest: {world_size} ranks x data.micro_batch_size="
            f"{batch.get('micro_batch_size')} cannot make {choice.target})"
        )
    if choice.grad_accum_steps != batch.get("grad_accum_steps"):
        say(f"train.grad_accum_steps={choice.grad_accum_steps} instead of {batch.get('grad_accum_steps')}: {what}")
    else:
        say(f"train.grad_accum_steps={choice.grad_accum_steps}: {what}")


def load(
    state: CheckpointState,
    ckpt: store.CheckpointInfo,
    rank: int,
    with_rng: bool,
    reader: Optional[FileSystemReader] = None,
) -> Optional[str]:
    """Load ``ckpt`` into ``state`` on this rank (RNG only at the same world size; a DCP checkpoint
    through ``reader``, torch's own when None); the error as one line, or None."""
    try:
        sd = state.state_dict(with_rng=with_rng)
        if ckpt.manifest["mode"] == "torch-async":
            loaded = torch.load(ckpt.path / f"rank{rank:05d}.pt", map_location="cpu", weights_only=False)
            sd = from_local(loaded, sd)
        else:
            with warnings.catch_warnings():  # DCP's note that it loads in one process: the point here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                # A load plan needs no other rank (DCP's global load plan is the local plans as
                # they are): each rank plans alone, and no plan goes through rank 0. The ranks
                # agree on the outcome afterwards (_load).
                dcp.load(sd, checkpoint_id=str(ckpt.path), storage_reader=reader, no_dist=True)
        state.load_state_dict(sd)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return None
