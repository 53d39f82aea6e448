"""The sections of the GPU check (:mod:`resilient_fsdp.gpu_check`), each run in its own process.

``python -m resilient_fsdp.gpu_check --section NAME`` runs one: it writes its results to
``<work>/<NAME>.json`` as it goes (a section killed at its budget still reports what it measured)
and ends with ``status`` ``ok`` or ``error``. Sizes come from a :class:`Plan`: the GPU one
(``1b`` for throughput and checkpoints, ``125m`` for the restart and resume runs) or the tiny one
of the CPU rehearsal. Module level uses the standard library only; torch and the project's
trainer are imported inside the sections.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from . import atomic
from .bench_recovery import fresh_dir

# Dense bf16 tensor-core peaks (NVIDIA's H100 and H200 SXM datasheets: 1,979 TFLOP/s "with
# sparsity", i.e. 989.4 dense), the denominator of MFU. Matched on torch's device name.
PEAKS = (("H200", 989.4e12, "NVIDIA H200 SXM datasheet, dense BF16 Tensor Core (1,979 TFLOP/s with sparsity / 2)"),
         ("H100 80GB HBM3", 989.4e12, "NVIDIA H100 SXM datasheet, dense BF16 Tensor Core (1,979 TFLOP/s with "
                                      "sparsity / 2)"))
COPY_FLOOR_BPS = 50e9  # device-to-host over PCIe Gen5: the copy-bound floor for staging the state
ASYNC_STALL_TARGET = 0.02  # async stall at most 2% of the synchronous save


@dataclass(frozen=True)
class Plan:
    """Model sizes and step counts; the GPU plan, or the tiny one for a rehearsal."""

    big_preset: str  # throughput and checkpoint
    big_seq_len: int
    big_micro_batch: int
    warmup_steps: int
    max_steps: int
    max_measure_s: float
    small_preset: str  # the restart and resume runs
    small_seq_len: int
    small_micro_batch: int
    lr: Optional[float]  # None: the configured default
    run_steps: int = 40
    interval_steps: int = 10
    fault_step: int = 22
    stop_step: int = 20


GPU_PLAN = Plan("1b", 2048, 4, 10, 300, 60.0, "125m", 512, 8, lr=3e-4)
TINY_PLAN = Plan("tiny", 64, 4, 3, 60, 20.0, "tiny", 64, 4, lr=None)


def tail(path: Path, lines: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# ---- what every section gets ------------------------------------------------------------------

class Section:
    """What a section's code gets: its plan, its folder, its deadline, and a way to save progress."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.cpu, self.tiny = args.cpu, args.tiny
        self.plan = TINY_PLAN if args.tiny else GPU_PLAN
        self.work = Path(args.work_dir)
        self.dir = self.work / name
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, status: str = "running", **extra: Any) -> None:
        """Write the results so far: a section killed at its budget still reports them."""
        atomic.write_json(self.work / f"{self.name}.json", {"status": status, "results": self.results, **extra},
                          sort_keys=False, default=str, newline=False)

    def overrides(self, run_dir: Path, big: bool) -> list[str]:
        p = self.plan
        preset, seq, mb = ((p.big_preset, p.big_seq_len, p.big_micro_batch) if big
                           else (p.small_preset, p.small_seq_len, p.small_micro_batch))
        out = [f"run_dir={run_dir}", f"model.preset={preset}", f"data.seq_len={seq}", f"data.micro_batch_size={mb}",
               f"dist.device={'cpu' if self.cpu else 'cuda'}"]
        return out + ([f"optim.lr={p.lr}"] if p.lr else [])

    def run_overrides(self, run_dir: Path) -> list[str]:
        """The restart and resume runs: one configuration, so their final parameters compare."""
        p = self.plan
        return self.overrides(run_dir, big=False) + [f"train.steps={p.run_steps}",
                                                     f"checkpoint.interval_steps={p.interval_steps}",
                                                     "train.log_every=10", "checkpoint.keep_last=1",
                                                     # NCCL's timeout above in-process restart's hard one.
                                                     f"dist.timeout_s={60 if self.cpu else 120}"]

    def in_process_overrides(self, run_dir: Path) -> list[str]:
        from .bench_recovery import COMMON

        out = self.run_overrides(run_dir) + COMMON + ["resilience.in_process=true"]
        if not self.cpu:
            # CUDA start-up (context, NCCL, first kernels) must not look like a hang to the wrapper.
            out += ["resilience.in_process_soft_timeout_s=60", "resilience.in_process_hard_timeout_s=90",
                    "resilience.in_process_heartbeat_timeout_s=30"]
        return out


def _child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, env: Optional[dict] = None) -> int:
    """Run ``cmd`` with its output appended to ``log``; a timeout kills it and is an error."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=_child_env(env), timeout=max(1.0, timeout)).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:4])} …; see {log}") from None


def train_run(s: Section, run_dir: Path, overrides: list[str], flags: Optional[list[str]] = None,
              env: Optional[dict] = None) -> dict:
    """One trainer process (``python -m resilient_fsdp.train``); returns its ``summary.json``."""
    cmd = [sys.executable, "-m", "resilient_fsdp.train", "--run-dir", str(run_dir), *(flags or [])]
    for o in overrides:
        cmd += ["--set", o]
    log = s.work / f"{s.name}-runs.log"
    code = run_logged(cmd, log, s.remaining() - 5, env)
    if code != 0:
        raise RuntimeError(f"trainer run in {run_dir.name} exited with code {code}: "
                           + " | ".join(tail(log, 3)))
    return json.loads((run_dir / "summary.json").read_text())


def step_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("event") == "step":
                out[int(r["step"])] = float(r["loss"])
    return out


def state_bytes(sd: Any) -> int:
    """Bytes of every tensor in a (sharded) state dict, as this rank holds them."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(sd, DTensor):
        sd = sd.to_local()
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(state_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(state_bytes(v) for v in sd)
    return 0


def peak_flops(device_name: str, override_tflops: Optional[float]) -> tuple[Optional[float], str]:
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    for key, flops, source in PEAKS:
        if key in device_name and "NVL" not in device_name:
            return flops, source
    return None, f"no datasheet peak known here for {device_name!r}; pass --peak-tflops"


# ---- section 0: environment --------------------------------------------------------------------

def section_environment(s: Section) -> None:
    import importlib
    import importlib.metadata as md

    import torch

    r = s.results
    r.update({"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()})
    for dist_name in ("nvidia-resiliency-ext", "pydantic", "PyYAML", "psutil", "numpy", "protobuf", "grpcio"):
        try:
            r[f"version_{dist_name}"] = md.version(dist_name)
        except md.PackageNotFoundError:
            r[f"version_{dist_name}"] = None
    r["nvrx"] = r["version_nvidia-resiliency-ext"]
    # What each section imports; a missing wheel shows up here, by name, before anything runs.
    imports = {}
    for module in ("resilient_fsdp.config", "resilient_fsdp.train.entrypoint",
                   "nvidia_resiliency_ext.checkpointing.async_ckpt.core", "nvidia_resiliency_ext.inprocess",
                   "nvidia_resiliency_ext.fault_tolerance.launcher"):
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            imports[module] = f"{type(exc).__name__}: {exc}"
    r["imports"] = imports
    # Staging buffers live in shared memory and checkpoints on the work folder's disk: a small
    # /dev/shm or a full disk fails the checkpoint section, and this says which.
    for label, path in (("dev_shm", "/dev/shm"), ("work_dir_disk", str(s.work))):
        try:
            usage = shutil.disk_usage(path)
            r[f"{label}_free_gib"] = round(usage.free / 2**30, 1)
        except OSError as exc:
            r[f"{label}_free_gib"] = f"unknown ({exc})"
    try:
        r["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        r["memory_gib"] = None
    try:
        from .resilience.agent import ft_launcher_executable

        r["ft_launcher"] = ft_launcher_executable()[0]
    except Exception as exc:  # noqa: BLE001 - the in_job section will fail on it; say why here
        r["ft_launcher"] = f"not found: {exc}"
    s.save()
    if not torch.cuda.is_available():
        r["skipped"] = {"gpu": "no CUDA device visible" + (" (--cpu)" if s.cpu else ""),
                        "nccl": "NCCL needs CUDA", "driver": "no NVIDIA driver in use",
                        "ceilings": "the bf16 matmul and device-to-host copy ceilings are measured on a GPU only"}
        return
    props = torch.cuda.get_device_properties(0)
    r.update({"gpu_name": props.name, "gpu_count": torch.cuda.device_count(),
              "gpu_memory_gib": round(props.total_memory / 2**30, 1),
              "compute_capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count})
    try:
        version = torch.cuda.nccl.version()
        r["nccl"] = ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)
    except Exception as exc:  # noqa: BLE001
        r["nccl"] = f"unknown ({exc})"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        r["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        r["driver"] = smi.stdout.split(",")[0].strip() if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        r["driver"] = f"unknown ({exc})"
    s.save()
    try:
        r["ceilings"] = measure_ceilings(torch)
    except Exception as exc:  # noqa: BLE001 - a reference figure; the sections can run without it
        r["ceilings"] = {"error": f"{type(exc).__name__}: {exc}"}


def _median_cuda_s(torch: Any, fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median seconds of ``fn`` on the GPU, timed with CUDA events after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _matmul_tflops(torch: Any, n: int) -> float:
    # Random data: zeros run measurably faster on this hardware and would flatter the ceiling.
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _median_cuda_s(torch, lambda: a @ b, 3, 10) / 1e12


def _d2h_gb_per_s(torch: Any, nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), device="cuda", dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / _median_cuda_s(torch, lambda: dst.copy_(src, non_blocking=True), 1, 5) / 1e9


def measure_ceilings(torch: Any) -> dict:
    """The bf16 matmul rate and the pinned device-to-host copy rate, measured here (medians)."""
    n, nbytes = 8192, 2 * 2**30
    out = {"bf16_matmul_tflops": round(_matmul_tflops(torch, n), 1), "matmul_shape": f"{n}x{n}x{n}",
           "d2h_pinned_gb_per_s": round(_d2h_gb_per_s(torch, nbytes), 1), "d2h_bytes": nbytes}
    torch.cuda.empty_cache()
    return out


# ---- section 1: throughput ---------------------------------------------------------------------

def section_throughput(s: Section) -> None:
    import torch

    from .config import load_config
    from .train.distributed import shutdown
    from .train.model import preset_args
    from .train.trainer import Trainer

    p, r = s.plan, s.results
    # Deterministic kernels are for exact comparisons (section 5); speed is measured without them.
    cfg = load_config(None, s.overrides(s.dir, big=True) + ["checkpoint.save_final=false", "checkpoint.resume=false",
                                                             "train.steps=100000", "train.deterministic=false"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        args = preset_args(p.big_preset)
        r.update({"preset": p.big_preset, "params": trainer.num_params, "seq_len": p.big_seq_len,
                  "micro_batch_size": p.big_micro_batch, "tokens_per_step": trainer.tokens_per_step,
                  "world_size": trainer.info.world_size, "device": str(trainer.info.device),
                  "backend": trainer.info.backend, "build_s": round(time.perf_counter() - t0, 2),
                  "precision": ("bf16 parameters and compute, fp32 gradient reduction (FSDP2 MixedPrecisionPolicy)"
                                if trainer.info.device.type == "cuda" else "fp32 (CPU)")})
        t1 = time.perf_counter()
        loss_first, _ = trainer.train_step()
        r["first_step_s"] = round(time.perf_counter() - t1, 3)
        for _ in range(p.warmup_steps - 1):
            trainer.train_step()
        cuda = trainer.info.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        s.save()
        # Stop at the step cap, the measuring-time cap, or well before the section's budget.
        stop_at = min(time.perf_counter() + p.max_measure_s, time.perf_counter() + s.remaining() - 15)
        start, steps, loss = time.perf_counter(), 0, loss_first
        while steps < p.max_steps and time.perf_counter() < stop_at:
            loss, _ = trainer.train_step()  # returns a Python float: the GPU has finished the step
            steps += 1
        elapsed = time.perf_counter() - start
        if steps == 0:
            raise RuntimeError("no step could be timed within the section's budget")
        tokens_per_s = trainer.tokens_per_step * steps / elapsed
        # Model FLOPs per token: 6 per weight that multiplies (every parameter but the input
        # embedding table, a lookup) plus 12·layers·dim·seq_len for attention scores and values,
        # without a causal discount (PaLM, Chowdhery et al. 2022, appendix B).
        matmul_params = trainer.num_params - args.vocab_size * args.dim
        flops_per_token = 6 * matmul_params + 12 * args.n_layers * args.dim * p.big_seq_len
        r.update({"steps_measured": steps, "measured_s": round(elapsed, 3), "steps_per_s": round(steps / elapsed, 3),
                  "tokens_per_s": round(tokens_per_s, 1), "step_time_s": round(elapsed / steps, 4),
                  "loss_first": loss_first, "loss_last": loss, "flops_per_token": flops_per_token,
                  "achieved_tflops": float(f"{flops_per_token * tokens_per_s / 1e12:.4g}")})
        if cuda:
            r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            peak, source = peak_flops(torch.cuda.get_device_name(), s.args.peak_tflops)
            r["peak_flops"], r["peak_source"] = peak, source
            r["mfu"] = round(flops_per_token * tokens_per_s / peak, 4) if peak else None
            if peak is None:
                r.setdefault("skipped", {})["mfu"] = source
        else:
            r["mfu"] = None
            r.setdefault("skipped", {})["mfu"] = ("not applicable on CPU: MFU is measured against a GPU's dense "
                                                  "bf16 peak, and a CPU run computes in fp32")
        if p.big_preset != "1b":
            r.setdefault("skipped", {})["1b"] = f"--tiny: the {p.big_preset} preset stands in for the 1b preset"
    finally:
        trainer.close(failed=False)
        shutdown()


# ---- section 2: checkpoint ---------------------------------------------------------------------

def section_checkpoint(s: Section) -> None:
    import torch

    from .checkpoint import nvrx
    from .bench_checkpoint import _timed_steps, measure_engine
    from .config import load_config
    from .train.distributed import shutdown
    from .train.trainer import Trainer

    p, r = s.plan, s.results
    cfg = load_config(None, s.overrides(s.dir, big=True) + ["checkpoint.save_final=false", "checkpoint.resume=false",
                                                             "train.steps=100000", "train.deterministic=false"])
    trainer = Trainer(cfg)
    root = s.dir / "checkpoints"
    try:
        _timed_steps(trainer, 2)  # creates the AdamW moments: the state is complete from here on
        nbytes = state_bytes(trainer.checkpointer.state.state_dict(with_rng=False))
        r.update({"preset": p.big_preset, "params": trainer.num_params, "state_bytes": nbytes,
                  "state": "model parameters (fp32) + AdamW moments, FSDP2 DTensors, one rank",
                  "nvrx": nvrx.NVRX_VERSION})
        idle = _timed_steps(trainer, 5)
        r["step_time_idle_s"] = round(statistics.median(idle), 4)
        s.save()
        step = 0
        during: list[float] = []
        for mode in ("sync", "async"):
            # async: one unmeasured save first, which starts NVRx's writer and allocates the staging
            # buffers; sync has neither, and each 13 GB write costs budget.
            figures, steps_during, step = measure_engine(trainer, mode, root, saves=1,
                                                         warmup_saves=1 if mode == "async" else 0, step=step)
            r[mode] = {k: v for k, v in figures.items() if k != "stall_s_all"}
            if mode == "async":
                during = steps_during
            # The synchronous checkpoint is not needed once measured; the disk is not large.
            shutil.rmtree(root / mode, ignore_errors=True)
            s.save()
        sync_stall, async_stall = r["sync"]["stall_s"], r["async"]["stall_s"]
        r["async_stall_over_sync"] = round(async_stall / sync_stall, 4)
        r["target_async_stall_over_sync"] = ASYNC_STALL_TARGET
        r["target_met"] = async_stall / sync_stall <= ASYNC_STALL_TARGET
        r["step_time_during_write_s"] = round(statistics.median(during), 4) if during else None
        r["steps_during_write"] = len(during)
        if during:
            r["step_time_during_write_over_idle"] = round(statistics.median(during) / statistics.median(idle), 3)
        if torch.cuda.is_available() and not s.cpu:
            r["copy_floor_s"] = round(nbytes / COPY_FLOOR_BPS, 4)
            r["copy_floor_basis"] = f"state bytes / {COPY_FLOOR_BPS / 1e9:.0f} GB/s device-to-host"
            r["async_stall_over_copy_floor"] = round(async_stall / r["copy_floor_s"], 2)
        else:
            r.setdefault("skipped", {})["copy_floor"] = ("no device-to-host copy on CPU: staging is a host-memory "
                                                         "copy, so the GPU copy-bound floor does not apply")
    finally:
        trainer.close(failed=False)
        shutdown()


# ---- section 5: exact resume (runs first of the three job sections: it is their reference) -----

def section_exact_resume(s: Section) -> None:
    p, r = s.plan, s.results
    fresh_dir(s.dir)
    straight = s.dir / "straight"
    resumed = s.dir / "resumed"
    a = train_run(s, straight, s.run_overrides(straight))
    (s.work / "reference.json").write_text(json.dumps({"params_sha256": a["params_sha256"]}))
    r.update({"preset": p.small_preset, "steps": p.run_steps, "stopped_at": p.stop_step,
              "checkpoint_interval_steps": p.interval_steps, "checkpoint_mode": "async (NVRx)",
              "reference_params_sha256": a["params_sha256"]})
    s.save()
    train_run(s, resumed, s.run_overrides(resumed) + [f"train.stop_at_step={p.stop_step}"])
    b = train_run(s, resumed, s.run_overrides(resumed))
    la, lb = step_losses(straight), step_losses(resumed)
    steps = sorted(set(la) & set(lb))
    diff = max(abs(la[k] - lb[k]) for k in steps)
    r.update({"resumed_from_step": b["resumed_from_step"], "steps_compared": len(steps),
              "resumed_params_sha256": b["params_sha256"], "bitwise_equal": a["params_sha256"] == b["params_sha256"],
              "losses_equal": all(la[k] == lb[k] for k in steps), "max_abs_loss_diff": diff})
    if r["bitwise_equal"] and r["losses_equal"]:
        r["verdict"] = "bitwise: parameters and every loss equal"
        return
    # Not bitwise: measure how far two runs that never stopped drift apart here (non-deterministic
    # kernels), and accept the resumed run within a small multiple of that drift.
    s.save()
    again = s.dir / "straight-again"
    c = train_run(s, again, s.run_overrides(again))
    lc = step_losses(again)
    noise = max(abs(la[k] - lc[k]) for k in sorted(set(la) & set(lc)))
    r.update({"repeat_bitwise_equal": c["params_sha256"] == a["params_sha256"], "run_to_run_max_abs_loss_diff": noise,
              "tolerance": 3 * noise,
              "tolerance_basis": "3x the largest loss difference between two uninterrupted runs of the same "
                                 "configuration on this machine (the non-determinism floor); resuming may add "
                                 "no more than that kind of rounding noise"})
    r["within_tolerance"] = noise > 0 and diff <= 3 * noise
    r["verdict"] = (f"not bitwise; largest loss difference {diff:.3g} "
                    + ("within" if r["within_tolerance"] else "OUTSIDE") + f" the tolerance {3 * noise:.3g}")


# ---- sections 3 and 4: restarts -----------------------------------------------------------------

def _reference(s: Section) -> Optional[str]:
    try:
        return json.loads((s.work / "reference.json").read_text())["params_sha256"]
    except (OSError, ValueError, KeyError):
        return None


def _recovery_results(s: Section, summary: dict) -> None:
    r = s.results
    recoveries = summary.get("recoveries") or []
    if len(recoveries) != 1:
        raise RuntimeError(f"expected one recovery in summary.json, found {recoveries!r}")
    (rec,) = recoveries
    reference = _reference(s)
    r.update({"recovery_s": round(rec["recovery_s"], 3), "lost_steps": rec["lost_steps"], "layer_seen": rec["layer"],
              "resumed_from_step": rec["resumed_from_step"], "restarts": summary.get("restarts"),
              "final_step": summary["final_step"], "params_sha256": summary["params_sha256"],
              "equal_to_fault_free": (summary["params_sha256"] == reference) if reference else None})
    if reference is None:
        r.setdefault("skipped", {})["equal_to_fault_free"] = "no reference: the exact_resume section did not finish"


def section_in_process(s: Section) -> None:
    from .local.launcher import free_port

    p, r = s.plan, s.results
    fresh_dir(s.dir)
    port = free_port()
    # The variables torchrun or ft_launcher would set for a world of one, without a launcher: this
    # section is about the in-process layer alone (the in-job section runs ft_launcher).
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    overrides = s.in_process_overrides(s.dir)
    fault = f"exception@{p.fault_step}:rank=0"
    r.update({"fault": fault, "world_size": 1, "preset": p.small_preset})
    summary = train_run(s, s.dir, overrides, [f"--inject={fault}"], env)
    _recovery_results(s, summary)
    if r["layer_seen"] != "in_process":
        raise RuntimeError(f"the fault was recovered by the {r['layer_seen']} layer, not in-process")
    r["backend"] = "gloo" if s.cpu else "nccl"
    r["exercised"] = ["NVRx inprocess.Wrapper caught the exception and restarted the training function in the "
                      "same process", "the process group was aborted and destroyed, and a new one created in a "
                      "fresh key space of NVRx's store", "the FSDP2 model was rebuilt and the newest committed "
                      "checkpoint reloaded"]
    r["not_exercised"] = ["a peer rank blocked in a collective being released by the abort: that needs a world "
                          "of at least 2 (NCCL allows one rank per GPU)",
                          "hang detection (soft/hard timeouts) and the health checks this project turns off"]
    if s.cpu:
        r.setdefault("skipped", {})["nccl_abort"] = ("needs CUDA: gloo's abort was exercised instead; on a GPU the "
                                                     "NCCL communicator is aborted")
    else:
        r["exercised"].append("NCCL communicator abort (ProcessGroupNCCL.abort) and re-creation on the GPU")


def section_in_job(s: Section) -> None:
    from .bench_recovery import COMMON
    from .config import load_config
    from .local.launcher import LocalJob, agent_command, free_port, write_ft_config
    from .checkpoint.nvrx import NVRX_VERSION
    from .resilience.accounting import JOB_START_ENV
    from .resilience.nvrx import QUIET_WARNINGS, RDZV_STORE_IN_NODE, RDZV_STORE_OUTSIDE

    p, r = s.plan, s.results
    fresh_dir(s.dir)
    fault = f"sigkill@{p.fault_step}:rank=0"
    r.update({"fault": fault, "nodes": 1, "nproc_per_node": 1, "preset": p.small_preset, "nvrx": NVRX_VERSION})
    overrides = s.run_overrides(s.dir) + COMMON + ["resilience.in_process=false"]
    job = LocalJob(nodes=1, nproc_per_node=1, run_dir=s.dir, resilience=load_config(None, overrides).resilience,
                   trainer_args=[a for o in overrides for a in ("--set", o)] + ["--inject", fault])
    write_ft_config(job)
    # The node hosts its own rendezvous store, as the pod at the rendezvous endpoint does. The local
    # launcher serves the store itself (is_host=false), which NVRx 0.7's rendezvous does not
    # support: there the store host must be an agent, since it closes every round.
    cmd = [(RDZV_STORE_IN_NODE if a == RDZV_STORE_OUTSIDE else a)
           for a in agent_command(job, 0, free_port())]
    log = s.work / f"{s.name}-runs.log"
    code = run_logged(cmd, log, s.remaining() - 5, {JOB_START_ENV: repr(time.time()), "PYTHONWARNINGS": QUIET_WARNINGS})
    if code != 0:
        raise RuntimeError(f"the ft_launcher node exited with code {code}: " + " | ".join(tail(log, 3)))
    _recovery_results(s, json.loads((s.dir / "summary.json").read_text()))
    if r["layer_seen"] != "in_job":
        raise RuntimeError(f"the fault was recovered by the {r['layer_seen']} layer, not in-job")
    r["exercised"] = [f"ft_launcher (NVRx {NVRX_VERSION}) under the node wrapper (resilient_fsdp.resilience.agent), as a pod runs "
                      "it, hosting its own rendezvous store, with " + ("CPU (gloo)" if s.cpu else "CUDA (NCCL)")
                      + " workers", "the rank's death detected, the node's workers respawned after a new "
                      "rendezvous, training resumed from the newest committed async checkpoint"]
    r["not_exercised"] = ["several nodes (one machine, one GPU), and the local launcher's external rendezvous "
                          "store (NVRx 0.4 only)", "hang detection by section timeouts (a crash only)"]


SECTIONS: dict[str, Callable[[Section], None]] = {
    "environment": section_environment, "throughput": section_throughput, "checkpoint": section_checkpoint,
    "in_process": section_in_process, "in_job": section_in_job, "exact_resume": section_exact_resume}


def run_child(args: argparse.Namespace) -> int:
    """Run the section ``args.section`` names; 0 when it finished, 1 when it failed."""
    s = Section(args.section, args)
    s.dir.mkdir(parents=True, exist_ok=True)
    status = 0
    try:
        SECTIONS[args.section](s)
        s.save("ok")
    except BaseException as exc:  # noqa: BLE001 - recorded for the report, then a non-zero exit
        s.save("error", error=f"{type(exc).__name__}: {exc}".strip()[:2000], traceback=traceback.format_exc())
        traceback.print_exc()
        status = 1
    finally:
        # Checkpoints are not reported, and on a GPU each run's weigh gigabytes: free the disk.
        for folder in sorted(s.dir.rglob("checkpoints"), reverse=True):
            shutil.rmtree(folder, ignore_errors=True)
        try:
            from .train.entrypoint import stop_helper_processes

            stop_helper_processes()
        except Exception:  # noqa: BLE001 - cleanup only; the parent sweeps what is left
            pass
    return status
