"""The checkpointer's per-step agreement rides on the loss all-reduce: two real ranks (gloo,
spawned processes) whose clocks disagree on ``checkpoint.interval_s`` still save at the same
step, rank 0's commit in its own process is learned at the step after it finished, and a step
with nothing to save or commit adds no collective of its own."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import torch.multiprocessing as mp

from tests.support import read_events


def _rank(rank: int, world: int, port: int, run_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch.distributed as dist

    from resilient_fsdp.config import load_config
    from resilient_fsdp.train.trainer import Trainer

    trainer = Trainer(
        load_config(
            None,
            [
                f"run_dir={run_dir}",
                "train.steps=400",
                "checkpoint.interval_s=3600",
                "checkpoint.save_final=false",
                "train.log_every=100",
            ],
        )
    )
    ckpt = trainer.checkpointer
    counted = {"in_after_step": False, "calls": 0}
    real_all_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        counted["calls"] += counted["in_after_step"]
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = all_reduce
    votes, after_step = ckpt.votes, ckpt.after_step
    per_step: list[dict] = []

    def skewed_votes():
        mine = votes()
        if rank == 1 and not per_step:  # rank 1's clock says the hour has passed; rank 0's does not
            mine = dataclasses.replace(mine, interval_passed=1.0)
        return mine

    def counting_after_step(step: int, agreed=None) -> float:
        counted.update(in_after_step=True, calls=0)
        saved_before, committed_before = ckpt.last_saved_step, ckpt.last_committed_step
        try:
            return after_step(step, agreed=agreed)
        finally:
            counted["in_after_step"] = False
            per_step.append(
                {
                    "step": step,
                    "agreed": dataclasses.asdict(agreed),
                    "saved": ckpt.last_saved_step != saved_before,
                    "committed": ckpt.last_committed_step != committed_before,
                    "all_reduces": counted["calls"],
                }
            )

    ckpt.votes, ckpt.after_step = skewed_votes, counting_after_step
    trainer.train()
    trainer.close(failed=False)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump(per_step, f)


def test_ranks_whose_clocks_disagree_save_together_without_a_collective_a_step(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1], ranks  # the same agreement, the same saves, on both ranks
    steps = ranks[0]
    assert [s["step"] for s in steps] == list(range(1, 401))
    assert steps[0]["agreed"]["interval_passed"] == 1.0 and steps[0]["saved"]  # one rank's vote is enough
    assert not any(s["saved"] for s in steps[1:])  # the hour has not passed again
    # The write is handed to rank 0's commit process at the first step at which no rank voted
    # that it still writes, and learned committed at the first step after it at which rank 0
    # voted that its commit no longer runs.
    handoff = next(i for i, s in enumerate(steps) if i > 0 and s["agreed"]["writing"] == 0.0)
    assert all(s["agreed"]["writing"] > 0 for s in steps[1:handoff]), steps[: handoff + 1]
    commit = next(i for i, s in enumerate(steps) if s["committed"])
    assert commit > handoff and steps[commit]["agreed"]["committing"] == 0.0, steps[: commit + 1]
    assert all(s["agreed"]["committing"] > 0 for s in steps[handoff + 1 : commit]), steps[: commit + 1]
    assert [e["step"] for e in read_events(tmp_path, "checkpoint")] == [1]
    # Every other step adds no all-reduce of the checkpointer's own.
    assert all(s["all_reduces"] == 0 for i, s in enumerate(steps) if i not in (0, commit)), steps
