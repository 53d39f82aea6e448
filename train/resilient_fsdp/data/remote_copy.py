"""An ``s3://`` ``data.path``: copied once to the shared volume, then read there like a local one.

Global rank 0 copies the prepared directory (``tokens.json``, ``tokens.bin``, ``tokenizer/``)
into ``<data.cache_dir>/<bucket>/<prefix>.partial-<id>`` with boto3's managed transfer, checks
``tokens.bin`` against the CRC32C its ``tokens.json`` records, and renames the directory into
place; every other rank waits for that directory. A copy whose ``tokens.json`` matches the
bucket's is reused, by every restart and by later jobs with the same ``data.cache_dir``; one
that does not (the data in the bucket was prepared again) is moved aside, never deleted.

The copy runs at start, inside the init hang-detection section: its timeout
(``resilience.hang_detection.init_timeout_s``) must cover the first copy.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .. import atomic
from ..config import ConfigError, S3Config
from .token_files import META, TokenMeta, meta_from_json, read_meta

KEY = "data.path"
WAIT_REPORT_S = 60.0


def cache_path(cache_root: Path, bucket: str, prefix: str) -> Path:
    return cache_root / bucket / (prefix or "_root")


def local_copy(
    uri: str, cache_root: Path, s3: S3Config, rank: int, say: Callable[[str], None], poll_s: float = 1.0
) -> Path:
    """The local directory holding ``uri``'s prepared data, copied there first if needed."""
    from ..checkpoint.s3.client import make_client, parse_s3_uri

    loc = parse_s3_uri(uri, KEY)
    client = make_client(s3)
    remote = _remote_meta(client, loc.bucket, loc.key(META), uri)
    target = cache_path(cache_root, loc.bucket, loc.prefix)
    if _matches(target, remote):
        return target
    if rank != 0:
        return _wait(target, remote, uri, say, poll_s)
    return _copy(client, loc, remote, target, uri, say)


def _remote_meta(client: Any, bucket: str, key: str, uri: str) -> TokenMeta:
    """The bucket's ``tokens.json``. What no retry fixes (no such object, no credentials, access
    denied) is a configuration error naming the fix; an unreachable endpoint stays retryable."""
    from botocore.exceptions import ClientError, NoCredentialsError

    from ..checkpoint.s3.client import DENIED

    try:
        raw = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except NoCredentialsError as exc:
        raise ConfigError(
            f"{KEY}={uri!r}: boto3 found no credentials in its default chain: give the job's "
            "ServiceAccount an IAM role (EKS Pod Identity or IRSA)"
        ) from exc
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NoSuchBucket"):
            raise ConfigError(
                f"{KEY}={uri!r}: no {META} there ({code}); upload the directory `resilient-fsdp data "
                f"prepare` wrote, e.g. aws s3 cp --recursive DIR {uri.rstrip('/')}/"
            ) from exc
        if code in DENIED:
            raise ConfigError(
                f"{KEY}={uri!r}: access denied ({code}); grant the job's role s3:ListBucket on bucket "
                f"{bucket!r} and s3:GetObject on the prefix"
            ) from exc
        raise
    try:
        return meta_from_json(json.loads(raw), f"{KEY}={uri!r}: its {META}")
    except ValueError as exc:  # not JSON
        raise ConfigError(
            f"{KEY}={uri!r}: its {META} is not JSON ({exc}); upload data prepare's directory again"
        ) from exc


def _matches(target: Path, remote: TokenMeta) -> bool:
    local = read_meta(target / META) if (target / META).is_file() else None
    return local is not None and local.crc32c == remote.crc32c and local.num_tokens == remote.num_tokens


def _wait(target: Path, remote: TokenMeta, uri: str, say: Callable[[str], None], poll_s: float) -> Path:
    start = last = time.monotonic()
    while not _matches(target, remote):
        if time.monotonic() - last >= WAIT_REPORT_S:
            last = time.monotonic()
            say(f"waiting {last - start:.0f} s for rank 0's copy of {uri} into {target}")
        time.sleep(poll_s)
    return target


def _copy(client: Any, loc: Any, remote: TokenMeta, target: Path, uri: str, say: Callable[[str], None]) -> Path:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        # A new FSx file system's root belongs to root; the chart's storage preparation makes only
        # the run directory the pods' own.
        raise ConfigError(
            f"data.cache_dir: cannot create {target.parent} as uid {os.getuid()} ({exc.strerror}): "
            "leave data.cache_dir unset (<run_dir>/data, which the chart prepares for the pods' "
            "user) or make that directory writable by the pods' user or fsGroup"
        ) from exc
    for stale in target.parent.glob(f"{target.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a copy a killed rank 0 left: this module's own scratch
    partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        return _fill(client, loc, remote, partial, target, uri, say)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _fill(
    client: Any, loc: Any, remote: TokenMeta, partial: Path, target: Path, uri: str, say: Callable[[str], None]
) -> Path:
    from ..checkpoint.integrity import file_crc32c

    t0, total = time.monotonic(), 0
    paginator = client.get_paginator("list_objects_v2")
    base = loc.key() + "/" if loc.prefix else ""
    for page in paginator.paginate(Bucket=loc.bucket, Prefix=base):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(base) :]
            if not rel or rel == META or rel.endswith("/"):
                continue
            dest = partial / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(loc.bucket, obj["Key"], str(dest))
            atomic.fsync_file(dest)
            total += obj["Size"]
    tokens = partial / "tokens.bin"
    if not tokens.is_file():
        raise ConfigError(f"{KEY}={uri!r}: {META} is there but tokens.bin is not; upload the whole prepared directory")
    got = file_crc32c(tokens)
    if got != remote.crc32c:
        raise ConfigError(
            f"{KEY}={uri!r}: tokens.bin has CRC32C {got}, its {META} says {remote.crc32c}: the object "
            "in the bucket is not the one data prepare wrote (cut or replaced); upload it again"
        )
    atomic.write_json(partial / META, remote.to_json())
    if target.exists():
        aside = target.with_name(f"{target.name}.replaced-{int(time.time())}")
        atomic.rename(target, aside)
        say(f"{target} held other data (prepared again since): moved aside to {aside}")
    atomic.rename(partial, target)
    say(f"copied {uri} to {target}: {total / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s, checksum verified")
    return target
