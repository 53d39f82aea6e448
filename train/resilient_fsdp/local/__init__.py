"""The one-machine cluster: ``resilient-fsdp local`` runs N simulated nodes, each the command a pod
runs (the node agent around ``ft_launcher``), and plays the rendezvous host and the job-level
restart a cluster would provide (``launcher``)."""
