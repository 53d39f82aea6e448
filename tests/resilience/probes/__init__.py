"""Scripts the resilience tests run as processes of their own: ``abort`` (a rank of a gloo group
aborted mid-collective) and ``sweeper`` (the node agent's sweep of a dead rank's helpers)."""

from pathlib import Path

HERE = Path(__file__).parent
