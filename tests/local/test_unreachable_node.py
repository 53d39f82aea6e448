"""A node that stops reporting (``node-freeze``): its link goes down and every process of its pod
stops, closing no connection, and the pod stays until its node is deleted ``for`` seconds later
(node auto-repair, the out-of-service taint), as a kernel hang or a wedged network driver leaves
a pod Terminating on a real cluster. Pods are network namespaces (root), on the image's NVRx.

- With a hot spare, a frozen training pod's place goes to the spare within an in-job restart,
  long before the node is deleted: training goes on at the same world size, bitwise equal to the
  job without a fault.
- A frozen store host (pod 0) is given up by every other pod after ``rendezvous.storeTimeoutSeconds``
  without a connection accepted, before its node is deleted, and pod 1 names it with its node and
  the runbook line; the job then recovers with pod 0's replacement, bitwise equal.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from tests.checkpoint.test_memory_tier import MEMORY
from tests.resilience.fault_jobs import IN_PROCESS, fault_free_run, lane_run, run_with_faults
from tests.support import LANES, netns_required, read_events

# What a pod's agent says when its launcher ended because another node failed (rejoin.py).
NOTICED = re.compile(r"ft_launcher ended \(\d+: ([a-z-]+)\), which another node's failure causes")


@pytest.fixture(scope="module")
def reference_3x1(tmp_path_factory):
    return fault_free_run(tmp_path_factory.mktemp("fault-free-3x1"), nodes=3, nproc=1)


class Noticed(threading.Thread):
    """Watches the agents' logs while the job runs: when (wall clock) each pod's agent first said
    that its launcher ended because another node failed."""

    def __init__(self, run_dir: Path, nodes: list[int]):
        super().__init__(daemon=True)
        self.run_dir, self.nodes = run_dir, nodes
        self.at: dict[int, tuple[float, str]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            for node in self.nodes:
                if node in self.at:
                    continue
                try:
                    text = (self.run_dir / "logs" / f"node{node}.log").read_text()
                except OSError:
                    continue
                found = NOTICED.search(text)
                if found:
                    self.at[node] = (time.time(), found.group(1))


# Extended: a minute of the CI tier's margin; a spare taking a lost pod's place stays in that tier
# (tests/resilience/test_hot_spares.py), and so does the frozen store host below.
@pytest.mark.extended
def test_a_frozen_training_pods_place_goes_to_the_hot_spare_before_its_node_is_deleted(
    tmp_path, request, reference_1x2
):
    """Two training pods of one rank and one spare, memory snapshots every 2 steps with replicas.
    The pod of rank 1 freezes after step 7 and its node is deleted 45 s later. Pod 0's rank finds
    its step hung (8 s), the in-job restart's rendezvous closes with the spare instead of the
    silent pod (NVRx's last call), and the spare restores rank 1 from the replica pod 0 keeps."""
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["node-freeze@8:rank=1:for=45"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1"],
        extra=["--value=spares=1"],
        timeout=400,
        **lane_run(request, "image"),
    )
    out = summary["_stdout"]
    (frozen,) = summary["recoveries"]
    assert frozen["layer"] == "in_job", summary["_output"]
    assert summary["restarts"]["job"] == 0 and summary["restarts"]["in_job"] == 1
    # Recovered within the in-job restart, not by the node's deletion 45 s later.
    assert frozen["recovery_s"] < 40, frozen
    assert "1 rank(s) from the replica a peer keeps" in out, summary["_output"]
    assert summary["world_size"] == 2 and {r.get("world_size") for r in read_events(run_dir, "start")} == {2}
    (done,) = [json.loads(p.read_text()) for p in (run_dir / "faults" / "requests").glob("*.done")]
    assert done["kind"] == "node-freeze" and done["node"] in (1, 2)
    assert re.search(rf"node{done['node']} \(\S+\) stopped reporting: link down, \d+ process\(es\) stopped", out)
    assert f"node{done['node']} (" in out and "its node was deleted" in out


def test_with_in_process_restart_a_frozen_pods_place_still_goes_to_the_hot_spare_at_the_same_world_size(
    tmp_path, request, reference_1x2
):
    """As above, with in-process restart on: the wrapper finds rank 1 unresponsive (its heartbeat
    timeout), and rather than going on in-process with a world of one rank, which NVRx's default
    rank assignment does, every rank leaves to the in-job restart, where the spare takes rank 1's
    place; the job ends bitwise equal, at world size 2 throughout."""
    netns_required()
    run_dir = tmp_path / "run"
    summary = run_with_faults(
        run_dir,
        ["node-freeze@8:rank=1:for=60"],
        reference_1x2,
        nodes=2,
        nproc=1,
        overrides=[*MEMORY, "checkpoint.memory.replicas=1", *IN_PROCESS],
        extra=["--value=spares=1"],
        timeout=400,
        **lane_run(request, "image"),
    )
    (frozen,) = summary["recoveries"]
    assert frozen["layer"] == "in_job", summary["_output"]
    assert frozen["recovery_s"] < 55, frozen  # before the node's deletion at 60 s
    assert summary["world_size"] == 2 and {r.get("world_size") for r in read_events(run_dir, "start")} == {2}
    assert "in-process restart cannot go on without rank(s) 1" in summary["_stdout"] + summary["_output"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lane", LANES)
def test_a_frozen_store_host_is_noticed_by_every_pod_within_the_store_timeout_and_the_job_recovers(
    tmp_path, request, lane, reference_3x1
):
    """Three pods of one rank; pod 0 (the store host) freezes after step 9 and its node is deleted
    110 s later. Every other pod's launcher ends within the store timeout (60 s) plus the hung
    step's detection (8 s), well before pod 0's node is deleted; they then join pod 0's replacement,
    and the job ends bitwise equal to the fault-free one."""
    netns_required()
    run_dir = tmp_path / "run"
    watch = Noticed(run_dir, [1, 2])
    watch.start()
    try:
        summary = run_with_faults(
            run_dir,
            ["node-freeze@10:node=0:for=110"],
            reference_3x1,
            nodes=3,
            nproc=1,
            timeout=500,
            **lane_run(request, lane),
        )
    finally:
        watch.done.set()
        watch.join()
    (done,) = [json.loads(p.read_text()) for p in (run_dir / "faults" / "requests").glob("*.done")]
    assert done["kind"] == "node-freeze" and done["node"] == 0
    assert set(watch.at) == {1, 2}, (watch.at, summary["_output"])
    for node, (t, ending) in watch.at.items():
        assert ending == "rendezvous-store-lost", (node, ending)
        # Noticed in under 2 minutes, and before the node's deletion (110 s) made it visible.
        assert 0 < t - done["time"] < 100, (node, t - done["time"])
    (recovery,) = summary["recoveries"]
    assert recovery["layer"] == "job", summary["_output"]
    for node in (1, 2):
        log = (run_dir / "logs" / f"node{node}.log").read_text()
        assert "(rendezvous.storeTimeoutSeconds=60): its host is gone without closing its connections" in log
    # Pod 1 (the watcher beside pod 0) named the silent pod and its node, with the runbook line,
    # then said it was back once its replacement started.
    watcher = (run_dir / "logs" / "node1.log").read_text()
    master = "resilient-fsdp-master-0"
    assert f"pod index 0 ({master}, node local-node-{master}) has not reported for " in watcher
    assert (
        f"`kubectl taint nodes local-node-{master} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`" in watcher
    )
    assert watcher.index("pod index 0 reports again") > watcher.index("pod index 0 (")
