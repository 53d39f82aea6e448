"""The connections a side group holds: ``lazy_gloo_group`` against an eager gloo group, in a
world of gloo ranks on loopback, run by test_scale.py.

usage: python object_group.py WORLD

Each rank counts its established TCP connections after the default group forms, after each side
group is made, and after the object collectives the checkpointer runs on it (a broadcast from rank
0, a gather to rank 0, an all-gather). Prints one JSON line: per rank, the connections each step
added, and what the collectives returned.
"""

import json
import os
import socket
import sys

import psutil
import torch.distributed as dist
import torch.multiprocessing as mp

from resilient_fsdp.checkpoint import group as group_mod
from resilient_fsdp.resilience import nvrx


STORE_PORT = 0  # the rendezvous store's: rank 0 hosts it, and its clients come and go


def connections() -> int:
    """Established TCP connections of this rank's groups (the store's are not a group's)."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and STORE_PORT not in (c.laddr.port, c.raddr.port)
    )


def rank_main(rank: int, world: int, port: int, out: dict) -> None:
    global STORE_PORT
    STORE_PORT = port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()  # every rank's connections of the default group are accepted
    base = connections()
    lazy = group_mod.lazy_gloo_group()
    dist.barrier()
    made = connections() - base
    dist.barrier()  # every rank has counted before any sends on the lazy group (and so connects)
    objects = group_mod.RankGroup(rank, world, device=None, objects=lazy)
    told = objects.broadcast("from rank 0" if rank == 0 else None)
    gathered = objects.gather(rank * 10)
    everyone = objects.all_gather(rank)
    dist.barrier()
    used = connections() - base
    dist.barrier()
    before_eager = connections()
    eager = dist.new_group(backend="gloo")
    dist.barrier()
    eager_made = connections() - before_eager
    dist.barrier()  # every rank has counted before any tears its groups down
    out[rank] = {
        "lazy_made": made,
        "lazy_used": used,
        "eager_made": eager_made,
        "told": told,
        "gathered": gathered,
        "all_gathered": everyone,
        "listeners_recorded": len(nvrx._GROUP_LISTENERS),
    }
    dist.destroy_process_group(eager)
    dist.destroy_process_group()


def main(world: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(world, port, out), nprocs=world)
        print(json.dumps({str(r): out[r] for r in sorted(out.keys())}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
