"""The CRDs vendored in charts/vendor/crds: pinned, recorded, and what `validate` reads by default."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import yaml

from tests.support import REPO
from resilient_fsdp.deploy import validate

VENDOR = REPO / "charts" / "vendor" / "crds"
MANIFEST = json.loads((VENDOR / "manifest.json").read_text())
# The versions the chart is written against (docs/eks-helm.md); fetch-crds pins the same.
EXPECTED = {
    "pytorchjobs.kubeflow.org": "v1.9.4",
    "jobsets.jobset.x-k8s.io": "v0.12.0",
    "trainjobs.trainer.kubeflow.org": "v2.3.0",
    "trainingruntimes.trainer.kubeflow.org": "v2.3.0",
    "clustertrainingruntimes.trainer.kubeflow.org": "v2.3.0",
}


def test_should_match_the_manifest_sha256_when_vendored_crds_are_read():
    for entry in MANIFEST["crds"]:
        data = (VENDOR / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], (
            f"{entry['file']} differs from the copy scripts/fetch-crds recorded: run scripts/fetch-crds"
        )
        assert len(data) == entry["bytes"]
        assert f"/{entry['repository']}/{entry['version']}/" in entry["url"]  # the file at the release tag
    assert sorted(p.name for p in VENDOR.glob("*.yaml")) == sorted(e["file"] for e in MANIFEST["crds"])


def test_should_pin_the_versions_the_chart_targets_when_manifest_is_read():
    assert {e["name"]: e["version"] for e in MANIFEST["crds"]} == EXPECTED
    for entry in MANIFEST["crds"]:
        doc = yaml.load((VENDOR / entry["file"]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        assert doc["kind"] == "CustomResourceDefinition" and doc["metadata"]["name"] == entry["name"]


def test_should_read_the_vendored_copy_when_no_crd_directory_is_given(monkeypatch):
    monkeypatch.delenv(validate.CRDS_ENV, raising=False)
    assert validate.crd_dir() == VENDOR
    schemas = validate.load_crd_schemas(validate.crd_dir())
    assert {
        ("kubeflow.org/v1", "PyTorchJob"),
        ("jobset.x-k8s.io/v1alpha2", "JobSet"),
        ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"),
        ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
    } <= set(schemas)
    monkeypatch.setenv(validate.CRDS_ENV, "/elsewhere")
    assert validate.crd_dir() == Path("/elsewhere") and validate.crd_dir("/given") == Path("/given")


def test_should_rewrite_the_same_manifest_when_fetch_crds_reads_the_pinned_releases(tmp_path):
    """scripts/fetch-crds against a local copy laid out as the release URLs are (no network here):
    it must fetch every pinned file and record exactly the committed manifest."""
    source = tmp_path / "source"
    for entry in MANIFEST["crds"]:
        path = source / entry["url"].split("://", 1)[1].split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((VENDOR / entry["file"]).read_bytes())
    dest = tmp_path / "crds"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VERSION")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch-crds"), str(dest)],
        capture_output=True,
        text=True,
        env={**env, "CRD_SOURCE_BASE": source.as_uri()},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((dest / "manifest.json").read_text()) == MANIFEST
    # A file that is not the CRD it should be is refused, and the destination is left alone.
    first = MANIFEST["crds"][0]
    (source / first["url"].split("://", 1)[1].split("/", 1)[1]).write_text("kind: ConfigMap\n")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch-crds"), str(dest)],
        capture_output=True,
        text=True,
        env={**env, "CRD_SOURCE_BASE": source.as_uri()},
        timeout=120,
    )
    assert proc.returncode != 0 and "is not the pytorchjobs.kubeflow.org" in proc.stderr
    assert json.loads((dest / "manifest.json").read_text()) == MANIFEST
