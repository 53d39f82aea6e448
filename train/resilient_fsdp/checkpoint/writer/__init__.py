"""The checkpoint writer: the process each rank's asynchronous saves are written by, and every
adaptation to NVRx's async checkpointing.

- ``process``: the rank's writer (NVRx's persistent worker), replaced when it dies or hangs;
- ``fork_server``: the pod's fork server every rank's writer is forked from;
- ``priority``: the writer's CPU and I/O priority, below training's;
- ``worker``: what runs inside the writer: the write functions, wrapped;
- ``dcp_plan``: the ``async`` engine's DCP planning with a plan cache, and its write buckets;
- ``decentralized_plan``: a save plan every rank makes alone;
- ``handoff``: the staged buffers sent to the writer once, references per save;
- ``report``: what one save's writer reports back to its rank.
"""
