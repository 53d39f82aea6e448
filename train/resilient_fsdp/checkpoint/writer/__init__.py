"""The checkpoint writer: the process each rank's asynchronous saves are written by, and every
adaptation to NVRx's async checkpointing.

- ``process``: :class:`~.process.WriterProcess`, the rank's writer (NVRx's persistent worker),
  started in the background, replaced when it dies or hangs; the NVRx adaptations (CPU-only
  torch, 0.4 / 0.7);
- ``fork_server``: the pod's fork server every rank's writer is forked from, already imported,
  under a pre-warmed server;
- ``priority``: the writer's CPU and I/O priority, below training's;
- ``worker``: what runs inside the writer: the write functions, wrapped (failures recorded,
  files hashed, the CPU shim, injected writer faults);
- ``dcp_plan``: the ``async`` engine's DCP planning with a plan cache, its write buckets over the
  staged buffers, the metadata, and the check that write results match the files;
- ``decentralized_plan``: a save plan every rank makes alone, and the digest the ranks agree on
  before they do;
- ``handoff``: the staged buffers sent to the writer once, references per save;
- ``report``: :class:`~.report.SaveReport`, what one save's writer reports back to its rank.
"""
