"""Shared test helpers: run the real launcher and trainer as subprocesses, read what they wrote, check
for leftovers; the S3 sandbox the S3 tests share. Fixtures live in ``conftest.py``."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# Every distributed test uses a short collective timeout: gloo cannot be aborted, so the peers
# of a failed rank would otherwise wait out the default.
FAST = ["dist.timeout_s=60"]

# The NVRx lanes a test runs on: the image's 0.7 (the lane ./scripts/test prepares) in CI, the
# pinned 0.4.1 in the extended tier (docs/tests.md).
LANES = [pytest.param("pinned", marks=pytest.mark.extended), "image"]


def lane_path(request, lane: str) -> list[Path]:
    """What goes on a job's PYTHONPATH for ``lane`` (the image's NVRx lane; nothing for the pinned one)."""
    return [] if lane == "pinned" else [request.getfixturevalue("nvrx_lane")]


MARK = "RESILIENT_FSDP_TEST_RUN"
# Every run directory a process was started for in the running test (:func:`kill_marked`).
MARKED: set[Path] = set()


def _env(pythonpath: list[Path] | None = None, mark: Path | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    if mark is not None:
        # Inherited by every descendant (agents, ranks, NVRx's spawned helpers), so a leftover
        # process can be found by its environment even after it was re-parented.
        env[MARK] = str(mark)
        MARKED.add(Path(mark))
    paths = [str(p) for p in (pythonpath or [])] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONWARNINGS"] = "ignore:The pynvml package is deprecated:FutureWarning"
    return env


def run_local(
    run_dir: Path,
    nodes: int = 1,
    nproc: int = 2,
    overrides: list[str] | None = None,
    pythonpath: list[Path] | None = None,
    timeout: float = 240,
    extra: list[str] | None = None,
    env: dict | None = None,
    isolation: str | None = None,
    open_files: tuple[int, int] | None = None,
) -> subprocess.CompletedProcess:
    """``resilient-fsdp local`` as a user runs it (the dev-cpu values, each pod a network namespace
    when root); returns the finished process (output captured). ``open_files``: as for
    :func:`run_guarded`."""
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        f"--nodes={nodes}",
        f"--nproc-per-node={nproc}",
        f"--run-dir={run_dir}",
        *([f"--isolation={isolation}"] if isolation else []),
        *(extra or []),
    ]
    for o in FAST + (overrides or []):
        cmd += ["--set", o]
    return run_guarded(cmd, run_dir, pythonpath, timeout, env, open_files=open_files)


def run_guarded(
    cmd: list[str],
    run_dir: Path,
    pythonpath: list[Path] | None,
    timeout: float,
    env: dict | None = None,
    file_size_limit: int | None = None,
    open_files: tuple[int, int] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion; on timeout kill it and everything it started, then fail.

    ``file_size_limit`` (bytes) caps every file the processes write (RLIMIT_FSIZE): writes past
    it fail with EFBIG, as they would with ENOSPC on a full disk. ``open_files``: the (soft, hard)
    ``nofile`` limit (RLIMIT_NOFILE) every process started inherits, as a container runtime sets it.
    """

    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, open_files)

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(pythonpath, run_dir, env),
        cwd=REPO,
        start_new_session=True,
        preexec_fn=limit,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in processes_of(run_dir):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        out, err = proc.communicate()
        pytest.fail(
            f"timed out after {timeout} s: {' '.join(cmd)}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_trainer(
    run_dir: Path,
    overrides: list[str] | None = None,
    pythonpath: list[Path] | None = None,
    timeout: float = 120,
    env: dict | None = None,
    file_size_limit: int | None = None,
    open_files: tuple[int, int] | None = None,
) -> subprocess.CompletedProcess:
    """One trainer process without a launcher (a world of one)."""
    cmd = [sys.executable, "-m", "resilient_fsdp.train", "--run-dir", str(run_dir)]
    for o in FAST + (overrides or []):
        cmd += ["--set", o]
    return run_guarded(cmd, run_dir, pythonpath, timeout, env, file_size_limit, open_files)


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("event") == event]


def read_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_events(run_dir, "step")]


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for ``run_dir`` by :func:`run_local` / :func:`run_trainer`."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARK) == str(run_dir):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def kill_marked() -> list[int]:
    """Kill what is left of every process started for the running test's run directories (a test
    that pytest-timeout ended before its own guard fired leaves them running); their pids."""
    killed = []
    for run_dir in list(MARKED):
        for p in processes_of(run_dir):
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
    MARKED.clear()
    return killed


def assert_no_leftovers(run_dir: Path, wait_s: float = 5.0) -> None:
    """No process started for ``run_dir`` (agents, ranks, spawned helpers) outlives the job, and no
    local pod (network namespace, veth pair, bridge) outlives its launcher."""
    deadline = time.monotonic() + wait_s
    left = processes_of(run_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_of(run_dir)
    described = []
    for p in left:
        try:
            described.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not described, "processes left running:\n" + "\n".join(described)
    leaked = netns_leftovers()
    assert not leaked, f"local pods left behind (network namespaces, veths, bridges): {leaked}"


def netns_leftovers() -> list[str]:
    """What finished local runs left of their pods; runs still going (other tests, other users)
    are not counted. Only root can make pods, so nothing is left otherwise."""
    if os.geteuid() != 0:
        return []
    from resilient_fsdp.local.runtime.netns_pods import plumbing

    return plumbing.leaked()


def netns_required() -> None:
    """Skip a test that needs local pods (root, ``ip netns``) where they cannot be made, naming the
    reason and how to run it; under ``CI`` fail instead, so missing setup never passes as a skip."""
    from resilient_fsdp.local.runtime.netns_pods.plumbing import available

    ok, reason = available()
    if ok:
        return
    message = (
        f"local pods (network namespaces) are not available here: {reason}; run the suite as root "
        "(sudo ./scripts/test, or a container with CAP_NET_ADMIN and CAP_SYS_ADMIN) to include it"
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def write_module(directory: Path, name: str, source: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return directory


# ---- the S3 tier's tests: moto's standalone server, a real S3 API over HTTP on loopback ----------

# Throwaway credentials for the local server; no shared config or instance metadata is consulted,
# so nothing here can reach AWS.
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Short timeouts and backoffs, so outages are noticed in seconds.
S3_FAST = [
    "checkpoint.s3.connect_timeout_s=1",
    "checkpoint.s3.read_timeout_s=2",
    "checkpoint.s3.max_attempts=2",
    "checkpoint.s3.retry_backoff_s=0.5",
    "checkpoint.s3.retry_backoff_max_s=2",
]


class S3Sandbox:
    """One fresh bucket on the shared local server, and a way to stop the server for a while."""

    def __init__(self, server, bucket: str):
        import boto3

        self.server, self.bucket, self.endpoint = server, bucket, server.endpoint
        self.client = boto3.session.Session().client("s3", endpoint_url=self.endpoint)
        self.client.create_bucket(Bucket=bucket)

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def overrides(self, prefix: str) -> list[str]:
        return [f"checkpoint.s3.uri={self.uri(prefix)}", f"checkpoint.s3.endpoint_url={self.endpoint}"] + S3_FAST

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def pause(self) -> None:
        """SIGSTOP: the server keeps its objects (held in its process) but answers nothing."""
        os.kill(self.server.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.server.proc.pid, signal.SIGCONT)
