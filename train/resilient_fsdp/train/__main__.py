"""``python -m resilient_fsdp.train``: what every rank runs (see :mod:`.entrypoint`)."""

import sys

from .entrypoint import main

if __name__ == "__main__":
    sys.exit(main())
