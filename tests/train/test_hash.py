"""params_sha256: the same digest at every world size, with memory bounded by one parameter."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.support import _env
from tests.train.probes import HERE as PROBES


def hash_at(world: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(PROBES / "params_hash.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(extra={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
             for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def test_the_digest_is_the_same_at_every_world_size_and_no_rank_gathers_the_model():
    one, three = hash_at(1), hash_at(3)  # 3: uneven dim-0 shards, an empty one for small parameters
    assert {r["digest"] for r in one + three} == {one[0]["digest"]}
    model, largest = one[0]["model_bytes"], one[0]["largest_param_bytes"]
    # Ranks other than 0 only send their shards: nothing near the model's size is allocated there
    # (gathering every full parameter on every rank would allocate the whole model).
    for r in three[1:]:
        assert r["allocated"] < model / 2, r
    # Rank 0 holds one full parameter (and its padded parts) at a time, not the model at once.
    assert three[0]["allocated"] >= largest
