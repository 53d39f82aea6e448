"""Is this container image sound? ``python -m resilient_fsdp.deploy.image_check`` (``scripts/check-image``).

Two depths, one list of checks (:func:`run_checks`): ``--build``, the last step of ``docker
build`` (no GPU), which also records the pins in the image so that the run-time check compares
against the same numbers; and the default, inside the image on a GPU node (e.g. nightly). Prints
one line per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib
import importlib.metadata
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .release_check import memlock_shortfall

# Where the pins go at build time and where the run-time check reads them.
PINS_FILE = Path("/opt/resilient-fsdp/pins.json")
# The EFA installer's locations (libfabric and the aws-ofi-nccl plugin NCCL loads).
EFA_LIB_DIRS = (Path("/opt/amazon/efa/lib"), Path("/opt/amazon/efa/lib64"))
OFI_NCCL_LIB_DIRS = (Path("/opt/amazon/ofi-nccl/lib"),)
# aws-ofi-nccl's tuner, which the chart's EFA pods name in NCCL_TUNER_PLUGIN (efa.ncclTunerPlugin's
# default; tests/deploy/test_image_check.py keeps the two equal). NCCL only warns when the file is
# missing and keeps its own algorithm choices, so nothing else would notice.
NCCL_TUNER_PLUGIN = Path("/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so")
# Launcher variables a pod carries; the one-process step must not try to join the job with them.
LAUNCHER_ENV = re.compile(r"^(MASTER_ADDR|MASTER_PORT|RANK|LOCAL_RANK|WORLD_SIZE|GROUP_RANK|PET_.*|TORCHELASTIC_.*)$")


@dataclass
class Result:
    name: str
    status: str  # "ok", "FAIL" or "skip"
    detail: str


@dataclass
class Pins:
    torch: Optional[str] = None
    cuda: Optional[str] = None
    nccl: Optional[str] = None
    nvrx: Optional[str] = None


def _release(version: str) -> str:
    """``2.13.0a0+9186a08b2c.nv26.07`` -> ``2.13.0a0``: the local part names the build, not the release."""
    return version.split("+", 1)[0]


def check_torch(pins: Pins) -> Result:
    import torch

    if torch.version.cuda is None or not torch.backends.cuda.is_built():
        return Result(
            "torch",
            "FAIL",
            f"torch {torch.__version__} was built without CUDA: the image must keep its "
            "base's CUDA build (a pip install replaced it?)",
        )
    if pins.torch and _release(torch.__version__) != pins.torch:
        return Result("torch", "FAIL", f"torch {torch.__version__}, pinned {pins.torch} (BASE_TORCH_VERSION)")
    return Result("torch", "ok", f"{torch.__version__}, built with CUDA {torch.version.cuda}")


def check_cuda(pins: Pins) -> Result:
    import torch

    built = torch.version.cuda
    if built is None:
        return Result("cuda", "FAIL", "torch has no CUDA build")
    if pins.cuda and ".".join(built.split(".")[:2]) != ".".join(pins.cuda.split(".")[:2]):
        return Result("cuda", "FAIL", f"torch was built with CUDA {built}, pinned {pins.cuda} (BASE_CUDA_VERSION)")
    return Result("cuda", "ok", f"CUDA {built}")


def _loaded_library(fragment: str) -> Optional[str]:
    """Path of a shared library this process has mapped whose name contains ``fragment``."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if fragment in Path(path).name:
                return path
    except OSError:
        pass
    return None


def check_nccl(pins: Pins) -> Result:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return Result("nccl", "FAIL", f"torch {torch.__version__} has no NCCL backend")
    version = ".".join(str(v) for v in torch.cuda.nccl.version())  # the linked library's own answer
    where = _loaded_library("libnccl") or "linked into torch"
    if pins.nccl and version != pins.nccl:
        return Result("nccl", "FAIL", f"NCCL {version} ({where}), pinned {pins.nccl} (BASE_NCCL_VERSION)")
    return Result("nccl", "ok", f"NCCL {version} ({where})")


def check_nvrx(pins: Pins) -> Result:
    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return Result("nvrx", "FAIL", "nvidia-resiliency-ext is not installed")
    if pins.nvrx and version != pins.nvrx:
        return Result("nvrx", "FAIL", f"nvidia-resiliency-ext {version}, pinned {pins.nvrx} (NVRX_VERSION)")
    return Result("nvrx", "ok", f"nvidia-resiliency-ext {version}")


def check_trainer(_pins: Pins) -> Result:
    for module in ("resilient_fsdp.train.entrypoint", "resilient_fsdp.resilience.agent"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import-time failure makes the image useless: report it
            return Result("trainer", "FAIL", f"import {module}: {type(exc).__name__}: {exc}")
    try:
        version = importlib.metadata.version("resilient-fsdp")
    except importlib.metadata.PackageNotFoundError:
        version = "from the source tree"
    return Result(
        "trainer",
        "ok",
        f"resilient-fsdp {version}: resilient_fsdp.train.entrypoint and resilient_fsdp.resilience.agent import",
    )


def check_ft_launcher(_pins: Pins) -> Result:
    found = shutil.which("ft_launcher")
    if not found:
        return Result("ft_launcher", "FAIL", "ft_launcher is not on PATH (nvidia-resiliency-ext's console script)")
    return Result("ft_launcher", "ok", found)


def _find_library(names: tuple[str, ...], dirs: tuple[Path, ...]) -> Optional[Path]:
    search = list(dirs) + [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    for directory in search:
        for name in names:
            if (directory / name).exists():
                return directory / name
    return None


def check_libfabric(_pins: Pins) -> Result:
    lib = _find_library(("libfabric.so.1",), EFA_LIB_DIRS)
    if lib is None and ctypes.util.find_library("fabric") is None:
        return Result(
            "libfabric",
            "FAIL",
            "libfabric.so.1 not found in /opt/amazon/efa/lib or LD_LIBRARY_PATH: the EFA installer did not run",
        )
    fi_info = shutil.which("fi_info")
    if fi_info is None:
        return Result("libfabric", "FAIL", f"{lib} found but fi_info is not on PATH (/opt/amazon/efa/bin)")
    out = subprocess.run([fi_info, "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return Result("libfabric", "FAIL", f"fi_info --version exited {out.returncode}: {out.stderr.strip()[-300:]}")
    version = next((ln.split(":", 1)[1].strip() for ln in out.stdout.splitlines() if ln.startswith("libfabric:")), "?")
    return Result("libfabric", "ok", f"libfabric {version} ({lib or 'on the loader path'})")


def check_ofi_nccl(_pins: Pins) -> Result:
    # NCCL_NET_PLUGIN=ofi (set in the image) makes NCCL load libnccl-net-ofi.so.
    suffix = os.environ.get("NCCL_NET_PLUGIN", "")
    names = (f"libnccl-net-{suffix}.so",) if suffix and "/" not in suffix else ()
    names += ("libnccl-net-ofi.so", "libnccl-net.so")
    lib = Path(suffix) if suffix.startswith("/") and Path(suffix).exists() else _find_library(names, OFI_NCCL_LIB_DIRS)
    if lib is None:
        return Result(
            "aws-ofi-nccl",
            "FAIL",
            f"no NCCL net plugin ({', '.join(names)}) in /opt/amazon/ofi-nccl/lib "
            "or LD_LIBRARY_PATH: NCCL would fall back to TCP sockets",
        )
    return Result("aws-ofi-nccl", "ok", f"{lib} (NCCL_NET_PLUGIN={suffix or 'unset'})")


def check_nccl_tuner(_pins: Pins, path: Path = NCCL_TUNER_PLUGIN) -> Result:
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*tuner*.so")) if path.parent.is_dir() else []
        return Result(
            "nccl-tuner",
            "FAIL",
            f"{path} (the chart's efa.ncclTunerPlugin) is not in the image"
            + (
                f"; {path.parent} has {', '.join(found)}: set efa.ncclTunerPlugin to it"
                if found
                else ": NCCL would keep its own algorithm choices on EFA; set efa.ncclTunerPlugin to where this "
                "aws-ofi-nccl puts its tuner, or to an empty string"
            ),
        )
    return Result("nccl-tuner", "ok", str(path))


def efa_devices() -> list[str]:
    """EFA devices the kernel exposes to this container (the device plugin mounts them)."""
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if "efa" in d.name or "efa" in _driver(d))


def _driver(ibdev: Path) -> str:
    try:
        return (ibdev / "device" / "driver").resolve().name
    except OSError:
        return ""


def check_gpu(_pins: Pins, cpu_ok: bool = False) -> Result:
    import torch

    if not torch.cuda.is_available():
        if cpu_ok:
            return Result("gpu", "skip", "no GPU visible (--cpu-ok): the FSDP step runs on CPU with gloo")
        return Result(
            "gpu",
            "FAIL",
            "no GPU visible: run on a GPU node with the NVIDIA runtime "
            "(docker run --gpus all, or a pod requesting nvidia.com/gpu)",
        )
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return Result("gpu", "ok", f"{torch.cuda.device_count()} x {', '.join(names)}")


def check_efa_device(_pins: Pins) -> Result:
    devices = efa_devices()
    if not devices:
        return Result("efa-device", "skip", "no EFA device on this node: fi_info -p efa not run")
    fi_info = shutil.which("fi_info")
    if fi_info is None:
        return Result("efa-device", "FAIL", f"EFA device(s) {', '.join(devices)} but no fi_info on PATH")
    out = subprocess.run([fi_info, "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or "provider: efa" not in out.stdout:
        return Result(
            "efa-device",
            "FAIL",
            f"fi_info -p efa failed on {', '.join(devices)} (exit {out.returncode}): "
            f"{(out.stderr or out.stdout).strip()[-300:]}; is the pod granted "
            "vpc.amazonaws.com/efa (and is memlock unlimited)?",
        )
    return Result("efa-device", "ok", f"fi_info -p efa: provider efa on {', '.join(devices)}")


def check_memlock(
    _pins: Pins, devices: Optional[list[str]] = None, limits: Callable[[int], tuple[int, int]] = resource.getrlimit
) -> Result:
    """``ulimit -l`` is unlimited where the node has EFA: libfabric registers (locks) every buffer."""
    devices = efa_devices() if devices is None else devices
    if not devices:
        return Result("memlock", "skip", "no EFA device on this node: the locked-memory limit does not matter")
    shortfall = memlock_shortfall(limits)
    if shortfall is None:
        return Result("memlock", "ok", f"ulimit -l unlimited (EFA: {', '.join(devices)})")
    return Result("memlock", "FAIL", f"on an EFA node, {shortfall}")


def check_fsdp_step(_pins: Pins, cpu_ok: bool = False, steps: int = 3) -> Result:
    """The trainer itself, a world of one: FSDP2-sharded tiny model, a few steps, a checkpoint."""
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not cpu_ok:
        return Result("fsdp-step", "FAIL", "no GPU visible (pass --cpu-ok to run the step on CPU)")
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_ENV.match(k)}
    env.setdefault("NCCL_DEBUG", "INFO")
    with tempfile.TemporaryDirectory(prefix="check-image-") as run_dir:
        cmd = [
            sys.executable,
            "-m",
            "resilient_fsdp.train",
            "--run-dir",
            run_dir,
            "--set",
            "model.preset=tiny",
            "--set",
            f"train.steps={steps}",
            "--set",
            "train.log_every=1",
            "--set",
            f"dist.device={'cuda' if on_gpu else 'cpu'}",
            "--set",
            "checkpoint.save_final=true",
        ]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        except subprocess.TimeoutExpired:
            return Result("fsdp-step", "FAIL", "the trainer did not finish within 600 s")
        text = out.stdout + out.stderr
        if out.returncode != 0:
            return Result("fsdp-step", "FAIL", f"the trainer exited {out.returncode}: {text.strip()[-800:]}")
        summary_path = Path(run_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        loss = summary.get("final_loss")
        if summary.get("final_step") != steps or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            return Result("fsdp-step", "FAIL", f"the trainer finished without a finite loss at step {steps}: {summary}")
        committed = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))
    backend = "cuda, nccl" if on_gpu else "cpu, gloo"
    if f"({backend})" not in text:
        return Result("fsdp-step", "FAIL", f"expected the trainer to run on ({backend}); its output:\n{text[-800:]}")
    detail = f"{steps} steps on ({backend}), final loss {loss:.4f}, checkpoint {', '.join(committed) or 'none'}"
    if on_gpu:
        plugin = [
            ln.split("NCCL INFO", 1)[1].strip()
            for ln in text.splitlines()
            if "NCCL INFO" in ln and ("NET/" in ln or "plugin" in ln.lower())
        ]
        if efa_devices() and not any("OFI" in ln or "Libfabric" in ln for ln in plugin):
            return Result(
                "fsdp-step",
                "FAIL",
                "NCCL did not load the aws-ofi-nccl plugin on an EFA node: "
                + ("; ".join(plugin[:3]) or "no NET lines in NCCL_DEBUG=INFO output"),
            )
        if plugin:
            detail += f"; NCCL: {plugin[0]}"
    if not committed:
        return Result("fsdp-step", "FAIL", f"no committed checkpoint after the run ({detail})")
    return Result("fsdp-step", "ok", detail)


def run_checks(pins: Pins, build: bool, cpu_ok: bool) -> list[Result]:
    """The checks of one depth. ``build`` (the last step of ``docker build``, no GPU): the pinned
    torch, CUDA, NCCL and NVRx, the trainer's import, ``ft_launcher`` on PATH, the EFA libraries
    where NCCL finds them. Otherwise (inside the image on a GPU node) the same, then a GPU, the EFA
    provider and an unlimited locked-memory limit where the node has EFA, and a few FSDP steps."""
    static: list[Callable[[Pins], Result]] = [
        check_torch,
        check_cuda,
        check_nccl,
        check_nvrx,
        check_trainer,
        check_ft_launcher,
        check_libfabric,
        check_ofi_nccl,
        check_nccl_tuner,
    ]
    results = []
    for check in static:
        try:
            results.append(check(pins))
        except Exception as exc:  # a check that crashes is a failed check, reported with the rest
            results.append(Result(check.__name__.removeprefix("check_"), "FAIL", f"{type(exc).__name__}: {exc}"))
    if build:
        return results
    for name, check in (
        ("gpu", lambda p: check_gpu(p, cpu_ok)),
        ("efa-device", check_efa_device),
        ("memlock", check_memlock),
        ("fsdp-step", lambda p: check_fsdp_step(p, cpu_ok)),
    ):
        try:
            results.append(check(pins))
        except Exception as exc:
            results.append(Result(name, "FAIL", f"{type(exc).__name__}: {exc}"))
    return results


def load_pins(path: Path) -> Pins:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"error: --pins {path}: no such file (the image writes it at build time; outside the image "
            "pass --expect-* flags instead)"
        ) from None
    return Pins(**{k: data.get(k) for k in ("torch", "cuda", "nccl", "nvrx")})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="check-image", description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="store_true", help="build-time checks only (no GPU, no EFA device, no training)")
    p.add_argument("--cpu-ok", action="store_true", help="run the FSDP step on CPU when no GPU is visible")
    p.add_argument("--pins", type=Path, help=f"expected versions (JSON); default {PINS_FILE} when it exists")
    p.add_argument("--expect-torch", help="torch release, e.g. 2.13.0a0 (the local +build part is ignored)")
    p.add_argument("--expect-cuda", help="CUDA major.minor torch was built with, e.g. 13.3")
    p.add_argument("--expect-nccl", help="NCCL version, e.g. 2.30.7")
    p.add_argument("--expect-nvrx", help="nvidia-resiliency-ext version, e.g. 0.7.0")
    p.add_argument("--save-pins", type=Path, help="after every check passed, write the expected versions here")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    # torch prints this deprecation notice on import when NVRx's pynvml dependency is present.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    args = build_parser().parse_args(argv)
    pins_path = args.pins or (PINS_FILE if PINS_FILE.exists() else None)
    pins = load_pins(pins_path) if pins_path else Pins()
    for field in ("torch", "cuda", "nccl", "nvrx"):
        value = getattr(args, f"expect_{field}")
        if value is not None:
            if not re.fullmatch(r"[0-9][0-9A-Za-z.]*", value):
                raise SystemExit(f"error: --expect-{field}={value!r}: expected a version such as 2.30.7")
            setattr(pins, field, value)
    results = run_checks(pins, build=args.build, cpu_ok=args.cpu_ok)
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"[check-image] {r.status:<4}  {r.name:<{width}}  {r.detail}", flush=True)
    failed = [r for r in results if r.status == "FAIL"]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "FAIL", "skip")}
    print(
        f"[check-image] {counts['ok']} ok, {counts['FAIL']} failed, {counts['skip']} skipped"
        f"{' (build-time checks)' if args.build else ''}"
    )
    if not failed and args.save_pins:
        args.save_pins.parent.mkdir(parents=True, exist_ok=True)
        args.save_pins.write_text(json.dumps(vars(pins), indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
