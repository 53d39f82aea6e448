"""Load every committed checkpoint of two runs (in one process, world size 1: DCP reshards) and
compare them step by step, bit for bit; run by test_checkpoint_failures.py.

usage: python compare.py WORK_DIR CHECKPOINTS_A CHECKPOINTS_B

Model, optimizer, schedule, counters and sampler position are compared; RNG streams are not
loaded at another world size, and learned hang-detection timeouts are timings. Prints one JSON
line: {step: true | "what differs or failed"} for every step committed in A.
"""

import json
import sys
from pathlib import Path

from round_trip import equal, snapshot
from resilient_fsdp.checkpoint import store
from resilient_fsdp.checkpoint.resume import load
from resilient_fsdp.config import load_config
from resilient_fsdp.train.trainer import Trainer


def main(work, a, b):
    trainer = Trainer(load_config(None, [f"run_dir={work}", "checkpoint.resume=false"]))
    theirs = {c.step: c for c in store.scan(Path(b))[0]}
    report = {}
    for info in store.scan(Path(a))[0]:
        states = []
        for ckpt in (info, theirs.get(info.step)):
            error = "missing" if ckpt is None else load(trainer.checkpointer.state, ckpt, 0, False)
            states.append(error or {k: v for k, v in snapshot(trainer).items() if k != "rng"})
        if any(isinstance(s, str) for s in states):
            report[info.step] = " / ".join(s if isinstance(s, str) else "ok" for s in states)
        else:
            diff = [k for k in states[0] if not equal(states[0][k], states[1][k])]
            report[info.step] = True if not diff else f"differs in {diff}"
    trainer.close(failed=False)
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
