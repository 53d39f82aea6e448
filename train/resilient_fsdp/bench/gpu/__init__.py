"""The GPU check (``scripts/gpu-check``): the CUDA path measured in one call on one GPU.

- ``check``: the runner (each section in its own process, under a time budget) and the report;
- ``sections``: the registry of sections and the child process that runs one;
- ``section``: what every section gets (plan, folder, deadline, trainer runs);
- ``measure``: environment and ceilings, throughput and MFU;
- ``checkpoint``: every checkpoint engine on the ``1b`` state (and ``8b`` if it fits);
- ``restarts``: in-process restart, in-job restart, exact resume;
- ``local_checkpoints``: the memory tier beside NVRx's ``LocalCheckpointManager`` on one state;
- ``nvrx_local``: NVRx's local checkpoints driven as a saver of the measuring loop;
- ``wheels``: the wheels carried to a machine without network, and their install there.

Module level is standard library only throughout: the runner reports a missing package instead
of dying on its import.
"""
