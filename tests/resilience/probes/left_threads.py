"""Run by tests/resilience/test_abort.py: one rank of a two-rank gloo job whose helper thread is
blocked on a peer when the rank's attempt fails.

usage: python left_threads.py RANK PORT

Both ranks join the process group as the trainer does and open a lazily connected side group (as
the memory tier's replicas do). Each starts a helper thread that waits to receive from the other
on the side group, which neither sends: the thread holds the group, as a replica receiver does.
Each leaves the thread to the abort (``nvrx.leave_to_abort``, as ``Replicator.close(wait=False)``
does) and takes the failure path (``distributed.shutdown(clean=False)``). Prints one JSON line:
whether the thread still runs after the abort, how long the abort took, and the threads and TCP
connections the process holds before the groups, and after the abort once the group objects are
collected.
"""

import gc
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from resilient_fsdp.checkpoint.group import lazy_gloo_group
from resilient_fsdp.config import load_config
from resilient_fsdp.resilience import nvrx
from resilient_fsdp.train import distributed, footprint


def main() -> None:
    rank, port = (int(a) for a in sys.argv[1:3])
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    before = footprint.measure()
    cfg = load_config(None, ["dist.device=cpu", "dist.timeout_s=60", "dist.init_timeout_s=60"]).dist
    distributed.init_distributed(cfg)
    dist.barrier()
    side = lazy_gloo_group()
    errors = []

    def receive(held: list):
        group = held.pop()  # the thread's frame is the group's only holder here
        try:
            dist.recv(torch.zeros(1), src=1 - rank, group=group)
        except Exception as exc:  # noqa: BLE001 - the abort's shutdown is what wakes it
            errors.append(type(exc).__name__)

    helper = threading.Thread(target=receive, args=([side],), name="blocked-helper", daemon=True)
    del side
    helper.start()
    time.sleep(2)  # both helpers are blocked in their receive by now
    nvrx.leave_to_abort([helper])
    t0 = time.monotonic()
    distributed.shutdown(clean=False)
    abort_s = time.monotonic() - t0
    gc.collect()
    print(
        json.dumps(
            {
                "rank": rank,
                "helper_alive": helper.is_alive(),
                "helper_error": errors,
                "abort_s": abort_s,
                "before": before,
                "after": footprint.measure(),
                "threads_after": footprint.thread_names(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
