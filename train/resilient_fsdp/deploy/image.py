"""``scripts/build-image``: build the trainer image (or an image on top of it) and push it to ECR.

``docker build`` runs with the pins as build arguments: NVRx from ``constraints-image.txt``, the
image version from ``pyproject.toml``, the git commit and the build time for the OCI labels.
With ``--push`` the image is tagged for the account's ECR registry in the region and pushed: the
registry address comes from the account (STS) and region, the repository is created if missing,
and ``docker login`` gets a token from ``ecr.GetAuthorizationToken`` on its standard input.
``--dry-run`` prints every command and API call in order and runs none of them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .ecr import ACCOUNT_RE, REPOSITORY_RE, Ecr, EcrError, Login, default_region, registry_address

REPO = Path(__file__).resolve().parents[3]
# The images this repository builds: Dockerfile and build context, relative to the repository.
IMAGES = {
    "trainer": ("images/trainer/Dockerfile", "."),
    "custom-model": ("images/custom-model/Dockerfile", "images/custom-model"),
}
DEFAULT_REPOSITORY = "resilient-fsdp"  # the chart's default image.repository
DEFAULT_PLATFORM = "linux/amd64"  # the GPU instances (p4d, p5, p6, g5, g6) are x86_64
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
ARG_RE = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?\s*$")


class ImageError(Exception):
    """A failure with a message that names the flag or step and the fix."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def usage_error(message: str) -> ImageError:
    # Bad input: exit 2, as argparse does for its own errors.
    return ImageError(message, exit_code=2)


def dockerfile_args(dockerfile: Path) -> dict[str, Optional[str]]:
    """Every ``ARG`` a Dockerfile declares, with its default (None without one)."""
    declared: dict[str, Optional[str]] = {}
    for line in dockerfile.read_text().splitlines():
        match = ARG_RE.match(line)
        if match:
            name, default = match.group(1), match.group(2)
            if default is not None or name not in declared:
                declared[name] = default.strip().strip('"') if default is not None else None
    return declared


def project_version(repo: Path = REPO) -> str:
    match = re.search(r'^version\s*=\s*"([^"]+)"', (repo / "pyproject.toml").read_text(), re.MULTILINE)
    if not match:
        raise ImageError("pyproject.toml has no [project] version")
    return match.group(1)


def nvrx_pin(repo: Path = REPO) -> str:
    """The NVRx version the image ships and the tests exercise."""
    for line in (repo / "constraints-image.txt").read_text().splitlines():
        if line.startswith("nvidia-resiliency-ext=="):
            return line.split("==", 1)[1].strip()
    raise ImageError("constraints-image.txt pins no nvidia-resiliency-ext version")


def git_revision(repo: Path = REPO) -> str:
    """The commit the image is built from, ``-dirty`` when the work tree has changes."""
    if shutil.which("git") is None:
        return "unknown"
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


@dataclass
class BuildPlan:
    """One ``docker build``: what, from where, with which arguments, under which name."""

    dockerfile: Path
    context: Path
    repository: str
    tag: str
    platform: str
    build_args: dict[str, str] = field(default_factory=dict)

    @property
    def local_ref(self) -> str:
        return f"{self.repository}:{self.tag}"

    def command(self) -> list[str]:
        cmd = ["docker", "build", "--file", _rel(self.dockerfile), "--platform", self.platform, "--tag", self.local_ref]
        for key, value in self.build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        return cmd + [_rel(self.context)]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


def plan_build(args: argparse.Namespace, repo: Path = REPO) -> BuildPlan:
    """Everything about the build that needs neither Docker nor AWS; bad flags fail here."""
    if args.dockerfile:
        dockerfile = Path(args.dockerfile)
        if not dockerfile.is_file():
            raise usage_error(f"--dockerfile {args.dockerfile}: no such file")
        context, name = dockerfile.parent, dockerfile.resolve().parent.name
    else:
        relative, ctx = IMAGES[args.image]
        dockerfile, context, name = repo / relative, repo / ctx, args.image
    version = project_version(repo)
    tag = args.tag or (version if name == "trainer" else f"{version}-{name}")
    if tag == "latest" or not TAG_RE.match(tag):
        raise usage_error(
            f"--tag {tag!r}: "
            + (
                "'latest' moves: a pod recreated later could run another trainer"
                if tag == "latest"
                else "not a valid image tag"
            )
            + f"; use a version, e.g. --tag {version}"
        )
    if not REPOSITORY_RE.match(args.repository):
        raise usage_error(
            f"--repository {args.repository!r}: use lower case letters, digits, '.', '_', '-' and '/', "
            f"e.g. --repository {DEFAULT_REPOSITORY}"
        )
    if not re.match(r"^linux/(amd64|arm64)$", args.platform):
        raise usage_error(f"--platform {args.platform!r}: expected linux/amd64 (x86 GPU instances) or linux/arm64")
    return BuildPlan(
        dockerfile=dockerfile,
        context=context,
        repository=args.repository,
        tag=tag,
        platform=args.platform,
        build_args=build_args(args, dockerfile, version, repo),
    )


def build_args(args: argparse.Namespace, dockerfile: Path, version: str, repo: Path = REPO) -> dict[str, str]:
    """The pins and labels this repository derives, then the user's ``--build-arg`` overrides.

    Derived values go only to ARGs the Dockerfile declares; an override of an undeclared ARG is
    an error (docker would ignore it with a warning, and the pin would silently not apply).
    """
    declared = dockerfile_args(dockerfile)
    derived = {
        "NVRX_VERSION": nvrx_pin(repo),
        "VERSION": version,
        "REVISION": git_revision(repo),
        "CREATED": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if args.base_digest:
        if not declared.get("BASE_IMAGE"):
            raise usage_error(f"--base-digest: {_rel(dockerfile)} declares no BASE_IMAGE with a default to pin")
        if not DIGEST_RE.match(args.base_digest):
            raise usage_error(
                f"--base-digest {args.base_digest!r}: expected sha256: and 64 hex digits, "
                "as `docker buildx imagetools inspect <image>` prints it"
            )
        derived["BASE_IMAGE"] = f"{declared['BASE_IMAGE'].split('@')[0]}@{args.base_digest}"
    if "TRAINER_IMAGE" in declared:
        derived["TRAINER_IMAGE"] = args.trainer_image or f"{DEFAULT_REPOSITORY}:{version}"
    elif args.trainer_image:
        raise usage_error(f"--trainer-image: {_rel(dockerfile)} declares no TRAINER_IMAGE to set")
    result = {k: v for k, v in derived.items() if k in declared}
    for item in args.build_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise usage_error(
                f"--build-arg {item!r}: expected KEY=VALUE, e.g. --build-arg EFA_INSTALLER_SHA256=<sha256>"
            )
        if key not in declared:
            raise usage_error(
                f"--build-arg {key}: {_rel(dockerfile)} declares no such ARG; it declares {', '.join(sorted(declared))}"
            )
        result[key] = value
    return result


class Runner:
    """Runs each step, or with ``dry_run`` only prints it; both print every step first."""

    def __init__(self, dry_run: bool, echo: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.dry_run = dry_run
        self.echo = echo

    def docker(
        self,
        argv: list[str],
        stdin: Optional[str] = None,
        stdin_from: str = "",
        env: Optional[dict[str, str]] = None,
        capture: bool = False,
    ) -> str:
        prefix = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        shown = (
            (prefix + " " if prefix else "") + shlex.join(argv) + (f"   # stdin: {stdin_from}" if stdin_from else "")
        )
        self.echo(("would run: " if self.dry_run else "+ ") + shown)
        if self.dry_run:
            return ""
        # No input: an empty standard input, so that nothing waits on the caller's terminal.
        stdin_args: dict = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
        proc = subprocess.run(
            argv,
            text=True,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE if capture else None,
            **stdin_args,
        )
        if proc.returncode != 0:
            raise ImageError(f"`{shlex.join(argv[:2])}` failed (exit {proc.returncode}); its output is above")
        return proc.stdout or ""

    def call(self, description: str, fn: Callable[[], Any], placeholder: Any = None) -> Any:
        self.echo(("would call: " if self.dry_run else "+ ") + description)
        return placeholder if self.dry_run else fn()


def check_docker() -> None:
    """Docker installed and its daemon reachable, or an error that says which and what to do."""
    if shutil.which("docker") is None:
        raise ImageError(
            "docker is not installed or not on PATH: install Docker Engine (with BuildKit) or "
            "Docker Desktop, or add --dry-run to print the commands without running them"
        )
    proc = subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        raise ImageError(
            f"docker cannot reach its daemon ({detail}): start Docker or set DOCKER_HOST, "
            "or add --dry-run to print the commands without running them"
        )


def resolve_ecr(args: argparse.Namespace) -> Optional[Ecr]:
    """The ECR region's API for ``--push`` (None without it); bad flags fail here, before any call."""
    if not args.push:
        if args.account or args.region:
            raise usage_error(
                f"{'--account' if args.account else '--region'} is for --push (the ECR registry's "
                "account and region); without --push nothing goes to AWS"
            )
        return None
    region = args.region or default_region()
    if not region:
        raise usage_error("--push: no AWS region: pass --region (e.g. --region us-west-2) or set AWS_REGION")
    if args.account and not ACCOUNT_RE.match(args.account):
        raise usage_error(f"--account {args.account!r}: an AWS account id is 12 digits")
    try:
        return Ecr(region)
    except EcrError as exc:
        raise usage_error(str(exc)) from None


def build_and_push(args: argparse.Namespace, runner: Runner, repo: Path = REPO) -> int:
    plan = plan_build(args, repo)
    ecr = resolve_ecr(args)
    if not args.dry_run:
        check_docker()
    runner.echo(
        f"[build-image] {plan.local_ref} from {_rel(plan.dockerfile)} (context {_rel(plan.context)}, {plan.platform})"
    )
    account = None
    if ecr is not None:
        # Credentials first: a missing one should fail before a long build, not after it.
        account = runner.call(
            "sts.GetCallerIdentity()  -> the account of the registry address",
            ecr.account,
            placeholder=args.account or "ACCOUNT_ID",
        )
        if args.account and not args.dry_run and account != args.account:
            raise usage_error(
                f"--account {args.account}: the credentials belong to account {account}; "
                "use that account's credentials (AWS_PROFILE) or drop --account"
            )
    runner.docker(plan.command(), env={"DOCKER_BUILDKIT": "1"})
    if ecr is None:
        runner.echo(
            f"[build-image] {'dry run: nothing was built' if runner.dry_run else 'built ' + plan.local_ref}; "
            f"for a local cluster: kind load docker-image {plan.local_ref}"
        )
        return 0
    push(plan, ecr, account, runner)
    return 0


def push(plan: BuildPlan, ecr: Ecr, account: str, runner: Runner) -> None:
    """Repository, login, tag, push; then the helm values that select the pushed image."""
    registry = registry_address(account, ecr.region)
    uri = runner.call(
        f"ecr.DescribeRepositories(repositoryNames=[{plan.repository!r}]), then "
        f"ecr.CreateRepository(repositoryName={plan.repository!r}, imageTagMutability='IMMUTABLE', "
        "scanOnPush=True) if it is missing",
        lambda: _ensure(ecr, plan.repository, runner.echo),
        placeholder=f"{registry}/{plan.repository}",
    )
    login = runner.call(
        "ecr.GetAuthorizationToken()  -> the docker login password",
        ecr.login,
        placeholder=Login(registry=registry, username="AWS", password=""),
    )
    runner.docker(
        ["docker", "login", "--username", login.username, "--password-stdin", login.registry],
        stdin=login.password,
        stdin_from="the token from ecr.GetAuthorizationToken",
    )
    remote = f"{uri}:{plan.tag}"
    runner.docker(["docker", "tag", plan.local_ref, remote])
    runner.docker(["docker", "push", remote])
    digests = runner.docker(["docker", "image", "inspect", "--format", "{{json .RepoDigests}}", remote], capture=True)
    digest = next(iter(re.findall(re.escape(uri) + r"@(sha256:[0-9a-f]{64})", digests)), None)
    if runner.dry_run:
        runner.echo("[build-image] dry run: nothing was built, created or pushed")
    else:
        runner.echo(f"[build-image] pushed {remote}" + (f" ({digest})" if digest else ""))
    runner.echo(
        f"[build-image] helm: --set image.repository={uri} --set image.tag={plan.tag}"
        + (f" --set image.digest={digest}" if digest else "")
    )


def _ensure(ecr: Any, repository: str, echo: Callable[[str], None]) -> str:
    uri, created = ecr.ensure_repository(repository)
    echo(f"[build-image] repository {uri} {'created (immutable tags, scan on push)' if created else 'exists'}")
    return uri


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/build-image",
        description=__doc__.split("\n\n")[0],
        epilog="Examples: scripts/build-image --dry-run; scripts/build-image --push "
        "--region us-west-2; scripts/build-image --image custom-model --push",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--image",
        choices=sorted(IMAGES),
        default="trainer",
        help="which image of this repository to build (default: trainer)",
    )
    which.add_argument(
        "--dockerfile",
        help="a Dockerfile of your own (a copy of images/custom-model); its directory is the build context",
    )
    p.add_argument(
        "--repository",
        default=DEFAULT_REPOSITORY,
        help=f"image name, and the ECR repository with --push (default: {DEFAULT_REPOSITORY})",
    )
    p.add_argument("--tag", help="image tag (default: the project version, plus -<image> for images on top of it)")
    p.add_argument("--platform", default=DEFAULT_PLATFORM, help=f"target platform (default: {DEFAULT_PLATFORM})")
    p.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an ARG the Dockerfile declares (repeatable)",
    )
    p.add_argument("--base-digest", metavar="sha256:...", help="pin the base image's digest as well as its tag")
    p.add_argument(
        "--trainer-image",
        metavar="REF",
        help="for images on top of the trainer: the trainer image to start FROM "
        "(default: resilient-fsdp:<version>, as a trainer build tags it)",
    )
    p.add_argument("--push", action="store_true", help="tag and push to Amazon ECR after the build")
    p.add_argument("--region", help="ECR region with --push (default: the AWS configuration's region)")
    p.add_argument(
        "--account",
        help="with --push: the expected AWS account (checked against the credentials; "
        "with --dry-run it fills in the registry address)",
    )
    p.add_argument("--dry-run", action="store_true", help="print every command and API call without running any")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return build_and_push(args, Runner(args.dry_run))
    except (ImageError, EcrError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)


if __name__ == "__main__":
    sys.exit(main())
