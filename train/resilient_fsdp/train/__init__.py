"""What every rank runs: ``python -m resilient_fsdp.train [--config FILE] [--set k=v]...``.

- ``entrypoint``: one rank's process: in-process restart around the attempts, exit codes;
- ``process_exit``: the process's end without the interpreter's finalization;
- ``arguments``: the command line and the configuration it resolves to (no torch import);
- ``trainer``: the composition root and the loop (``Trainer``, its ``TrainCounters``);
- ``resources``: what outlives an in-process restart (checkpoint engine, S3 uploader, monitor);
- ``model``: the built-in decoder-only transformer;
- ``presets``: its size presets' shapes and parameter counts (importable without torch);
- ``state_fit``: whether a training state fits its GPUs, the rule the chart applies too (no torch import);
- ``parallelize``: FSDP2 sharding and activation checkpointing;
- ``data``: token datasets and the resumable distributed sampler;
- ``global_batch``: the global batch at another world size (``train.elastic_batch``; no torch import);
- ``factories``: ``pkg.module:function`` imports for custom models and datasets;
- ``distributed``: device, backend and process group from launcher variables;
- ``metrics``: progress lines, ``metrics.jsonl``, parameter hashing.
- ``footprint``: what a rank's process holds at each start (threads, descriptors, connections, children).
"""
