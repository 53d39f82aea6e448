"""The fault ledger: every fired fault and its recovery, one JSON file each, on storage every rank
shares (``<run_dir>/faults/``).

"Once per job" is kept here: a rank claims a fault by creating its record exclusively before
firing it, so the restart the fault causes passes the same step again without firing it twice.
Restart accounting reads the records back (:mod:`.accounting`).

Non-finite losses the job met (injected or not) are kept beside them, in ``faults/non-finite/``,
one file each (:mod:`.non_finite`), and so are the stragglers found, in ``faults/stragglers/``
(:mod:`.stragglers`), and the replica mismatches, in ``faults/sdc/`` (:mod:`.sdc`): they are events of the job, not faults it was told to fire, so the fired
faults and their recoveries do not count them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import atomic
from ..config import FaultSpec


def json_records(directory: Path, order: str = "t") -> list[dict]:
    """Every record of ``directory`` (a JSON file each), by its ``order`` field; a file torn by a
    crash mid-write, or gone meanwhile, is passed over."""
    records = []
    for path in directory.glob("*.json") if directory.is_dir() else []:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r.get(order, 0.0))


class FaultLedger:
    """Fired faults and their recoveries, one JSON file each, on storage every rank shares."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "faults"

    def claim(self, spec: FaultSpec, record: dict) -> bool:
        """Record ``spec`` as fired; False if it already was (by any rank, in any earlier attempt)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        # Durable before the fault fires: it may kill this process next.
        return atomic.create_exclusive(self.dir / f"{spec.key}.json", json.dumps(record, sort_keys=True))

    def claimed(self, spec: FaultSpec) -> bool:
        return (self.dir / f"{spec.key}.json").exists()

    def arm(self, spec: FaultSpec) -> None:
        """``spec`` waits for its moment (a ``sigkill-during-restore``: the next restore), which
        may come in another process: kept beside the records, not among them."""
        (self.dir / "armed").mkdir(parents=True, exist_ok=True)
        atomic.create_exclusive(self.dir / "armed" / f"{spec.key}.json", json.dumps({"fault": str(spec)}))

    def armed(self, spec: FaultSpec) -> bool:
        return (self.dir / "armed" / f"{spec.key}.json").exists()

    def fired(self) -> list[dict]:
        """Every fired fault, oldest first."""
        records = []
        for path in self.dir.glob("*.json") if self.dir.is_dir() else []:
            if path.name.endswith((".recovery.json", ".went-on.json")):
                continue
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # a record torn by the fault itself: nothing to account for
        return sorted(records, key=lambda r: r["t_fault"])

    def recoveries(self) -> dict[str, dict]:
        found = {}
        for path in self.dir.glob("*.recovery.json") if self.dir.is_dir() else []:
            try:
                found[path.name[: -len(".recovery.json")]] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return found

    def record_recovery(self, key: str, record: dict) -> None:
        atomic.write_json(self.dir / f"{key}.recovery.json", record, indent=None, newline=False)

    def record_went_on(self, key: str, record: dict) -> None:
        """Training went on past a fault that stops nothing by itself (a partition that healed
        in time): no restart is its recovery."""
        atomic.write_json(self.dir / f"{key}.went-on.json", record, indent=None, newline=False)

    def went_on(self) -> dict[str, dict]:
        found = {}
        for path in self.dir.glob("*.went-on.json") if self.dir.is_dir() else []:
            try:
                found[path.name[: -len(".went-on.json")]] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return found

    # -- non-finite losses ------------------------------------------------------------------------

    @property
    def non_finite_dir(self) -> Path:
        return self.dir / "non-finite"

    def record_non_finite(self, record: dict, seen: int) -> Path:
        """Keep one non-finite loss at ``record["step"]``, the ``seen``-th recorded there, durably:
        the restart it causes reads it back. Every rank writes it (the first one wins), so it is
        kept whichever rank the restart stops first."""
        self.non_finite_dir.mkdir(parents=True, exist_ok=True)
        path = self.non_finite_dir / f"step{record['step']:08d}-{seen}.json"
        atomic.create_exclusive(path, json.dumps(record, sort_keys=True))
        return path

    def non_finite(self) -> list[dict]:
        """Every non-finite loss recorded in this run directory, oldest first."""
        return json_records(self.non_finite_dir)

    # -- stragglers -------------------------------------------------------------------------------

    @property
    def stragglers_dir(self) -> Path:
        return self.dir / "stragglers"

    def record_straggler(self, record: dict) -> None:
        """Keep a straggler found (``record["key"]`` names it), or its record updated."""
        self.stragglers_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_json(self.stragglers_dir / f"{record['key']}.json", record, indent=None, newline=False)

    def stragglers(self) -> list[dict]:
        """Every straggler found in this run directory, oldest first."""
        return json_records(self.stragglers_dir, order="t_found")

    # -- replica mismatches (silent data corruption) -----------------------------------------------

    def record_sdc(self, record: dict) -> None:
        """Keep a replica mismatch (``record["key"]``), or its record updated (re-verified)."""
        (self.dir / "sdc").mkdir(parents=True, exist_ok=True)
        atomic.write_json(self.dir / "sdc" / f"{record['key']}.json", record, indent=None, newline=False)

    def sdc(self) -> list[dict]:
        """Every replica mismatch found in this run directory, oldest first."""
        return json_records(self.dir / "sdc", order="t_detected")
