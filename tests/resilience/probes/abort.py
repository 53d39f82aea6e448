"""Run by tests/resilience/test_abort.py: one rank of a gloo job whose rank 0 fails while the others
wait for it in a collective.

usage: python abort.py RANK WORLD_SIZE PORT

Every rank joins the process group the way the trainer does (``distributed.init_distributed``,
which records the group's connections), and takes part in one all-reduce. Then rank 0 leaves the
collectives: it takes the failure path (``distributed.shutdown(clean=False)``) and stays alive
for 30 s, as a rank whose teardown is slow (a checkpoint writer being drained, a hung GPU call),
holding a reference to the group, as a failed attempt's traceback does (its frames hold the model,
the mesh and the group): destroying the group then does not close its connections.
The other ranks enter an all-reduce that rank 0 never joins and report how long it took to fail.
``dist.timeout_s`` is 60 s. Prints one JSON line.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from resilient_fsdp.config import load_config
from resilient_fsdp.train import distributed


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    cfg = load_config(None, ["dist.device=cpu", "dist.timeout_s=60", "dist.init_timeout_s=60"]).dist
    distributed.init_distributed(cfg)
    t = torch.ones(4)
    dist.all_reduce(t)
    report = {"rank": rank, "warm_up": t.tolist()}
    if rank == 0:
        time.sleep(2)  # the others are blocked in their all-reduce by now
        held = dist.distributed_c10d._get_default_group()  # noqa: F841 - kept alive, see above
        t0 = time.monotonic()
        distributed.shutdown(clean=False)
        report["shutdown_s"] = time.monotonic() - t0
        print(json.dumps(report), flush=True)
        time.sleep(30)
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        report["error"] = None
    except Exception as exc:  # noqa: BLE001 - what the peer sees is the point
        report["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    report["failed_after_s"] = time.monotonic() - t0
    print(json.dumps(report), flush=True)
    os._exit(0)  # the group is broken; skip its teardown


if __name__ == "__main__":
    main()
