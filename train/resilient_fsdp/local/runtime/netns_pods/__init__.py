"""Pods as Linux network namespaces on one machine, under ``NetnsRuntime`` (and usable alone).

- ``network``: ``PodNetwork``, the pods of one run on their bridge, and each ``NetnsPod``: its
  processes, kills and partitions;
- ``plumbing``: the Linux plumbing under them: names, subnets, process kills, teardown, stale-run
  cleanup, and whether pods can be made here;
- ``dns``: ``ClusterDNS``, the run's name server for its pods (their names, their addresses'
  reverse lookups, nothing else);
- ``host_ports``: ``HostPort``, a port of this machine's loopback relayed into every pod's own
  (a local S3-API server's);
- ``podinit``: the setup inside a pod (hostname, hosts file and resolv.conf, mounts), run by path;
- ``run_state``: each run's state file and owner;
- ``exit_cleanup``: closing runs at exit and on signals.
"""
