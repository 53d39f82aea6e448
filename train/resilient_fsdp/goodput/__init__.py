"""How much of the wall time a job trains, and the settings that maximise it.

- ``model``: the closed form: Young's and Daly's checkpoint intervals, expected goodput, failure rates;
- ``costs``: a checkpoint's stall and write time, estimated from the model, the GPUs and the storage;
- ``settings``: the advisor's arithmetic: checkpoint interval, timeouts and restart limits from the inputs;
- ``advice_table``: the advice as the printed table and as a chart values snippet;
- ``advise``: ``resilient-fsdp advise``: the advisor's flags and inputs (measured, estimated, the chart's);
- ``profiles``: the values profiles' restart settings and the header that derives them, from the advisor;
- ``simulate``: ``resilient-fsdp simulate``: Monte Carlo goodput per cluster size and restart strategy;
- ``report``: ``resilient-fsdp report --run-dir DIR``: a finished run's timeline and goodput breakdown.
"""
