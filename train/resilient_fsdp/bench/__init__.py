"""How things are measured: ``resilient-fsdp bench ...`` and the GPU check.

- ``checkpoint``: ``bench checkpoint``: training-loop stall of every checkpoint engine, torch DCP's
  ``async_save`` included (``checkpoint_engines``: the engines and the measuring loop);
- ``recovery``: ``bench recovery``: one fault recovered by each restart layer;
- ``soak``: ``bench soak``: a fault a minute for ten minutes: goodput and exactness;
- ``campaign``: ``bench campaign``: one job through faults, a rewind, a shrink and a regrow: what stays
  bounded, what the restart budgets count, what is left behind;
- ``s3``: ``bench s3``: S3 throughput, managed transfer vs one stream (and the local S3 server);
- ``results``: how every benchmark writes its ``--out`` JSON;
- ``gpu``: ``scripts/gpu-check``: the prepared one-GPU check and the wheels it carries.
"""
