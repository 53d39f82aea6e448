"""The one-machine cluster: pods as network namespaces, and the launcher that runs them."""
