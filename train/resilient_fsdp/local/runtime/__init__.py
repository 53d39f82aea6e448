"""Where the local cluster's pods run: network namespaces (root) or processes on loopback.

- ``base``: ``Runtime``, what the launcher asks of either mode and what both share (the volumes'
  host side, the pod's environment), with a table of how the two differ;
- ``netns``: ``NetnsRuntime``, each pod a network namespace (``netns_pods/``: those pods, on
  Linux);
- ``loopback``: ``LoopbackRuntime``, each pod plain processes on 127.0.0.x;
- ``paths``: a pod's paths as this machine sees them.
"""
