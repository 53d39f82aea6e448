"""``resilient-fsdp bench checkpoint``: training-loop stall of sync vs async checkpoints.

One process, one model state (the ``125m`` preset with AdamW state by default), every engine in
turn on that same state:

- ``sync``: the loop waits for the whole DCP write;
- ``async`` (NVRx DCP writer) and ``torch-async`` (NVRx ``TorchAsyncCheckpoint``): the loop
  waits for staging and planning only, then trains on while the worker writes; the steps taken
  meanwhile give ``step_time_s.during_save``, compared with ``step_time_s.idle``.

Each engine saves ``--warmup-saves`` times unmeasured first (the first save allocates and
touches the staging buffers and waits for the worker to start), then ``--saves`` measured times;
medians are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from ..checkpoint import nvrx
from .results import write_results
from ..checkpoint.checkpointer import Checkpointer
from ..config import load_config
from ..train.distributed import shutdown
from ..train.trainer import Trainer


def _timed_steps(trainer: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    return times


def measure_engine(trainer: Trainer, mode: str, root: Path, saves: int, warmup_saves: int, step: int
                   ) -> tuple[dict, list[float], int]:
    """Save ``warmup_saves + saves`` times with ``mode``; returns figures, step times during
    background writes, and the next step number."""
    cfg = dataclasses.replace(trainer.cfg.checkpoint, mode=mode, keep_last=1, interval_steps=0)
    ckpt = Checkpointer(cfg, root / mode, trainer.info, trainer.checkpointer.state,
                        trainer.checkpointer.identity, lambda _msg: None)
    ckpt.preflight()
    stalls, writes, during, nbytes, growth = [], [], [], 0, []
    cuda = trainer.info.device.type == "cuda"
    try:
        for i in range(warmup_saves + saves):
            step += 1
            if cuda:  # device memory the save itself takes (staging must not copy shards back)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            record = ckpt.save(step)
            stall = time.perf_counter() - t0
            if cuda and i >= warmup_saves:
                growth.append(torch.cuda.max_memory_allocated() - base)
            steps_during = []
            while record is None:
                t1 = time.perf_counter()
                trainer.train_step()
                record = ckpt.poll()
                steps_during.append(time.perf_counter() - t1)
                if len(steps_during) > 200:
                    record = ckpt.wait()
            if i >= warmup_saves:
                stalls.append(stall)
                writes.append(record["write_s"])
                during += steps_during
                nbytes = record["bytes"]
    finally:
        ckpt.close()
    figures = {"stall_s": statistics.median(stalls), "write_s": statistics.median(writes), "bytes": nbytes,
               "stall_s_all": stalls, "steps_during_write": len(during) / max(1, saves),
               "device_peak_growth_bytes": max(growth) if growth else None}
    return figures, during, step


def measure_verify(trainer: Trainer, root: Path) -> dict:
    """The cost of ``checkpoint.verify: load`` on the newest checkpoint under ``root``: reading every
    file back and comparing its CRC32C (what a world of one does; N ranks each read 1/N), against
    loading the checkpoint (DCP) into the trainer's state; both from the page cache when it holds
    the files, so they are compared under the same conditions."""
    from ..checkpoint import integrity, store
    from ..checkpoint.resume import load

    info = store.scan(root)[0][-1]
    files = info.manifest["checksums"]
    times = {"verify_s": [], "load_s": []}
    for _ in range(3):
        t0 = time.perf_counter()
        problems = integrity.verify(info.path, files, list(files))
        times["verify_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        error = load(trainer.checkpointer.state, info, trainer.info.rank, True)
        times["load_s"].append(time.perf_counter() - t0)
        if problems or error:
            raise RuntimeError(f"{info.path}: {problems or error}")
    nbytes = sum(e["bytes"] for e in files.values())
    verify_s, load_s = statistics.median(times["verify_s"]), statistics.median(times["load_s"])
    return {"path": str(info.path), "bytes": nbytes, "files": len(files), "verify_s": verify_s, "load_s": load_s,
            "verify_over_load": verify_s / load_s, "verify_gb_per_s": nbytes / verify_s / 1e9, "runs": times}


def run(args: argparse.Namespace) -> dict:
    run_dir = Path(args.run_dir).resolve()
    overrides = [f"run_dir={run_dir}", f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
                 f"data.micro_batch_size={args.micro_batch_size}", "checkpoint.save_final=false",
                 "checkpoint.resume=false", f"checkpoint.writer_threads={args.writer_threads}",
                 "train.steps=100000"] + list(args.overrides)
    trainer = Trainer(load_config(None, overrides))
    try:
        _timed_steps(trainer, 2)  # creates the AdamW state, warms allocator and kernels
        idle = _timed_steps(trainer, args.idle_steps)
        results: dict = {"modes": list(args.modes), "loadavg_start": os.getloadavg(),
                         "params": trainer.num_params, "preset": args.preset, "torch": torch.__version__,
                         "nvrx": nvrx.NVRX_VERSION, "threads": torch.get_num_threads(),
                         "cpu_count": os.cpu_count(), "device": trainer.info.device.type}
        during_all: list[float] = []
        step = 0
        for mode in args.modes:
            figures, during, step = measure_engine(trainer, mode, run_dir / "checkpoints", args.saves,
                                                   args.warmup_saves, step)
            results[mode.replace("-", "_")] = figures
            if mode != "sync":
                during_all += during
        results["step_time_s"] = {"idle": statistics.median(idle),
                                  "during_save": statistics.median(during_all) if during_all else None}
        sync = results.get("sync", {}).get("stall_s")
        results["ratios"] = {
            f"{m}_stall_over_sync": results[m]["stall_s"] / sync for m in ("async", "torch_async") if sync and m in results}
        results["ratios"]["step_time_during_save_over_idle"] = (
            results["step_time_s"]["during_save"] / results["step_time_s"]["idle"] if during_all else None)
        results["verify"] = measure_verify(trainer, run_dir / "checkpoints" / args.modes[-1])
    finally:
        trainer.close(failed=False)
        shutdown()
    return results


def table(r: dict) -> str:
    gb = r[r["modes"][-1].replace("-", "_")]["bytes"] / 1e9
    rows = [
        f"checkpoint benchmark: preset {r['preset']} ({r['params'] / 1e6:.0f}M params + AdamW state, "
        f"{gb:.2f} GB on disk), {r['device']}, {r['threads']} threads, NVRx {r['nvrx']}, torch {r['torch']}",
        f"{'engine':<12} {'stall (s)':>10} {'write (s)':>10} {'stall / sync':>13}",
    ]
    for mode in (m.replace("-", "_") for m in r["modes"]):
        f, sync = r[mode], (r.get("sync") or {}).get("stall_s")
        share = f"{f['stall_s'] / sync:>13.1%}" if sync else f"{'n/a':>13}"
        rows.append(f"{mode:<12} {f['stall_s']:>10.3f} {f['write_s']:>10.3f} {share}")
    st = r["step_time_s"]
    during = f"{st['during_save']:.3f} s" if st["during_save"] else "n/a (writes finished within one step)"
    ratio = r["ratios"]["step_time_during_save_over_idle"]
    rows.append(f"step time: idle {st['idle']:.3f} s, with a background write in flight {during}"
                + (f" ({ratio - 1:+.1%})" if ratio else ""))
    v = r["verify"]
    rows.append(f"checkpoint.verify=load on one rank: {v['verify_s']:.3f} s for {v['bytes'] / 1e9:.2f} GB in {v['files']} "
                f"files ({v['verify_gb_per_s']:.2f} GB/s), {v['verify_over_load']:.0%} of the {v['load_s']:.3f} s load")
    return "\n".join(rows)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="training-loop stall of sync vs async checkpoint saves",
                       description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="125m", help="model preset (default 125m: ~134M parameters)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--saves", type=int, default=2, help="measured saves per engine (median reported)")
    p.add_argument("--warmup-saves", type=int, default=1, help="unmeasured saves per engine first")
    p.add_argument("--idle-steps", type=int, default=5, help="steps timed without a save in flight")
    p.add_argument("--writer-threads", type=int, default=2, help="checkpoint.writer_threads for async")
    p.add_argument("--modes", nargs="+", default=["sync", "async", "torch-async"],
                   choices=["sync", "async", "torch-async"], help="engines to measure, in this order")
    p.add_argument("--run-dir", default="runs/bench-checkpoint", help="where checkpoints are written")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(table(results))
    write_results(results, args.out)
    return 0

