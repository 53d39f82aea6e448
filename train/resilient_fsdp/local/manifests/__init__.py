"""The rendered manifests as the local cluster reads them: per workload kind, its pods and restart rules.

- ``spec``: what every kind reads into: the pods (``PodSpec``, ``Mount``, ``Volume``), the
  ``Workload``, the restart rules the controller asks (``RestartRules``), and the Kubernetes rules
  every kind applies (``$(VAR)`` expansion, quantities, Service names), and ``InitContainer``;
- ``security``: a container's user, groups, capabilities and read-only root from its pod's and
  its own ``securityContext`` (``Security``), the container runtime's defaults, the ``nofile`` limit;
- ``errors``: ``WorkloadError``, which every reader raises;
- ``kinds``: the readers by manifest ``kind`` (``KINDS``) and ``pods_of``, the workload among the
  rendered documents;
- ``pytorchjob``: a PyTorchJob's pods, the operator's variables, and its ``RestartPolicy``;
- ``jobset``: a JobSet's pods, and its Jobs' and its own restart rules (``JobSetPolicy``);
- ``trainjob``: a TrainJob, refused with the reason.
"""
