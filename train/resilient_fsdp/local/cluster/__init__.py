"""The cluster around the pods: the kubelet and the workload controller, and the infrastructure faults.

- ``launcher``: the kubelet and the controller: pods started, output forwarded, failures handled
  by the kind's restart rules;
- ``fault_requests``: the node faults a rank asks the cluster for (``node-loss``, ``partition``),
  carried out.
"""
