"""How much of the wall time a job trains, and the settings that maximise it.

- ``model``: the closed form: Young's and Daly's checkpoint intervals, expected goodput, failure rates;
- ``costs``: a checkpoint's stall and write time, estimated from the model, the GPUs and the storage;
- ``advise``: ``resilient-fsdp advise``: checkpoint interval, timeouts and restart limits for a cluster;
- ``profiles``: the values profiles' restart settings and the header that derives them, from the advisor;
- ``simulate``: ``resilient-fsdp simulate``: Monte Carlo goodput per cluster size and restart strategy;
- ``report``: ``resilient-fsdp report RUN_DIR``: a finished run's timeline and goodput breakdown.
"""
