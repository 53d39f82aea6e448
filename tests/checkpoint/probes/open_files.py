"""A checkpoint of over 3,000 tensors (``many_tensors``, with AdamW's state) under the open-files
limit the test sets, in one process (a world of one), run by test_open_files.py.

usage: python open_files.py RUN_DIR MODE

Trains 2 steps, snapshots every piece of state, saves, trains on while the write may be in flight,
waits for the commit, then resumes a fresh trainer from it and compares it with the snapshot bit
for bit. Counts the file descriptors the trainer and its writer process hold before the first save
and after the commit. Prints one JSON line.
"""

import json
import resource
import sys

import psutil

from round_trip import equal, snapshot
from resilient_fsdp.checkpoint.staging import local_tensors
from resilient_fsdp.checkpoint.writer.process import NVRX_VERSION
from resilient_fsdp.config import load_config
from resilient_fsdp.train.trainer import Trainer


def step(trainer):
    trainer.train_step()
    trainer.counters.step += 1


def held_fds(trainer):
    writer = trainer.checkpointer.engine.writer
    writer.usable()  # started
    return {"trainer": psutil.Process().num_fds(), "writer": psutil.Process(writer.pid).num_fds()}


def main(run_dir, mode):
    overrides = [
        f"run_dir={run_dir}",
        f"checkpoint.mode={mode}",
        "model.factory=many_tensors:build",
        "train.steps=4",
        "checkpoint.save_final=false",
        "optim.warmup_steps=2",
    ]
    trainer = Trainer(load_config(None, overrides))
    step(trainer)
    step(trainer)
    before = snapshot(trainer)
    tensors = local_tensors(trainer.checkpointer.state.state_dict())
    fds_before = held_fds(trainer)
    trainer.checkpointer.save(2)
    step(trainer)  # the live state changes while the write may still be in flight
    record = trainer.checkpointer.wait()
    fds_after = held_fds(trainer)
    writer_limit = psutil.Process(trainer.checkpointer.engine.writer.pid).rlimit(psutil.RLIMIT_NOFILE)
    trainer.close(failed=False)

    fresh = Trainer(load_config(None, overrides))
    resumed_step = fresh.checkpointer.resume()
    after = snapshot(fresh)
    fresh.close(failed=False)
    print(
        json.dumps(
            {
                "nvrx_version": NVRX_VERSION,
                "tensors": len(tensors),
                "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "open_files_limit": {
                    "trainer": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                    "writer": list(writer_limit),
                },
                "fds_before": fds_before,
                "fds_after": fds_after,
                "committed": record is not None,
                "bytes": record["bytes"] if record else None,
                "resumed_step": resumed_step,
                "equal": {k: equal(before[k], after[k]) for k in before},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
