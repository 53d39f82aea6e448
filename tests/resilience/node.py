"""One node as a pod runs it, for the restart-policy tests: the node agent
(``python -m resilient_fsdp.resilience.agent``) around ``ft_launcher`` and the trainer's
ranks; real processes. The agent hosts the rendezvous store, as a one-node pod does and
as NVRx 0.7's barrier rendezvous requires."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from resilient_fsdp.config import load_config
from resilient_fsdp.resilience.ft_config import ft_launcher_flags, write_ft_config
from resilient_fsdp.resilience.nvrx import RDZV_STORE_IN_NODE
from tests.support import FAST, REPO, _env, run_guarded

AGENT = [sys.executable, "-m", "resilient_fsdp.resilience.agent"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(
    run_dir: Path,
    overrides: list[str],
    nproc: int = 2,
    inject: list[str] | None = None,
    trainer_args: list[str] | None = None,
) -> list[str]:
    """The agent's command line for a one-node job of ``nproc`` ranks in ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sets = [a for o in FAST + overrides for a in ("--set", o)]
    trainer = [
        "-m",
        "resilient_fsdp.train",
        "--run-dir",
        str(run_dir),
        *sets,
        *[f"--inject={s}" for s in inject or []],
        *(trainer_args or []),
    ]
    rdzv = [
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.5",
        f"--log-dir={run_dir / 'logs'}",
    ]
    resilience = load_config(None, overrides).resilience
    ft_cfg = write_ft_config(run_dir / "ft_config.yaml", resilience)
    return [
        *AGENT,
        f"--ft-cfg-path={ft_cfg}",
        *rdzv,
        f"--rdzv-id=node-{run_dir.name}",
        RDZV_STORE_IN_NODE,
        *ft_launcher_flags(resilience),
        *trainer,
    ]


def run_node(
    run_dir: Path,
    overrides: list[str],
    pythonpath: list[Path] | None = None,
    inject: list[str] | None = None,
    timeout: float = 300,
    trainer_args: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run one node to its end; the agent's exit code is the pod's."""
    cmd = node_command(run_dir, overrides, inject=inject, trainer_args=trainer_args)
    env = {"PYTHONUNBUFFERED": "1"}
    return run_guarded(cmd, run_dir, pythonpath, timeout, env)


def start_node(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    """Start one node in the background (output to ``run_dir/node.log``)."""
    cmd = node_command(run_dir, overrides)
    log = open(run_dir / "node.log", "w")
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
        env=_env(None, run_dir, {"PYTHONUNBUFFERED": "1"}),
    )


def attempts(log_dir: Path) -> list[str]:
    """The worker groups a launcher started: torch elastic's ``<log_dir>/<run>/attempt_<k>`` folders."""
    return sorted({p.name for p in log_dir.glob("*/attempt_*")})
