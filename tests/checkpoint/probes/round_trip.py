"""Checkpoint round trip in one process (a world of one), run by test_round_trips.py.

usage: python round_trip.py RUN_DIR MODE

Trains 3 steps, snapshots every piece of state, saves, keeps training (mutating the live
tensors while the write may still be in flight), finalizes, then loads the checkpoint into a
fresh trainer and compares it with the snapshot bit for bit. Prints one JSON line.
"""

import copy
import json
import random
import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from resilient_fsdp.checkpoint.writer.process import NVRX_VERSION
from resilient_fsdp.checkpoint.state import rng_state
from resilient_fsdp.config import load_config
from resilient_fsdp.train.trainer import Trainer


def local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(trainer):
    sd = trainer.checkpointer.state.state_dict()
    return {
        "model": {k: local(v) for k, v in sd["model"].items()},
        "optim": {
            k: {n: local(x) if torch.is_tensor(x) else x for n, x in v.items()} for k, v in sd["optim"]["state"].items()
        },
        "lr_scheduler": copy.deepcopy(sd["lr_scheduler"]),
        "trainer": dict(sd["trainer"]),
        "data": dict(sd["data"]),
        "rng": {k: v.clone() if torch.is_tensor(v) else v for k, v in rng_state().items()},
    }


def equal(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def main(run_dir, mode):
    overrides = [
        f"run_dir={run_dir}",
        f"checkpoint.mode={mode}",
        "train.steps=3",
        "checkpoint.save_final=false",
        "optim.warmup_steps=2",
    ]
    trainer = Trainer(load_config(None, overrides))
    for _ in range(3):
        trainer.train_step()
        trainer.counters.step += 1
    before = snapshot(trainer)
    trainer.checkpointer.save(3)
    for _ in range(2):  # mutate parameters, optimizer state, schedule, sampler and RNG
        trainer.train_step()
        torch.rand(5)
        random.random()
        np.random.rand(3)
    changed = not equal(before, snapshot(trainer))
    record = trainer.checkpointer.wait()
    trainer.close(failed=False)

    fresh = Trainer(load_config(None, overrides))
    resumed_step = fresh.checkpointer.resume()
    after = snapshot(fresh)
    report = {
        "nvrx_version": NVRX_VERSION,
        "mode": mode,
        "committed": record is not None,
        "resumed_step": resumed_step,
        "live_state_changed_during_write": changed,
        "equal": {k: equal(before[k], after[k]) for k in before},
    }
    fresh.close(failed=False)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
