"""params_sha256: the same digest at every world size, changed by one bit, hashed where the shards
are (no rank gathers a parameter of two or more dimensions)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.support import _env
from tests.train.probes import HERE as PROBES


def hash_at(world: int, shard_group: int = 0) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBES / "params_hash.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                extra={
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "SHARD_GROUP": str(shard_group),
                }
            ),
        )
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def test_the_digest_is_the_same_at_every_world_size_and_every_rank_hashes_its_own_rows():
    one, three = hash_at(1), hash_at(3)  # 3: uneven dim-0 shards, an empty one for small parameters
    assert {r["digest"] for r in one + three} == {one[0]["digest"]}
    assert {r["flipped"] for r in one + three} == {one[0]["flipped"]} != {one[0]["digest"]}
    largest = one[0]["largest_param_bytes"]
    # Rows are hashed in place where they are: no rank, rank 0 included, allocates as much as the
    # largest parameter (gathering it to hash it would); only the 1-D ones are gathered whole.
    for r in one + three:
        assert r["allocated"] < largest / 4, r


def test_hsdp_gives_the_same_digest_and_each_row_is_hashed_once():
    one, hsdp = hash_at(1), hash_at(4, shard_group=2)  # 2 replicas of 2 shards each
    assert {r["digest"] for r in hsdp} == {one[0]["digest"]}
    assert {r["flipped"] for r in hsdp} == {one[0]["flipped"]}
