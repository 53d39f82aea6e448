"""The memory tier: checkpoints in the pods' memory, restored by a copy, with the shared volume and
S3 behind them.

- ``tier``: the memory checkpoints in the step loop (save, stall, commit off the training thread,
  restore from a rank's own slot, removal at the job's end);
- ``slots``: a rank's two alternating snapshots in ``/dev/shm`` and their commit records;
- ``peers``: which rank keeps which rank's replica (never on its own pod);
- ``agreement``: the one restore decision every rank reaches from every rank's report.
"""
