"""Where and how: the ``s3://`` location, the boto3 client and transfer settings, S3 errors as one
line, and the start-up check of the bucket. boto3 is imported inside functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...config import S3Config, split_s3_uri

MIB = 1024 * 1024


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # without a trailing slash; "" for the bucket's root

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def uri(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"


def parse_s3_uri(uri: str, key: str = "checkpoint.s3.uri") -> S3Location:
    """``s3://bucket/prefix`` -> :class:`S3Location`; a ConfigError naming ``key`` otherwise."""
    return S3Location(*split_s3_uri(uri, key))


def make_client(cfg: S3Config, max_attempts: Optional[int] = None) -> Any:
    """An S3 client: credentials from boto3's default chain only, never from the configuration."""
    import boto3  # here: ``resilient-fsdp config`` and a trainer without an S3 tier never pay for it
    from botocore.config import Config as BotoConfig

    config = BotoConfig(
        retries={"mode": cfg.retry_mode, "max_attempts": max_attempts or cfg.max_attempts},
        connect_timeout=cfg.connect_timeout_s,
        read_timeout=cfg.read_timeout_s,
        # One pooled connection per concurrent request of a transfer, plus a few for listing.
        max_pool_connections=cfg.max_concurrency + 4,
        s3={"addressing_style": cfg.addressing_style},
    )
    # A session per client: boto3's default session is not safe to share between threads.
    return boto3.session.Session().client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region, config=config)


def transfer_config(cfg: S3Config, limit_bandwidth: bool = False) -> Any:
    from boto3.s3.transfer import TransferConfig

    bandwidth = int(cfg.max_bandwidth_mb_s * 1e6) if (limit_bandwidth and cfg.max_bandwidth_mb_s) else None
    # Threads, not the CRT client: it is optional in boto3 and would bypass the retry settings.
    return TransferConfig(
        multipart_threshold=cfg.multipart_threshold_mb * MIB,
        multipart_chunksize=cfg.multipart_chunksize_mb * MIB,
        max_concurrency=cfg.max_concurrency,
        use_threads=True,
        max_bandwidth=bandwidth,
        preferred_transfer_client="classic",
    )


# S3 error codes no retry fixes: the caller's identity may not do what it asked.
DENIED = frozenset({"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})


def describe_error(exc: BaseException) -> str:
    """One line for logs and ``summary.json``: the S3 error code when there is one."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        err = response["Error"]
        text = f"{err.get('Code', type(exc).__name__)}: {err.get('Message', '') or exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def check_access(cfg: S3Config) -> Optional[str]:
    """Start-up check of the bucket. Returns a configuration error to stop the job with (no
    credentials, no such bucket, access denied), or None; an unreachable endpoint is only a
    warning here, printed by the caller from the raised exception."""
    from botocore.exceptions import NoCredentialsError

    loc = parse_s3_uri(cfg.uri)
    try:
        make_client(cfg, max_attempts=2).head_bucket(Bucket=loc.bucket)
    except NoCredentialsError:
        return (
            "checkpoint.s3.uri is set but boto3 found no credentials in its default chain: in the cluster, "
            "annotate the job's ServiceAccount for IRSA (eks.amazonaws.com/role-arn) or use EKS Pod Identity; "
            "locally, set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    except Exception as exc:
        code = error_code(exc)
        where = f" at {cfg.endpoint_url}" if cfg.endpoint_url else ""
        if code in ("404", "NoSuchBucket"):
            return (
                f"checkpoint.s3.uri={cfg.uri!r}: bucket {loc.bucket!r} does not exist{where}; create it "
                "(the job never creates buckets) or fix the uri"
            )
        if code in DENIED:
            return (
                f"checkpoint.s3.uri={cfg.uri!r}: access to bucket {loc.bucket!r} denied{where} ({code}); grant "
                "the job's role s3:ListBucket on the bucket and s3:GetObject, s3:PutObject, s3:DeleteObject "
                "on the prefix"
            )
        raise
    return None
