"""The ``async`` engine's plan cache, in one process (a world of one), run by test_round_trips.py
against each NVRx lane.

usage: python plan_cache.py RUN_DIR [KEPT RANK ROWS,ROWS,... end|abort]

Saves a small state of DTensors and non-tensor items with the engine itself, step after step:
unchanged (the cache is validated, then used without planning), then with an added key, then with
a changed shape. Each save is loaded back with DCP into a fresh state of the shape saved and
compared bit for bit. Prints one JSON line: per save, the agreed plan vote, whether it loaded
bitwise and whether the staging buffers travelled to the writer with it.

``PROBE_PLANNING`` (environment): the engine's ``checkpoint.planning``, ``collective`` unless
given: in a world of one a plan made alone is validated at once, so the cache's steps show only
with DCP's collective planning. ``PROBE_BREAK_ALONE=1``: planning alone raises, as a state it
cannot plan would; a save that fails reports its error instead of loading.

With ``KEPT``, the engine keeps its validated plan in that file for the rank's next process and
starts from the one kept there: each run of the probe is one process of a rank, its saves of
the given numbers of rows.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from resilient_fsdp.checkpoint.writer import dcp_plan, decentralized_plan, handoff
from resilient_fsdp.checkpoint.writer.process import NVRX_VERSION
from resilient_fsdp.checkpoint.engines import AsyncEngine

SENT = []
_payload_for = handoff.Registry.payload_for


def recording_payload_for(self, worker_pid):
    payload = _payload_for(self, worker_pid)
    SENT.append(payload is not None)
    return payload


handoff.Registry.payload_for = recording_payload_for


def make_state(mesh, step, extra_key=False, rows=8):
    g = torch.Generator().manual_seed(step)
    sd = {
        "model": {
            "w": distribute_tensor(torch.randn(rows, 4, generator=g), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.randn(6, generator=g), mesh, [Shard(0)]),
        },
        "step": step,
        "note": "x" * step,
    }
    if extra_key:
        sd["model"]["extra"] = distribute_tensor(torch.randn(5, 3, generator=g), mesh, [Shard(0)])
    return sd


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a.to_local() if hasattr(a, "to_local") else a, b.to_local() if hasattr(b, "to_local") else b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def save(engine, sd, root, step):
    vote = engine.agree([engine.vote(sd)])  # a world of one: its vote is every rank's
    path = Path(root) / f"step_{step}"
    path.mkdir(parents=True)
    engine.start(sd, path, step, f"t{step}", vote)
    expected = {
        k: (v if not isinstance(v, dict) else {n: t.to_local().clone() for n, t in v.items()}) for k, v in sd.items()
    }
    engine.staged()
    for t in sd["model"].values():
        t.to_local().add_(1.0)  # the training step after the save changes the live state
    deadline = time.monotonic() + 120
    while not engine.local_status()[0]:
        if time.monotonic() > deadline:
            raise RuntimeError("the write did not finish")
        time.sleep(0.02)
    outcome = engine.collect()
    if outcome.error and os.environ.get("PROBE_BREAK_ALONE"):
        return vote, outcome.error
    if outcome.error:
        raise RuntimeError(outcome.error)
    _key, metadata = engine.commit_metadata()  # what the coordinator's commit writes .metadata from
    dcp_plan.write_metadata(path, metadata, [outcome.results])
    loaded = {"model": {n: torch.zeros_like(t) for n, t in sd["model"].items()}, "step": 0, "note": ""}
    dcp.load(loaded, checkpoint_id=str(path))
    got = {
        "model": {n: t.to_local() for n, t in loaded["model"].items()},
        "step": loaded["step"],
        "note": loaded["note"],
    }
    return vote, equal(expected, got)


def main(root, kept=None, rank=0, rows=None, end="end"):
    """``kept``: the file the engine keeps its validated plan in for the next process, as ``rank``;
    ``rows``: one save per item, of that many rows (otherwise the fixed sequence above); ``end``:
    ``end`` (the job ended: the kept plan goes) or ``abort`` (the process fails: it stays)."""
    if os.environ.get("PROBE_BREAK_ALONE"):

        def broken(*_args, **_kwargs):
            raise AssertionError("a chunk this plan cannot place")

        decentralized_plan.plan_save = broken
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    engine = AsyncEngine(0, thread_count=2, planning=os.environ.get("PROBE_PLANNING", "collective"))
    engine.attach(1, rank, Path(kept) if kept else None)
    report = []
    try:
        plan = (
            [dict()] * 4 + [dict(extra_key=True)] * 3 + [dict(extra_key=True, rows=10)] * 3
            if rows is None
            else [dict(rows=r) for r in rows]
        )
        for step, kwargs in enumerate(plan, start=1):
            sent_before = len(SENT)
            vote, ok = save(engine, make_state(mesh, step, **kwargs), root, step)
            sent = len(SENT) > sent_before and SENT[-1]  # a save that failed before its hand-off sent nothing
            report.append(
                {
                    "step": step,
                    "vote": vote,
                    "bitwise": ok is True,
                    "buffers_sent": sent,
                    "error": ok if isinstance(ok, str) else None,
                }
            )
    finally:
        if end == "end":
            engine.job_ended()
        engine.close(abort=end != "end")
        dist.destroy_process_group()
    print(json.dumps({"nvrx_version": NVRX_VERSION, "saves": report, "notes": engine.take_notes()}))


if __name__ == "__main__":
    if len(sys.argv) > 2:  # RUN_DIR KEPT RANK ROWS,ROWS,... end|abort
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(r) for r in sys.argv[4].split(",")], sys.argv[5])
    else:
        main(sys.argv[1])
