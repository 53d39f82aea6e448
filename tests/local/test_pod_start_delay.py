"""``--pod-start-delay`` and ``--replacement-delay``: the flags' checks, the launcher starting a
delayed pod late once, and a lost pod's replacement late each time.

The scheduling tests run the launcher in a process of its own (it becomes a subreaper and reaps
its descendants) on two trivial pods, a Python one-liner each, no training, on loopback, which
needs no root: each pod records when it started, and the first start of one of them fails (or
asks the local cluster to lose it, as a ``node-loss`` fault does) so that the controller recreates it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import resilient_fsdp
from resilient_fsdp.cli import main as cli_main
from resilient_fsdp.config import ConfigError
from resilient_fsdp.local.job import start_delays

DELAY = 2.0
# How much later one pod's interpreter may reach its first line than another's, started at the
# same moment, on a loaded two-core machine: the launcher's delay is between the two starts, and
# each pod records its own start only once Python is up.
START_JITTER = 0.5

# Appends "n<index> <start time>" to STARTS (not the hostname, which loopback mode rewrites in a
# pod's env to its address); the first start of FAIL_FIRST exits 137, as a pod
# killed with its node does (PyTorchJob ExitCode: recreated); the first start of LOSE_FIRST asks
# the local cluster to lose its pod (a node-loss request) and waits to be killed.
POD = """
import json, os, sys, time
path, me = os.environ["STARTS"], os.environ["POD"]
with open(path, "a") as f:
    f.write(f"{me} {time.monotonic()}\\n")
starts = [line.split()[0] for line in open(path)].count(me)
if me == os.environ["LOSE_FIRST"] and starts == 1:
    request = os.path.join(os.environ["REQUESTS"], f"node-loss-step1-node{me[1:]}.json")
    with open(request + ".tmp", "w") as f:
        json.dump({"kind": "node-loss", "node": int(me[1:]), "step": 1}, f)
    os.rename(request + ".tmp", request)
    time.sleep(30)
sys.exit(137 if me == os.environ["FAIL_FIRST"] and starts == 1 else 0)
"""


# The launcher on two trivial pods: argv run_dir, {index: seconds}, the pod whose first start fails.
LAUNCH = """
import json, sys
from pathlib import Path
from resilient_fsdp.local.cluster.launcher import LocalJob, LocalLauncher
from resilient_fsdp.local.manifests.pytorchjob import RestartPolicy
from resilient_fsdp.local.manifests.spec import PodSpec, Workload
from resilient_fsdp.local.runtime.loopback import LoopbackRuntime

run_dir, delays, fail_first = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
lose_first, replacement_delay = sys.argv[5], float(sys.argv[6])
pods = [PodSpec(hostname=f"trivial-{i}", index=i, role="worker", container="main",
                command=[sys.executable, "-c", sys.argv[4]], args=[], mounts=[], volumes={},
                env={"STARTS": str(run_dir / "starts"), "POD": f"n{i}", "FAIL_FIRST": fail_first,
                     "LOSE_FIRST": lose_first, "REQUESTS": str(run_dir / "faults" / "requests")})
        for i in range(2)]
workload = Workload("PyTorchJob", "trivial", "default", pods, {}, RestartPolicy("ExitCode", None),
                    "trivial-0:29400", success="all")
job = LocalJob(workload=workload, run_dir=run_dir, fail_grace_s=5,
               start_delays={int(i): s for i, s in delays.items()}, replacement_delay_s=replacement_delay)
runtime = LoopbackRuntime(workload, run_dir, "sd0001", {"PATH": "/usr/bin:/bin"})
try:
    sys.exit(LocalLauncher(job, runtime).run())
finally:
    runtime.close()
"""


def run_trivial(
    tmp_path: Path, delays: dict[int, float], fail_first: str, lose_first: str = "none", replacement_delay: float = 0.0
) -> tuple[int, str, dict[str, list[float]]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(resilient_fsdp.__file__).resolve().parents[1])}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            LAUNCH,
            str(run_dir),
            json.dumps(delays),
            fail_first,
            POD,
            lose_first,
            str(replacement_delay),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
    )
    starts: dict[str, list[float]] = {}
    for line in (run_dir / "starts").read_text().splitlines():
        pod, when = line.split()
        starts.setdefault(pod, []).append(float(when))
    return proc.returncode, proc.stdout + proc.stderr, starts


@pytest.mark.timeout(60)
def test_a_delayed_pod_starts_late_the_first_time_only(tmp_path):
    code, out, starts = run_trivial(tmp_path, {0: DELAY}, fail_first="n0")
    assert code == 0, out
    assert "[local] trivial-0 (pod 0) starts 2 s after the others (--pod-start-delay" in out
    assert "[local] starting trivial-0 (pod 0), 2 s after the others (--pod-start-delay)" in out
    first, recreated = starts["n0"]
    assert first - starts["n1"][0] >= DELAY - START_JITTER, out
    # Its recreation (after the 137) is not delayed again: it starts within the watch loop's beat.
    assert recreated - first < DELAY / 2, out
    assert "trivial-0 exited with code 137" in out and "job finished: every pod exited 0" in out


@pytest.mark.timeout(60)
def test_without_a_delay_every_pod_starts_at_once(tmp_path):
    code, out, starts = run_trivial(tmp_path, {}, fail_first="none")
    assert code == 0, out
    assert abs(starts["n0"][0] - starts["n1"][0]) < DELAY - START_JITTER
    assert "--pod-start-delay" not in out


@pytest.mark.timeout(60)
def test_a_lost_pods_replacement_starts_after_the_replacement_delay_and_an_exited_one_at_once(tmp_path):
    code, out, starts = run_trivial(tmp_path, {}, fail_first="n1", lose_first="n0", replacement_delay=DELAY)
    assert code == 0, out
    assert "trivial-0 was lost (its processes were killed)" in out
    assert "[local] trivial-0's replacement starts in 2 s (--replacement-delay)" in out
    assert "[local] starting trivial-0 (pod 0), 2 s after the loss (--replacement-delay" in out
    first, replacement = starts["n0"]
    assert replacement - first >= DELAY, out  # the loss comes after the first start, the delay after it
    # A pod that exits on its own (137: not lost) is recreated at once, replacement delay or not.
    failed, recreated = starts["n1"]
    assert recreated - failed < DELAY / 2, out


def test_start_delays_parse_and_check_the_flag():
    assert start_delays(["0=30", "2=1.5"], pods=3) == {0: 30.0, 2: 1.5}
    assert start_delays([]) == {}
    for flag, message in [
        ("x=3", "give INDEX=SECONDS"),
        ("3", "give INDEX=SECONDS"),
        ("-1=3", "give INDEX=SECONDS"),
        ("0=soon", "SECONDS must be a number of seconds, 0 or more"),
        ("0=-2", "SECONDS must be a number of seconds, 0 or more"),
        ("0=nan", "SECONDS must be a number of seconds, 0 or more"),
    ]:
        with pytest.raises(ConfigError, match=message) as raised:
            start_delays([flag])
        assert f"--pod-start-delay {flag}:" in str(raised.value) and "e.g. --pod-start-delay 0=30" in str(raised.value)
    with pytest.raises(ConfigError, match=r"--pod-start-delay 2=5: the job has 2 pod\(s\), so INDEX is 0 to 1"):
        start_delays(["2=5"], pods=2)
    with pytest.raises(ConfigError, match="pod 0 already has a delay"):
        start_delays(["0=5", "0=6"], pods=2)


def test_the_command_refuses_a_bad_delay_with_exit_2(tmp_path, capsys):
    args = ["local", "--run-dir", str(tmp_path / "run"), "--isolation", "loopback", "--nodes", "2"]
    assert cli_main([*args, "--pod-start-delay", "zero=5"]) == 2
    assert "error: --pod-start-delay zero=5: give INDEX=SECONDS" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the render
    assert cli_main([*args, "--pod-start-delay", "2=5"]) == 2
    assert "error: --pod-start-delay 2=5: the job has 2 pod(s), so INDEX is 0 to 1" in capsys.readouterr().err
    assert cli_main([*args, "--replacement-delay", "-1"]) == 2
    assert "error: --replacement-delay=-1: give a number of seconds, 0 or more" in capsys.readouterr().err
