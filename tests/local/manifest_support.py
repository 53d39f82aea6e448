"""Helpers for the local cluster's tests: the dev-cpu chart rendered as ``resilient-fsdp local`` renders it."""

from __future__ import annotations

from tests.deploy.chart_support import VALUES_DIR
from resilient_fsdp.deploy.chart import load_values, render

# What every local run renders with: its claim, bound to the run directory, at /fsx.
LOCAL = ["storage.type=existingClaim", "storage.existingClaim=local-run-dir", "trainer.run_dir=/fsx"]


def rendered(*sets: str, release: str = "job"):
    """values/dev-cpu.yaml rendered with the local run's claim, then ``sets`` (``--set`` expressions)."""
    return render(load_values([VALUES_DIR / "dev-cpu.yaml"], [*LOCAL, *sets]), release=release)
