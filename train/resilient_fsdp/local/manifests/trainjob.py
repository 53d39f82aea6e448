"""The TrainJob reader of the local cluster: a refusal that says why.

A TrainJob (``trainer.kubeflow.org/v1alpha1``) renders, but its pods come from its runtime's
JobSet, which the local cluster does not simulate: the reader names the kinds it runs instead.
"""

from __future__ import annotations

from .spec import Workload, WorkloadError


def read_trainjob(doc: dict) -> Workload:
    """Refuses the TrainJob ``doc``, naming the kinds to render instead."""
    raise WorkloadError(
        "workload.kind=TrainJob: the local cluster runs PyTorchJob and JobSet only so far (a "
        "TrainJob's pods come from its runtime's JobSet, not simulated yet); render with "
        "workload.kind=JobSet or PyTorchJob"
    )
