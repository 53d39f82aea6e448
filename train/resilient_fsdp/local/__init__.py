"""The one-machine cluster of ``resilient-fsdp local``: the rendered chart's pods run here.

- ``job``: ``resilient-fsdp local``: flags to chart values, the render, the pods, the launch;
- ``manifests/``: the rendered workload per kind: the pods its controller would create
  (``PodSpec``), and the kind's restart rules;
- ``cluster/``: the cluster around the pods: the kubelet and the workload controller
  (``launcher``), and the node faults a rank asks for, carried out (``fault_requests``);
- ``runtime/``: where pods run: network namespaces or loopback, and a pod's paths as this
  machine sees them.
"""
