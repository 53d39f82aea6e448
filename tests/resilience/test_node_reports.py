"""Pods report to the run directory; pods 0 and 1 name one that stopped reporting, once, with its
node and the runbook line, and serve it as a metric. Real threads and files; the freeze is a
reporter stopped without its last ``ended`` report, as a hung node leaves it."""

from __future__ import annotations

import time

from prometheus_client.core import Metric

from resilient_fsdp.resilience.metrics_endpoint import RunCollector
from resilient_fsdp.resilience.node_reports import NodeReports, read_reports, silent, silent_after


def _freeze(reports: NodeReports) -> None:
    reports._stopping.set()  # the node hangs: no more reports, and no ended one
    reports.join(timeout=5)


def test_a_pod_that_stops_reporting_is_named_once_by_the_watchers_and_one_that_ends_is_not(tmp_path):
    said: dict[int, list[str]] = {0: [], 1: [], 2: [], 3: []}
    pods = {
        i: NodeReports(
            tmp_path, i, f"job-node-0-{i}", f"ip-10-0-0-{i}", silent_after_s=0.6, say=said[i].append, interval_s=0.1
        )
        for i in range(4)
    }
    for p in pods.values():
        p.start()
    time.sleep(0.5)
    _freeze(pods[3])
    pods[2].stop()  # ended: its pod exited (finished, or failed and is being replaced by the controller)
    time.sleep(1.5)
    for i in (0, 1):  # the watchers
        (line,) = said[i]
        assert line.startswith("pod index 3 (job-node-0-3, node ip-10-0-0-3) has not reported for ")
        assert "`kubectl taint nodes ip-10-0-0-3 node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`" in line
    assert said[2] == said[3] == []  # only pods 0 and 1 watch
    # The frozen pod's node comes back (or its replacement starts): said once more.
    back = NodeReports(
        tmp_path, 3, "job-node-0-3", "ip-10-0-0-9", silent_after_s=0.6, say=said[3].append, interval_s=0.1
    )
    back.start()
    time.sleep(0.5)
    assert said[0][-1] == "pod index 3 reports again"
    for p in (pods[0], pods[1], back):
        p.stop()
    reports = {r["index"]: r for r in read_reports(tmp_path)}
    assert all(r["ended"] for r in reports.values()) and reports[3]["node"] == "ip-10-0-0-9"
    assert silent(list(reports.values()), time.time() + 3600, 0.6) == []  # ended pods are never silent
    assert silent_after(60.0) == 60.0 and silent_after(None) == 30.0


def test_pods_0_and_1_serve_the_silent_pods_as_metrics_and_the_others_do_not(tmp_path):
    quiet = NodeReports(tmp_path, 5, "job-node-0-5", "ip-10-0-0-5", silent_after_s=0.2, say=print, interval_s=0.1)
    quiet.start()
    time.sleep(0.2)
    _freeze(quiet)
    time.sleep(0.5)

    def families(node: str) -> dict[str, Metric]:
        return {m.name: m for m in RunCollector(tmp_path, node, silent_after_s=0.2).collect()}

    watcher = families("1")
    assert [s.value for s in watcher["resilient_fsdp_silent_nodes"].samples] == [1]
    (sample,) = watcher["resilient_fsdp_node_silent_seconds"].samples
    assert sample.labels == {"node": "1", "pod_index": "5", "kubernetes_node": "ip-10-0-0-5"} and sample.value > 0.4
    assert "resilient_fsdp_silent_nodes" not in families("4")  # a pod that does not watch reads no reports
