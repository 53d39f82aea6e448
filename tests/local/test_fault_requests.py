"""The node faults a rank asks the local cluster for, carried out on the pods once and marked (no
processes: the executor's calls are recorded)."""

from __future__ import annotations

import json

from tests.local.manifest_support import rendered
from resilient_fsdp.local.cluster.fault_requests import FaultExecutor, requests_dir
from resilient_fsdp.local.manifests.kinds import pods_of


class _Runtime:
    """Records what the executor asks of the pods."""

    def __init__(self):
        self.calls = []

    def kill(self, pod):
        self.calls.append(("kill", pod.hostname))
        return [1, 2, 3]

    def partition(self, pod, seconds):
        self.calls.append(("partition", pod.hostname, seconds))


def test_fault_requests_are_carried_out_once_and_marked(tmp_path):
    workload = pods_of(rendered("nodes=2").documents())
    runtime, lost, said = _Runtime(), set(), []
    executor = FaultExecutor(tmp_path, runtime, workload, said.append, lost)
    folder = requests_dir(tmp_path)
    folder.mkdir(parents=True)
    requests = {
        "node-loss-step12-node0": {"kind": "node-loss", "node": 0, "step": 12, "for_s": None},
        "partition-step28-node1": {"kind": "partition", "node": 1, "step": 28, "for_s": 20},
        "partition-step30-node7": {"kind": "partition", "node": 7, "step": 30, "for_s": None},
    }
    for name, body in requests.items():
        (folder / f"{name}.json").write_text(json.dumps({**body, "rank": 0, "time": 1.0}))
    done = executor.poll()
    assert len(done) == 3 and executor.poll() == []
    assert runtime.calls == [("kill", "job-resilient-fsdp-master-0"), ("partition", "job-resilient-fsdp-worker-0", 20)]
    assert lost == {"job-resilient-fsdp-master-0"}
    assert sorted(p.name for p in folder.iterdir()) == [
        "node-loss-step12-node0.done",
        "partition-step28-node1.done",
        "partition-step30-node7.failed",
    ]
    assert any("node 7 does not exist: the job has 2 pod(s)" in line for line in said)
