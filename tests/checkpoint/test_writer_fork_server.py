"""Checkpoint writers forked from the pod's fork server (``checkpoint.writer.fork_server``), between
real processes: a pre-warmed server, clients that hand it ranks, and each rank's real
``WriterProcess``. The writer is a fork of the pod's fork server (itself a fork of the server),
not a new interpreter; it has what a spawned writer would have inherited from its rank
(environment, umask, standard streams) and the writer's priority and blocked SIGTERM; it exits
when its rank is killed; a restarted rank's writer comes from the same fork server; and when the
fork server is gone, a rank's writer is spawned as NVRx does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from resilient_fsdp.checkpoint.writer.priority import WRITER_NICE
from resilient_fsdp.resilience import prewarm
from tests.support import REPO, _env

# The rank a test server forks: starts its writer, has it run ``writer_probe.report`` and prints
# what the writer reported; then exits (``close``) or waits to be killed (``stay``).
RANK = textwrap.dedent("""
    import json, os, sys, time
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
    from resilient_fsdp.checkpoint.writer.process import WriterProcess
    import writer_probe
    if __name__ == "__main__":  # the writer imports this module again (a spawned one, or a fork's preparation)
        out, then = sys.argv[1], sys.argv[2]
        writer = WriterProcess(rank=0)
        assert writer.usable() is None
        writer.queue.schedule_async_request(AsyncRequest(writer_probe.report, (out,), []))
        deadline = time.monotonic() + 60
        while not os.path.exists(out) and time.monotonic() < deadline:
            writer.poll()
            time.sleep(0.02)
        print(json.dumps({"rank": os.getpid(), **json.load(open(out))}), flush=True)
        if then == "stay":
            while True:
                time.sleep(1)
        writer.close()
""")
# Runs in the writer: what it is and what it has, into ``out``; a line on its standard error.
WRITER_PROBE = textwrap.dedent("""
    import json, os, sys
    def report(out):
        umask = os.umask(0)
        os.umask(umask)
        status = open("/proc/self/status").read()
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\\0")
        print("a line from the writer", file=sys.stderr, flush=True)
        with open(out + ".tmp", "w") as f:
            json.dump({"writer": os.getpid(), "parent": os.getppid(), "probe": os.environ.get("PROBE"),
                       "umask": umask, "nice": os.getpriority(os.PRIO_PROCESS, 0), "sigterm_blocked": bool(blocked >> 14 & 1),
                       "spawned": any(b"multiprocessing" in part for part in cmdline),
                       "cuda_hidden": os.environ.get("CUDA_VISIBLE_DEVICES") == ""}, f)
        os.rename(out + ".tmp", out)
""")
CLIENT = (
    "import sys; from resilient_fsdp.resilience import prewarm; r = prewarm.run_as_client(sys.argv[1:]); "
    "sys.exit(99 if r is None else r)"
)


def _start_server(tmp) -> dict:
    (tmp / "rank_probe.py").write_text(RANK)
    (tmp / "writer_probe.py").write_text(WRITER_PROBE)
    path = str(tmp / "prewarm.sock")
    env = {**_env(), "PYTHONPATH": f"{tmp}:{REPO / 'train'}:{_env().get('PYTHONPATH', '')}".rstrip(":")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "resilient_fsdp.resilience.prewarm",
            f"--socket={path}",
            "--module=rank_probe",
            "--",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.path.exists(path), "the server never bound its socket"
    return {"path": path, "env": env, "tmp": tmp, "proc": proc}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = _start_server(tmp_path_factory.mktemp("writer-fork-server"))
    yield started
    started["proc"].terminate()
    started["proc"].wait(timeout=30)


def _rank(server, name: str, then: str = "close") -> tuple[subprocess.Popen, dict]:
    """A client whose rank starts its writer; (the client, what the writer reported)."""
    out = server["tmp"] / f"{name}.json"
    env = {**server["env"], prewarm.SOCKET_ENV: server["path"], "PROBE": f"from client {name}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(out), then],
        env=env,
        cwd=server["tmp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        umask=0o027,
    )
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=60)[1][-3000:]
    return proc, json.loads(line)


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_ranks_writer_is_forked_by_the_pods_fork_server_with_what_spawn_would_have_given_it(server):
    proc, seen = _rank(server, "first")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    fork_server = psutil.Process(seen["parent"])
    assert fork_server.ppid() == server["proc"].pid and seen["parent"] != seen["rank"]
    assert not seen["spawned"]  # a fork: no new interpreter importing torch
    assert seen["probe"] == "from client first" and seen["umask"] == 0o027 and seen["cuda_hidden"]
    assert seen["nice"] == WRITER_NICE and seen["sigterm_blocked"]
    assert "a line from the writer" in err  # the rank's standard error


def test_a_killed_ranks_writer_exits_and_the_next_ranks_writer_comes_from_the_same_fork_server(server):
    proc, seen = _rank(server, "killed", then="stay")
    os.killpg(proc.pid, signal.SIGTERM)  # as ft_launcher stops a rank: its client's process group
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert _gone(seen["rank"]), "the rank outlived its client"
    assert _gone(seen["writer"]), "the writer outlived its rank"
    again, seen_again = _rank(server, "restarted")
    again.communicate(timeout=60)
    assert seen_again["parent"] == seen["parent"] and seen_again["writer"] != seen["writer"]


def test_without_the_fork_server_a_ranks_writer_is_spawned(tmp_path):
    server = _start_server(tmp_path)
    try:
        proc, seen = _rank(server, "before")
        proc.communicate(timeout=60)
        os.kill(seen["parent"], signal.SIGKILL)  # the pod's fork server dies
        assert _gone(seen["parent"])
        proc, seen = _rank(server, "after")
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert seen["spawned"] and seen["parent"] == seen["rank"]
        assert seen["probe"] == "from client after" and seen["nice"] == WRITER_NICE and seen["sigterm_blocked"]
    finally:
        server["proc"].terminate()
        server["proc"].wait(timeout=30)
