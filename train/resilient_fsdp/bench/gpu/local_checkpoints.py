"""The GPU check's node-local checkpoints side by side: the memory tier against NVRx's
``LocalCheckpointManager`` (:mod:`.nvrx_local`) on the same FSDP2 state, one rank (the ``125m``
preset with AdamW moments; ``tiny`` in the rehearsal), timed by the loop ``bench checkpoint``
uses: save stall (the call and the wait before the optimizer step), time until complete, step time
while the write runs; then a load of each back into device memory, checked bitwise against the
state as it was saved (training moved the live state on in between).

Replication is not compared: NVRx's clique and the tier's peer both need a second rank on
another device, and the check has one GPU."""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from .section import Section

FIGURES = ("save_call_s", "wait_before_step_s", "stall_s", "write_s", "step_time_s", "bytes")
COMPLETE_TIMEOUT_S = 300


def section_local_checkpoints(s: Section) -> None:
    from ...checkpoint.writer.process import NVRX_VERSION
    from ...config import load_config
    from ...train.trainer import Trainer
    from ..checkpoint import _timed_steps
    from ..checkpoint_engines import measure
    from .checkpoint import close_trainer
    from .measure import state_bytes
    from .nvrx_local import CPU_STAND_INS, LocalManagerSaver

    p, r = s.plan, s.results
    run_dir = s.dir / "run"
    root = run_dir / "local"
    cfg = load_config(
        None,
        s.overrides(run_dir, big=False)
        + [
            "checkpoint.mode=sync",
            "checkpoint.save_final=false",
            "checkpoint.resume=false",
            "train.steps=100000",
            "train.deterministic=false",
        ],
    )
    trainer = Trainer(cfg)
    try:
        _timed_steps(trainer, 2)  # creates the AdamW moments: the state is complete from here on
        r.update(
            {
                "preset": cfg.model.preset,
                "params": trainer.num_params,
                "nvrx": NVRX_VERSION,
                "state_bytes": state_bytes(trainer.checkpointer.state.state_dict(with_rng=False)),
                "state": "model parameters (fp32) + AdamW moments, FSDP2 DTensors' local shards, one rank",
                "saves_per_engine": p.checkpoint_saves,
                "step_time_idle_s": round(statistics.median(_timed_steps(trainer, 3)), 4),
            }
        )
        if trainer.info.device.type != "cuda":
            r["stand_ins"] = list(CPU_STAND_INS)
        r.setdefault("skipped", {})["replication"] = (
            "one GPU: NVRx's CliqueReplicationStrategy and the memory tier's replica both need a second rank "
            "on another device"
        )
        s.save()
        step = 0
        for name, saver in (("memory", None), ("nvrx_local", LocalManagerSaver(trainer, root / "timed"))):
            figures, step = measure(trainer, name, root, p.checkpoint_saves, 1, step, saver=saver)
            r[name] = {k: figures[k] for k in FIGURES}
            s.save()
        r["nvrx_local_stall_over_memory"] = round(r["nvrx_local"]["stall_s"] / r["memory"]["stall_s"], 2)
        r["nvrx_local_write_over_memory"] = round(r["nvrx_local"]["write_s"] / r["memory"]["write_s"], 2)
        s.save()
        step = _load_memory(trainer, r, step + 1)
        s.save()
        _load_nvrx(trainer, r, root / "load", step + 1, LocalManagerSaver)
        r["nvrx_local_load_over_memory"] = round(r["nvrx_local_load_s"] / r["memory_load_s"], 2)
    finally:
        close_trainer(trainer, root)
        del trainer


def _clones(tensors: list) -> list:
    return [t.detach().clone() for t in tensors]


def _load_memory(trainer: Any, r: dict, step: int) -> int:
    """Save ``step`` into the memory tier, train one step on, restore it and compare."""
    import torch

    from ...checkpoint.memory.tier import MemoryTier
    from ...checkpoint.staging import local_tensors

    state, group = trainer.checkpointer.state, trainer.checkpointer.group
    tier = MemoryTier(
        1, Path("/dev/shm"), f"gpu-check-{uuid.uuid4().hex[:8]}", "gpu-check", group.rank, group.world_size
    )
    try:
        saved = _clones(local_tensors(state.state_dict(with_rng=False)))
        tier.save(step, state.state_dict())
        deadline = time.monotonic() + COMPLETE_TIMEOUT_S
        while True:
            tier.before_optimizer_step()
            done = [rec for rec in tier.poll() if rec["step"] == step]
            if done and done[0]["error"]:
                raise RuntimeError(f"the memory tier's save of step {step} failed: {done[0]['error']}")
            if done:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the memory tier's save of step {step} did not complete in {COMPLETE_TIMEOUT_S} s")
            time.sleep(0.01)
        trainer.train_step()  # the live state moves on: the restore has something to undo
        t0 = time.perf_counter()
        tier.report()
        problem = tier.restore(state, step)
        if trainer.info.device.type == "cuda":
            torch.cuda.synchronize()
        r["memory_load_s"] = round(time.perf_counter() - t0, 4)
        if problem:
            raise RuntimeError(f"the memory tier could not restore step {step}: {problem}")
        live = local_tensors(state.state_dict(with_rng=False))
        r["memory_load_bitwise"] = len(live) == len(saved) and all(torch.equal(a, b) for a, b in zip(live, saved))
        r["memory_load_phases_s"] = {k: round(v, 4) for k, v in tier.restore_phases.items()}
    finally:
        tier.close(remove=True)
    return step


def _load_nvrx(trainer: Any, r: dict, root: Path, step: int, saver_class: type) -> None:
    """Save ``step`` with NVRx's manager, train one step on, load it and compare."""
    saver = saver_class(trainer, root)
    try:
        saved = {k: v.detach().clone() for k, v in saver.shards().items()}
        saver.start(step)
        deadline = time.monotonic() + COMPLETE_TIMEOUT_S
        while saver.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"NVRx's local save of step {step} did not complete in {COMPLETE_TIMEOUT_S} s")
            time.sleep(0.01)
        trainer.train_step()
        r["nvrx_local_load_s"], r["nvrx_local_load_bitwise"] = saver.load(saved)
        r["nvrx_local_load_s"] = round(r["nvrx_local_load_s"], 4)
    finally:
        saver.close()
