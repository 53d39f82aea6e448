"""Amazon ECR for the trainer image: the registry address, the repository, a login token.

An account's registry in a region is ``<account>.dkr.ecr.<region>.amazonaws.com``; the account
is whoever the credentials belong to (STS ``GetCallerIdentity``). Every call goes through boto3,
so the standard AWS settings apply: profiles, roles, ``AWS_REGION``, and ``AWS_ENDPOINT_URL``
(the tests point it at a local ECR API server). Failures become :class:`EcrError` messages that
say what to fix.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]+$")
ACCOUNT_RE = re.compile(r"^[0-9]{12}$")
# ECR's repository name rule (lower case, path-like, 2-256 characters).
REPOSITORY_RE = re.compile(r"^(?=.{2,256}$)(?:[a-z0-9]+(?:[._-][a-z0-9]+)*/)*[a-z0-9]+(?:[._-][a-z0-9]+)*$")

NO_CREDENTIALS = (
    "no AWS credentials found: configure them (aws configure, AWS_PROFILE, AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or an instance/pod role), or add --dry-run to see the steps without AWS"
)


class EcrError(Exception):
    """An ECR or STS step that failed; the message names the step and the fix."""


@dataclass(frozen=True)
class Login:
    """What ``docker login`` needs; the password is a 12-hour token, never printed."""

    registry: str
    username: str
    password: str = field(repr=False)


def _boto3() -> Any:
    # Imported on first use: building an image without pushing it needs no AWS SDK.
    try:
        import boto3
        import botocore.exceptions  # noqa: F401  (used through boto3's package namespace)
    except ModuleNotFoundError:
        raise EcrError(
            "boto3 is not installed: pip install -c constraints.txt -e . (scripts/build-image installs it)"
        ) from None
    return boto3


def registry_address(account: str, region: str) -> str:
    """The registry host of ``account`` in ``region`` (China regions use their own domain)."""
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{account}.dkr.ecr.{region}.{suffix}"


def default_region() -> Optional[str]:
    """The region the AWS configuration names (``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile)."""
    # AWS_REGION is what the AWS CLI v2 and the other SDKs read first; botocore reads only the rest.
    return os.environ.get("AWS_REGION") or _boto3().session.Session().region_name


@contextlib.contextmanager
def _calling(what: str) -> Iterator[None]:
    """Turn boto3's exceptions for the call ``what`` into an EcrError with the fix."""
    import botocore.exceptions

    try:
        yield
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError):
        raise EcrError(f"{what}: {NO_CREDENTIALS}") from None
    except botocore.exceptions.NoRegionError:
        raise EcrError(f"{what}: no AWS region: pass --region or set AWS_REGION") from None
    except botocore.exceptions.EndpointConnectionError as exc:
        raise EcrError(
            f"{what}: cannot reach {exc.kwargs.get('endpoint_url', 'the AWS endpoint')}: check the "
            "network, the region, and AWS_ENDPOINT_URL if it is set"
        ) from None
    except botocore.exceptions.ClientError as exc:
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "Error"), error.get("Message", str(exc))
        hint = ""
        if code in (
            "AccessDenied",
            "AccessDeniedException",
            "UnrecognizedClientException",
            "InvalidClientTokenId",
            "ExpiredToken",
            "ExpiredTokenException",
            "SignatureDoesNotMatch",
        ):
            hint = (
                "; the credentials need sts:GetCallerIdentity and ecr:DescribeRepositories, "
                "ecr:CreateRepository, ecr:GetAuthorizationToken and the push actions, and must not be expired"
            )
        raise EcrError(f"{what}: {code}: {message}{hint}") from None


class Ecr:
    """The ECR API of one region, as the credentials in the environment see it."""

    def __init__(self, region: str, session: Optional[Any] = None):
        if not REGION_RE.match(region or ""):
            raise EcrError(f"--region {region!r}: not an AWS region name such as us-west-2")
        self.region = region
        self._session = session or _boto3().session.Session()

    def _client(self, service: str):
        return self._session.client(service, region_name=self.region)

    def account(self) -> str:
        """The account the credentials belong to."""
        with _calling("sts.GetCallerIdentity"):
            return self._client("sts").get_caller_identity()["Account"]

    def registry(self, account: Optional[str] = None) -> str:
        """The registry address of ``account`` (default: the caller's) in this region."""
        return registry_address(account or self.account(), self.region)

    def ensure_repository(self, name: str) -> tuple[str, bool]:
        """The repository's URI, creating it if missing; returns ``(uri, created)``.

        A new repository has immutable tags (a pushed version cannot be overwritten, so every pod
        of a job runs the same trainer) and scans each pushed image for known vulnerabilities.
        """
        if not REPOSITORY_RE.match(name):
            raise EcrError(
                f"--repository {name!r}: ECR names are lower case letters, digits, '.', '_', '-' "
                "and '/' between parts, e.g. resilient-fsdp or team/resilient-fsdp"
            )
        ecr = self._client("ecr")
        # The not-found and already-exists answers are handled inside each call's error context,
        # before it would turn them into errors.
        with _calling("ecr.DescribeRepositories"):
            try:
                return ecr.describe_repositories(repositoryNames=[name])["repositories"][0]["repositoryUri"], False
            except ecr.exceptions.RepositoryNotFoundException:
                pass
        with _calling("ecr.CreateRepository"):
            try:
                created = ecr.create_repository(
                    repositoryName=name,
                    imageTagMutability="IMMUTABLE",
                    imageScanningConfiguration={"scanOnPush": True},
                    encryptionConfiguration={"encryptionType": "AES256"},
                )["repository"]
                return created["repositoryUri"], True
            except ecr.exceptions.RepositoryAlreadyExistsException:  # created meanwhile by someone else
                return ecr.describe_repositories(repositoryNames=[name])["repositories"][0]["repositoryUri"], False

    def login(self) -> Login:
        """A ``docker login`` for this region's registry, from ``ecr.GetAuthorizationToken``."""
        with _calling("ecr.GetAuthorizationToken"):
            data = self._client("ecr").get_authorization_token()["authorizationData"][0]
        username, sep, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
        if not sep or not password:
            raise EcrError("ecr.GetAuthorizationToken returned a token that is not 'user:password'")
        registry = re.sub(r"^https?://", "", data["proxyEndpoint"]).rstrip("/")
        return Login(registry=registry, username=username, password=password)
