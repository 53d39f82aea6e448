"""The grammar of an S3 location, ``s3://bucket/prefix`` (``checkpoint.s3.uri``)."""

from __future__ import annotations

import re

from .errors import ConfigError

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def split_s3_uri(uri: str, key: str = "checkpoint.s3.uri") -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end); a ConfigError naming
    ``key`` otherwise."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{key}={uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{key}={uri!r}: {bucket!r} is not a valid bucket name (3-63 characters: lower-case "
            "letters, digits, dots and hyphens)"
        )
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise ConfigError(f"{key}={uri!r}: empty path segment in the prefix")
    return bucket, prefix
