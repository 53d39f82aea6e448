"""ECR for the image: registry address, repository creation and the login token, over HTTP.

No AWS account is reachable here, so STS and ECR are moto's standalone server on a loopback
port (image_support.aws_server); boto3 reaches it through AWS_ENDPOINT_URL as it would any
endpoint. The Docker engine cannot run here either: the push test puts a recording stand-in for
the docker CLI on PATH (image_support.docker_stand_in) and checks what it was asked to do.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import boto3
import pytest

from tests.deploy.image_support import REPO, aws_env, aws_server, docker_calls, docker_stand_in  # noqa: F401
from resilient_fsdp.deploy.ecr import Ecr, EcrError, registry_address

MOTO_ACCOUNT = "123456789012"  # the account moto's server answers GetCallerIdentity with


@pytest.fixture
def aws(aws_server, monkeypatch):
    """This process's boto3 pointed at the local server, with throwaway credentials."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in aws_env(aws_server).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    return aws_server


def _client(endpoint: str, service: str, region: str = "us-west-2"):
    """The test's own view of the local server, independent of the code under test."""
    session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing")
    return session.client(service, region_name=region, endpoint_url=endpoint)


def test_registry_address_is_the_callers_account_in_the_region(aws):
    assert Ecr("us-west-2").account() == MOTO_ACCOUNT
    assert Ecr("us-west-2").registry() == f"{MOTO_ACCOUNT}.dkr.ecr.us-west-2.amazonaws.com"
    assert Ecr("eu-central-1").registry() == f"{MOTO_ACCOUNT}.dkr.ecr.eu-central-1.amazonaws.com"
    assert registry_address("111122223333", "cn-north-1") == "111122223333.dkr.ecr.cn-north-1.amazonaws.com.cn"


def test_repository_is_created_once_immutable_and_scanned(aws):
    uri, created = Ecr("us-west-2").ensure_repository("team/created-once")
    assert created and uri == f"{MOTO_ACCOUNT}.dkr.ecr.us-west-2.amazonaws.com/team/created-once"
    again, created_again = Ecr("us-west-2").ensure_repository("team/created-once")
    assert (again, created_again) == (uri, False)
    repo = _client(aws, "ecr").describe_repositories(repositoryNames=["team/created-once"])["repositories"][0]
    assert repo["imageTagMutability"] == "IMMUTABLE"
    assert repo["imageScanningConfiguration"] == {"scanOnPush": True}


def test_existing_repository_is_used_as_it_is(aws):
    _client(aws, "ecr").create_repository(repositoryName="made-by-hand", imageTagMutability="MUTABLE")
    uri, created = Ecr("us-west-2").ensure_repository("made-by-hand")
    assert not created and uri.endswith("/made-by-hand")
    repo = _client(aws, "ecr").describe_repositories(repositoryNames=["made-by-hand"])["repositories"][0]
    assert repo["imageTagMutability"] == "MUTABLE"  # not changed behind the owner's back


def test_login_token_is_the_docker_password_for_the_registry(aws):
    login = Ecr("us-west-2").login()
    token = _client(aws, "ecr").get_authorization_token()["authorizationData"][0]["authorizationToken"]
    user, _, password = base64.b64decode(token).decode().partition(":")
    assert (login.username, login.password) == (user, password) and password
    assert login.registry == Ecr("us-west-2").registry()
    assert password not in repr(login)  # never printed by accident


@pytest.mark.parametrize("name", ["Upper", "a", "bad//slash", "-leading", "trailing/"])
def test_bad_repository_names_are_refused_before_any_call(aws, name):
    with pytest.raises(EcrError, match=r"--repository .*lower case"):
        Ecr("us-west-2").ensure_repository(name)


def test_bad_region_names_the_flag():
    with pytest.raises(EcrError, match=r"--region 'us west'"):
        Ecr("us west")


def test_missing_credentials_say_how_to_provide_them(aws_server, monkeypatch):
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in aws_env(aws_server, credentials=False).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    with pytest.raises(EcrError) as info:
        Ecr("us-west-2").account()
    assert str(info.value).startswith("sts.GetCallerIdentity: no AWS credentials found")
    assert "aws configure" in str(info.value) and "--dry-run" in str(info.value)


def test_unreachable_endpoint_is_named(monkeypatch):
    from tests.deploy.image_support import free_port

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in aws_env(f"http://127.0.0.1:{free_port()}").items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(EcrError, match=r"sts.GetCallerIdentity: cannot reach http://127.0.0.1:\d+"):
        Ecr("us-west-2").account()


def _build_image(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resilient_fsdp.deploy.image", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_push_creates_the_repository_logs_in_with_the_token_and_pushes(aws_server, tmp_path):
    bin_dir = docker_stand_in(tmp_path / "bin")  # the Docker engine cannot run here (see module docstring)
    env = aws_env(aws_server, region="eu-west-1")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    out = _build_image(["--push", "--repository", "pushed/trainer", "--tag", "9.9.9"], env)
    assert out.returncode == 0, out.stderr + out.stdout
    registry = f"{MOTO_ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com"
    remote = f"{registry}/pushed/trainer:9.9.9"
    calls = docker_calls(bin_dir)
    verbs = [c["argv"][0] if c["argv"][0] != "image" else "image inspect" for c in calls]
    assert verbs == ["version", "build", "login", "tag", "push", "image inspect"]
    build, login, tag, push = calls[1]["argv"], calls[2]["argv"], calls[3]["argv"], calls[4]["argv"]
    assert build[build.index("--tag") + 1] == "pushed/trainer:9.9.9"
    assert "--build-arg" in build and "NVRX_VERSION=0.7.0" in build
    # The password reaches docker on stdin only, and it is the token the ECR API issued.
    token = _client(aws_server, "ecr", "eu-west-1").get_authorization_token()["authorizationData"][0]
    assert login == ["login", "--username", "AWS", "--password-stdin", registry]
    assert calls[2]["stdin"] == base64.b64decode(token["authorizationToken"]).decode().split(":", 1)[1]
    assert calls[2]["stdin"] not in out.stdout + out.stderr
    assert tag == ["tag", "pushed/trainer:9.9.9", remote] and push == ["push", remote]
    repos = _client(aws_server, "ecr", "eu-west-1").describe_repositories()["repositories"]
    assert [r["repositoryName"] for r in repos] == ["pushed/trainer"]
    assert (
        f"--set image.repository={registry}/pushed/trainer --set image.tag=9.9.9 --set image.digest=sha256:"
        in out.stdout
    )


def test_push_without_credentials_fails_before_building(aws_server, tmp_path):
    bin_dir = docker_stand_in(tmp_path / "bin")
    env = aws_env(aws_server, credentials=False)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    out = _build_image(["--push"], env)
    assert out.returncode == 1
    assert "error: sts.GetCallerIdentity: no AWS credentials found" in out.stderr
    assert [c["argv"][0] for c in docker_calls(bin_dir)] == ["version"]  # no build was started


def test_push_to_another_account_than_the_credentials_is_refused(aws_server, tmp_path):
    bin_dir = docker_stand_in(tmp_path / "bin")
    env = aws_env(aws_server)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    out = _build_image(["--push", "--account", "999999999999"], env)
    assert out.returncode == 2
    assert f"--account 999999999999: the credentials belong to account {MOTO_ACCOUNT}" in out.stderr
    assert [c["argv"][0] for c in docker_calls(bin_dir)] == ["version"]


def test_dry_run_makes_no_api_call(aws_server):
    out = _build_image(["--push", "--dry-run", "--repository", "never-created"], aws_env(aws_server))
    assert out.returncode == 0, out.stderr
    assert "would call: ecr.GetAuthorizationToken()" in out.stdout
    names = [r["repositoryName"] for r in _client(aws_server, "ecr").describe_repositories()["repositories"]]
    assert "never-created" not in names
