"""Per-save costs that grow with the world, bounded without processes: the commit's gather and
``.metadata`` are linear in the ranks, :func:`integrity.share` is O(files log world) and assigns
as the linear scan did, and object collectives run on a CPU group."""

from __future__ import annotations

import pickle
import random
import time

import torch
import torch.distributed as dist

from resilient_fsdp.bench import commit_scale
from resilient_fsdp.checkpoint import group as group_mod
from resilient_fsdp.checkpoint import integrity


def share_by_scan(files: dict[str, dict], world_size: int, rank: int) -> list[str]:
    """The reference: largest file first, to the least-loaded rank found by a scan of the world."""
    loads = [0] * world_size
    mine = []
    for name in sorted(files, key=lambda n: (-int(files[n].get("bytes", 0)), n)):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += int(files[name].get("bytes", 0))
        if target == rank:
            mine.append(name)
    return mine


def test_share_matches_the_linear_scan_on_random_inputs():
    rng = random.Random(7)
    for _ in range(30):
        world = rng.randint(1, 40)
        # Few distinct sizes, so ties (and their breaking by rank) are exercised.
        files = {
            f"f{i:04d}": {"bytes": rng.choice([0, 1, 2, 5, 100, rng.randint(0, 10**6)])}
            for i in range(rng.randint(0, 120))
        }
        for rank in range(world):
            assert integrity.share(files, world, rank) == share_by_scan(files, world, rank)
    parts = [integrity.share(files, world, r) for r in range(world)]
    assert sorted(n for p in parts for n in p) == sorted(files)


def test_share_at_1024_ranks_is_fast():
    world = 1024
    files = {f"__{r}_{t}.distcp": {"bytes": 10**9 + r * 7 + t} for r in range(world) for t in range(4)}
    t0 = time.perf_counter()
    mine = integrity.share(files, world, 3)
    elapsed = time.perf_counter() - t0
    assert len(mine) == 4  # 4 files per rank of about equal size: 4 each
    assert elapsed < 1.0, f"share over {len(files)} files x {world} ranks took {elapsed:.2f} s"


def test_the_commit_gather_and_metadata_grow_linearly_with_the_world():
    names = commit_scale.fqns(layers=2)
    one = len(pickle.dumps(commit_scale.rank_outcome(5, 8, names)))
    assert one > 100 * len(names) // 2  # a write result per tensor shard, not a summary
    small, large = commit_scale.measure(8, layers=2), commit_scale.measure(32, layers=2)
    assert small["tensors"] == large["tensors"] == len(names)
    per_rank = (small["gather_bytes_per_rank"], large["gather_bytes_per_rank"])
    assert abs(per_rank[1] - per_rank[0]) / per_rank[0] < 0.05, per_rank  # the same per rank: linear
    ratio = large["metadata_bytes"] / small["metadata_bytes"]
    assert 3.0 < ratio < 5.0, ratio  # 4x the ranks: about 4x the .metadata
    assert large["files"] == 32 * commit_scale.WRITER_THREADS


def test_hsdp_commit_grows_with_the_shard_group_not_the_world():
    names = commit_scale.fqns(layers=2)
    fsdp = commit_scale.measure(32, layers=2)
    small, large = commit_scale.measure(32, layers=2, shard_group=4), commit_scale.measure(128, layers=2, shard_group=4)
    # Each shard written once: the .metadata of a 4-rank shard group at 32 and 128 ranks is the same
    # size, and an eighth of FSDP's at 32; the gathered results shrink with it.
    assert abs(large["metadata_bytes"] - small["metadata_bytes"]) / small["metadata_bytes"] < 0.05
    assert 6.0 < fsdp["metadata_bytes"] / small["metadata_bytes"] < 10.0
    assert fsdp["gather_bytes"] / small["gather_bytes"] > 4.0
    results = [commit_scale.rank_outcome(r, 32, names, shard_group=4).results for r in range(32)]
    written = [(w.index.fqn, tuple(w.index.offset)) for rs in results for w in rs]
    assert len(written) == len(set(written)) == len(names) * 4  # every shard exactly once
    assert large["files"] == 128 * commit_scale.WRITER_THREADS  # every rank still writes its files


def test_object_collectives_use_gloo_and_follow_a_new_default_group(tmp_path):
    if dist.is_initialized():  # another test's one-rank group (they make one when none is there)
        dist.destroy_process_group()
    for attempt in range(2):  # an in-process restart destroys the default group and makes another
        store = dist.FileStore(str(tmp_path / f"store{attempt}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            assert group_mod.open_object_group() is None  # gloo already: the default group carries objects
            assert group_mod._object_group[0]() is dist.distributed_c10d._get_default_group()
            g = group_mod.RankGroup(0, 1, device=torch.device("cpu"))
            assert dist.get_backend(g._objects()) == "gloo"
            assert g.gather({"a": 1}) == [{"a": 1}] and g.broadcast(3) == 3 and g.all_gather("x") == ["x"]
        finally:
            dist.destroy_process_group()


def test_side_groups_connect_a_rank_only_to_the_peers_its_collectives_reach():
    """Real gloo ranks (10) on loopback: the lazy side group the checkpointer's objects travel on
    (and the replicas') opens no connection when it is made, where an eager group connects every
    rank to every other at every start; after a broadcast, a gather and an all-gather along the
    object collectives' tree a rank holds its parent and its children alone: rank 0 four of the
    nine others, no rank more than five."""
    import json
    import subprocess
    import sys

    from tests.checkpoint.probes import HERE
    from tests.support import REPO, _env

    world = 10
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(HERE / "object_group.py"), str(world)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=_env([HERE]),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(ranks) == [str(r) for r in range(world)]
    for r, got in ranks.items():
        assert got["told"] == "from rank 0" and got["all_gathered"] == list(range(world))
        assert got["gathered"] == ([10 * i for i in range(world)] if r == "0" else None)
        assert got["eager_made"] == world - 1, got  # the full mesh, at creation
        assert got["lazy_made"] == 0, got
        assert got["listeners_recorded"] >= 1  # an abort can shut down what arrives later
    # The tree of FANOUT children a rank: rank 0 talks to its children, every other rank to its
    # parent and its children, whatever the world.
    fanout = group_mod.FANOUT
    for r, got in ranks.items():
        rank = int(r)
        children = len(range(rank * fanout + 1, min(rank * fanout + 1 + fanout, world)))
        assert got["lazy_used"] == children + (rank > 0), (r, got)
    assert max(got["lazy_used"] for got in ranks.values()) <= fanout + 1
