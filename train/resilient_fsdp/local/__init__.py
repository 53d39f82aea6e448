"""The one-machine cluster: pods as network namespaces (``pods``: the pods of a run; ``netns``: the
Linux plumbing under them; ``run_state``: each run's state file and owner; ``exit_cleanup``: closing
runs at exit and on signals; ``podinit``: the setup inside a pod; ``paths``: a pod's paths as this machine sees them), and ``resilient-fsdp local``
(``launcher``), which runs N simulated nodes, each the command a pod runs (the node agent around
``ft_launcher``), and plays the rendezvous host and the job-level restart a cluster would provide."""
