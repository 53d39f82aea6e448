"""Shared by the image tests: a local ECR/STS API server, and a stand-in for the Docker CLI.

No AWS account is reachable from the tests, so ECR and STS are moto's standalone server, a real
HTTP server on a loopback port that boto3 reaches by ``AWS_ENDPOINT_URL`` like any endpoint.
No Docker engine exists here either: where a test needs ``docker`` to run, a small executable
records each invocation (argv and standard input) instead, and says so where it is used.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def aws_server(tmp_path_factory):
    """moto's standalone server on a free loopback port (the one the S3 tests and ``bench s3``
    use: it serves ECR and STS too); yields its URL, stops it afterwards."""
    from resilient_fsdp.bench.s3 import LocalS3Server

    try:
        server = LocalS3Server(tmp_path_factory.mktemp("moto") / "server.log")
    except RuntimeError as exc:
        pytest.fail(f"{exc}; is moto[server] installed? ./scripts/test installs it")
    try:
        yield server.endpoint
    finally:
        server.stop()


def aws_env(endpoint: str | None, region: str = "us-west-2", credentials: bool = True) -> dict:
    """A clean AWS environment: no profile files, no instance metadata, the given endpoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        # Never ask the EC2 instance metadata service (an address outside this machine).
        AWS_EC2_METADATA_DISABLED="true",
        AWS_REGION=region,
    )
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    if credentials:
        # moto's server accepts any key; these exist only inside the local server.
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    return env


def docker_stand_in(directory: Path, repo_digest: str = "sha256:" + "ab" * 32) -> Path:
    """A ``docker`` executable that records argv and stdin to ``calls.jsonl`` in ``directory``.

    Stands in for the Docker CLI and engine, which cannot run here; answers ``version`` (a server
    version, so the daemon counts as reachable) and ``image inspect`` (a repo digest for the pushed
    reference), and exits 0 for everything else.
    """
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "docker"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        args = sys.argv[1:]
        stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
        with open({str(directory / "calls.jsonl")!r}, "a") as f:
            f.write(json.dumps({{"argv": args, "stdin": stdin}}) + "\\n")
        if args[:1] == ["version"]:
            print("29.0.0")
        elif args[:2] == ["image", "inspect"]:
            ref = args[-1].rsplit(":", 1)[0]
            print(json.dumps([ref + "@{repo_digest}"]))
        """)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return directory


def docker_calls(directory: Path) -> list[dict]:
    path = directory / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
