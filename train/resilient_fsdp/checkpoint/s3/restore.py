"""The restore from S3 at start, split across every rank.

Rank 0 picks the newest complete checkpoint under ``checkpoint.s3.uri`` and prepares the partial
download directory in ``checkpoint.dir`` (an earlier start's partial download of the same
checkpoint is resumed, not discarded); every rank then downloads its share of the files (largest
first, balanced by bytes, so a large restore spreads over every node's network), checks each
against the marker's size and the checksum recorded when it was written, and reports through the
rendezvous store. Rank 0 waits there for every rank, with ``checkpoint.s3.restore_timeout_s`` as
its deadline (not the collective timeout), commits the download like a freshly written
checkpoint and posts the outcome, which the other ranks wait for with the same deadline. A
download checked against its checksums is remembered as verified, so the load that follows does
not read it a second time to verify it (:class:`..integrity.VerifiedHere`).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch.distributed as dist

from ...config import CheckpointConfig
from .. import integrity, store
from ..group import RankGroup
from ..store import CheckpointError
from .client import describe_error, make_client, parse_s3_uri
from .remote import checkpoint_id, newest_complete
from .transfer import commit_download, download_files, prepare_download

_POLL_S = 0.2


@dataclass(frozen=True)
class Restored:
    """The checkpoint a start downloaded from S3."""

    step: int
    uri: str

    def as_dict(self) -> dict:
        return asdict(self)


def restores_from_s3(cfg: CheckpointConfig) -> bool:
    """Whether this start may restore from S3 (an S3 tier, restore on, resuming the newest)."""
    return bool(cfg.s3.uri and cfg.s3.restore and cfg.resume and not cfg.resume_from)


def plan_restore(cfg: CheckpointConfig, root: Path, say: Callable[[str], None]) -> Optional[dict]:
    """Rank 0, when ``root`` holds no complete checkpoint: ``{"s3": plan}`` for the newest complete
    checkpoint under the prefix, or None when there is none. Raises when S3 fails."""
    s3 = cfg.s3
    loc = parse_s3_uri(s3.uri)
    try:
        found = newest_complete(make_client(s3), loc, say=say)
    except Exception as exc:
        raise RuntimeError(
            f"no complete checkpoint in {root} and listing checkpoint.s3.uri={s3.uri!r} failed: "
            f"{describe_error(exc)}. The start is retried by the restart layers; set "
            "checkpoint.s3.restore=false to start without S3"
        ) from exc
    if found is None:
        say(f"no complete checkpoint under {s3.uri}: starting from scratch")
        return None
    remote, manifest = found
    uri = loc.uri(store.committed_name(remote.step))
    root.mkdir(parents=True, exist_ok=True)
    partial, present = prepare_download(root, remote.step, checkpoint_id(manifest), uri)
    total = sum(manifest["files"].values())
    say(
        f"no complete checkpoint in {root}: restoring step {remote.step} from {uri}/ ({len(manifest['files'])} files, "
        f"{total / 1e6:.1f} MB, split across the ranks)"
        + (f"; resuming an earlier partial download ({present} file(s) there)" if present else "")
    )
    return {
        "s3": {
            "step": remote.step,
            "uri": uri,
            "manifest": manifest,
            "partial": str(partial),
            "token": uuid.uuid4().hex,
        }
    }


def restore_collectively(
    group: RankGroup, checkpoint: CheckpointConfig, plan: dict, say: Callable[[str], None]
) -> Restored:
    """Every rank: download this rank's share of ``plan``; rank 0 commits. Raises CheckpointError,
    the same on every rank, when any rank failed."""
    cfg, rank, world = checkpoint.s3, group.rank, group.world_size
    kv = group.store()
    key = f"resilient_fsdp/s3-restore/{plan['token']}"
    manifest, partial = plan["manifest"], Path(plan["partial"])
    mine = integrity.share({n: {"bytes": b} for n, b in manifest["files"].items()}, world, rank)
    t0 = time.perf_counter()
    error = ""
    try:
        download_files(
            make_client(cfg), cfg, parse_s3_uri(cfg.uri), manifest, mine, partial, verify=checkpoint.verify != "never"
        )
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the restore everywhere
        error = f"rank {rank}: {describe_error(exc)}"
    kv.set(f"{key}/rank{rank}", error)
    if error:
        kv.add(f"{key}/failed", 1)
    kv.add(f"{key}/done", 1)
    deadline = time.monotonic() + cfg.restore_timeout_s
    if rank == 0:
        outcome = _finish(kv, key, world, deadline, plan, partial)
        kv.set(f"{key}/outcome", json.dumps(outcome))
    else:
        try:
            kv.wait([f"{key}/outcome"], timedelta(seconds=cfg.restore_timeout_s))
            outcome = json.loads(kv.get(f"{key}/outcome"))
        except Exception as exc:  # noqa: BLE001 - the store's timeout
            outcome = {
                "error": f"rank 0 did not finish the restore within checkpoint.s3.restore_timeout_s="
                f"{cfg.restore_timeout_s:g} ({type(exc).__name__})"
            }
    if "error" in outcome:
        raise CheckpointError(
            f"restoring step {plan['step']} from {plan['uri']}/ failed: {outcome['error']}. The "
            "partial download is kept and resumed by the next start; set "
            "checkpoint.s3.restore=false to start without S3"
        )
    if checkpoint.verify != "never":  # every rank checked its share: loading need not read it to verify
        integrity.verified_here.remember(Path(outcome["path"]), manifest)
    seconds = time.perf_counter() - t0
    total = sum(manifest["files"].values())
    say(
        f"restored step {plan['step']} from S3 in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.1f} MB/s "
        f"over {world} rank(s)) -> {outcome['path']}"
    )
    return Restored(plan["step"], plan["uri"])


def _finish(kv: dist.Store, key: str, world: int, deadline: float, plan: dict, partial: Path) -> dict:
    """Rank 0: wait for every rank's report, then commit; the outcome every rank acts on."""
    while int(kv.add(f"{key}/done", 0)) < world:
        if time.monotonic() > deadline:
            return {
                "error": f"only {int(kv.add(f'{key}/done', 0))} of {world} ranks finished their share within "
                "checkpoint.s3.restore_timeout_s"
            }
        time.sleep(_POLL_S)
    if int(kv.add(f"{key}/failed", 0)):
        errors = [e for e in (kv.get(f"{key}/rank{r}").decode() for r in range(world)) if e]
        return {"error": errors[0] + (f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else "")}
    try:
        info = commit_download(partial, plan["manifest"])
    except OSError as exc:
        return {"error": f"committing the download failed: {exc}"}
    return {"path": str(info.path)}
