"""The deterministic-failure rule: the same failure at the same place, after a restart that
replayed it, is no transient fault, and no layer retries it again.

Every restart resumes exactly, so a step trained again sees what it saw the first time: a
transient fault (a killed rank, a hang, an NCCL error) does not come back, a bug in ``forward`` or
an unreadable sample does. :func:`judge` gives a failure its :class:`Signature`, records it with
its place in ``<run_dir>/faults/failures/`` (shared by every pod) and raises
:class:`RepeatedFailure` (configuration-type: :func:`.exit_codes.is_configuration_failure`) when
an earlier attempt recorded the same at the same place. The trainer's attempt
(:mod:`.attempt`) and the non-finite loss rule (:mod:`.non_finite`) use it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Optional

from .. import atomic
from .ledger import json_records

START = "start"
"""The place of an attempt before its first step: the model, the data, the resume."""

# The directory under <run_dir>/faults/ that holds the records.
RECORDS = "failures"
_TRACEBACK_CHARS = 20_000
_MESSAGE_CHARS = 2_000

# Numbers as a message carries them: addresses, hex ids, decimals, exponents, plain integers.
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# What a peer's failure, an abort or a lost connection raises on the ranks that did not fail:
# gloo's and NCCL's errors are RuntimeErrors that only their text tells apart.
_COMMUNICATION = re.compile(
    r"gloo|nccl|\bc10d\b|ProcessGroup|Connection (?:closed|reset|refused)|Broken pipe|Socket Timeout|"
    r"timed out|Timeout|TCPStore|DistStore|DistNetwork|DistBackend|aborted|abort\(\)|watchdog",
    re.I,
)
_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.ESTALE,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EBUSY,
    errno.EINTR,
    errno.ENOLINK,
    errno.EREMOTEIO,
}
# Libraries whose every exception is a remote service's or a network's (S3 through boto3), or
# NVRx's own restart machinery.
_TRANSIENT_MODULES = ("botocore", "boto3", "s3transfer", "urllib3", "requests", "nvidia_resiliency_ext")


class RepeatedFailure(Exception):
    """The same failure at the same place as an earlier attempt's, after a restart that replayed
    that place: configuration-type (:func:`.exit_codes.is_configuration_failure`), retried by no
    layer. ``record``: what this attempt recorded of it."""

    def __init__(self, message: str, record: Optional[dict] = None):
        super().__init__(message)
        self.record = record or {}


@dataclass(frozen=True)
class Signature:
    """What makes two failures the same one.

    Its type, its message with every number and address replaced by ``N`` (ranks, sizes, pids and
    tensor values vary between attempts), and the innermost frame of its traceback outside torch.
    """

    type: str
    """The exception's class, with its module (``builtins.ValueError``)."""
    message: str
    """Its message, numbers and addresses as ``N``, whitespace collapsed."""
    frame: str
    """The innermost frame outside torch: ``path:line in function`` (the path from its package on)."""

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.type}\n{self.message}\n{self.frame}".encode()).hexdigest()[:16]


def normalised(message: str) -> str:
    """``message`` with every number and address as ``N`` and its whitespace collapsed."""
    return " ".join(_NUMBER.sub("N", message).split())[:_MESSAGE_CHARS]


def _torch_dir() -> Optional[str]:
    try:
        import torch
    except ImportError:
        return None
    return os.path.dirname(torch.__file__) + os.sep


def _short_path(path: str) -> str:
    """A frame's file from its package on (``resilient_fsdp/train/trainer.py``), so one image's
    frames read the same in every pod whatever its site-packages is called."""
    parts = Path(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    return "/".join(parts[-3:])


def innermost_frame(tb: Optional[TracebackType]) -> str:
    """The innermost frame of ``tb`` whose file is not torch's: where the code that failed was
    called from (the user's ``forward``, the trainer's loss), ``"-"`` when there is none."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    skip = _torch_dir()
    for frame in reversed(frames):
        if skip is None or not frame.filename.startswith(skip):
            return f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"
    return "-"


def signature(exc: BaseException) -> Signature:
    kind = type(exc)
    return Signature(f"{kind.__module__}.{kind.__qualname__}", normalised(str(exc)), innermost_frame(exc.__traceback__))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes and contexts, each once."""
    seen, out = set(), []
    node: Optional[BaseException] = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        out.append(node)
        node = node.__cause__ or node.__context__
    return out


def transient_reason(exc: BaseException) -> Optional[str]:
    """Why ``exc`` (or what caused it) is a communication or storage failure, which keeps every
    retry; None when it is judged by the rule."""
    try:
        from torch.distributed import DistError
    except ImportError:  # torch without distributed: nothing raises it
        DistError = ()
    for e in _chain(exc):
        module = type(e).__module__ or ""
        if module.split(".")[0] in _TRANSIENT_MODULES:
            return f"{module}.{type(e).__qualname__}: a remote service's or the restart machinery's"
        if isinstance(e, (ConnectionError, TimeoutError, socket.timeout)):
            return f"{type(e).__name__}: a lost connection or a timeout"
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return f"{errno.errorcode.get(e.errno, e.errno)}: an I/O or network error that may pass"
        if isinstance(e, DistError):
            return f"{type(e).__name__}: a collective or the rendezvous store failed"
        if isinstance(e, RuntimeError) and _COMMUNICATION.search(str(e)):
            return "a collective's or the process group's error (a peer failed, or its connection did)"
    return None


def earlier(records: list[dict], where: str, digest: Optional[str], attempt: Optional[str] = None) -> list[dict]:
    """The records of ``records`` (oldest first) at ``where`` with ``digest`` (None: any) since the
    last one that failed the job, left by an attempt other than ``attempt`` (whose other ranks may
    have failed the job already: their record does not start a new count)."""
    since = 0
    for i, record in enumerate(records):
        if record.get("outcome") == "failed" and (attempt is None or record.get("attempt") != attempt):
            since = i + 1
    return [
        r
        for r in records[since:]
        if r.get("where") == where
        and (digest is None or r.get("digest") == digest)
        and (attempt is None or r.get("attempt") != attempt)
    ]


class FailureRecords:
    """The judged failures of a run directory, one JSON file each, on storage every rank shares."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "faults" / RECORDS

    def read(self) -> list[dict]:
        """Every record, oldest first (one torn by a crash mid-write is nothing to judge by)."""
        return json_records(self.dir)

    def add(self, record: dict) -> tuple[Path, bool]:
        """Keep ``record`` (one per signature, place, attempt and outcome: every rank that fails the
        same way writes the same file, the first one wins); its path and whether this call wrote it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", record["where"].lower()).strip("-")
        path = self.dir / f"{record['digest']}-{slug}-{record['attempt']}-{record['outcome']}.json"
        return path, atomic.create_exclusive(path, json.dumps(record, sort_keys=True))


def judge(exc: BaseException, where: str, attempt: str, records: FailureRecords, identity: dict) -> Optional[str]:
    """Judge ``exc``, which ends an attempt (``attempt``: its id, the same on every rank) at
    ``where``: raise :class:`RepeatedFailure` (from ``exc``) when an earlier attempt failed the same
    way there, else record it. Returns what to say about it (said by the rank whose record is kept),
    or None. ``identity``: who failed (rank, node, host, layer), kept in the record.

    The place is the key, not the checkpoint: any resume (the first attempt's checkpoint, a newer
    one, the pod's memory snapshot) computes the step from the same state. Failures before the
    attempt's process group exists are the rendezvous' and the network's: never judged. Only records
    since the last one that failed the job count: a job started again after a fix gets its one
    restart again.
    """
    if transient_reason(exc) is not None:
        return None
    sig = signature(exc)
    try:
        before = earlier(records.read(), where, sig.digest, attempt)
    except OSError:
        return None  # the run directory cannot be read: nothing to judge by, the failure stays retried
    record = {
        **asdict(sig),
        "digest": sig.digest,
        "where": where,
        "attempt": attempt,
        "t": time.time(),
        "raw_message": str(exc)[:_MESSAGE_CHARS],
        "host": socket.gethostname(),
        **identity,
        "traceback": "".join(traceback.format_exception(exc))[-_TRACEBACK_CHARS:],
        "outcome": "failed" if before else "restart",
    }
    try:
        path, written = records.add(record)
    except OSError:
        path, written = None, False
    what = f"{sig.type.removeprefix('builtins.')}: {str(exc)[:500]} (at {sig.frame})"
    if before:
        first = before[0]
        raise RepeatedFailure(
            f"the same failure at {where} after a restart that replayed it, so no transient fault: {what}. It first "
            f"ended attempt {first['attempt']} on rank {first.get('rank')} (node {first.get('node')}, host "
            f"{first.get('host')}), and {len(before) + 1} attempt(s) ended with it in all; no layer retries it "
            f"again. Fix its cause (the traceback is in this rank's log and in {path or records.dir}) and start the "
            "job again: it resumes from the newest committed checkpoint",
            record,
        ) from exc
    if not written:
        return None
    return (
        f"{what} ended this attempt at {where}; recorded as {path.name} in {records.dir}: a restart replays "
        f"{where} exactly, and the same failure there again ends the job (exit 2) instead of another retry"
    )
