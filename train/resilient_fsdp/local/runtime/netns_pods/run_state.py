"""The record of each local run: run ids, state files, their lock, and whether a run's owner lives.

Every run has the state file ``/run/resilient-fsdp/netns/<id>.json`` and the temp directory
``<id>.d`` beside it. The state file records the run's resource names, its /24 and its owner (pid
and start time, so a reused pid does not pass for the owner). It is written before the first
resource exists and removed after the last one is gone, so a launcher killed at any point leaves a
record; ``plumbing.cleanup_stale()`` reads these records to find what dead runs left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from .... import atomic

STATE_DIR = Path("/run/resilient-fsdp/netns")
RUN_ID = re.compile(r"^[a-z0-9]{1,6}$")
# What atomic.write_bytes leaves beside a state file when it is killed mid-write:
# ".<id>.json.tmp<pid>".
_TMP_STATE = re.compile(r"^\.([a-z0-9]{1,6})\.json\.tmp\d*$")


def new_run_id() -> str:
    return secrets.token_hex(3)


def state_path(run_id: str) -> Path:
    return STATE_DIR / f"{run_id}.json"


def run_dir(run_id: str) -> Path:
    """The run's temp directory: the hosts file, and the empty directory pods stage mounts on."""
    return STATE_DIR / f"{run_id}.d"


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22, starttime


def boot_id() -> str:
    """This boot's id: a start time only identifies a process within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def owner_alive(state: dict) -> bool:
    """Whether the launcher that wrote ``state`` still runs (same boot, pid AND start time)."""
    if state.get("boot_id") != boot_id():  # /run is not a tmpfs everywhere: it may outlive a boot
        return False
    try:
        start = process_start(int(state["owner_pid"]))
        return start is not None and start == int(state["owner_start"])
    except (KeyError, TypeError, ValueError):
        return False


@contextlib.contextmanager
def state_lock() -> Iterator[None]:
    """Serialise subnet choice, probes and stale cleanup across launchers.

    An flock is released by the kernel when its holder dies, so a SIGKILLed launcher cannot
    leave it held. Not reentrant: a second flock from the same process on a new descriptor blocks.
    """
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_state(run_id: str, state: dict) -> None:
    """Replace the run's state file atomically (a reader never sees half a file)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    atomic.write_json(state_path(run_id), state, indent=1, newline=False)


def read_states() -> dict[str, dict]:
    """Every run's state by run id; an unreadable file reads as ``{}`` (an ownerless run)."""
    states: dict[str, dict] = {}
    for path in STATE_DIR.glob("*.json"):
        if not RUN_ID.match(path.stem):
            continue
        try:
            states[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            states[path.stem] = {}
    return states


def remove_state(run_id: str) -> None:
    state_path(run_id).unlink(missing_ok=True)
    for path in STATE_DIR.glob(f".{run_id}.json.tmp*"):
        path.unlink(missing_ok=True)


def remove_leftover_files(live: set[str]) -> None:
    """Remove the temp directories and half-written state files of every run not in ``live``."""
    for path in STATE_DIR.glob("*.d"):
        run_id = path.name[:-2]
        if RUN_ID.match(run_id) and run_id not in live:
            shutil.rmtree(path, ignore_errors=True)
    for path in STATE_DIR.glob(".*.json.tmp*"):
        if (m := _TMP_STATE.match(path.name)) and m.group(1) not in live:
            path.unlink(missing_ok=True)
