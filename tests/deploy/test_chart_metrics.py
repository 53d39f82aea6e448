"""The metrics values: the agent's endpoint on a named port, the scraper's NetworkPolicy rule, the
optional PodMonitor (templates/podmonitor.yaml), and the rules that refuse conflicting values."""

from __future__ import annotations

import json

import pytest

from tests.deploy.chart_support import BASE, container, pod_spec, render, render_error
from resilient_fsdp.deploy import chart
from resilient_fsdp.resilience.agent import parse_agent_args


def agent_flags(rendered: chart.Rendered) -> dict:
    flags, _ = parse_agent_args(container(rendered)["args"])
    return flags


def test_should_serve_metrics_from_every_pods_agent_on_a_named_port_when_defaults_are_used():
    rendered = render("metrics.port=9555")
    for role in ("Master", "Worker"):
        c = container(rendered, role)
        args = c["args"]
        # The agent's own flag (before `--`), read by the agent's own parser.
        assert args.index("--metrics-port=9555") < args.index("--")
        assert {"name": "metrics", "containerPort": 9555, "protocol": "TCP"} in c["ports"]
    assert agent_flags(rendered)["--metrics-port"] == 9555
    off = render("metrics.enabled=false")
    assert "--metrics-port" not in agent_flags(off)
    assert [p["name"] for p in container(off)["ports"]] == ["pytorchjob-port"]


def test_should_serve_the_same_endpoint_when_kind_is_jobset():
    js = render("workload.kind=JobSet").find("JobSet")
    (c,) = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=9410" in c["args"]
    assert {"name": "metrics", "containerPort": 9410, "protocol": "TCP"} in c["ports"]


def test_should_admit_the_scraper_to_the_metrics_port_only_when_network_policy_is_on():
    policy = render().find("NetworkPolicy")
    own, scraper = policy["spec"]["ingress"]
    assert own["from"][0]["podSelector"] == policy["spec"]["podSelector"] and "ports" not in own
    assert scraper["ports"] == [{"port": 9410, "protocol": "TCP"}]
    assert scraper["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    # Other scrapers verbatim (the managed collector reaches pods from the VPC: an ipBlock).
    peers = [{"ipBlock": {"cidr": "10.0.0.0/16"}}]
    custom = chart.render(chart.load_values([], BASE, [f"metrics.scrapers={json.dumps(peers)}"]))
    assert custom.find("NetworkPolicy")["spec"]["ingress"][1]["from"] == peers
    for sets in (["metrics.scrapers=null"], ["metrics.enabled=false"]):
        (only,) = render(*sets).find("NetworkPolicy")["spec"]["ingress"]
        assert only == own
    # An Amazon Managed Service for Prometheus collector scrapes from its subnets: CIDRs beside the
    # default scraper, without restating it.
    managed = render("metrics.scraperCIDRs={10.0.16.0/20,10.0.32.0/20}").find("NetworkPolicy")["spec"]["ingress"][1]
    assert managed["from"] == scraper["from"] + [
        {"ipBlock": {"cidr": "10.0.16.0/20"}},
        {"ipBlock": {"cidr": "10.0.32.0/20"}},
    ]
    alone = render("metrics.scrapers=null", "metrics.scraperCIDRs={10.0.16.0/20}").find("NetworkPolicy")
    assert alone["spec"]["ingress"][1]["from"] == [{"ipBlock": {"cidr": "10.0.16.0/20"}}]
    assert "metrics.scraperCIDRs" in render_error("metrics.scraperCIDRs={sg-0123}")


def test_should_render_a_pod_monitor_of_the_jobs_pods_when_enabled():
    assert not [d for d in render().documents() if d["kind"] == "PodMonitor"]  # off by default
    rendered = render(
        "metrics.podMonitor.enabled=true",
        "metrics.podMonitor.labels.release=kps",
        "metrics.podMonitor.interval=15s",
        "metrics.podMonitor.scrapeTimeout=5s",
        release="run1",
    )
    monitor = rendered.find("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == "run1-resilient-fsdp" and monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}
    ]
    # It selects every pod of this job, and each has the port it names.
    selector = monitor["spec"]["selector"]["matchLabels"]
    job = rendered.find("PyTorchJob")
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        labels = replica["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), role
        assert "app.kubernetes.io/component" in labels  # podTargetLabels: which role a series comes from
        assert "metrics" in [p["name"] for p in container(rendered, role)["ports"]]
    assert monitor["spec"]["podTargetLabels"] == ["app.kubernetes.io/component"]
    assert pod_spec(rendered)["containers"][0]["name"] == "pytorch"


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["metrics.enabled=false", "metrics.podMonitor.enabled=true"],
            "metrics.podMonitor.enabled=true but metrics.enabled=false: the PodMonitor would scrape an endpoint no pod "
            "serves; set metrics.enabled=true, or metrics.podMonitor.enabled=false",
        ),
        (
            ["metrics.port=29400"],
            "metrics.port=29400 is also rendezvous.port: pod 0's agent listens on both; choose "
            "another metrics.port, e.g. 9410",
        ),
        (["workload.kind=TrainJob", "metrics.port=29500"], "metrics.port=29500 with workload.kind=TrainJob"),
        (["metrics.podMonitor.interval=30 seconds"], "metrics.podMonitor.interval"),
        (["metrics.port=80"], "metrics.port"),
    ],
)
def test_should_fail_naming_the_key_when_metrics_values_conflict(sets, message):
    assert message in render_error(*sets)
