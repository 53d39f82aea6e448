"""The job-level bound a PyTorchJob does not have: its pods' failures, counted by the pods.

Under ``restartPolicy: ExitCode`` the training operator recreates every pod that exits 128-255
and its ``backoffLimit`` never ends the job, so a job whose pods keep failing holds its nodes for
ever. Each pod's node agent records a retried exit in ``<run_dir>/faults/pod-failures/``
(:func:`judge`); past the limit (``job.backoffLimit``) in a row without training progress, it
exits 2 instead. Failures between which training progressed are forgiven; a pod lost with its
node records nothing, as a Job does not count a disruption.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Optional

from .. import atomic
from .ledger import json_records

RECORDS = "pod-failures"
_TAIL_BYTES = 1 << 16  # the last step record is at the file's end, far within this
_STEP = re.compile(rb'"event": "step"')


def progress(run_dir: Path) -> int:
    """The last step training completed in ``run_dir`` (``metrics.jsonl``'s last step record), or
    0 when none is recorded or the file cannot be read. A resume drops the records of the steps it
    trains again, so a job failing at the same step again reads the same number."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        if not _STEP.search(line):
            continue
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # the first line of the tail is cut, or torn by a crash
    return 0


class PodFailures:
    """The job's recorded pod failures, oldest first."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "faults" / RECORDS

    def read(self) -> list[dict]:
        return json_records(self.dir)

    def add(self, record: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{record['t']:.6f}-{record['pod']}-{record['outcome']}.json"
        atomic.write_json(path, record, indent=None, newline=False)
        return path


def without_progress(records: list[dict], now: int) -> list[dict]:
    """The failures among ``records`` (oldest first), since the last one that ended the job, that
    came in a row without progress up to a failure at step ``now``: a failure whose step is past
    the furthest any earlier one reached starts a new row."""
    row: list[dict] = []
    furthest = -1
    for record in records:
        if record.get("outcome") == "ended":
            row, furthest = [], -1
            continue
        if record["progress"] > furthest:
            row = []
        furthest = max(furthest, record["progress"])
        row.append(record)
    return row if now <= furthest else []


def judge(run_dir: Path, limit: int, code: int, pod: str, index: Optional[int]) -> Optional[str]:
    """Record that this pod's node exits ``code`` (retried by the job level); the message to end
    the job with instead (exit 2) when it makes more than ``limit`` failures in a row without
    progress, else None. Storage that cannot be read or written leaves the failure retried.

    Each failure is one JSON file under ``<run_dir>/faults/pod-failures/`` with the furthest step
    trained; a failure after which no step passed the furthest the earlier ones reached continues
    the run of failures. A job started again in the same run directory after the bound ended one
    gets its budget back.
    """
    failures = PodFailures(run_dir)
    now = progress(run_dir)
    try:
        row = without_progress(failures.read(), now)
        record = {"t": time.time(), "pod": pod, "index": index, "code": code, "progress": now, "outcome": "failed"}
        if len(row) + 1 <= limit:
            failures.add(record)
            return None
        failures.add({**record, "outcome": "ended"})
    except OSError:
        return None
    seen = "; ".join(f"{r['pod']} exited {r['code']} at step {r['progress']}" for r in row[-5:])
    return (
        f"{len(row) + 1} pod failures in a row without training past step {now} (job.backoffLimit={limit}): "
        f"{seen}{'; ' if seen else ''}{pod} exits {code} now at step {now}. Under a PyTorchJob the operator would "
        "recreate the pods for ever, so this node exits 2 and the job fails. The nodes' logs say what failed; "
        f"the records are in {failures.dir}. Fix the cause and start the job again (it resumes from the newest "
        "committed checkpoint), or raise job.backoffLimit"
    )
