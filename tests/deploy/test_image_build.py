"""scripts/build-image: the docker commands it runs, and its errors for bad input.

--dry-run prints every command without Docker; where a test needs the commands to run, no
Docker engine exists here, so tests/deploy/test_image_ecr.py uses a recording stand-in for the CLI.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.deploy.image_support import REPO, aws_env, docker_calls, docker_stand_in
from resilient_fsdp.deploy.image import dockerfile_args, nvrx_pin, project_version

VERSION = project_version()


def build_image(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = aws_env(None) if env is None else env
    return subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.deploy.image", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def commands(stdout: str) -> list[list[str]]:
    """The commands a dry run printed, split as a shell would (environment prefixes dropped)."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("would run: "):
            words = shlex.split(line[len("would run: ") :].split("   # ", 1)[0])
            found.append(words[words.index("docker") :])
    return found


def test_dry_run_prints_the_build_with_the_pins_as_build_args():
    out = build_image("--dry-run")
    assert out.returncode == 0, out.stderr
    assert "DOCKER_BUILDKIT=1 docker build" in out.stdout  # the Dockerfile needs BuildKit (RUN --mount)
    [build] = commands(out.stdout)
    assert build[:8] == [
        "docker",
        "build",
        "--file",
        "images/trainer/Dockerfile",
        "--platform",
        "linux/amd64",
        "--tag",
        f"resilient-fsdp:{VERSION}",
    ]
    assert build[-1] == "."  # the context is the repository root: constraints and source live there
    args = dict(build[i + 1].split("=", 1) for i, word in enumerate(build) if word == "--build-arg")
    assert args["NVRX_VERSION"] == nvrx_pin() == "0.7.0"
    assert args["VERSION"] == VERSION
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", args["REVISION"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", args["CREATED"])
    assert set(args) <= set(dockerfile_args(REPO / "images/trainer/Dockerfile"))


def test_dry_run_push_prints_every_aws_call_and_docker_command_in_order():
    out = build_image("--dry-run", "--push", "--region", "us-east-2", "--account", "111122223333", "--tag", "1.2.3")
    assert out.returncode == 0, out.stderr
    steps = []
    for line in out.stdout.splitlines():
        if line.startswith("would call: "):
            steps.append(line[len("would call: ") :].split("(")[0])
        elif line.startswith("would run: "):
            words = line.split()
            steps.append(words[words.index("docker") + 1])
    assert steps == [
        "sts.GetCallerIdentity",
        "build",
        "ecr.DescribeRepositories",
        "ecr.GetAuthorizationToken",
        "login",
        "tag",
        "push",
        "image",
    ]
    registry = "111122223333.dkr.ecr.us-east-2.amazonaws.com"
    remote = f"{registry}/resilient-fsdp:1.2.3"
    cmds = commands(out.stdout)
    assert cmds[1] == ["docker", "login", "--username", "AWS", "--password-stdin", registry]
    assert cmds[2] == ["docker", "tag", "resilient-fsdp:1.2.3", remote]
    assert cmds[3] == ["docker", "push", remote]
    assert "stdin: the token from ecr.GetAuthorizationToken" in out.stdout  # never on the command line
    assert "ecr.CreateRepository(repositoryName='resilient-fsdp'" in out.stdout
    assert f"helm: --set image.repository={registry}/resilient-fsdp --set image.tag=1.2.3" in out.stdout


def test_dry_run_needs_no_docker_and_no_credentials(tmp_path):
    env = aws_env(None, credentials=False)
    env["PATH"] = str(tmp_path)  # nothing on PATH: no docker, no aws
    out = build_image("--dry-run", "--push", "--region", "us-west-2", env=env)
    assert out.returncode == 0, out.stderr
    assert "ACCOUNT_ID.dkr.ecr.us-west-2.amazonaws.com/resilient-fsdp" in out.stdout


def test_custom_model_builds_from_the_trainer_image_in_its_own_context():
    out = build_image("--dry-run", "--image", "custom-model")
    [build] = commands(out.stdout)
    assert build[build.index("--file") + 1] == "images/custom-model/Dockerfile"
    assert build[build.index("--tag") + 1] == f"resilient-fsdp:{VERSION}-custom-model"
    assert f"TRAINER_IMAGE=resilient-fsdp:{VERSION}" in build and build[-1] == "images/custom-model"
    out = build_image("--dry-run", "--image", "custom-model", "--trainer-image", "reg.example/trainer:7")
    assert "TRAINER_IMAGE=reg.example/trainer:7" in commands(out.stdout)[0]


def test_overrides_reach_the_build():
    digest = "sha256:" + "0" * 64
    out = build_image(
        "--dry-run", "--base-digest", digest, "--build-arg", "EFA_INSTALLER_SHA256=abc", "--platform", "linux/arm64"
    )
    [build] = commands(out.stdout)
    assert f"BASE_IMAGE=nvcr.io/nvidia/pytorch:26.07-py3@{digest}" in build
    assert "EFA_INSTALLER_SHA256=abc" in build
    assert build[build.index("--platform") + 1] == "linux/arm64"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tag", "latest"], "--tag 'latest': 'latest' moves"),
        (["--tag=.bad"], "--tag '.bad': not a valid image tag; use a version, e.g. --tag"),
        (["--repository", "Resilient"], "--repository 'Resilient': use lower case letters"),
        (
            ["--build-arg", "NO_SUCH=1"],
            "--build-arg NO_SUCH: images/trainer/Dockerfile declares no such ARG; it declares "
            "BASE_CUDA_VERSION, BASE_IMAGE",
        ),
        (["--build-arg", "NVRX_VERSION"], "--build-arg 'NVRX_VERSION': expected KEY=VALUE"),
        (["--base-digest", "sha256:123"], "--base-digest 'sha256:123': expected sha256: and 64 hex digits"),
        (["--platform", "amd64"], "--platform 'amd64': expected linux/amd64"),
        (["--trainer-image", "x:1"], "--trainer-image: images/trainer/Dockerfile declares no TRAINER_IMAGE"),
        (
            ["--image", "custom-model", "--base-digest", "sha256:" + "0" * 64],
            "--base-digest: images/custom-model/Dockerfile declares no BASE_IMAGE",
        ),
        (["--push", "--region", "nowhere"], "--region 'nowhere': not an AWS region name"),
        (["--push", "--region", "us-west-2", "--account", "12"], "--account '12': an AWS account id is 12 digits"),
        (["--region", "us-west-2"], "--region is for --push"),
        (["--dockerfile", "no/such/Dockerfile"], "--dockerfile no/such/Dockerfile: no such file"),
    ],
)
def test_bad_input_names_the_flag_and_the_fix(args, message):
    out = build_image("--dry-run", *args)
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith(f"error: {message}"), out.stderr


def test_push_without_a_region_says_how_to_set_one():
    out = build_image("--dry-run", "--push", env=aws_env(None, region=""))
    assert out.returncode == 2
    assert "error: --push: no AWS region: pass --region" in out.stderr


def test_missing_docker_is_reported_with_the_fix(tmp_path):
    env = aws_env(None)
    env["PATH"] = str(tmp_path)  # this machine has no Docker; an empty PATH makes sure of it
    out = build_image(env=env)
    assert out.returncode == 1
    assert out.stderr.startswith("error: docker is not installed or not on PATH: install Docker Engine")


def test_unreachable_docker_daemon_is_reported(tmp_path):
    # A docker CLI whose daemon is down (the real one prints this and exits 1); no engine runs here.
    (tmp_path / "docker").write_text(
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon at "
        "unix:///var/run/docker.sock. Is the docker daemon running?' >&2\nexit 1\n"
    )
    (tmp_path / "docker").chmod(0o755)
    env = aws_env(None)
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    out = build_image(env=env)
    assert out.returncode == 1
    assert "error: docker cannot reach its daemon (Cannot connect to the Docker daemon" in out.stderr
    assert "start Docker or set DOCKER_HOST" in out.stderr


def test_a_failed_build_stops_before_anything_is_pushed(tmp_path):
    bin_dir = docker_stand_in(tmp_path / "bin")  # records calls; the engine cannot run here
    script = (
        (bin_dir / "docker")
        .read_text()
        .replace(
            'if args[:1] == ["version"]:', 'if args[:1] == ["build"]:\n    sys.exit(3)\nif args[:1] == ["version"]:'
        )
    )
    (bin_dir / "docker").write_text(script)
    env = aws_env(None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    out = build_image("--tag", "1.0.0", env=env)
    assert out.returncode == 1
    assert "error: `docker build` failed (exit 3); its output is above" in out.stderr
    assert [c["argv"][0] for c in docker_calls(bin_dir)] == ["version", "build"]


def test_the_script_is_a_thin_wrapper_around_the_module():
    # The real entry script: it makes sure .venv holds the package (boto3 included), then runs the module.
    out = subprocess.run(
        [str(REPO / "scripts/build-image"), "--dry-run", "--tag", "3.2.1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env=aws_env(None),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "would run: DOCKER_BUILDKIT=1 docker build --file images/trainer/Dockerfile" in out.stdout
    assert "--tag resilient-fsdp:3.2.1" in out.stdout


def test_a_copied_example_builds_from_its_own_directory(tmp_path):
    mine = tmp_path / "mine"
    shutil.copytree(REPO / "images/custom-model", mine)
    out = build_image("--dry-run", "--dockerfile", str(mine / "Dockerfile"))
    assert out.returncode == 0, out.stderr
    [build] = commands(out.stdout)
    assert build[build.index("--tag") + 1] == f"resilient-fsdp:{VERSION}-mine"
    assert build[-1] == str(mine) and f"TRAINER_IMAGE=resilient-fsdp:{VERSION}" in build
