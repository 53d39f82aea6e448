"""``resilient-fsdp bench s3``: upload and download throughput, managed transfer vs one stream.

One run, one checkpoint-shaped directory (``--files`` files of random bytes, ``--size-gib`` in
all), timed phases against the same S3 endpoint (:func:`run`). Without ``--endpoint-url`` it
starts moto's standalone S3 server on loopback (the ``test`` extra installs it) with throwaway
credentials; with it, credentials come from boto3's default chain and ``--uri`` names a bucket
and prefix, under which the benchmark writes a fresh sub-prefix and deletes only that.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional

from ..checkpoint import store
from ..checkpoint.s3 import client as s3_client
from ..checkpoint.s3 import remote as s3_remote
from ..checkpoint.s3 import transfer as s3_transfer
from .results import write_results
from ..config import ConfigError, S3Config

CHUNK = 8 * 1024 * 1024


class LocalS3Server:
    """moto's standalone server (``python -m moto.server``) on a free loopback port: a real AWS
    API over HTTP (S3 here; the tests use its ECR and STS too), where no AWS account is reachable."""

    def __init__(self, log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the local S3 server did not start; see {log_path}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class PeakRss:
    """Samples a process's resident memory (the local server's) while the benchmark runs."""

    def __init__(self, pid: Optional[int]):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if pid is not None:
            self._thread.start()

    def _run(self) -> None:
        import psutil

        proc = psutil.Process(self.pid)
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        return self.peak


def make_checkpoint(root: Path, size: int, files: int) -> Path:
    """A committed checkpoint directory of ``files`` random files adding up to ``size`` bytes."""
    import numpy as np

    partial = root / store.partial_name(1, "0000beef")
    partial.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_file = size // files
    for i in range(files):
        with open(partial / f"__{i}_0.distcp", "wb") as f:
            left = per_file
            while left:
                n = min(CHUNK * 8, left)
                f.write(rng.bytes(n))
                left -= n
    return store.commit(partial, {"step": 1, "bench": True, "created_unix": time.time()})


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def single_stream_upload(client: Any, loc: s3_client.S3Location, ckpt: Path) -> int:
    total = 0
    for rel, size in s3_remote.local_files(ckpt).items():
        with open(ckpt / rel, "rb") as f:
            client.put_object(Bucket=loc.bucket, Key=loc.key("single", rel), Body=f)
        total += size
    return total


def single_stream_download(client: Any, loc: s3_client.S3Location, ckpt: Path, dest: Path) -> int:
    total = 0
    dest.mkdir(parents=True)
    for rel in s3_remote.local_files(ckpt):
        body = client.get_object(Bucket=loc.bucket, Key=loc.key("single", rel))["Body"]
        with open(dest / rel, "wb") as f:
            while block := body.read(CHUNK):
                f.write(block)
                total += len(block)
    return total


def delete_prefix(client: Any, loc: s3_client.S3Location) -> None:
    base = loc.key() + "/" if loc.prefix else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=base):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=loc.bucket, Delete={"Objects": keys, "Quiet": True})


class CpuClock:
    """CPU seconds (user + system) of this process (the client, all its threads) and of the
    local server: on a small machine they show which side a transfer is bound by."""

    def __init__(self, server_pid: Optional[int]):
        import psutil

        self.client = psutil.Process()
        self.server = psutil.Process(server_pid) if server_pid else None

    def read(self) -> tuple[float, float]:
        c = self.client.cpu_times()
        s = self.server.cpu_times() if self.server else None
        return c.user + c.system, (s.user + s.system) if s else 0.0


def _timed(clock: CpuClock, fn, *args) -> tuple[float, tuple[float, float], Any]:
    c0, s0 = clock.read()
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    c1, s1 = clock.read()
    return seconds, (c1 - c0, s1 - s0), out


def _same_files(a: Path, b: Path) -> bool:
    names = s3_remote.local_files(a)
    return names == s3_remote.local_files(b) and all(sha256_file(a / n) == sha256_file(b / n) for n in names)


def _rank_upload(
    cfg: S3Config, loc: s3_client.S3Location, ckpt: str, manifest: dict, names: list[str], rank: int, go: Any, out: Any
) -> None:
    """One rank of the parallel upload (a spawned process): ready, wait for the start, upload."""
    client = s3_client.make_client(cfg)
    client.list_buckets()  # connection and credentials before the clock starts
    out.put(("ready", rank))
    go.wait()
    try:
        s3_transfer.upload_share(client, cfg, loc, Path(ckpt), manifest, names, rank, replace=True)
        out.put(("done", rank))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        out.put(("error", f"rank {rank}: {s3_client.describe_error(exc)}"))


def ranks_upload(cfg: S3Config, loc: s3_client.S3Location, ckpt: Path, ranks: int) -> tuple[float, int]:
    """Upload ``ckpt`` from ``ranks`` processes, each its share, then the marker; (seconds, bytes)."""
    import multiprocessing

    from ..checkpoint import integrity

    manifest = store.read_manifest(ckpt)
    sizes = s3_remote.local_files(ckpt)
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_upload,
            args=(
                cfg,
                loc,
                str(ckpt),
                manifest,
                integrity.share({n: {"bytes": b} for n, b in sizes.items()}, ranks, r),
                r,
                go,
                out,
            ),
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    try:
        for _ in range(ranks):
            kind, what = out.get(timeout=120)
            if kind != "ready":
                raise RuntimeError(what)
        t0 = time.perf_counter()
        go.set()
        for _ in range(ranks):
            kind, what = out.get(timeout=3600)
            if kind == "error":
                raise RuntimeError(what)
        client = s3_client.make_client(cfg)
        s3_transfer.put_marker(client, loc, ckpt, manifest)  # every receipt is there: rank 0's last step
        return time.perf_counter() - t0, sum(sizes.values())
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run(args: argparse.Namespace) -> dict:
    """Four timed phases against one endpoint: single stream (one ``PutObject`` / streamed
    ``GetObject`` per file, in turn); managed (the S3 tier's own path: boto3's managed transfer,
    multipart above ``--threshold-mib``, ``--max-concurrency`` requests, marker last); and ``--ranks``
    processes uploading their shares as a job does (:func:`~checkpoint.s3.transfer.upload_share`),
    timed from every process ready until the marker is there. Downloads are checked byte for byte
    outside the timings.
    """
    if args.endpoint_url is not None and args.uri is None:
        raise ConfigError("--endpoint-url needs --uri s3://bucket/prefix (a bucket that exists there)")
    if args.size_gib <= 0 or args.files < 1 or args.ranks < 1:
        raise ConfigError(f"--size-gib={args.size_gib}, --files={args.files} and --ranks={args.ranks} must be positive")
    # A new directory of its own inside --work-dir: removing it afterwards touches nothing else.
    work = Path(args.work_dir).resolve() / time.strftime("bench-s3-%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    server = None
    if args.uri is None:
        try:
            import moto  # noqa: F401  (only to give a clear error)
        except ImportError:
            raise ConfigError(
                "the local S3 server needs moto: pip install -c constraints.txt -e '.[test]', or "
                "pass --endpoint-url and --uri"
            ) from None
        # Throwaway credentials for the throwaway server; they never leave this process tree.
        for k, v in (
            ("AWS_ACCESS_KEY_ID", "bench"),
            ("AWS_SECRET_ACCESS_KEY", "bench"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
        ):
            os.environ[k] = v
        server = LocalS3Server(work.parent / "s3-server.log")
    try:
        endpoint = server.endpoint if server else args.endpoint_url
        # A fresh sub-prefix: the benchmark deletes only what it wrote.
        base = s3_client.parse_s3_uri(args.uri or "s3://bench-s3/run", key="--uri")
        uri = f"s3://{base.bucket}/{base.key(f'bench-s3-{uuid.uuid4().hex[:8]}')}"
        cfg = S3Config(
            uri=uri,
            endpoint_url=endpoint,
            max_concurrency=args.max_concurrency,
            multipart_threshold_mb=args.threshold_mib,
            multipart_chunksize_mb=args.chunk_mib,
            addressing_style="path" if server else "auto",
            max_attempts=3,
        )
        loc = s3_client.parse_s3_uri(uri)
        client = s3_client.make_client(cfg)
        if server:
            client.create_bucket(Bucket=loc.bucket)
        size = int(args.size_gib * 1024**3)
        print(f"writing {args.files} file(s), {size / 1024**3:.2f} GiB of random bytes into {work}", flush=True)
        ckpt = make_checkpoint(work / "source", size, args.files)
        nbytes = sum(s3_remote.local_files(ckpt).values())
        load_start = os.getloadavg()  # other work on the machine skews the figures: record it
        rss = PeakRss(server.proc.pid if server else None)
        clock = CpuClock(server.proc.pid if server else None)
        phases: dict[str, dict] = {}

        def record(name: str, seconds: float, cpu: tuple[float, float], moved: int) -> None:
            phases[name] = {
                "seconds": seconds,
                "bytes": moved,
                "MB_per_s": moved / 1e6 / seconds,
                "client_cpu_s": cpu[0],
                "server_cpu_s": cpu[1] if server else None,
            }
            print(
                f"  {name:<22} {seconds:7.2f} s  {moved / 1e6 / seconds:8.1f} MB/s  CPU: client {cpu[0]:.1f} s"
                + (f", server {cpu[1]:.1f} s" if server else ""),
                flush=True,
            )

        print(
            f"endpoint {endpoint} ({'local moto server' if server else 'given'}), {nbytes / 1024**3:.2f} GiB",
            flush=True,
        )
        seconds, cpu, moved = _timed(clock, single_stream_upload, client, loc, ckpt)
        record("upload_single_stream", seconds, cpu, moved)
        seconds, cpu, moved = _timed(clock, single_stream_download, client, loc, ckpt, work / "single")
        record("download_single_stream", seconds, cpu, moved)
        single_ok = _same_files(ckpt, work / "single")
        shutil.rmtree(work / "single")
        delete_prefix(client, s3_client.S3Location(loc.bucket, loc.key("single")))  # the server's disk and memory

        seconds, cpu, result = _timed(clock, s3_transfer.upload_checkpoint, client, cfg, loc, ckpt)
        record("upload_managed", seconds, cpu, result["bytes"])
        found = s3_remote.newest_complete(client, loc)
        (work / "managed").mkdir()
        seconds, cpu, info = _timed(
            clock, s3_transfer.download_checkpoint, client, cfg, loc, found[0], found[1], work / "managed"
        )
        record("download_managed", seconds, cpu, nbytes)
        managed_ok = _same_files(ckpt, info.path)
        delete_prefix(client, loc)

        ranks_loc = s3_client.S3Location(loc.bucket, loc.key("ranks"))
        seconds, cpu, (ranks_s, moved) = _timed(clock, ranks_upload, cfg, ranks_loc, ckpt, args.ranks)
        record(f"upload_{args.ranks}_ranks", ranks_s, cpu, moved)
        ranks_ok = s3_remote.newest_complete(client, ranks_loc) is not None
        delete_prefix(client, ranks_loc)
        peak = rss.stop()
    finally:
        if server:
            server.stop()
        if not args.keep_files:
            shutil.rmtree(work, ignore_errors=True)
    if not (single_ok and managed_ok):
        raise RuntimeError("downloaded files differ from the source files")
    if not ranks_ok:
        raise RuntimeError(f"the upload from {args.ranks} ranks left no complete checkpoint")
    import boto3
    import botocore

    up = phases["upload_managed"]["MB_per_s"] / phases["upload_single_stream"]["MB_per_s"]
    down = phases["download_managed"]["MB_per_s"] / phases["download_single_stream"]["MB_per_s"]
    ranks = phases[f"upload_{args.ranks}_ranks"]["MB_per_s"] / phases["upload_managed"]["MB_per_s"]
    return {
        "endpoint": "local moto server" if server else endpoint,
        "uri": uri,
        "bytes": nbytes,
        "files": args.files,
        "transfer": {
            "max_concurrency": args.max_concurrency,
            "multipart_threshold_mib": args.threshold_mib,
            "multipart_chunksize_mib": args.chunk_mib,
        },
        "ranks": args.ranks,
        "phases": phases,
        "ratios": {
            "upload_managed_over_single": up,
            "download_managed_over_single": down,
            f"upload_{args.ranks}_ranks_over_rank0_alone": ranks,
        },
        "verified_bytes_equal": True,
        "server_peak_rss_bytes": peak or None,
        "versions": {
            "boto3": boto3.__version__,
            "botocore": botocore.__version__,
            "moto": _version("moto") if server else None,
            "python": platform.python_version(),
        },
        "cpu_count": os.cpu_count(),
        "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
    }


def _version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def table(r: dict) -> str:
    p = r["phases"]
    rows = [
        f"S3 transfer benchmark: {r['bytes'] / 1024**3:.2f} GiB in {r['files']} file(s), {r['endpoint']}, "
        f"{r['cpu_count']} CPU(s); managed: multipart {r['transfer']['multipart_chunksize_mib']} MiB parts above "
        f"{r['transfer']['multipart_threshold_mib']} MiB, {r['transfer']['max_concurrency']} parallel requests",
        f"{'direction':<10} {'single stream':>15} {'managed':>15} {'managed / single':>17}",
    ]
    for d in ("upload", "download"):
        single, managed = p[f"{d}_single_stream"]["MB_per_s"], p[f"{d}_managed"]["MB_per_s"]
        rows.append(f"{d:<10} {single:>10.1f} MB/s {managed:>10.1f} MB/s {managed / single:>16.2f}x")
    if "ranks" in r:
        n = r["ranks"]
        alone, many = p["upload_managed"]["MB_per_s"], p[f"upload_{n}_ranks"]["MB_per_s"]
        rows.append(
            f"upload from {n} ranks in parallel: {many:.1f} MB/s vs rank 0 alone {alone:.1f} MB/s ({many / alone:.2f}x)"
        )
    if r["server_peak_rss_bytes"]:
        rows.append(f"local server peak memory: {r['server_peak_rss_bytes'] / 1024**3:.2f} GiB")
    return "\n".join(rows)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "s3",
        help="S3 upload/download throughput: managed multipart transfer vs a single stream",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size in GiB (default 2)")
    p.add_argument("--files", type=int, default=8, help="files it is split into (default 8, like 8 ranks' shards)")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=S3Config().max_concurrency,
        help="parallel requests of the managed transfer (checkpoint.s3.max_concurrency)",
    )
    p.add_argument(
        "--threshold-mib",
        type=int,
        default=S3Config().multipart_threshold_mb,
        help="multipart threshold (checkpoint.s3.multipart_threshold_mb)",
    )
    p.add_argument(
        "--chunk-mib",
        type=int,
        default=S3Config().multipart_chunksize_mb,
        help="part size (checkpoint.s3.multipart_chunksize_mb)",
    )
    p.add_argument("--ranks", type=int, default=4, help="ranks uploading in parallel, each its share (default 4)")
    p.add_argument("--endpoint-url", help="an S3-compatible endpoint instead of the local moto server")
    p.add_argument(
        "--uri",
        help="s3://bucket/prefix to use there; the benchmark writes under a new sub-prefix and deletes only that",
    )
    p.add_argument(
        "--work-dir",
        default="runs/bench-s3",
        help="files go into a new directory inside it, removed afterwards unless --keep-files",
    )
    p.add_argument("--keep-files", action="store_true", help="keep the generated and downloaded files")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(table(results))
    write_results(results, args.out)
    return 0
