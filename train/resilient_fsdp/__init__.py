"""resilient-fsdp: fault-tolerant PyTorch FSDP2 training with NVRx, from a laptop to EKS.

The folders are the architecture; each package's own docstring lists its modules.

- ``config/``: the typed run configuration (defaults < YAML file < ``--set``) and the fault kinds;
  imports nothing else here.
- ``atomic``: the one way files are replaced in place (write, fsync, rename, fsync the directory).
- ``cli``: the ``resilient-fsdp`` command (argument parsing and dispatch only).
- ``train/``: what every rank runs (``python -m resilient_fsdp.train``): the trainer, model,
  FSDP2 sharding, data, process group, metrics.
- ``data/``: training data: ``resilient-fsdp data prepare`` (text through a tokenizer into a token
  file), the prepared directory's format, an ``s3://`` ``data.path`` copied once to the volume.
- ``hf/``: Hugging Face models: one built from a ``config.json``, pretrained safetensors in, and
  ``checkpoints export`` (the trained model out).
- ``checkpoint/``: the checkpointer the loop calls, what a checkpoint holds, the engines and the
  writer process (every adaptation to NVRx's async checkpointing), commit and retention, resume,
  the S3 tier, ``resilient-fsdp checkpoints``.
- ``resilience/``: one attempt's resilience hooks, the restart layers (hang detection, in-process
  restart, graceful stop), fault injection, restart accounting, the node agent every pod runs.
- ``local/``: the one-machine cluster of ``resilient-fsdp local`` (manifests, cluster, runtimes).
- ``deploy/``: the Helm chart from Python, validation with each workload kind's admission rules,
  the ``helm test`` release check, the chart README, the image build and its checks.
- ``bench/``: the benchmarks and the GPU check.
- ``goodput/``: the goodput model, ``advise``, ``simulate`` and ``report``.

The pod side (``config``, ``atomic``, ``train``, ``data``, ``hf``, ``checkpoint``, ``resilience``) imports nothing
from ``local``, ``deploy``, ``bench`` or ``goodput``; ``tests/test_layout.py`` keeps this and the
other layout rules true.

Nothing runs at import time: NVRx and torch elastic spawn fresh interpreters that import these
modules, so every side effect lives behind a function call.
"""

__version__ = "0.1.0"
