"""The error every reader of a rendered workload raises: its message names the field and the fix."""


class WorkloadError(ValueError):
    """A rendered workload the local cluster cannot run; the message names the field."""
