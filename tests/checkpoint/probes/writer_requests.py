"""The rank's writer process as the trainer starts it, and requests it cannot take, in one process;
run by test_open_files.py against each NVRx lane.

usage: python writer_requests.py RUN_DIR

- ``limits``: the process resources of a rank (``ProcessResources``) raise the soft open-files
  limit to the hard one and say so once; the writer process they start inherits the raised limit.
- ``writer``: what the writer process reports from inside (its ``CUDA_VISIBLE_DEVICES``, whether
  torch initialised CUDA in it) and how the trainer built its queue (NVRx 0.7's ``cpu_shm_mode``).
- ``unsendable``: a ``torch-async`` save of a state holding a value that cannot be pickled fails
  at once, naming that value; the next save commits.
- ``feeder``: a request put on NVRx's queue that its feeder thread cannot pickle (a lambda) is
  reported by the next poll, naming it; the writer is replaced and takes requests again.

Prints one JSON line.
"""

import contextlib
import io
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from resilient_fsdp.checkpoint import open_files
from resilient_fsdp.checkpoint.writer.process import NVRX_VERSION
from resilient_fsdp.checkpoint.writer.report import SaveReport
from resilient_fsdp.config import load_config
from resilient_fsdp.train.resources import ProcessResources


def writer_facts(path):
    """Runs in the writer process."""
    Path(path).write_text(
        json.dumps(
            {
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "cuda_initialized": torch.cuda.is_initialized(),
                "open_files_limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
            }
        )
    )


def until_done(poll, timeout_s=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        done, error = poll()
        if done:
            return time.monotonic() - t0, error
        time.sleep(0.02)
    raise RuntimeError("the writer did not finish")


def ask_writer(writer, run_dir, name):
    path = Path(run_dir) / f"{name}.json"
    report = SaveReport.new(name, 0)
    writer.usable()
    writer.send(report, None, writer_facts, (str(path),))
    until_done(writer.poll)
    report.discard()
    return json.loads(path.read_text())


def unpicklable():
    """A value ``copy.deepcopy`` copies (staging does) but pickle cannot: its class is local."""

    class Local:
        pass

    return Local()


def save(engine, run_dir, step, sd):
    partial = Path(run_dir) / f"step{step}"
    partial.mkdir()
    engine.start(sd, partial, step, f"t{step}")
    engine.staged()
    seconds, _ = until_done(engine.local_status)
    outcome = engine.collect()
    return {"seconds": seconds, "error": outcome.error, "files": sorted(p.name for p in partial.iterdir())}


def main(run_dir):
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        # The first raises the limit and says so, then starts the writer; the second says nothing.
        resources = ProcessResources(load_config(None, [f"run_dir={run_dir}", "checkpoint.mode=torch-async"]))
        ProcessResources(load_config(None, [f"run_dir={run_dir}", "checkpoint.mode=sync"])).close(False)
    engine = resources.engine
    out = {
        "nvrx_version": NVRX_VERSION,
        "said": [ln for ln in said.getvalue().splitlines() if "RLIMIT_NOFILE" in ln],
        "later_call_first": open_files.raise_soft_limit()[1],
        "trainer_limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "cpu_shm_mode": getattr(engine.writer.queue, "cpu_shm_mode", None),
        "writer": ask_writer(engine.writer, run_dir, "facts"),
    }

    state = {"w": torch.randn(4, 3), "data": {"position": 7, "sampler": unpicklable()}}
    out["unsendable"] = save(engine, run_dir, 1, state)
    state["data"]["sampler"] = "picklable"
    out["after_unsendable"] = save(engine, run_dir, 2, state)

    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    engine.writer.queue.schedule_async_request(AsyncRequest(lambda: None, (), []))
    out["feeder_seconds"], out["feeder_error"] = until_done(engine.writer.poll)
    out["writer_after_feeder"] = ask_writer(engine.writer, run_dir, "facts-after")  # a new writer
    out["notes"] = engine.writer.notes
    resources.close(False)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
