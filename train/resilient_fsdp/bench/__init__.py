"""How things are measured: ``resilient-fsdp bench ...`` and the GPU check.

- ``checkpoint``: ``bench checkpoint``: training-loop stall of every checkpoint engine, torch DCP's
  ``async_save`` included (``checkpoint_engines``: the engines and the measuring loop);
- ``commit_scale``: ``python -m resilient_fsdp.bench.commit_scale``: rank 0's commit at 1,024
  ranks, from synthetic outcomes (the gather's size, ``.metadata``, ``share()``);
- ``scale``: ``bench scale``: a save's planning, a resume's metadata and load planning, rank 0's
  per-save hand-off and a start's connections at 1,024 and 16,384 ranks, with DCP's planner
  objects in simulated ranks (torch's fake process group);
- ``recovery``: ``bench recovery``: one fault recovered by each restart layer;
- ``slow_and_silent``: ``bench slow-and-silent``: what finding slow ranks and silent corruption
  costs, how soon each is found, how long routing around it takes;
- ``soak``: ``bench soak``: a fault a minute for ten minutes: goodput and exactness;
- ``campaign``: ``bench campaign``: one job through faults, a rewind, a shrink and a regrow: what stays
  bounded, what the restart budgets count, what is left behind;
- ``s3``: ``bench s3``: S3 throughput, managed transfer vs one stream (and the local S3 server);
- ``resume_cost``: the bytes one resume reads at 1,024 ranks (modelled) and the parameter hash's
  rate per rank (measured);
- ``results``: how every benchmark writes its ``--out`` JSON;
- ``gpu``: ``scripts/gpu-check``: the prepared one-GPU check and the wheels it carries.
"""
