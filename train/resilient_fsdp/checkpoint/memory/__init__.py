"""The memory tier: checkpoints in the pods' memory, restored by a copy, with the shared volume and
S3 behind them.

- ``tier``: the memory checkpoints in the step loop (save, stall, commit off the training thread,
  restore, removal at the job's end);
- ``slots``: a rank's two alternating snapshots in ``/dev/shm`` and their commit records;
- ``pinning``: page-locking a snapshot's ``/dev/shm`` slot on CUDA so the device-to-host copy runs
  at full bandwidth;
- ``values``: a snapshot's non-tensor values, kept beside its bytes;
- ``prefetch``: a new process's read-ahead of its newest snapshot while it builds its model;
- ``peers``: which rank keeps which rank's replica (never on its own pod);
- ``replicas``: sending each rank's newest snapshot to its peer, and back to a replacement pod;
- ``agreement``: the one restore decision every rank reaches from every rank's report.
"""
