"""The one-machine cluster of ``resilient-fsdp local``: the rendered chart's pods run here.

- ``job``: ``resilient-fsdp local``: flags to chart values, the render, the pods, the launch;
- ``workload``: the pods the workload controller would create, read from the rendered manifests,
  and its restart rules; ``jobset``: a JobSet's;
- ``launcher``: the kubelet and the controller: pods started, output forwarded, failures handled;
- ``runtimes``: where pods run: network namespaces (``pods``: the pods of a run; ``netns``: the
  Linux plumbing under them; ``podinit``: the setup inside a pod; ``run_state``: each run's
  state file and owner; ``exit_cleanup``: closing runs at exit and on signals) or loopback;
- ``paths``: a pod's paths as this machine sees them;
- ``fault_requests``: the node faults a rank asks the cluster for, carried out.
"""
