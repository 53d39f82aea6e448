"""Which pod stopped reporting, named in a minute, with the command that gets it replaced.

A node whose kernel hangs leaves its pod Running, then Terminating, and the Job controller waits;
nothing in Kubernetes says which of hundreds of pods it is. So each pod's node agent writes
``<run_dir>/nodes/<index>.json`` every :data:`INTERVAL_S` and a last ``ended`` one; the agents of
pods 0 and 1 (1 covers for a silent pod 0) name a pod silent past ``silent_after_s`` in their log
and as a metric (:mod:`.metrics_endpoint`). :class:`NodeReports` is used by the node agent.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from .. import atomic

REPORTS = "nodes"
INTERVAL_S = 10.0
# The pods whose agents watch the others: pod 0, and pod 1 for when pod 0 is the silent one.
WATCHERS = (0, 1)


def report_path(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / REPORTS / f"{index}.json"


def read_reports(run_dir: Path) -> list[dict]:
    """Every pod's newest report (unreadable ones skipped: a report is replaced atomically)."""
    found = []
    folder = Path(run_dir) / REPORTS
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and isinstance(report.get("index"), int):
            found.append(report)
    return found


def silent(reports: list[dict], now: float, after_s: float) -> list[tuple[dict, float]]:
    """The reports of pods silent for more than ``after_s`` and not ended, with their silence."""
    return [
        (r, now - float(r.get("time", 0)))
        for r in reports
        if not r.get("ended") and now - float(r.get("time", 0)) > after_s
    ]


def runbook(report: dict, silence_s: float) -> str:
    node = report.get("node") or "<its node>"
    return (
        f"pod index {report['index']} ({report.get('pod') or 'its pod'}, node {node}) has not reported for "
        f"{silence_s:.0f} s: it is being replaced, or its node stopped reporting (a kernel hang, a wedged "
        f"network driver). If `kubectl get node {node}` says NotReady or Unknown and the pod is still Running or "
        f"Terminating: terminate its instance (a pod that came back beside its replacement would stop the "
        f"rendezvous), then `kubectl taint nodes {node} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute` "
        "lets Kubernetes delete the pod so that the job replaces it; node auto-repair does the same after 30 "
        "minutes NotReady"
    )


class NodeReports(threading.Thread):
    """Reports this pod every :data:`INTERVAL_S`; on a watcher (:data:`WATCHERS`), also names the
    pods that stopped reporting through ``say``. :meth:`stop` writes the ``ended`` report.

    Pod 1 watches too, covering for a silent pod 0. A pod being replaced after a loss is silent
    until its replacement starts: the line says both. A pod that reports again is said to be back.
    """

    def __init__(
        self,
        run_dir: Path,
        index: int,
        pod: str,
        node: str,
        silent_after_s: float,
        say: Callable[[str], None],
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(name="node-reports", daemon=True)
        self.run_dir, self.index, self.pod, self.node = Path(run_dir), index, pod, node
        self.silent_after_s, self.say, self.interval_s, self.clock = silent_after_s, say, interval_s, clock
        self.named: set[int] = set()  # silent pods already named
        self._stopping = threading.Event()

    def run(self) -> None:
        while True:
            self._write(ended=False)
            if self.index in WATCHERS:
                self._watch()
            if self._stopping.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        self._write(ended=True)

    def _write(self, ended: bool) -> None:
        try:
            path = report_path(self.run_dir, self.index)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(
                path,
                {"index": self.index, "pod": self.pod, "node": self.node, "time": self.clock(), "ended": ended},
                indent=None,
                newline=False,
            )
        except OSError:
            pass  # the volume is unavailable for now: the next report tries again

    def _watch(self) -> None:
        reports = [r for r in read_reports(self.run_dir) if r["index"] != self.index]
        quiet = {r["index"]: (r, s) for r, s in silent(reports, self.clock(), self.silent_after_s)}
        for index, (report, silence) in sorted(quiet.items()):
            if index not in self.named:
                self.named.add(index)
                self.say(runbook(report, silence))
        for index in sorted(self.named - set(quiet)):
            self.named.discard(index)
            self.say(f"pod index {index} reports again")


def silent_after(store_timeout_s: Optional[float]) -> float:
    """A pod is silent after the store timeout (what the other pods wait for a vanished store
    host), and never before three reports were missed."""
    return max(store_timeout_s or 0.0, 3 * INTERVAL_S)
