"""Scripts the resilience tests run as processes of their own: ``abort`` (a rank of a gloo group
aborted mid-collective), ``sweeper`` (the node agent's sweep of a dead rank's helpers) and
``restart_polls`` (NVRx 0.7's restart waits as the node agent's ft_launcher runs them)."""

from pathlib import Path

HERE = Path(__file__).parent
