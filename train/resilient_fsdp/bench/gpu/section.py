"""What every section of the GPU check gets: its plan (model sizes, step counts), its folder, its
deadline, and helpers to run the trainer and read what it wrote. Standard library only."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ... import atomic


@dataclass(frozen=True)
class Plan:
    """Model sizes and step counts; the GPU plan, or the tiny one for a rehearsal."""

    big_preset: str  # throughput and checkpoint
    big_seq_len: int
    big_micro_batch: int
    warmup_steps: int
    max_steps: int
    max_measure_s: float
    small_preset: str  # the restart and resume runs
    small_seq_len: int
    small_micro_batch: int
    lr: Optional[float]  # None: the configured default
    run_steps: int = 40
    interval_steps: int = 10
    fault_step: int = 22
    stop_step: int = 20
    # The checkpoint section: the presets measured (the later ones only if they fit the machine)
    # and the measured saves per engine, after one unmeasured save for the asynchronous ones.
    checkpoint_presets: tuple = ("1b", "8b")
    checkpoint_saves: int = 2


GPU_PLAN = Plan("1b", 2048, 4, 10, 300, 60.0, "125m", 512, 8, lr=3e-4)
# The rehearsal only has to run every code path, in CI time: few steps, one measured save.
TINY_PLAN = Plan(
    "tiny",
    64,
    4,
    3,
    20,
    6.0,
    "tiny",
    64,
    4,
    lr=None,
    run_steps=12,
    interval_steps=4,
    fault_step=7,
    stop_step=8,
    checkpoint_presets=("tiny", "8b"),
    checkpoint_saves=1,
)


def tail(path: Path, lines: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# ---- what every section gets ------------------------------------------------------------------


class Section:
    """What a section's code gets: its plan, its folder, its deadline, and a way to save progress."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.cpu, self.tiny = args.cpu, args.tiny
        self.plan = TINY_PLAN if args.tiny else GPU_PLAN
        self.work = Path(args.work_dir)
        self.dir = self.work / name
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, status: str = "running", **extra: Any) -> None:
        """Write the results so far: a section killed at its budget still reports them."""
        atomic.write_json(
            self.work / f"{self.name}.json",
            {"status": status, "results": self.results, **extra},
            sort_keys=False,
            default=str,
            newline=False,
        )

    def overrides(self, run_dir: Path, big: bool) -> list[str]:
        p = self.plan
        preset, seq, mb = (
            (p.big_preset, p.big_seq_len, p.big_micro_batch)
            if big
            else (p.small_preset, p.small_seq_len, p.small_micro_batch)
        )
        out = [
            f"run_dir={run_dir}",
            f"model.preset={preset}",
            f"data.seq_len={seq}",
            f"data.micro_batch_size={mb}",
            f"dist.device={'cpu' if self.cpu else 'cuda'}",
        ]
        return out + ([f"optim.lr={p.lr}"] if p.lr else [])

    def run_overrides(self, run_dir: Path) -> list[str]:
        """The restart and resume runs: one configuration, so their final parameters compare."""
        p = self.plan
        return self.overrides(run_dir, big=False) + [
            f"train.steps={p.run_steps}",
            f"checkpoint.interval_steps={p.interval_steps}",
            "train.log_every=10",
            "checkpoint.keep_last=1",
            # NCCL's timeout above in-process restart's hard one.
            f"dist.timeout_s={60 if self.cpu else 120}",
        ]

    def in_process_overrides(self, run_dir: Path) -> list[str]:
        from ..recovery import COMMON

        out = self.run_overrides(run_dir) + COMMON + ["resilience.in_process.enabled=true"]
        if not self.cpu:
            # CUDA start-up (context, NCCL, first kernels) must not look like a hang to the wrapper.
            out += [
                "resilience.in_process.soft_timeout_s=60",
                "resilience.in_process.hard_timeout_s=90",
                "resilience.in_process.heartbeat_timeout_s=30",
            ]
        return out


def _child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, env: Optional[dict] = None) -> int:
    """Run ``cmd`` with its output appended to ``log``; a timeout kills it and is an error."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_child_env(env),
                timeout=max(1.0, timeout),
            ).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:4])} …; see {log}") from None


def train_run(
    s: Section, run_dir: Path, overrides: list[str], flags: Optional[list[str]] = None, env: Optional[dict] = None
) -> dict:
    """One trainer process (``python -m resilient_fsdp.train``); returns its ``summary.json``."""
    cmd = [sys.executable, "-m", "resilient_fsdp.train", "--run-dir", str(run_dir), *(flags or [])]
    for o in overrides:
        cmd += ["--set", o]
    log = s.work / f"{s.name}-runs.log"
    code = run_logged(cmd, log, s.remaining() - 5, env)
    if code != 0:
        raise RuntimeError(f"trainer run in {run_dir.name} exited with code {code}: " + " | ".join(tail(log, 3)))
    return json.loads((run_dir / "summary.json").read_text())


def step_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("event") == "step":
                out[int(r["step"])] = float(r["loss"])
    return out
