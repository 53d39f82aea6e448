"""resilient-fsdp: fault-tolerant PyTorch FSDP2 training with NVRx, from a laptop to EKS.

- ``config/``: the typed run configuration and the fault kinds; imports nothing else here.
- ``atomic``: the one way files are replaced in place.
- ``cli``: the ``resilient-fsdp`` command (argument parsing and dispatch only).
- ``train/``: what every rank runs (``python -m resilient_fsdp.train``).
- ``data/``: training data: preparation, the prepared format, an ``s3://`` source.
- ``hf/``: Hugging Face models in and out.
- ``checkpoint/``: checkpoints: save, commit, retention, resume, the S3 tier.
- ``resilience/``: the restart layers, fault injection and accounting, the node agent.
- ``local/``: the one-machine cluster of ``resilient-fsdp local``.
- ``deploy/``: the Helm chart, its validation and release check, the image's checks.
- ``bench/``: the benchmarks and the GPU check.
- ``goodput/``: the goodput model, ``advise``, ``simulate`` and ``report``.

The pod side (the first seven) imports nothing of the last four (``tests/test_layout.py``).
Nothing runs at import time: NVRx and torch elastic spawn interpreters that import these modules.
"""

__version__ = "0.1.0"
