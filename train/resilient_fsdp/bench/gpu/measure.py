"""GPU check sections 0 and 1: the environment and measured ceilings, throughput and MFU (the
checkpoint section is :mod:`.checkpoint`). torch and the trainer are imported inside the sections."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from typing import Any, Callable, Optional

from .section import Section

# Dense bf16 tensor-core peaks (NVIDIA's H100 and H200 SXM datasheets: 1,979 TFLOP/s "with
# sparsity", i.e. 989.4 dense), the denominator of MFU. Matched on torch's device name.
PEAKS = (
    ("H200", 989.4e12, "NVIDIA H200 SXM datasheet, dense BF16 Tensor Core (1,979 TFLOP/s with sparsity / 2)"),
    ("H100 80GB HBM3", 989.4e12, "NVIDIA H100 SXM datasheet, dense BF16 Tensor Core (1,979 TFLOP/s with sparsity / 2)"),
)


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
    r.update(
        {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    )
    for dist_name in ("nvidia-resiliency-ext", "pydantic", "PyYAML", "psutil", "numpy", "protobuf", "grpcio"):
        try:
            r[f"version_{dist_name}"] = md.version(dist_name)
        except md.PackageNotFoundError:
            r[f"version_{dist_name}"] = None
    r["nvrx"] = r["version_nvidia-resiliency-ext"]
    # What each section imports; a missing wheel shows up here, by name, before anything runs.
    imports = {}
    try:  # the NVRx modules the checkpointing and restart layers use, as they list them
        from ...checkpoint.writer import process as checkpoint_writer
        from ...resilience import nvrx as restart_nvrx

        nvrx_modules = checkpoint_writer.NVRX_MODULES + restart_nvrx.NVRX_MODULES
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        imports["resilient_fsdp.checkpoint.writer.process"] = f"{type(exc).__name__}: {exc}"
        nvrx_modules = ()
    for module in ("resilient_fsdp.config", "resilient_fsdp.train.entrypoint", *nvrx_modules):
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
        from ...resilience.agent import ft_launcher_executable

        r["ft_launcher"] = " ".join(ft_launcher_executable())
    except Exception as exc:  # noqa: BLE001 - the in_job section will fail on it; say why here
        r["ft_launcher"] = f"not found: {exc}"
    s.save()
    if not torch.cuda.is_available():
        r["skipped"] = {
            "gpu": "no CUDA device visible" + (" (--cpu)" if s.cpu else ""),
            "nccl": "NCCL needs CUDA",
            "driver": "no NVIDIA driver in use",
            "ceilings": "the bf16 matmul and device-to-host copy ceilings are measured on a GPU only",
        }
        return
    props = torch.cuda.get_device_properties(0)
    r.update(
        {
            "gpu_name": props.name,
            "gpu_count": torch.cuda.device_count(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    )
    try:
        version = torch.cuda.nccl.version()
        r["nccl"] = ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)
    except Exception as exc:  # noqa: BLE001
        r["nccl"] = f"unknown ({exc})"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
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
    out = {
        "bf16_matmul_tflops": round(_matmul_tflops(torch, n), 1),
        "matmul_shape": f"{n}x{n}x{n}",
        "d2h_pinned_gb_per_s": round(_d2h_gb_per_s(torch, nbytes), 1),
        "d2h_bytes": nbytes,
    }
    torch.cuda.empty_cache()
    return out


# ---- section 1: throughput ---------------------------------------------------------------------


def section_throughput(s: Section) -> None:
    import torch

    from ...config import load_config
    from ...train.distributed import shutdown
    from ...train.model import preset_args
    from ...train.trainer import Trainer

    p, r = s.plan, s.results
    # Deterministic kernels are for exact comparisons (section 5); speed is measured without them.
    cfg = load_config(
        None,
        s.overrides(s.dir, big=True)
        + ["checkpoint.save_final=false", "checkpoint.resume=false", "train.steps=100000", "train.deterministic=false"],
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        args = preset_args(p.big_preset)
        r.update(
            {
                "preset": p.big_preset,
                "params": trainer.num_params,
                "seq_len": p.big_seq_len,
                "micro_batch_size": p.big_micro_batch,
                "tokens_per_step": trainer.tokens_per_step,
                "world_size": trainer.info.world_size,
                "device": str(trainer.info.device),
                "backend": trainer.info.backend,
                "build_s": round(time.perf_counter() - t0, 2),
                "precision": (
                    "bf16 parameters and compute, fp32 gradient reduction (FSDP2 MixedPrecisionPolicy)"
                    if trainer.info.device.type == "cuda"
                    else "fp32 (CPU)"
                ),
            }
        )
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
        r.update(
            {
                "steps_measured": steps,
                "measured_s": round(elapsed, 3),
                "steps_per_s": round(steps / elapsed, 3),
                "tokens_per_s": round(tokens_per_s, 1),
                "step_time_s": round(elapsed / steps, 4),
                "loss_first": loss_first,
                "loss_last": loss,
                "flops_per_token": flops_per_token,
                "achieved_tflops": float(f"{flops_per_token * tokens_per_s / 1e12:.4g}"),
            }
        )
        if cuda:
            r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            peak, source = peak_flops(torch.cuda.get_device_name(), s.args.peak_tflops)
            r["peak_flops"], r["peak_source"] = peak, source
            r["mfu"] = round(flops_per_token * tokens_per_s / peak, 4) if peak else None
            if peak is None:
                r.setdefault("skipped", {})["mfu"] = source
        else:
            r["mfu"] = None
            r.setdefault("skipped", {})["mfu"] = (
                "not applicable on CPU: MFU is measured against a GPU's dense bf16 peak, and a CPU run computes in fp32"
            )
        if p.big_preset != "1b":
            r.setdefault("skipped", {})["1b"] = f"--tiny: the {p.big_preset} preset stands in for the 1b preset"
    finally:
        trainer.close(failed=False)
        shutdown()
