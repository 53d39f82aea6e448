"""Security scan of every rendered profile with checkov: no failed check without a recorded reason."""

from __future__ import annotations

import pytest

from tests.deploy.chart_support import PROFILES, profile_files, render
from resilient_fsdp.deploy import chart, chart_scan

# A namespace of its own, as a real install uses (the default namespace is a finding in itself).
NAMESPACE = "ml-training"


@pytest.fixture(scope="module")
def checkov():
    try:
        return chart_scan.checkov_executable()
    except chart.ChartError as exc:
        # Never a skip: scripts/test installs checkov, so a missing one is a broken setup.
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def profile_findings(checkov) -> dict[str, list[chart_scan.Failure]]:
    sets = {
        name: chart.render(chart.load_values(profile_files(name)), namespace=NAMESPACE).documents() for name in PROFILES
    }
    return chart_scan.scan(sets, checkov)


def test_should_explain_every_failed_check_when_profiles_are_scanned(profile_findings):
    unexplained = {
        name: [str(f) for f in fs if f.check_id not in chart_scan.ACCEPTED] for name, fs in profile_findings.items()
    }
    assert {k: v for k, v in unexplained.items() if v} == {}


def test_should_keep_no_stale_exception_when_accepted_checks_are_listed(profile_findings):
    seen = {f.check_id for fs in profile_findings.values() for f in fs}
    assert set(chart_scan.ACCEPTED) <= seen, f"accepted but never failing: {set(chart_scan.ACCEPTED) - seen}"


def test_should_scan_the_pods_inside_the_pytorchjob_when_a_pod_setting_is_weakened(checkov):
    docs = render(
        "pod.containerSecurityContext.readOnlyRootFilesystem=false",
        "pod.containerSecurityContext.allowPrivilegeEscalation=true",
        namespace=NAMESPACE,
    ).documents()
    failed = {f.check_id for f in chart_scan.scan({"weak": docs}, checkov)["weak"]}
    assert {"CKV_K8S_20", "CKV_K8S_22"} <= failed


@pytest.mark.parametrize("kind", ["JobSet", "TrainJob"])
def test_should_scan_the_pods_inside_a_jobset_or_runtime_when_a_pod_setting_is_weakened(checkov, kind):
    docs = render(
        f"workload.kind={kind}",
        "pod.containerSecurityContext.readOnlyRootFilesystem=false",
        "releaseCheck.enabled=false",
        namespace=NAMESPACE,
    ).documents()
    assert [p["metadata"]["name"] for p in chart_scan.pods_of(docs)] == ["resilient-fsdp-node-0"]
    failed = {f.check_id for f in chart_scan.scan({"weak": docs}, checkov)["weak"]}
    assert "CKV_K8S_22" in failed
