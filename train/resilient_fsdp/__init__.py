"""resilient-fsdp: fault-tolerant PyTorch FSDP2 training with NVRx, from a laptop to EKS.

Modules, one concept each:

- ``config``: the typed run configuration (defaults < YAML file < ``--set``).
- ``model``: the built-in decoder-only transformer and its size presets.
- ``factories``: ``pkg.module:function`` imports for custom models and datasets.
- ``data``: token datasets and the resumable distributed sampler.
- ``distributed``: device, backend and process-group setup from launcher variables.
- ``parallelize``: FSDP2 sharding and activation checkpointing.
- ``metrics``: progress lines, ``metrics.jsonl``, ``summary.json`` and parameter hashing.
- ``train``: the trainer entrypoint every pod runs (``python -m resilient_fsdp.train``).
- ``launcher``: ``resilient-fsdp local``, simulated nodes of ``ft_launcher`` agents on one machine.
- ``cli``: the ``resilient-fsdp`` command.

Nothing runs at import time: NVRx and torch elastic spawn fresh interpreters that import these
modules, so every side effect lives behind a function call.
"""

__version__ = "0.1.0"
