"""GPU check section 2: every checkpoint engine on the GPU, the figures of ``bench checkpoint``.

The plan's first checkpoint preset (``1b``; ``tiny`` in the rehearsal) is measured with every
engine the section's budget allows, in this order: ``sync``, ``async``, ``dcp_process``,
``torch-async``, ``dcp_thread``; per engine the time inside the save call, the wait before
``optimizer.step()``, the stall, the time until committed and the step time while the write
runs. The next preset (``8b``) is measured the same way only if it fits: its device, host and
disk needs are estimated first, and a preset that does not fit is reported with the estimate.
The GPU assertions (device memory flat during a save, stall near the copy time, a bounded
hash) run on the first preset. torch and the trainer are imported inside.
"""

from __future__ import annotations

import shutil
import time
import statistics
from typing import Any

from .measure import _d2h_gb_per_s, state_bytes
from .section import Section

COPY_FLOOR_BPS = 50e9  # device-to-host over PCIe Gen5: the copy-bound floor for staging the state
ASYNC_STALL_TARGET = 0.02  # async stall at most 2% of the synchronous save
ENGINES = ("sync", "async", "dcp_process", "torch-async", "dcp_thread")
DEVICE_GROWTH_LIMIT = 0.05  # of the state: a shard copied back to the device would be about 1.0
STALL_OVER_COPY_LIMIT = 1.5  # the async stall against the measured device-to-host copy of the state
STALL_FIXED_S = 0.25  # planning and the hand-off to the writer, which do not grow with the state
HASH_LIMIT = 3  # params_sha256's peak device memory, in largest parameters
FIGURES = (
    "save_call_s",
    "wait_before_step_s",
    "commit_s",
    "commit_background_s",
    "stall_s",
    "write_s",
    "step_time_s",
    "bytes",
    "steps_during_write",
    "cpu_s_during_write",
    "core_s_during_write",
)


def fit_estimate(preset: str, seq_len: int, micro_batch: int, work_dir: Any) -> dict:
    """What a preset needs on one GPU (fp32 parameters and gradients, AdamW moments, the bf16
    copy FSDP2 gathers, activations without checkpointing: a rough upper figure), in host shared
    memory (the staging buffers) and on disk (two checkpoints), against what this machine has."""
    import torch

    from ...train.model import build_model, count_params, preset_args

    with torch.device("meta"):
        params = count_params(build_model(preset))
    args = preset_args(preset)
    tokens = seq_len * micro_batch
    need = {
        "device_bytes": params * 18 + args.n_layers * tokens * (args.dim * 16 + args.ffn_dim * 6) * 2,
        "host_shm_bytes": params * 12,
        "disk_bytes": params * 12 * 2,
    }
    have = {
        "device_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0,
        "host_shm_bytes": shutil.disk_usage("/dev/shm").free,
        "disk_bytes": shutil.disk_usage(work_dir).free,
    }
    short = [k for k in need if need[k] > 0.9 * have[k]]
    why = ", ".join(
        f"{k.replace('_bytes', '')} needs about {need[k] / 1e9:.0f} GB of {have[k] / 1e9:.0f} GB" for k in short
    )
    return {"preset": preset, "params": params, "need": need, "have": have, "fits": not short, "why": why}


def section_checkpoint(s: Section) -> None:
    p, r = s.plan, s.results
    first, *others = p.checkpoint_presets
    r.update(_measure_preset(s, first, assertions=True))
    r["engines_measured"] = [e for e in ENGINES if e.replace("-", "_") in r]
    s.save()
    r["other_presets"] = {}
    for preset in others:
        fit = fit_estimate(preset, p.big_seq_len, p.big_micro_batch, s.work)
        entry: dict = {"estimate": fit}
        r["other_presets"][preset] = entry
        if s.cpu:
            entry["skipped"] = f"the {preset} preset is measured on a GPU only; its needs are estimated here"
        elif not fit["fits"]:
            entry["skipped"] = f"does not fit this machine: {fit['why']}"
        elif s.remaining() < 120:
            entry["skipped"] = f"{s.remaining():.0f} s left of the section's budget"
        else:
            entry.update(_measure_preset(s, preset, assertions=False))
        s.save()


def _measure_preset(s: Section, preset: str, assertions: bool) -> dict:
    import torch

    from ...checkpoint.writer.process import NVRX_VERSION
    from ...config import load_config
    from ...train.trainer import Trainer
    from ..checkpoint import _timed_steps
    from ..checkpoint_engines import measure

    p = s.plan
    run_dir = s.dir / preset
    cfg = load_config(
        None,
        s.overrides(run_dir, big=True)
        + [
            f"model.preset={preset}",
            "checkpoint.mode=sync",
            "checkpoint.save_final=false",
            "checkpoint.resume=false",
            "train.steps=100000",
            "train.deterministic=false",
        ],
    )
    trainer = Trainer(cfg)
    root = run_dir / "checkpoints"
    out: dict = {}
    try:
        _timed_steps(trainer, 2)  # creates the AdamW moments: the state is complete from here on
        nbytes = state_bytes(trainer.checkpointer.state.state_dict(with_rng=False))
        out.update(
            {
                "preset": preset,
                "params": trainer.num_params,
                "state_bytes": nbytes,
                "state": "model parameters (fp32) + AdamW moments, FSDP2 DTensors, one rank",
                "nvrx": NVRX_VERSION,
                "saves_per_engine": p.checkpoint_saves,
            }
        )
        idle = _timed_steps(trainer, 5)
        out["step_time_idle_s"] = round(statistics.median(idle), 4)
        step, per_save = 0, None
        for mode in ENGINES:
            warmup = 0 if mode == "sync" else 1
            if per_save is not None and (warmup + p.checkpoint_saves) * per_save * 1.5 > s.remaining() - 30:
                out.setdefault("skipped", {})[mode] = f"not enough of the section's budget left ({s.remaining():.0f} s)"
                continue
            figures, step = measure(trainer, mode, root, p.checkpoint_saves, warmup, step)
            out[mode.replace("-", "_")] = {k: figures[k] for k in FIGURES}
            if per_save is None:
                per_save = max(figures["write_s"], out["step_time_idle_s"])
            shutil.rmtree(root / mode, ignore_errors=True)  # the disk holds few 13 GB checkpoints
            if assertions:
                s.results.update(out)
                s.save()
        sync_stall = out["sync"]["stall_s"]
        out["ratios"] = {
            f"{k}_stall_over_sync": round(out[k]["stall_s"] / sync_stall, 4)
            for k in (m.replace("-", "_") for m in ENGINES[1:])
            if k in out
        }
        for k in (m.replace("-", "_") for m in ENGINES[1:]):
            if k in out and out[k]["step_time_s"]:
                out["ratios"][f"{k}_step_time_over_idle"] = round(out[k]["step_time_s"] / out["step_time_idle_s"], 3)
        asy = out["async"]
        out["async_stall_over_sync"] = out["ratios"]["async_stall_over_sync"]
        out["target_async_stall_over_sync"] = ASYNC_STALL_TARGET
        out["target_met"] = asy["stall_s"] / sync_stall <= ASYNC_STALL_TARGET
        out["step_time_during_write_s"] = asy["step_time_s"]
        if asy["step_time_s"]:
            out["step_time_during_write_over_idle"] = out["ratios"]["async_step_time_over_idle"]
        if assertions:
            _staging_and_hash_assertions(s, trainer, out, nbytes, asy["stall_s"], root, step)
        if torch.cuda.is_available() and not s.cpu:
            out["copy_floor_s"] = round(nbytes / COPY_FLOOR_BPS, 4)
            out["copy_floor_basis"] = f"state bytes / {COPY_FLOOR_BPS / 1e9:.0f} GB/s device-to-host"
            out["async_stall_over_copy_floor"] = round(asy["stall_s"] / out["copy_floor_s"], 2)
        else:
            out.setdefault("skipped", {})["copy_floor"] = (
                "no device-to-host copy on CPU: staging is a host-memory "
                "copy, so the GPU copy-bound floor does not apply"
            )
    finally:
        close_trainer(trainer, root)
        del trainer
    return out


def close_trainer(trainer: Any, root: Any) -> None:
    """End a section's trainer: its checkpointer and process group closed, the device's cached
    memory given back, its checkpoints under ``root`` removed (the disk holds few of them)."""
    import torch

    from ...train.distributed import shutdown

    trainer.close(failed=False)
    shutdown()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    shutil.rmtree(root, ignore_errors=True)


def _device_growth_of_a_save(trainer: Any, root: Any, step: int) -> int:
    """Peak device memory an ``async`` save adds while its state is staged (nothing overlaps it:
    the staging copy is awaited before training goes on); the save is then trained through."""
    import torch

    from ..checkpoint_engines import OurSaver

    saver = OurSaver(trainer, "async", root)
    original, trainer.checkpointer = trainer.checkpointer, saver
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        saver.start(step + 1)
        saver.before_optimizer_step()
        torch.cuda.synchronize()
        growth = torch.cuda.max_memory_allocated() - base
        deadline = time.monotonic() + 600
        while saver.poll() is None and time.monotonic() < deadline:
            trainer.train_step()
    finally:
        trainer.checkpointer = original
        saver.close()
    return growth


def _staging_and_hash_assertions(
    s: Section, trainer: Any, r: dict, nbytes: int, async_stall: float, root: Any, step: int
) -> None:
    """The GPU-only checks, as assertions the report shows:

    - staging keeps DTensors over host buffers: device memory does not grow by a shard during an
      async save (``device_memory_flat_during_save``);
    - the async stall is close to the time of a pinned device-to-host copy of the state
      (``stall_close_to_d2h_copy``);
    - ``params_sha256`` hashes each rank's rows where they are (copied to the host in bounded
      blocks; only 1-D parameters gathered): its peak device memory grows by less than a few of the
      largest parameter, not the model (``params_hash_bounded``).

    On CPU the hash runs (the rehearsal exercises its code) and the memory figures are skipped.
    """
    import torch

    from ...train.metrics import params_sha256

    cuda = torch.cuda.is_available() and not s.cpu
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    r["params_sha256"] = params_sha256(trainer.model)
    if not cuda:
        r.setdefault("skipped", {})["device_memory"] = (
            "GPU only: on CPU nothing is copied to or from a device, so device memory during a save, the "
            "device-to-host copy time and the hash's device memory cannot be measured"
        )
        return
    hash_growth = torch.cuda.max_memory_allocated() - base
    largest = max(
        p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
        for p in trainer.model.parameters()
    )
    growth = _device_growth_of_a_save(trainer, root, step)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    copy_s = nbytes / (_d2h_gb_per_s(torch, min(nbytes, 2 * 2**30)) * 1e9)
    r.update(
        {
            "async_device_growth_bytes": growth,
            "async_device_growth_over_state": round(growth / nbytes, 4) if growth is not None else None,
            "device_memory_flat_during_save": growth is not None and growth < DEVICE_GROWTH_LIMIT * nbytes,
            "d2h_copy_s": round(copy_s, 4),
            "async_stall_over_d2h_copy": round(async_stall / copy_s, 2),
            "stall_close_to_d2h_copy": async_stall <= STALL_OVER_COPY_LIMIT * copy_s + STALL_FIXED_S,
            "params_hash_peak_growth_bytes": hash_growth,
            "largest_param_bytes": largest,
            "params_hash_bounded": hash_growth <= HASH_LIMIT * largest,
        }
    )
    torch.cuda.empty_cache()
