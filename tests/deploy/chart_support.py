"""Helpers for the chart tests: rendering with Helm's real engine, and pulling pods apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from resilient_fsdp.deploy import chart, validate

REPO = Path(__file__).resolve().parents[2]
VALUES_DIR = REPO / "values"
MY_CLUSTER = VALUES_DIR / "examples" / "my-cluster.yaml"
PROFILES = sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))
# The smallest values that render on the chart's default GPU instance type: a user's existing
# claim and the registry the nodes pull from (the local default name is refused on GPUs).
REGISTRY = "123456789012.dkr.ecr.us-west-2.amazonaws.com/resilient-fsdp"
IMAGE = [f"image.repository={REGISTRY}"]
BASE = ["storage.existingClaim=ckpt", *IMAGE]


def profile_files(name: str) -> list[Path]:
    """A profile as a user installs it: the profile, then their cluster's file (the CPU profile
    needs none: it uses no cloud resources)."""
    return [VALUES_DIR / f"{name}.yaml"] + ([] if name == "dev-cpu" else [MY_CLUSTER])


def render(*sets: str, files: list[Path] = (), base: list[str] = BASE, **kwargs) -> chart.Rendered:
    """The chart rendered with ``files`` and ``--set`` expressions, as ``resilient-fsdp render``."""
    return chart.render(chart.load_values(list(files), list(base) + list(sets)), **kwargs)


def render_error(*sets: str, files: list[Path] = (), base: list[str] = BASE) -> str:
    with pytest.raises(chart.ChartError) as caught:
        render(*sets, files=files, base=base)
    return str(caught.value)


def job(rendered: chart.Rendered) -> dict:
    return rendered.find("PyTorchJob")


def pod_spec(rendered: chart.Rendered, role: str = "Master") -> dict:
    """A replica's pod spec."""
    return job(rendered)["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]


def container(rendered: chart.Rendered, role: str = "Master") -> dict:
    (only,) = [c for c in pod_spec(rendered, role)["containers"] if c["name"] == "pytorch"]
    return only


def env(rendered: chart.Rendered, role: str = "Master") -> dict:
    """Plain env values by name (entries with valueFrom map to their valueFrom)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(rendered, role).get("env", [])}


def config_map(rendered: chart.Rendered, key: str) -> dict:
    return yaml.safe_load(rendered.find("ConfigMap")["data"][key])


def volume(rendered: chart.Rendered, name: str, role: str = "Master") -> dict:
    (only,) = [v for v in pod_spec(rendered, role)["volumes"] if v["name"] == name]
    return only


def mount(rendered: chart.Rendered, name: str, role: str = "Master") -> dict:
    (only,) = [m for m in container(rendered, role)["volumeMounts"] if m["name"] == name]
    return only


@pytest.fixture(scope="session")
def crds() -> dict:
    """The CRD schemas: the vendored copy (charts/vendor/crds), or $RESILIENT_FSDP_CRDS. The copy is in
    the repository, so a missing CRD is a broken checkout, never a skip."""
    try:
        return validate.load_crd_schemas(validate.crd_dir())
    except chart.ChartError as exc:
        pytest.fail(f"CRDs missing: {exc}")
