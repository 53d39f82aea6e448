"""The one-machine cluster: pods as network namespaces (``netns``, ``pods``, ``podinit``), and
``resilient-fsdp local`` (``launcher``), which runs N simulated nodes, each the command a pod runs
(the node agent around ``ft_launcher``), and plays the rendezvous host and the job-level restart a
cluster would provide."""
