"""Pre-warmed ranks (``resilience.prewarm``) between real processes: a server that has imported the
trainer forks a rank for each client, which ends as its rank ends (exit code or signal), passes
on the signals it gets, takes its rank with it when it is killed, and runs the rank itself when
the server refuses or is not there. A trainer forked from the server trains bitwise like one
started afresh, and finds every heavy module it uses already imported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from resilient_fsdp.resilience import nccl_env, prewarm
from tests.support import REPO, _env, read_summary, run_trainer

# The rank a test server forks: what it does is its first argument.
PROBE = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    what = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else None
    if what == "threads":  # torch is imported already (the server's preload)
        import torch
        print(json.dumps({"threads": torch.get_num_threads(), "env": os.environ.get("OMP_NUM_THREADS")}), flush=True)
        sys.exit(0)
    if what == "report":
        print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                          "socket": os.environ.get("RESILIENT_FSDP_PREWARM_SOCKET"), "argv": sys.argv[1:],
                          "umask": os.umask(0o22), "main": __name__}), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.exit(7)
    if what == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(143)))
    if what in ("term", "hang"):
        # hang: a helper in the rank's process group, holding the rank's streams
        child = subprocess.Popen(["sleep", "600"]) if what == "hang" else None
        with open(out, "w") as f:
            json.dump({"pid": os.getpid(), "child": child and child.pid}, f)
        while True:
            time.sleep(0.05)
""")

CLIENT = (
    "import sys; from resilient_fsdp.resilience import prewarm; r = prewarm.run_as_client(sys.argv[1:]); "
    "sys.exit(99 if r is None else r)"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A pre-warmed server whose forks run the probe (it imports the trainer as the pod's does), in
    the environment the node agent gives it for two ranks a node."""
    started = start_server(tmp_path_factory.mktemp("prewarm"))
    yield started
    started["proc"].terminate()
    started["proc"].wait(timeout=30)


def start_server(tmp: Path, trainer_args: tuple[str, ...] = ()) -> dict:
    """A probe server for ranks started with ``trainer_args`` (the pod's ``--config``, ``--set``)."""
    (tmp / "probe_rank.py").write_text(PROBE)
    path = str(tmp / "prewarm.sock")
    env = {k: v for k, v in _env().items() if k != "OMP_NUM_THREADS"}
    env = prewarm.with_launcher_threads({**env, "PYTHONPATH": f"{tmp}:{REPO / 'train'}"}, nproc_per_node=2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "resilient_fsdp.resilience.prewarm",
            f"--socket={path}",
            "--module=probe_rank",
            "--",
            *trainer_args,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60  # bound before the imports: a client then waits for them
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.path.exists(path), "the server never bound its socket"
    return {"path": path, "env": env, "tmp": tmp, "proc": proc}


def client(server, *args, env=None, **kwargs) -> subprocess.Popen:
    env = {**server["env"], prewarm.SOCKET_ENV: server["path"], "PROBE": "from the client", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, *args],
        env=env,
        cwd=server["tmp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def test_a_forked_rank_has_the_clients_streams_environment_and_directory_and_its_exit_code_comes_back(server):
    proc = client(server, "report", "x")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err
    report = json.loads(out)
    assert report["pid"] != proc.pid and report["sid"] == report["pid"]  # a session of its own
    assert report["probe"] == "from the client" and report["cwd"] == str(server["tmp"])
    assert report["socket"] is None  # the rank's own children do not hand themselves over
    assert report["argv"] == ["report", "x"] and report["main"] == "__main__"
    assert "to stderr" in err


def test_a_rank_killed_by_a_signal_kills_its_client_with_the_same_signal(server):
    proc = client(server, "signal")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL


def test_sigterm_to_the_client_reaches_the_rank(server):
    marker = server["tmp"] / "term.json"
    proc = client(server, "term", str(marker))
    _wait_for(marker)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "got SIGTERM" in out, err


def test_a_killed_client_takes_its_rank_and_the_ranks_process_group_with_it(server):
    marker = server["tmp"] / "hang.json"
    proc = client(server, "hang", str(marker))
    rank = _wait_for(marker)
    os.killpg(proc.pid, signal.SIGKILL)  # as ft_launcher's stop ends: the client's process group
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_alive(rank["pid"]) or _alive(rank["child"])):
        time.sleep(0.1)
    assert not _alive(rank["pid"]) and not _alive(rank["child"])


def test_a_client_whose_import_time_environment_differs_runs_the_rank_itself_saying_why(server):
    proc = client(server, "report", env={"PYTHONPATH": server["env"]["PYTHONPATH"] + ":/elsewhere"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 99, err
    assert "PYTHONPATH differ between the rank's environment and the server's; this rank imports its own" in err


def test_a_forked_rank_runs_the_intra_op_threads_ft_launcher_gives_a_node_of_several_ranks(server):
    """ft_launcher gives each rank ``OMP_NUM_THREADS=1`` when a node runs several; OpenMP reads it
    when torch loads, in the server, so the server must have imported torch with it too."""
    assert prewarm.with_launcher_threads({}, 2) == {"OMP_NUM_THREADS": "1"}
    assert server["env"]["OMP_NUM_THREADS"] == "1"
    proc = client(server, "threads")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out) == {"threads": 1, "env": "1"}


def test_the_agent_leaves_a_set_thread_count_and_a_node_of_one_rank_alone():
    assert prewarm.with_launcher_threads({"OMP_NUM_THREADS": "4"}, 8) == {"OMP_NUM_THREADS": "4"}
    assert prewarm.with_launcher_threads({}, 1) == {}
    assert prewarm.with_launcher_threads({}, None) == {}  # --nproc-per-node=auto: the server refuses instead


def test_a_client_whose_thread_count_differs_from_the_servers_runs_the_rank_itself_saying_why(server):
    """A fork keeps the server's OpenMP thread count whatever its environment says: a rank asking for
    another one imports its own torch, which reads it."""
    proc = client(server, "threads", env={"OMP_NUM_THREADS": "2"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 99, err
    assert "OMP_NUM_THREADS differ between the rank's environment and the server's" in err


def test_a_rank_with_in_process_restart_is_forked_from_a_server_that_set_the_layers_variables(tmp_path):
    """The in-process layer's variables (TORCH_CPP_LOG_LEVEL among them, read when torch loads) are
    set by the server before its imports and by a rank only after the hand-over: the server
    compares the rank's environment as the rank would hold it at its torch import."""
    in_process = ("--set", "resilience.in_process.enabled=true")
    layer: dict[str, str] = {}
    nccl_env.apply_before_torch(["threads", *in_process], layer)
    assert layer["TORCH_CPP_LOG_LEVEL"] == "error"  # the layer sets variables, so the check below can fail
    started = start_server(tmp_path, in_process)
    try:
        proc = client(started, "threads", *in_process)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err  # forked: 99 is a client that ran the rank itself
        assert "did not fork this rank" not in err
        assert json.loads(out)["threads"] == 1
    finally:
        started["proc"].terminate()
        started["proc"].wait(timeout=30)


def test_without_a_server_the_client_runs_the_rank_itself(tmp_path, server):
    proc = client(server, "report", env={prewarm.SOCKET_ENV: str(tmp_path / "none.sock")})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 99 and "no pre-warmed server at" in err


def test_a_client_does_not_wait_for_a_server_that_died_before_it_bound(tmp_path, server):
    dead = subprocess.Popen(["true"])
    dead.wait()
    sock = tmp_path / "dead.sock"
    Path(f"{sock}.starting").write_text(str(dead.pid))  # as the agent leaves it for a server that died
    started = time.monotonic()
    proc = client(server, "report", env={prewarm.SOCKET_ENV: str(sock)})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 99 and "no pre-warmed server at" in err
    assert time.monotonic() - started < prewarm.CONNECT_WAIT_S / 4


def test_a_server_with_a_second_thread_or_another_interpreter_does_not_fork():
    request = {"executable": sys.executable, "env": dict(os.environ), "argv": []}
    assert prewarm.refusal(request) is None or "threads" in prewarm.refusal(request)
    assert "the client runs /usr/bin/python9" in prewarm.refusal({**request, "executable": "/usr/bin/python9"})
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "threads (a fork keeps only one)" in prewarm.refusal(request)
    finally:
        stop.set()
        thread.join()


def test_a_trainer_forked_from_the_server_trains_bitwise_like_one_started_afresh(tmp_path):
    path = str(tmp_path / "trainer.sock")
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "resilient_fsdp.resilience.prewarm", f"--socket={path}", "--"],
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )  # the trainer's environment
    Path(f"{path}.starting").write_text(str(server.pid))  # as the agent does: the rank waits for the server
    try:
        steps = ["train.steps=4", "checkpoint.interval_steps=2"]
        forked = run_trainer(tmp_path / "forked", steps, env={prewarm.SOCKET_ENV: path})
        assert forked.returncode == 0, forked.stderr[-3000:]
        assert "imports its own" not in forked.stderr, forked.stderr[-3000:]
        fresh = run_trainer(tmp_path / "fresh", steps)
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        assert read_summary(tmp_path / "forked")["params_sha256"] == read_summary(tmp_path / "fresh")["params_sha256"]
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert "pre-warmed server ready" in err and server.returncode == 0, err[-3000:]


# A trainer run in a process that first made the server's preload (the server's own function);
# prints the modules the run imported after that. Guarded: the writer process it spawns imports
# this script again.
AFTER_PRELOAD = textwrap.dedent("""
    import json, sys
    if __name__ == "__main__":
        from resilient_fsdp.resilience import nccl_env, prewarm
        prewarm._preload(sys.argv[1:])
        before = set(sys.modules)
        from resilient_fsdp.train.entrypoint import main
        try:
            main(sys.argv[1:])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print("IMPORTED AFTER " + json.dumps(sorted(set(sys.modules) - before)), flush=True)
""")
# What a rank must find imported in the server: each costs a forked rank tenths of a second or more.
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch._functorch",
    "torch.fx",
    "torch.distributed",
    "torch.nn",
    "torch.optim",
    "torch.testing",
    "numpy",
)


def test_a_trainers_heavy_imports_are_all_made_by_the_server_before_it_forks(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "after_preload.py"
    script.write_text(AFTER_PRELOAD)
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--run-dir",
            str(run_dir),
            "--set",
            "train.steps=3",
            "--set",
            "checkpoint.interval_steps=2",
            "--set",
            "dist.timeout_s=60",
        ],
        env=_env(mark=run_dir),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("IMPORTED AFTER "))
    imported = json.loads(line.removeprefix("IMPORTED AFTER "))
    late = [m for m in imported if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert late == [], f"add to prewarm.PRELOAD what imports these: {late}"
    assert read_summary(run_dir)["final_step"] == 3


def _wait_for(path: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped yet by its parent) is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
