"""Scripts the trainer tests run as processes of their own: ``params_hash`` (one rank's
``params_sha256`` and the memory it allocated)."""

from pathlib import Path

HERE = Path(__file__).parent
