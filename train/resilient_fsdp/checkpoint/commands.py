"""``resilient-fsdp checkpoints list|verify|export|pull|push``: the operator's view of both checkpoint tiers.

``list`` shows local and S3 checkpoints side by side; ``verify`` checks every file against its
manifest's checksum; ``export`` writes a committed checkpoint's model as a Hugging Face directory;
``pull`` downloads one from S3, committed atomically as the job commits; ``push`` uploads one,
marker last. They read the job's configuration (``--config``/``--set``), so they point where the
job does; ``--run-dir``, ``--uri`` and ``--endpoint-url`` are shorthands. Nothing is deleted here.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import Config, ConfigError, load_config
from ..hf import export as hf_export
from . import integrity, store
from .s3 import client as s3_client
from .s3 import remote as s3_remote
from .s3 import transfer as s3_transfer


def add_parser(sub: argparse._SubParsersAction, add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "checkpoints",
        help="list, pull or push checkpoints between checkpoint.dir and S3",
        description=__doc__.split("\n")[0],
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    specs = {
        "list": "local checkpoints and their state (and S3's, side by side, when checkpoint.s3.uri is set)",
        "verify": "check every file of the local checkpoints (or --step) against its manifest's checksum",
        "export": "write a checkpoint's model as a Hugging Face directory (safetensors, config.json, tokenizer)",
        "pull": "download the newest complete S3 checkpoint (or --step) into checkpoint.dir",
        "push": "upload the newest local checkpoint (or --step) to checkpoint.s3.uri",
    }
    handlers = {"list": cmd_list, "verify": cmd_verify, "export": cmd_export, "pull": cmd_pull, "push": cmd_push}
    for name, text in specs.items():
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument(
            "--run-dir",
            help="a run directory (its checkpoints/ and config.yaml), or a directory of "
            "step_N checkpoints"
            + (" (created when missing)" if name == "pull" else "")
            + "; another checkpoint directory: --set checkpoint.dir=DIR",
        )
        a.add_argument("--uri", help="shorthand for --set checkpoint.s3.uri=s3://bucket/prefix")
        a.add_argument(
            "--endpoint-url", help="shorthand for --set checkpoint.s3.endpoint_url=URL (S3-compatible stores)"
        )
        if name == "list":
            a.add_argument("--json", action="store_true", help="print JSON instead of a table")
        else:
            a.add_argument(
                "--step", type=int, help="this step instead of " + ("every one" if name == "verify" else "the newest")
            )
        if name == "export":
            a.add_argument("--out", required=True, help="the directory to write (new, or empty)")
            a.add_argument("--dtype", choices=sorted(hf_export.DTYPES), help="cast the weights (default: as trained)")
            a.add_argument(
                "--max-shard-gb",
                type=float,
                default=hf_export.DEFAULT_SHARD_BYTES / 1024**3,
                help="largest safetensors file (GiB); larger models are split with an index",
            )
            a.add_argument(
                "--tokenizer", help="tokenizer file or directory to include (default: the run's, from data prepare)"
            )
            a.add_argument(
                "--hf-config",
                help="the config.json of a model.hf_config run whose run directory lacks model/config.json",
            )
        if name == "push":
            a.add_argument(
                "--replace",
                action="store_true",
                help="replace a different commit of the same step already complete in S3",
            )
        add_config_args(a)
        a.set_defaults(command="checkpoints", handler=handlers[name])


def _config(args: argparse.Namespace, need_s3: bool = True) -> Config:
    overrides = list(args.overrides)
    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None and not Path(run_dir).is_dir() and getattr(args, "action", None) != "pull":
        raise ConfigError(
            f"--run-dir {run_dir}: no such directory; pass a run directory (its checkpoints/ and "
            "config.yaml) or a directory of step_N checkpoints"
        )
    if run_dir is not None:
        saved = Path(run_dir) / "config.yaml"
        if args.config is None and saved.is_file():
            args.config = str(saved)  # the run's own model and data, for export
        overrides += [f"run_dir={json.dumps(run_dir)}", f"checkpoint.dir={json.dumps(str(checkpoints_in(run_dir)))}"]
    for flag, key in (("uri", "checkpoint.s3.uri"), ("endpoint_url", "checkpoint.s3.endpoint_url")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")  # quoted: a path or URL stays a string
    cfg = load_config(args.config, overrides)
    if need_s3 and not cfg.checkpoint.s3.uri:
        raise ConfigError(
            "checkpoint.s3.uri is not set: pass --uri s3://bucket/prefix (or --set checkpoint.s3.uri=...)"
        )
    return cfg


class _Bar:
    """A byte progress bar (tqdm, shown on terminals only) fed from s3transfer's threads."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self._lock = threading.Lock()
        self._bar = tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, file=sys.stderr
        )

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def close(self) -> None:
        self._bar.close()


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e6:.1f} MB in {seconds:.1f} s ({nbytes / 1e6 / max(seconds, 1e-9):.1f} MB/s)"


def checkpoints_in(run_dir: str) -> Path:
    """The checkpoint directory ``--run-dir`` names: its ``checkpoints/``, or itself."""
    p = Path(run_dir)
    return p / "checkpoints" if (p / "checkpoints").is_dir() or not p.is_dir() else p


def cmd_list(args: argparse.Namespace) -> int:
    cfg = _config(args, need_s3=False)
    root, uri = cfg.checkpoint_dir, cfg.checkpoint.s3.uri
    if not root.is_dir() and not uri:
        raise ConfigError(f"{root} is not a directory: pass --run-dir with a run directory or a checkpoint directory")
    local, unusable = store.scan(root)
    loc = s3_client.parse_s3_uri(uri) if uri else None
    remote = s3_remote.list_remote(s3_client.make_client(cfg.checkpoint.s3), loc) if loc else []
    rows: dict[int, dict[str, Any]] = {}
    for c in local:
        rows.setdefault(c.step, {"step": c.step})["local"] = {"path": str(c.path), "bytes": store.dir_bytes(c.path)}
    for r in remote:
        rows.setdefault(r.step, {"step": r.step})["s3"] = {
            "uri": loc.uri(store.committed_name(r.step)) + "/",
            "complete": r.complete,
            "files": len(r.files),
            "bytes": sum(r.files.values()),
            "last_modified": r.last_modified,
        }
    aside = {kind: [{"step": step, "path": str(p)} for step, p in found] for kind, found in store.aside(root).items()}
    for c in local:
        rows[c.step]["local"].update(
            {
                "files": len(c.manifest.get("checksums", {})),
                "mode": c.manifest.get("mode"),
                "world_size": c.manifest.get("world_size"),
                "created_unix": c.manifest.get("created_unix"),
            }
        )
    listing = {
        "dir": str(root),
        "uri": uri,
        "checkpoints": [rows[s] for s in sorted(rows)],
        "local_unusable": [str(p) for p in unusable],
        "local_aside": aside,
    }
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    print(f"local: {root}" + (f"\nS3:    {uri}" if uri else ""))
    if uri:
        print(f"{'step':>10}  {'local':<10} {'S3':<12} {'size':>10}  S3 last modified (UTC)")
    else:
        print(f"{'step':>10}  {'state':<10} {'files':>5} {'size':>10}  {'mode':<11} {'ranks':>5}  committed (UTC)")
    for row in listing["checkpoints"]:
        s3 = row.get("s3")
        if not uri:
            c = row["local"]
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c["created_unix"])) if c.get("created_unix") else ""
            print(
                f"{row['step']:>10}  {'committed':<10} {c['files']:>5} {c['bytes'] / 1e6:>7.1f} MB  "
                f"{c.get('mode') or '?':<11} {c.get('world_size') or '?':>5}  {when}"
            )
            continue
        state = "-" if s3 is None else ("complete" if s3["complete"] else "INCOMPLETE")
        size = (row.get("local") or s3 or {}).get("bytes", 0)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s3["last_modified"])) if s3 else ""
        print(f"{row['step']:>10}  {'yes' if 'local' in row else '-':<10} {state:<12} {size / 1e6:>8.1f} MB  {when}")
    for path in unusable:
        print(f"not a complete checkpoint (left in place): {path}")
    what = {
        "superseded": "an older commit of step {step}, kept until retention passes its step",
        "abandoned": "step {step} of a timeline abandoned by checkpoint.resume_from (never deleted by the job)",
        "suspect": "step {step}, saved after the replicas last agreed and before they differed (silent data "
        "corruption suspected): never resumed from, never deleted by the job",
        "deleting": "being deleted by retention",
    }
    for kind, entries in aside.items():
        for e in entries:
            print(f"{kind}: {e['path']}: {what[kind].format(step=e['step'])}")
    if any(r.get("s3", {}).get("complete") is False for r in listing["checkpoints"]):
        print(
            "INCOMPLETE: no COMPLETE marker (an upload in progress or cut off): never restored, never deleted by "
            "retention; the job re-uploads its own, or delete the prefix yourself"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    cfg = _config(args, need_s3=False)
    root = cfg.checkpoint_dir
    committed, unusable = store.scan(root)
    chosen = [c for c in committed if args.step is None or c.step == args.step]
    if not chosen:
        what = f"step {args.step}" if args.step is not None else "committed checkpoint"
        print(f"error: no {what} in {root}", file=sys.stderr)
        return 1
    bad = 0
    for c in chosen:
        problems = damage(c)
        size = sum(int(e.get("bytes", 0)) for e in c.manifest.get("checksums", {}).values())
        if not c.manifest.get("checksums"):
            print(f"step {c.step}: its {store.MARKER} records no checksums; nothing to verify it against")
        elif problems:
            bad += 1
            print(f"step {c.step}: DAMAGED ({c.path})")
            for line in problems:
                print(f"  {c.path / line.split(':', 1)[0]}: {line.split(':', 1)[1].strip()}")
        else:
            print(
                f"step {c.step}: ok, {len(c.manifest.get('checksums', {}))} files, {size / 1e6:.1f} MB match their "
                f"{integrity.ALGORITHM} checksums"
            )
    for path in unusable:
        print(f"not a complete checkpoint (never loaded, left in place): {path}")
    if bad:
        print(
            f"error: {bad} of {len(chosen)} checkpoint(s) damaged; the job skips a damaged one for the one before it "
            "(checkpoint.verify=load)",
            file=sys.stderr,
        )
    return 1 if bad else 0


def damage(ckpt: store.CheckpointInfo) -> list[str]:
    """Every file of ``ckpt`` that does not match its manifest, one line each (``name: what``);
    none for a manifest that records no checksums."""
    files = ckpt.manifest.get("checksums") or {}
    return integrity.verify(ckpt.path, files, sorted(files))


def _intact(root: Path, step: Optional[int], not_done: str) -> Optional[store.CheckpointInfo]:
    """The newest committed checkpoint in ``root`` (or ``step``), its files matching its manifest;
    None, with the reason printed, when there is none or it is damaged."""
    committed, _ = store.scan(root)
    chosen = [c for c in committed if step is None or c.step == step]
    if not chosen:
        print(f"error: no committed {f'step {step}' if step is not None else 'checkpoint'} in {root}", file=sys.stderr)
        return None
    ckpt = chosen[-1]
    problems = damage(ckpt)
    if problems:
        print(
            f"error: step {ckpt.step} is damaged on the local volume, nothing {not_done}: {ckpt.path}/{problems[0]} "
            "(`resilient-fsdp checkpoints verify` lists every bad file)",
            file=sys.stderr,
        )
        return None
    return ckpt


def cmd_export(args: argparse.Namespace) -> int:
    if args.run_dir is None:
        raise ConfigError(
            "checkpoints export needs --run-dir: the run directory (its config.yaml says which model "
            "the checkpoint holds)"
        )
    cfg = _config(args, need_s3=False)
    ckpt = _intact(cfg.checkpoint_dir, args.step, "exported")
    if ckpt is None:
        return 1
    t0 = time.perf_counter()
    info = hf_export.export(
        cfg,
        Path(args.run_dir),
        ckpt,
        Path(args.out),
        dtype=args.dtype,
        max_shard_bytes=int(args.max_shard_gb * 1024**3),
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        hf_config=Path(args.hf_config) if args.hf_config else None,
        progress=lambda m: print(m, file=sys.stderr),
    )
    extras = (["config.json"] if info["config"] else []) + info["tokenizer_files"]
    print(
        f"exported step {ckpt.step}: {info['tensors']} tensors, {info['bytes'] / 1e6:.1f} MB in {info['files']} "
        f"safetensors file(s){', ' + ', '.join(extras) if extras else ''} -> {info['out']} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    cfg = _config(args)
    s3, root = cfg.checkpoint.s3, cfg.checkpoint_dir
    loc, client = s3_client.parse_s3_uri(s3.uri), s3_client.make_client(s3)
    found = s3_remote.newest_complete(client, loc, step=args.step, say=lambda m: print(m, file=sys.stderr))
    if found is None:
        what = f"step {args.step}" if args.step is not None else "checkpoint"
        print(f"error: no complete {what} under {s3.uri}", file=sys.stderr)
        return 1
    remote, manifest = found
    existing = store.read_manifest(root / store.committed_name(remote.step))
    if existing is not None:
        print(f"step {remote.step} is already in {root}; nothing pulled")
        return 0
    for stale in s3_transfer.remove_stale_downloads(root):
        print(f"removed {stale}: an earlier, unfinished pull", file=sys.stderr)
    total = sum(manifest["files"].values())
    root.mkdir(parents=True, exist_ok=True)
    bar = _Bar(total, f"pull step {remote.step}")
    t0 = time.perf_counter()
    try:
        info = s3_transfer.download_checkpoint(client, s3, loc, remote, manifest, root, progress=bar)
    finally:
        bar.close()
    print(f"pulled step {remote.step}: {_rate(total, time.perf_counter() - t0)} -> {info.path}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    cfg = _config(args)
    s3, root = cfg.checkpoint.s3, cfg.checkpoint_dir
    info = _intact(root, args.step, "pushed")
    if info is None:
        return 1
    loc, client = s3_client.parse_s3_uri(s3.uri), s3_client.make_client(s3)
    total = sum(s3_remote.local_files(info.path).values())
    bar = _Bar(total, f"push step {info.step}")
    t0 = time.perf_counter()
    try:
        result = s3_transfer.upload_checkpoint(
            client,
            s3,
            loc,
            info.path,
            replace=args.replace,
            resume=True,
            progress=bar,
            say=lambda m: print(m, file=sys.stderr),
        )
    finally:
        bar.close()
    where = loc.uri(store.committed_name(info.step)) + "/"
    if result["status"] == "already-there":
        print(f"step {info.step} is already complete at {where}; nothing pushed")
    elif result["status"] == "kept-remote":
        print(f"error: {where} holds another commit of step {info.step}; pass --replace to replace it", file=sys.stderr)
        return 1
    else:
        skipped = f", {result['skipped_files']} file(s) already there" if result["skipped_files"] else ""
        print(f"pushed step {info.step}: {_rate(result['bytes'], time.perf_counter() - t0)}{skipped} -> {where}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch; S3 and file errors become one line naming what failed."""
    try:
        return args.handler(args)
    except ConfigError:
        raise
    except Exception as exc:
        print(f"error: {s3_client.describe_error(exc)}", file=sys.stderr)
        return 1
