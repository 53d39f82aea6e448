"""``python -m resilient_fsdp.train``: what every rank runs (see :mod:`.entrypoint`)."""

import importlib.util
import os
import sys
import time

from ..resilience import prewarm

# When this rank's process began, for the recovery's phases (resilience.accounting): stamped by the
# process ft_launcher started, and kept by the rank the pre-warmed server forks for it (its
# environment is that process's, without the server's socket).
if __name__ == "__main__" and (prewarm.PROCESS_START_ENV not in os.environ or prewarm.SOCKET_ENV in os.environ):
    os.environ[prewarm.PROCESS_START_ENV] = repr(time.time())

if __name__ == "__main__" and prewarm.SOCKET_ENV in os.environ:
    # The pod's pre-warmed server forks this rank; this process relays to it (resilience.prewarm).
    handed = prewarm.run_as_client(sys.argv[1:])
    if handed is not None:
        sys.exit(handed)

from ..resilience.nccl_env import apply_before_torch  # noqa: E402 (after the hand-over: it imports the config)

# The restart layers' environment before torch loads: it reads TORCH_CPP_LOG_LEVEL only then.
apply_before_torch(sys.argv[1:])

from .entrypoint import main  # noqa: E402 (after the environment is set)
from .process_exit import run_and_exit  # noqa: E402

if __name__ == "__main__":
    # The processes multiprocessing spawns from a rank (NVRx's checkpoint writer and the manager
    # its results go through) first import the main module by name, unless it is a package's
    # __main__, which they skip. They need the trainer's imports: without torch.distributed.checkpoint
    # loaded there, every save waits seconds for it. Naming the entrypoint as the main module
    # gives them what they had when the trainer was a single module.
    __spec__ = importlib.util.find_spec("resilient_fsdp.train.entrypoint")
    # Without the interpreter's finalization: seconds of every restart (see .process_exit).
    run_and_exit(main)
