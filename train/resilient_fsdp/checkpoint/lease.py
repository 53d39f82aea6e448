"""The lease on ``checkpoint.dir``: one job writes a checkpoint directory at a time.

Rank 0 takes ``<checkpoint.dir>/LEASE`` at start (:mod:`.preflight`, before it recovers, resumes
or commits anything), renews it from a background thread every :data:`RENEW_S` seconds, checks
it before every commit and releases it at exit. The file names the job (:func:`job_id`), the
host and the process. Every restart of the same job takes the lease over; an earlier install of
the job is waited for while it is live (up to ``checkpoint.lease_wait_s``); another job's live
lease refuses the start, naming that job; a lease whose holder is gone is taken over.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import psutil

from .. import atomic
from ..config import CheckpointConfig, ConfigError

LEASE = "LEASE"
# Set by the node agent (resilient_fsdp.resilience.node_rank): the job's id as the chart gives it,
# and this install of it.
JOB_ENV = "RESILIENT_FSDP_JOB_ID"
INSTALL_ENV = "RESILIENT_FSDP_INSTALL_ID"
TTL_S = 120.0  # a lease not renewed for this long, held on another host, is stale
RENEW_S = 30.0


def job_id(cfg: CheckpointConfig) -> str:
    """This job's identity: ``checkpoint.job_id`` when set, else the rendezvous id as the chart gives
    it (:data:`JOB_ENV`, the install's id added by the node agent), else the launcher's
    ``TORCHELASTIC_RUN_ID`` (the id ``ft_launcher`` and ``torchrun`` give every rank of every
    restart); a trainer started without a launcher is a job of its own (host and process id)."""
    if cfg.job_id:
        return cfg.job_id
    run_id = os.environ.get(JOB_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    return f"standalone-{socket.gethostname()}-{os.getpid()}"


def _process_start(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def taken_over(path: Path, holder: str) -> Optional[str]:
    """Why the lease at ``path`` is no longer ``holder``'s (its commits stop), or None while it is.
    By value, so that rank 0's commit process checks it too."""
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError):
        current = None
    current = current if isinstance(current, dict) else {}
    if current.get("holder") == holder:
        return None
    return (
        f"the lease on {path.parent} was taken over by job {current.get('job')!r} (host "
        f"{current.get('host')}); this job no longer commits checkpoints there"
    )


class Lease:
    """Rank 0's hold on one checkpoint directory."""

    def __init__(self, root: Path, job: str, say: Callable[[str], None]):
        self.root, self.job, self.say = root, job, say
        self.install = os.environ.get(INSTALL_ENV, "").strip() or None
        self.path = root / LEASE
        self.holder = uuid.uuid4().hex
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _record(self) -> dict:
        return {
            "job": self.job,
            "install": self.install,
            "holder": self.holder,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "renewed_unix": time.time(),
            "ttl_s": TTL_S,
        }

    def read(self) -> Optional[dict]:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def acquire(self) -> None:
        """Take the lease, or raise a ConfigError naming the job that holds it (one waited for
        is refused as well: :meth:`try_acquire` waits)."""
        waiting = self.try_acquire()
        if waiting is not None:
            raise ConfigError(self.refusal_after_wait(0.0))

    def try_acquire(self) -> Optional[str]:
        """Take the lease and return None; or, while an earlier install of this job holds it, take
        nothing and return whom this waits for; or raise a ConfigError naming the job that holds it."""
        current = self.read()
        if current is not None and current.get("holder") != self.holder:
            reason = self._live(current)
            if reason and current.get("job") != self.job:
                raise ConfigError(self._refusal(current, reason))
            if reason and self.install and current.get("install") and current["install"] != self.install:
                return (
                    f"waiting for the earlier install {current['install'][:8]} of job {self.job!r} (host "
                    f"{current.get('host')}, pid {current.get('pid')}; {reason}) to release the lease on "
                    f"{self.root}: it is stopping, and its final checkpoint is the one this install resumes from"
                )
            who = "an earlier run of this job" if current.get("job") == self.job else f"job {current.get('job')!r}"
            self.say(
                f"taking over the lease on {self.root} from {who} (host {current.get('host')}, pid "
                f"{current.get('pid')}{'' if current.get('job') == self.job else ': ' + self._stale(current)})"
            )
        atomic.write_json(self.path, self._record(), indent=None, newline=False)
        time.sleep(0.05)  # a second job writing at the same moment: the file tells who won
        mine = self.read()
        if mine is None or mine.get("holder") != self.holder:
            raise ConfigError(self._refusal(mine or {}, "it took the lease at the same moment"))
        self._thread = threading.Thread(target=self._renew, name="checkpoint-lease", daemon=True)
        self._thread.start()
        return None

    def refusal_after_wait(self, waited_s: float) -> str:
        current = self.read() or {}
        return (
            f"checkpoint.dir={str(self.root)!r} is still held by the earlier install {str(current.get('install'))[:8]} "
            f"of job {self.job!r} (host {current.get('host')}, pid {current.get('pid')}) after {waited_s:.0f} s "
            f"(checkpoint.lease_wait_s): its pods are still running. Delete them (kubectl get pods -A -l "
            f"jobset.sigs.k8s.io/jobset-uid={current.get('install')}) or raise checkpoint.lease_wait_s; two installs "
            "must not write one checkpoint directory"
        )

    def _live(self, lease: dict) -> Optional[str]:
        """Why ``lease``'s holder counts as alive, or None when it is stale: its process runs (on
        this host), or it was renewed within :data:`TTL_S` seconds (another host)."""
        if lease.get("host") == socket.gethostname() and lease.get("pid"):
            start = _process_start(int(lease["pid"]))
            same = start is not None and (lease.get("pid_start") is None or abs(start - lease["pid_start"]) < 1)
            return "its process is running on this host" if same else None
        age = time.time() - float(lease.get("renewed_unix", 0))
        return f"it was renewed {age:.0f} s ago" if age < float(lease.get("ttl_s", TTL_S)) else None

    def _stale(self, lease: dict) -> str:
        if lease.get("host") == socket.gethostname():
            return "its process is gone"
        return f"not renewed for {time.time() - float(lease.get('renewed_unix', 0)):.0f} s"

    def _refusal(self, lease: dict, reason: str) -> str:
        return (
            f"checkpoint.dir={str(self.root)!r} is in use by job {lease.get('job')!r} (host {lease.get('host')}, "
            f"pid {lease.get('pid')}; {reason}): two jobs must not write one checkpoint directory. Give this job "
            f"its own checkpoint.dir, or stop the other one first. This job is {self.job!r} (checkpoint.job_id, "
            f"else the launcher's rendezvous id). A lease whose job is gone is taken over once its process has "
            f"exited (same host) or {TTL_S:.0f} s after its last renewal; delete {self.path} only if you are sure"
        )

    def check(self) -> Optional[str]:
        """None while this job holds the lease; otherwise why it no longer does (commits stop)."""
        if not self.lost:
            self.lost = taken_over(self.path, self.holder)
        return self.lost

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            if self.check():
                return
            try:
                atomic.write_json(self.path, self._record(), indent=None, newline=False)
            except OSError:
                pass  # renewed again in RENEW_S; a lease is stale only after TTL_S

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.check() is None:
            try:
                self.path.unlink()
            except OSError:
                pass
