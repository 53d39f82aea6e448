"""Checkpoints: what they hold, how they are written, committed, kept, resumed and copied to S3.

- ``state``: what a checkpoint holds for one rank (model, optimizer, schedule, counters, sampler,
  RNG, learned timeouts);
- ``staging``: the snapshot in reused host buffers that the loop waits for;
- ``engines``: ``async`` (NVRx DCP writer), ``torch-async`` (NVRx, one file per rank), ``sync``;
- ``checkpointer``: save on schedule, poll, agree, finalize, commit; resume;
- ``resume``: which checkpoint a start resumes from, and the S3 restore before it;
- ``store``: the directory layout, the atomic commit, discovery and retention;
- ``nvrx``: every adaptation to NVRx's async checkpointing (CPU-only torch, 0.4 / 0.7);
- ``s3``: the S3 tier (durable copies, restore on a new cluster);
- ``commands``: ``resilient-fsdp checkpoints list|pull|push``.
"""
