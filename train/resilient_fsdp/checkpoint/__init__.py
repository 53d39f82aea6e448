"""Checkpoints: what they hold, how they are written, committed, kept, resumed and copied to S3.

- ``checkpointer``: what the loop calls (after each step, at the end): save on schedule, poll,
  agree, finalize, commit, log; resume;
- ``commit``: rank 0's commit of a checkpoint (outcomes, ``.metadata``, lease, manifest, rename)
  and the process of its own it runs in between steps;
- ``failures``: a failed save's cause, the streak of them that ends a job, a full volume's message;
- ``group``: the ranks a checkpoint is written by and the collectives the checkpointer uses;
- ``state``: what a checkpoint holds for one rank (model, optimizer, schedule, counters, sampler,
  RNG, learned timeouts) and the canonical parameter names;
- ``staging``: the snapshot in reused host buffers that the loop waits for;
- ``arena``: the one block of shared memory a rank's staging buffers are views of;
- ``engines``: what an engine is, and ``async`` (NVRx DCP writer), ``torch-async`` (NVRx, one
  file per rank), ``sync``;
- ``writer/``: the rank's checkpoint writer process and every adaptation to NVRx's async
  checkpointing;
- ``integrity``: checksums computed while files are written, and their verification;
- ``resume``: which checkpoint a start resumes from, and loading it;
- ``metadata_index``: the commit's index of DCP's ``.metadata`` that a resume reads instead;
- ``store``: the directory layout, the atomic commit, discovery and retention;
- ``lease``: one job at a time writes a checkpoint directory;
- ``run_identity``: which run a checkpoint directory belongs to (``RUN``), what the pod's memory is keyed by;
- ``shared_volume``: whether this process can write the run or checkpoint directory, and the
  chart values that fix it when not;
- ``s3/``: the S3 tier (durable copies, restore on a new cluster);
- ``memory/``: the memory tier (snapshots in the pods' memory, replicas on other pods);
- ``commands``: ``resilient-fsdp checkpoints list|pull|push``.
"""
