"""The workload kinds the local cluster reads: one reader per manifest ``kind``, in :data:`KINDS`.

:func:`pods_of` finds the one workload among the rendered documents, hands it to its kind's reader
(:mod:`.pytorchjob`, :mod:`.jobset`, :mod:`.trainjob`) and checks that every volume its pods mount
was rendered (the ConfigMaps among them).
"""

from __future__ import annotations

from typing import Callable

from .jobset import read_jobset
from .pytorchjob import read_pytorchjob
from .spec import Workload, WorkloadError
from .trainjob import read_trainjob

# Workload kinds by the manifest's kind: each reader returns the pods its controller creates.
KINDS: dict[str, Callable[[dict], Workload]] = {
    "PyTorchJob": read_pytorchjob,
    "JobSet": read_jobset,
    "TrainJob": read_trainjob,
}


def pods_of(documents: list[dict]) -> Workload:
    """The workload among rendered ``documents`` (one PyTorchJob, JobSet or TrainJob) with the
    ConfigMaps its pods mount. Other objects (ServiceAccount, NetworkPolicy, the ``helm test``
    Pod) have no local counterpart and are left out."""
    workloads = [d for d in documents if d.get("kind") in KINDS]
    if len(workloads) != 1:
        raise WorkloadError(
            f"expected one workload ({', '.join(KINDS)}) in the rendered chart, found "
            f"{[d.get('kind') for d in workloads]}"
        )
    workload = KINDS[workloads[0]["kind"]](workloads[0])
    maps = {
        d["metadata"]["name"]: {k: str(v) for k, v in (d.get("data") or {}).items()}
        for d in documents
        if d.get("kind") == "ConfigMap"
    }
    for pod in workload.pods:
        for mount in pod.mounts:
            volume = pod.volumes.get(mount.volume)
            if volume is None:
                raise WorkloadError(f"pod {pod.hostname}: volumeMount {mount.volume!r} has no volume")
            if volume.kind == "configMap" and volume.source.get("name") not in maps:
                raise WorkloadError(
                    f"pod {pod.hostname}: volume {volume.name} needs ConfigMap "
                    f"{volume.source.get('name')!r}, which the chart did not render"
                )
    workload.config_maps = maps
    return workload
