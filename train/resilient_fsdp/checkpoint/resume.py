"""Which checkpoint a start resumes from, and loading it on this rank.

The newest committed ``step_N`` in ``checkpoint.dir`` (or ``checkpoint.resume_from``); with an
S3 tier and nothing complete locally, rank 0 first restores the newest complete one from S3
(:func:`restore_from_s3`), committed like a freshly written checkpoint. The collective parts
(agreeing on the outcome) are the checkpointer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..config import CheckpointConfig, ConfigError
from . import store
from .s3 import client as s3_client
from .s3 import transfer as s3_transfer
from .state import CheckpointState, from_local


def find_resume_point(cfg: CheckpointConfig, root: Path, rank: int, say: Callable[[str], None]
                      ) -> Optional[store.CheckpointInfo]:
    """``resume_from``, else the newest committed checkpoint under ``root`` (None: start fresh).
    Rank 0 names every directory it skips."""
    if cfg.resume_from:
        path = Path(cfg.resume_from)
        manifest = store.read_manifest(path)
        if manifest is None:
            raise ConfigError(f"checkpoint.resume_from={str(path)!r} is not a complete checkpoint "
                              f"(no readable {store.MARKER} manifest); name a step_N directory")
        return store.CheckpointInfo(int(manifest["step"]), path, manifest)
    if not cfg.resume:
        return None
    committed, unusable = store.scan(root)
    if rank == 0:
        for path in unusable:
            say(f"warning: skipping {path}: not a complete checkpoint (left in place; "
                "delete it once you no longer need it)")
    return committed[-1] if committed else None


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


def restores_from_s3(cfg: CheckpointConfig) -> bool:
    """Whether this start may restore from S3 (an S3 tier, restore on, resuming the newest)."""
    return bool(cfg.s3.uri and cfg.s3.restore and cfg.resume and not cfg.resume_from)


def restore_from_s3(cfg: CheckpointConfig, root: Path, say: Callable[[str], None]) -> Optional[dict]:
    """Rank 0: when ``root`` holds no complete checkpoint, download the newest complete one from
    S3. Returns ``{"step", "uri"}`` when one was restored, ``{"error"}`` when S3 failed, else None."""
    s3 = cfg.s3
    if store.scan(root)[0]:
        return None
    try:
        info = s3_transfer.restore_newest(s3, root, say)
        return {"step": info.step, "uri": s3_client.parse_s3_uri(s3.uri).uri(info.path.name)} if info else None
    except Exception as exc:
        return {"error": f"no complete checkpoint in {root} and restoring from checkpoint.s3.uri="
                         f"{s3.uri!r} failed: {s3_client.describe_error(exc)}. The start is retried by the "
                         "restart layers; set checkpoint.s3.restore=false to start without S3"}
