"""Checkpoints: what they hold, how they are written, committed, kept, resumed and copied to S3.

- ``checkpointer``: what the loop calls after each step and at the end; save, poll, wait, resume;
- ``votes``: the per-step votes the trainer's loss all-reduce sums for the checkpointer;
- ``pending``: the save in flight and the record or failure its commit makes;
- ``commit``: rank 0's commit of a checkpoint and the process of its own it runs in;
- ``retention``: rank 0's retention thread (``checkpoint.keep_last``, torn writes swept);
- ``preflight``: a start's checks: the directory writable, the lease taken, S3 reachable;
- ``reports``: what the checkpointer says in the run's log;
- ``failures``: a failed save's cause, the streak that ends a job, a full volume's message;
- ``group``: the ranks a checkpoint is written by and the collectives the checkpointer uses;
- ``state``: what a checkpoint holds for one rank, and the canonical parameter names;
- ``staging``: the snapshot in reused host buffers that the loop waits for;
- ``arena``: the one block of shared memory a rank's staging buffers are views of;
- ``open_files``: a process's open-files limit, raised to the hard limit at start;
- ``engines``: what an engine is, and ``async``, ``torch-async``, ``sync``;
- ``writer/``: the rank's checkpoint writer process and every adaptation to NVRx's checkpointing;
- ``integrity``: checksums computed while files are written, and their verification;
- ``resume``: which checkpoint a start resumes from, and loading it;
- ``metadata_index``: the commit's index of DCP's ``.metadata`` that a resume reads instead;
- ``store``: the directory layout, the atomic commit, discovery and retention;
- ``lease``: one job at a time writes a checkpoint directory;
- ``run_identity``: which run a checkpoint directory belongs to (``RUN``);
- ``shared_volume``: whether this process can write a directory, and the chart values that fix it;
- ``s3/``: the S3 tier (durable copies, restore on a new cluster);
- ``memory/``: the memory tier (snapshots in the pods' memory, replicas on other pods);
- ``commands``: ``resilient-fsdp checkpoints list|pull|push``.
"""
