"""The restart layers, and what they need in a pod.

- ``attempt``: one attempt at the training function and every resilience hook it runs;
- ``rank_monitor``: in-job hang detection: sections reported to ``ft_launcher``'s rank monitor;
- ``inprocess``: in-process restart (NVRx ``inprocess.Wrapper``) around the training function;
- ``graceful_stop``: SIGTERM becomes "finish the step, commit a checkpoint, exit retryably";
- ``ft_config``: the ``fault_tolerance:`` settings and the ``ft_launcher`` flags;
- ``nvrx``: every adaptation to NVRx's restart layers (CPU, versions);
- ``nccl_env``: the NCCL and torch variables each restart layer needs, and where hang dumps go;
- ``faults``: fault injection (the kinds are :data:`resilient_fsdp.config.FAULT_KINDS`);
- ``ledger``: fired faults and their recoveries, once per job, on shared storage;
- ``deterministic``: the same failure at the same place after a restart is retried by no layer;
- ``non_finite``: a non-finite loss: one in-job restart as a suspected hardware fault, then exit 2;
- ``stragglers``: slow ranks found, reported, or replaced by a hot spare without a job restart;
- ``straggler_detector``: NVRx's straggler detector, both versions, with CPU's section timings only;
- ``sdc``: silent data corruption under HSDP: the replicas compared, a mismatch rolled back;
- ``accounting``: which layer restarted an attempt; recoveries and goodput for ``summary.json``;
- ``exit_codes``: what a node's exit code means, and which layer retries it;
- ``agent``: a node's main process (a pod's PID 1) around ``ft_launcher``;
- ``pod_failures``: the job's pod failures counted by its pods, the bound a PyTorchJob lacks;
- ``node_taint``: the node a failed health check names, tainted so the next pod goes elsewhere;
- ``prewarm``: every new rank forked from a server in the pod that has imported the trainer;
- ``metrics_endpoint``: the agent's Prometheus endpoint, the run's records as metrics;
- ``node_rank``: a node's index in the job, who hosts the rendezvous store, its node rank;
- ``rejoin``: a node that another node's failure stopped joins again in its pod, bounded;
- ``store_watch``: a store host gone without closing its connections, given up in a minute;
- ``node_reports``: which pod stopped reporting, named with its node and the runbook line;
- ``processes``: process-tree helpers the agent shares with the local launcher.
"""
