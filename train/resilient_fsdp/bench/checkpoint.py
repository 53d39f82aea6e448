"""``resilient-fsdp bench checkpoint``: the training-loop stall of every way of checkpointing, side
by side on the same state in one run.

One process, one model state (the ``125m`` preset with AdamW state by default; ``--preset tiny``
shows the fixed costs), every engine of :mod:`.checkpoint_engines` in turn, torch DCP's
``async_save`` and the memory tier included; :func:`run` says what is measured per engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ..checkpoint.writer.process import NVRX_VERSION
from ..config import load_config
from ..config.errors import UsageError
from ..train.distributed import shutdown
from ..train.trainer import Trainer
from .checkpoint_engines import ENGINES, measure, page_faults, pin
from .gpu.measure import state_bytes
from .results import write_results

# Targets: async stall <= 2% of sync and not above the best DCP configuration; the
# tiny preset's stall <= 10 ms; steps during a write <= 1.10x idle; a memory save's stall <= the
# async save's.
STALL_OVER_SYNC_TARGET = 0.02
TINY_STALL_TARGET_S = 0.010
STEP_TIME_TARGET = 1.10


def _timed_steps(trainer: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    return times


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
    return {
        "path": str(info.path),
        "bytes": nbytes,
        "files": len(files),
        "verify_s": verify_s,
        "load_s": load_s,
        "verify_over_load": verify_s / load_s,
        "verify_gb_per_s": nbytes / verify_s / 1e9,
        "runs": times,
    }


def run(args: argparse.Namespace) -> dict:
    """Per engine, ``--warmup-saves`` unmeasured saves (the first allocates the staging buffers and
    starts the writer), then ``--saves`` measured ones, each trained through until committed. Per
    engine, median and min of: the time inside the save call, the wait before ``optimizer.step()``
    (the staging copy), ``commit_s`` on the training thread (rank 0's commit process writes in the
    background: ``commit_background_s``), their sum ``stall_s``, ``write_s`` until committed, and
    ``step_time_s`` while the write runs, against idle steps. ``--pin`` puts training and the writers
    on separate cores.
    """
    run_dir = Path(args.run_dir).resolve()
    overrides = [
        f"run_dir={run_dir}",
        f"model.preset={args.preset}",
        f"data.seq_len={args.seq_len}",
        f"data.micro_batch_size={args.micro_batch_size}",
        "checkpoint.save_final=false",
        "checkpoint.resume=false",
        f"checkpoint.writer_threads={args.writer_threads}",
        # The trainer's own checkpointer stays idle (no writer process): each engine
        # measured gets a checkpointer of its own.
        "checkpoint.mode=sync",
        "train.steps=100000",
    ] + list(args.overrides)
    trainer = Trainer(load_config(None, overrides))
    pinned = None
    try:
        if args.pin:
            if (os.cpu_count() or 1) < 2:
                raise UsageError("--pin needs at least 2 CPUs: training on one, the writers on another")
            torch.set_num_threads(1)
            pinned = (0, 1)
            pin(*pinned)
        _timed_steps(trainer, 2)  # creates the AdamW state, warms allocator and kernels
        process_cpu0, main_cpu0, faults0 = time.process_time(), time.thread_time(), page_faults()
        idle = _timed_steps(trainer, args.idle_steps)
        idle_cpu = {
            "process": time.process_time() - process_cpu0,
            "main_thread": time.thread_time() - main_cpu0,
            "page_faults": page_faults() - faults0,
        }
        results: dict = {
            "modes": list(args.modes),
            "loadavg_start": os.getloadavg(),
            "params": trainer.num_params,
            "preset": args.preset,
            "torch": torch.__version__,
            "nvrx": NVRX_VERSION,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "device": trainer.info.device.type,
            "saves": args.saves,
            "warmup_saves": args.warmup_saves,
            "pinned": {"training_cpu": 0, "writer_cpu": 1} if pinned else None,
            # The allocator's settings change how many pages each step faults in.
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "idle_step_time_s": statistics.median(idle),
            "idle_step_time_s_min": min(idle),
            "idle_step_time_s_all": idle,
            "idle_cpu_s_per_step": {k: v / len(idle) for k, v in idle_cpu.items()},
        }
        if trainer.info.device.type == "cpu":
            results["host_copy_bytes"] = state_bytes(trainer.checkpointer.state.state_dict(with_rng=False))
            results["host_copy_s"] = host_copy_s(results["host_copy_bytes"])
        step = 0
        for mode in args.modes:
            results[key(mode)], step = measure(
                trainer, mode, run_dir / "checkpoints", args.saves, args.warmup_saves, step, pinned
            )
            print(
                f"{mode}: stall {results[key(mode)]['stall_s']:.4f} s (median), write "
                f"{results[key(mode)]['write_s']:.2f} s",
                flush=True,
            )
        results["loadavg_end"] = os.getloadavg()
        results["ratios"] = ratios(results)
        results["targets"] = verdicts(results)
        if "async" in args.modes and args.verify:
            results["verify"] = measure_verify(trainer, run_dir / "checkpoints" / "async")
    finally:
        trainer.close(failed=False)
        shutdown()
    return results


def host_copy_s(nbytes: int, repeats: int = 3) -> float:
    """The floor of a staging copy on this host: the fastest of ``repeats`` copies of ``nbytes``
    between two buffers already faulted in, with torch's threads (what a save's copy cannot beat)."""
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def key(mode: str) -> str:
    return mode.replace("-", "_")


def ratios(r: dict) -> dict:
    out: dict = {}
    sync = (r.get("sync") or {}).get("stall_s")
    for mode in r["modes"]:
        f = r[key(mode)]
        if sync and mode != "sync":
            out[f"{key(mode)}_stall_over_sync"] = f["stall_s"] / sync
        if f.get("step_time_s"):
            out[f"{key(mode)}_step_time_over_idle"] = f["step_time_s"] / r["idle_step_time_s"]
    return out


def verdicts(r: dict) -> dict:
    """Each target this run can judge: the measured figure and whether it is met."""
    out: dict = {}
    if "async" not in r:
        return out
    stall = r["async"]["stall_s"]
    ratio = r["ratios"].get("async_stall_over_sync")
    if ratio is not None:
        out["async_stall_over_sync"] = {
            "measured": ratio,
            "target": STALL_OVER_SYNC_TARGET,
            "met": ratio <= STALL_OVER_SYNC_TARGET,
        }
        if r.get("host_copy_s") and "sync" in r:
            # What no save that copies the state can go below on this host: its copy.
            out["async_stall_over_sync"].update(
                copy_floor_over_sync=r["host_copy_s"] / r["sync"]["stall_s"],
                stall_over_copy_floor=stall / r["host_copy_s"],
            )
    peers = [r[p]["stall_s"] for p in ("dcp_process", "dcp_thread") if p in r]
    if peers:
        out["async_stall_not_above_best_dcp"] = {"measured": stall, "best_dcp": min(peers), "met": stall <= min(peers)}
    if "memory" in r:
        out["memory_stall_not_above_async"] = {
            "measured": r["memory"]["stall_s"],
            "async": stall,
            "met": r["memory"]["stall_s"] <= stall,
        }
    if r["preset"] == "tiny":
        out["tiny_stall_s"] = {"measured": stall, "target": TINY_STALL_TARGET_S, "met": stall <= TINY_STALL_TARGET_S}
    over_idle = r["ratios"].get("async_step_time_over_idle")
    if over_idle is not None:
        out["async_step_time_over_idle"] = {
            "measured": over_idle,
            "target": STEP_TIME_TARGET,
            "met": over_idle <= STEP_TIME_TARGET,
        }
    return out


def table(r: dict) -> str:
    gb = r[key(r["modes"][-1])]["bytes"] / 1e9
    rows = [
        f"checkpoint benchmark: preset {r['preset']} ({r['params'] / 1e6:.1f}M params + AdamW state, {gb:.3f} GB on "
        f"disk), {r['device']}, {r['threads']} threads, NVRx {r['nvrx']}, torch {r['torch']}; {r['saves']} measured "
        f"saves per engine, median (min)" + (", training and writers pinned to separate cores" if r["pinned"] else ""),
        f"{'engine':<12} {'save call':>17} {'wait < step':>17} {'commit (thread)':>17} {'stall':>17} {'stall/sync':>10} "
        f"{'committed':>9} "
        f"{'step during write':>19}",
    ]
    for mode in r["modes"]:
        f = r[key(mode)]
        share = r["ratios"].get(f"{key(mode)}_stall_over_sync")
        cells = [
            f"{f[c]:.4f} ({f[c + '_min']:.4f})" if c in f else "n/a"
            for c in ("save_call_s", "wait_before_step_s", "commit_s", "stall_s")
        ]
        during = (
            f"{f['step_time_s']:.3f} s ({f['step_time_s'] / r['idle_step_time_s']:.2f}x)" if f["step_time_s"] else "n/a"
        )
        rows.append(
            f"{key(mode):<12} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} {cells[3]:>17} "
            f"{'' if share is None else f'{share:.2%}':>10} {f['write_s']:>8.2f}s {during:>19}"
        )
    rows.append(f"idle step time {r['idle_step_time_s']:.3f} s (min {r['idle_step_time_s_min']:.3f} s)")
    if r.get("host_copy_s"):
        rows.append(
            f"copy floor: one host copy of the state's {r['host_copy_bytes'] / 1e9:.3f} GB "
            f"{r['host_copy_s']:.4f} s ({r['host_copy_bytes'] / 1e9 / r['host_copy_s']:.1f} GB/s)"
        )
    idle_cpu = r.get("idle_cpu_s_per_step") or {}
    if idle_cpu:
        rows.append(
            f"training process CPU per idle step: {idle_cpu['process']:.3f} s, main thread "
            f"{idle_cpu['main_thread']:.3f} s, {idle_cpu['page_faults']:.0f} pages faulted in"
        )
    for mode in r["modes"]:
        cpu = r[key(mode)].get("cpu_s_during_write") or {}
        if cpu:
            rows.append(
                f"{key(mode)}: training process CPU from save to commit (median) "
                + ", ".join(f"{name} {value:.3f} s" for name, value in cpu.items())
                + f"; {r[key(mode)]['page_faults_during_write']:.0f} pages faulted in, "
                f"{r[key(mode)]['steps_during_write']:.1f} steps"
            )
        for core, fields in (r[key(mode)].get("core_s_during_write") or {}).items():
            rows.append(
                f"{key(mode)}: {core} from save to commit (median) "
                + ", ".join(f"{name} {value:.2f} s" for name, value in fields.items() if value)
            )
    for name, v in r["targets"].items():
        rows.append(f"target {name}: {'met' if v['met'] else 'MISSED'} ({v})")
    if "verify" in r:
        v = r["verify"]
        rows.append(
            f"checkpoint.verify=load on one rank: {v['verify_s']:.3f} s for {v['bytes'] / 1e9:.2f} GB in "
            f"{v['files']} files ({v['verify_gb_per_s']:.2f} GB/s), {v['verify_over_load']:.0%} of the "
            f"{v['load_s']:.3f} s load"
        )
    return "\n".join(rows)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="training-loop stall of every checkpoint engine, torch DCP's included",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--preset", default="125m", help="model preset (default 125m: ~134M parameters)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--saves", type=int, default=5, help="measured saves per engine (median and min reported)")
    p.add_argument("--warmup-saves", type=int, default=1, help="unmeasured saves per engine first")
    p.add_argument("--idle-steps", type=int, default=5, help="steps timed without a save in flight")
    p.add_argument("--writer-threads", type=int, default=2, help="checkpoint.writer_threads for async")
    p.add_argument(
        "--modes", nargs="+", default=list(ENGINES), choices=list(ENGINES), help="engines to measure, in this order"
    )
    p.add_argument("--pin", action="store_true", help="training on CPU 0 (one torch thread), writer processes on CPU 1")
    p.add_argument("--verify", action="store_true", help="also measure checkpoint.verify=load on the async checkpoint")
    p.add_argument("--run-dir", default="runs/bench-checkpoint", help="where checkpoints are written")
    p.add_argument("--out", help="also write the results as JSON to this file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(table(results))
    write_results(results, args.out)
    return 0
