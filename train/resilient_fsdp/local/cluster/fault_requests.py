"""The infrastructure faults a rank asks the local cluster for: ``node-loss``, ``partition``,
``node-freeze``.

A rank cannot take its own pod's network down, nor kill its pod the way a lost machine dies.
When such a fault fires, the rank writes a request to ``<run_dir>/faults/requests/``
(``RESILIENT_FSDP_FAULT_REQUESTS`` names the folder in every pod); the launcher
(:mod:`.launcher`) polls it, and :class:`FaultExecutor` carries each request out on the pod's
runtime, then renames it ``<name>.done`` (or ``<name>.failed``, the reason printed). Whether a
fault fires at all, once per job, is the trainer's ledger.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable

from ... import atomic
from ...config import NODE_FAULT_KINDS
from ..manifests.spec import Workload, WorkloadError
from ..runtime.base import Runtime

KINDS = NODE_FAULT_KINDS  # the kinds the table marks as carried out by the cluster


def requests_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "faults" / "requests"


class FaultExecutor:
    """Carries out the requests in ``<run_dir>/faults/requests`` on ``runtime``'s pods."""

    def __init__(self, run_dir: Path, runtime: Runtime, workload: Workload, say: Callable[[str], None], lost: set[str]):
        self.dir = requests_dir(run_dir)
        self.runtime, self.workload, self.say, self.lost = runtime, workload, say, lost
        self.executed: list[dict] = []

    def poll(self) -> list[dict]:
        """Carry out every pending request; return what was done (also kept in ``executed``)."""
        done = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                request = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # written atomically, so this is a request being replaced: next poll
            try:
                record = self.execute(request)
                suffix = ".done"
            except (WorkloadError, KeyError, ValueError, TypeError, OSError) as exc:
                record = {**request, "error": str(exc)}
                suffix = ".failed"
                self.say(f"fault request {path.name} could not be carried out: {exc}")
            atomic.rename(path, path.with_suffix(suffix))
            done.append(record)
        self.executed += done
        return done

    def execute(self, request: dict) -> dict:
        """Carry out one request: ``node-loss`` kills every process of pod N at once (as a lost
        machine dies; its controller recreates it); ``partition`` takes its link down for
        ``for_s`` seconds or for good; ``node-freeze`` takes its link down and stops its processes,
        and after ``for_s`` deletes its node, as node auto-repair would (netns only, both)."""
        kind, node = request["kind"], int(request["node"])
        if kind not in KINDS:
            raise ValueError(
                f"unknown infrastructure fault {kind!r} (the local cluster carries out {', '.join(KINDS)})"
            )
        if not 0 <= node < len(self.workload.pods):
            raise ValueError(f"node {node} does not exist: the job has {len(self.workload.pods)} pod(s)")
        pod = self.workload.pods[node]
        t0 = time.time()
        if kind == "node-loss":
            self.lost.add(pod.hostname)
            pids = self.runtime.kill(pod)
            self.say(
                f"fault {kind} at step {request.get('step')}: node{node} ({pod.hostname}) lost, "
                f"{len(pids)} process(es) killed at once"
            )
        elif kind == "node-freeze":
            seconds = float(request["for_s"])
            pids = self.runtime.freeze(pod)
            self.say(
                f"fault {kind} at step {request.get('step')}: node{node} ({pod.hostname}) stopped reporting: "
                f"link down, {len(pids)} process(es) stopped; its node is deleted in {seconds:g} s"
            )
            timer = threading.Timer(seconds, self._delete_frozen, (pod, node))
            timer.daemon = True
            timer.start()
        else:
            seconds = request.get("for_s")
            self.runtime.partition(pod, seconds)
            self.say(
                f"fault {kind} at step {request.get('step')}: node{node} ({pod.hostname}) cut off from the "
                f"other pods " + (f"for {seconds:g} s" if seconds else "for good")
            )
        return {**request, "executed_at": t0, "pod": pod.hostname}

    def _delete_frozen(self, pod, node: int) -> None:
        """A frozen pod's node is deleted: the controller sees the pod fail and recreates it."""
        self.lost.add(pod.hostname)
        try:
            pids = self.runtime.delete_frozen(pod)
        except (WorkloadError, OSError, KeyError) as exc:  # the run is being torn down
            self.say(f"node{node} ({pod.hostname}): deleting its frozen node failed: {exc}")
            return
        self.say(
            f"node{node} ({pod.hostname}): its node was deleted (auto-repair, out-of-service taint); "
            f"{len(pids)} stopped process(es) killed"
        )
