"""Memory replicas between real processes over gloo (``checkpoint.memory.replicas``): each rank's
newest snapshot reaches the rank on the next pod whole over a group that connects a pair only when
it first talks, an overtaken one is skipped and said, a start's exchange moves a replica back into its rank's own slot, and a corrupt replica moved back
is refused by its rank's load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from resilient_fsdp.checkpoint.memory.slots import job_root, remove_job
from resilient_fsdp.local.cluster.launcher import free_port
from tests.support import REPO

SHM = Path("/dev/shm")
RUN = "test-run"  # the run id (``run_identity``) the slots of these tests are kept under

WORKER = textwrap.dedent("""
    import json, os, sys, time, torch
    import torch.distributed as dist
    from pathlib import Path
    from resilient_fsdp.checkpoint.memory.agreement import Report, decide
    from resilient_fsdp.checkpoint.memory.replicas import Replicator, exchange, pairs_group, replica_slots
    from resilient_fsdp.checkpoint.memory.slots import MemorySlots, owner_name

    def sockets():
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:  # the listing's own descriptor, closed by now
                pass
        return sum(link.startswith("socket:") for link in links)

    rank, world, root = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = sockets()
    group = pairs_group()
    made = sockets() - before
    dist.barrier()  # no peer sends (and so connects) before every rank has counted
    own = MemorySlots(root, owner_name(rank))
    source, holder = (rank - 1) % world, (rank + 1) % world   # one rank per pod
    said = []
    rep = Replicator(group, own, replica_slots(root, source), rank, holder, source, said.append)

    def save(step):
        tensors = [torch.full((1000,), float(rank * 100 + step)), torch.arange(7, dtype=torch.int64) + step]
        slot = own.next_slot()
        spans, views = own.open(slot, tensors)
        for v, t in zip(views, tensors):
            v.copy_(t)
        return own.commit(slot, spans, step, "d", world_size=world, rank=rank, job="j", attempt=0,
                          extra=f"rank {rank} step {step}".encode())

    first = save(2)
    rep.committed(first)
    assert rep.wait_sent(2, 60), rep.errors   # step 2's replica is sent
    rep.committed(save(4))
    rep.committed(save(6))                 # 4 may be overtaken before it leaves: skipped, said
    dist.barrier()
    rep.close()
    kept = replica_slots(root, source)
    newest = kept.newest()
    views = kept.read(newest)               # every checksum, as a load checks them
    out = {"rank": rank, "replica_of": source, "replica_step": newest.step, "replica_rank": newest.rank,
           "value": float(views[0][0]), "extra": kept.extra(newest).decode(), "sent": rep.sent,
           "skipped": rep.skipped, "said": said, "errors": rep.errors, "sockets_made": made,
           "lazy_env_left": os.environ.get("TORCH_GLOO_LAZY_INIT")}
    # A replacement pod for rank 1: its own slots are gone; the start's decision and exchange.
    if rank == 1:
        own.remove()
    dist.barrier()
    group2 = pairs_group()
    reports = [None] * world
    mine = Report(rank, tuple(r.step for r in own.records()), {source: tuple(r.step for r in kept.records())})
    dist.all_gather_object(reports, mine)
    decision = decide(reports, world, durable_step=4)
    out["decision"] = [decision.step, {str(k): v for k, v in decision.sources.items()}]
    out["exchange_error"] = exchange(group2, decision, rank, own, lambda s: replica_slots(root, s))
    restored = own.newest()
    out["own_after"] = [restored.step, float(own.read(restored)[0][0]), own.extra(restored).decode()]
    # The same replacement again, but the replica rank 2 keeps has a flipped byte: it arrives, and
    # its rank's load refuses it (the sender's checksums travel with it).
    if rank == 2:
        record = next(r for r in kept.records() if r.step == 6)
        path = kept.dir / f"slot-{record.slot}.bin"
        data = bytearray(path.read_bytes())
        data[record.spans[0][0]] ^= 0x01
        path.write_bytes(bytes(data))
    if rank == 1:
        own.remove()
    dist.barrier()
    group3 = pairs_group()
    out["exchange_again_error"] = exchange(group3, decision, rank, own, lambda s: replica_slots(root, s))
    if rank == 1:
        from resilient_fsdp.checkpoint.memory.slots import SlotInvalid
        try:
            own.read(own.newest())
            out["corrupt_replica"] = "loaded"
        except SlotInvalid as exc:
            out["corrupt_replica"] = exc.reason
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
""")


def test_replicas_reach_the_next_pod_whole_and_come_back_to_a_replacement_pod(tmp_path):
    job = f"replicas-{os.getpid()}-{tmp_path.name[-12:]}"
    root = job_root(SHM, job, RUN)
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "train"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "3",
    }
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(root)],
                env={**env, "RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(3)
        ]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        for o in outs:
            source = (o["rank"] - 1) % 3
            assert (o["replica_of"], o["replica_step"], o["replica_rank"]) == (source, 6, source), o
            assert o["value"] == source * 100 + 6 and o["extra"] == f"rank {source} step 6", o
            assert o["errors"] == [] and o["sent"][0] == 2 and o["sent"][-1] == 6, o
            assert all(f"step {s} not replicated" in " ".join(o["said"]) for s in o["skipped"]), o
            # An eager gloo group opens a socket to each other rank at once (and one to listen):
            # three here. The replicas' group only listens until a pair first talks.
            assert o["sockets_made"] < 2 and o["lazy_env_left"] is None, o
        # Rank 1's pod was replaced: step 6 for it comes from rank 2, which kept its replica.
        assert {json.dumps(o["decision"]) for o in outs} == {json.dumps([6, {"0": None, "1": 2, "2": None}])}
        assert [o["exchange_error"] for o in outs] == [None, None, None]
        assert outs[1]["own_after"] == [6, 106.0, "rank 1 step 6"]
        assert [o["exchange_again_error"] for o in outs] == [None, None, None]
        assert outs[1]["corrupt_replica"] == "tensor 0 fails its CRC32C (step 6)"
    finally:
        remove_job(SHM, job)


ABORTING = textwrap.dedent("""
    import os, sys, time, torch
    import torch.distributed as dist
    from pathlib import Path
    from resilient_fsdp.checkpoint.memory.replicas import Replicator, replica_slots
    from resilient_fsdp.checkpoint.memory.slots import MemorySlots, owner_name

    rank, root, marker = int(os.environ["RANK"]), Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    peer = 1 - rank
    rep = Replicator(group, MemorySlots(root, owner_name(rank)), replica_slots(root, peer), rank, peer, peer,
                     lambda _: None)
    if rank == 1:  # its attempt failed: it closes without waiting, and its process exits
        rep.close(wait=False)
        marker.write_text("closed")
        os._exit(0)
    # Rank 0, on the other pod, is still training: it has not closed, so it has sent no goodbye.
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("peer closed while this rank still ran" if marker.exists() else "peer still waiting", flush=True)
    rep.close(timeout_s=5)
    os._exit(0)
""")


def test_a_failed_rank_leaves_without_waiting_for_its_peers_goodbye(tmp_path):
    """Two real processes: rank 1's attempt fails while rank 0 (another pod) goes on. Waiting for
    rank 0's goodbye would hold rank 1's exit, which is how the launchers learn of the failure,
    for the replicator's 30 s; an aborting close returns at once."""
    job = f"replicas-abort-{os.getpid()}-{tmp_path.name[-12:]}"
    root = job_root(SHM, job, RUN)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "train"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
    }
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", ABORTING, str(root), str(tmp_path / "closed")],
                env={**env, "RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
        assert outs[0][0].strip() == "peer closed while this rank still ran", outs[0]
    finally:
        remove_job(SHM, job)


BROKEN = textwrap.dedent("""
    import os, sys, time, torch
    import torch.distributed as dist
    from pathlib import Path
    from resilient_fsdp.checkpoint.memory.replicas import Replicator, pairs_group, replica_slots
    from resilient_fsdp.checkpoint.memory.slots import MemorySlots, owner_name

    rank, root, gone = int(os.environ["RANK"]), Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = pairs_group()
    peer, said = 1 - rank, []
    own = MemorySlots(root, owner_name(rank))
    rep = Replicator(group, own, replica_slots(root, peer), rank, peer if rank == 0 else None,
                     peer if rank == 1 else None, said.append)

    def save(step):
        slot = own.next_slot()
        spans, views = own.open(slot, [torch.full((1000,), float(step))])
        views[0].fill_(float(step))
        return own.commit(slot, spans, step, "d", world_size=2, rank=rank, job="j", attempt=0, extra=b"x")

    if rank == 1:  # the other pod: it takes one replica, then its node is gone
        deadline = time.monotonic() + 30
        while not rep.received and time.monotonic() < deadline:
            time.sleep(0.02)
        print(f"received {rep.received}", flush=True)
        gone.write_text("exiting")
        os._exit(9)
    rep.committed(save(2))
    assert rep.wait_sent(2, 30), rep.errors
    deadline = time.monotonic() + 30
    while not gone.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    # Snapshots go on being taken, as training does, until a send meets the closed connection.
    step = 2
    while rep.healthy and time.monotonic() < deadline:
        step += 2
        rep.committed(save(step))
        rep.wait_sent(step, 1.0)
    print(f"healthy={rep.healthy} sent={rep.sent}", flush=True)
    print("errors: " + " | ".join(rep.errors), flush=True)
    os._exit(0)
""")


def test_replication_that_stops_is_said_at_once_and_reported_unhealthy(tmp_path):
    """Two real processes: the holder's process dies after one replica. The sender's next send
    fails; it must not stop silently: the replicator is no longer healthy (the step's vote, the
    ``memory_replication`` record) and its error names the peer, for the training thread to say."""
    job = f"replicas-broken-{os.getpid()}-{tmp_path.name[-12:]}"
    root = job_root(SHM, job, RUN)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "train"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
    }
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", BROKEN, str(root), str(tmp_path / "gone")],
                env={**env, "RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        assert procs[1].returncode == 9 and outs[1][0].strip() == "received [2]", outs[1]
        assert procs[0].returncode == 0, outs[0][1][-3000:]
        out = outs[0][0]
        assert "healthy=False sent=[2" in out, out
        assert "errors: sending step " in out and "to rank 1: " in out, out  # the training thread says it
    finally:
        remove_job(SHM, job)
