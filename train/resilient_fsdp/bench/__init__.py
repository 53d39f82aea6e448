"""How things are measured: ``resilient-fsdp bench ...`` and the GPU check.

- ``checkpoint``: ``bench checkpoint``: training-loop stall of every checkpoint engine;
- ``checkpoint_engines``: the engines ``bench checkpoint`` compares and the measuring loop;
- ``commit_scale``: rank 0's commit at 1,024 ranks, from synthetic outcomes;
- ``scale``: ``bench scale``: planning, resume metadata and connections at 16,384 ranks;
- ``recovery``: ``bench recovery``: one fault recovered by each restart layer;
- ``slow_and_silent``: ``bench slow-and-silent``: slow ranks and silent corruption, found and fixed;
- ``soak``: ``bench soak``: a fault a minute for ten minutes: goodput and exactness;
- ``campaign``: ``bench campaign``: one job through faults, a rewind, a shrink and a regrow;
- ``s3``: ``bench s3``: S3 throughput, managed transfer vs one stream;
- ``resume_cost``: the bytes one resume reads at 1,024 ranks and the parameter hash's rate;
- ``results``: how every benchmark writes its ``--out`` JSON;
- ``gpu``: ``scripts/gpu-check``: the prepared one-GPU check and the wheels it carries.
"""
