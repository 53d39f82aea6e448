"""The one error a configuration problem raises: :class:`ConfigError`."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the key and the fix."""

    # With the PyTorchJob restart policy `ExitCode`, codes 1-127 fail the job at once while
    # 128-255 recreate the pod: a retry cannot fix a configuration error, so fail fast.
    exit_code = 2
