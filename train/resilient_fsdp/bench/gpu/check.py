"""``python -m resilient_fsdp.bench.gpu.check``: the CUDA path, measured in one call on one GPU.

Run through ``scripts/gpu-check`` (which first installs the wheels the machine lacks). The
sections (:data:`RUN_ORDER`, titled in :data:`TITLES`): throughput and MFU, every checkpoint
engine, in-process and in-job restarts, exact resume, node-local checkpoints. Each runs in its
own process under its own budget (:data:`BUDGET_S`) inside the whole check's
(:func:`run_section`); ``gpu-check.json`` and ``gpu-check.md`` in ``--out`` are rewritten after
every section, so whatever finished comes back even if the call is cut short. ``--cpu --tiny``
rehearses the sections on CPU and skips only what needs CUDA, saying why. The parent uses the
standard library alone, so it can report a missing package instead of dying on the import.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from ... import atomic
from ..recovery import fresh_dir
from .section import GPU_PLAN, TINY_PLAN, tail
from .sections import SECTIONS, run_child

# Run order: exact_resume runs before the restart sections because its uninterrupted run is the
# reference their final parameters are compared with.
RUN_ORDER = ("environment", "throughput", "checkpoint", "exact_resume", "in_process", "in_job", "local_checkpoints")
REPORT_ORDER = ("environment", "throughput", "checkpoint", "in_process", "in_job", "exact_resume", "local_checkpoints")
TITLES = {
    "environment": "environment and measured ceilings",
    "throughput": "1. steps/s and MFU",
    "checkpoint": "2. checkpoint engines",
    "in_process": "3. in-process restart",
    "in_job": "4. in-job restart (ft_launcher)",
    "exact_resume": "5. exact resume",
    "local_checkpoints": "6. memory tier and NVRx's local checkpoints",
}
# Seconds each section may take at most. Expected on one H200: about 10, 60, 130 (five engines, three
# saves each of 13 GB; depends on the disk), 45, 20, 35 and 40 (four saves and two loads of 1.6 GB).
BUDGET_S = {
    "environment": 60,
    "throughput": 110,
    "checkpoint": 200,
    "exact_resume": 120,
    "in_process": 75,
    "in_job": 100,
    "local_checkpoints": 90,
}
# The whole check: a device call may run 10 minutes, and wheel installation and start-up come first.
TOTAL_BUDGET_S = 450
# A CPU rehearsal on a shared 2-core machine runs every process start several times slower.
CPU_BUDGET_FACTOR = 3
MIN_SECTION_S = 20  # not worth starting a section with less left


# ---- the parent: runs each section in a child process and writes the report --------------------


class Report:
    """``gpu-check.json`` and ``gpu-check.md`` in the output folder, rewritten after every change."""

    def __init__(self, out: Path, mode: dict):
        self.out = out
        self.data: dict = {
            "check": "resilient-fsdp gpu-check",
            "mode": mode,
            "environment": {},
            "sections": {},
            "status": "running",
        }

    def section(self, name: str, record: dict) -> None:
        self.data["sections"][name] = record
        if name == "environment" and isinstance(record.get("results"), dict):
            self.data["environment"].update(record["results"])
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        atomic.write_json(self.out / "gpu-check.json", self.data, default=str)
        atomic.write_text(self.out / "gpu-check.md", markdown(self.data))


def adopt_orphans() -> None:
    """Become a child subreaper: processes a section orphans (NVRx workers, ft_launcher agents)
    re-parent here, so the sweep after each section can end them and free the GPU."""
    try:
        from ...resilience.processes import become_subreaper
    except ImportError:  # a missing package: the environment section reports it
        return
    become_subreaper()


def sweep_descendants() -> int:
    """End every process a section left behind (their GPU memory with them); returns how many."""
    try:
        import psutil

        from ...resilience.processes import kill_descendants
    except ImportError:
        return 0
    left = len(psutil.Process().children(recursive=True))
    if left:
        kill_descendants(timeout=5.0)
    return left


def run_section(name: str, args: argparse.Namespace, work: Path, timeout: float, log: Path) -> dict:
    """One section in a child process; its result file, or what is known when it failed.

    A section that fails or overruns is recorded with its error (and killed) and the next one runs,
    so one CUDA or NCCL problem costs one section, not the call.
    """
    result_file = work / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = (
        [
            sys.executable,
            "-m",
            "resilient_fsdp.bench.gpu.check",
            "--section",
            name,
            "--work-dir",
            str(work),
            "--budget-s",
            f"{timeout:.1f}",
        ]
        + (["--cpu"] if args.cpu else [])
        + (["--tiny"] if args.tiny else [])
    )
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    t0 = time.monotonic()
    timed_out = False
    with open(log, "w") as out:
        child = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
            code = child.wait()
    swept = sweep_descendants()
    try:
        record = json.loads(result_file.read_text())
    except (OSError, ValueError):
        record = {"results": {}}
    if timed_out:
        record["status"] = "timeout"
        record["error"] = f"exceeded its time budget of {timeout:.0f} s and was killed; partial results kept"
    elif record.get("status") not in ("ok", "error"):
        record["status"] = "error"
        record["error"] = f"the section's process exited with code {code} without a result; see the log"
    record["elapsed_s"] = round(time.monotonic() - t0, 2)
    record["budget_s"] = round(timeout)
    if swept:
        record["processes_left_and_killed"] = swept
    if record["status"] != "ok":
        record["log_tail"] = [line for path in section_logs(work, name) for line in tail(path, 25)]
    return record


def section_logs(work: Path, name: str) -> list[Path]:
    """A section's own output, its runs' output, and the ft_launcher node logs of its job."""
    return [work / f"{name}.log", work / f"{name}-runs.log", *sorted((work / name / "logs").glob("node*.log"))]


def append_logs(combined: Path, work: Path, name: str, limit: int = 300_000) -> None:
    """Every log of a section, the last ``limit`` bytes of each, in the one log that travels back."""
    with open(combined, "a") as f:
        for log in section_logs(work, name):
            try:
                text = log.read_bytes()[-limit:].decode(errors="replace")
            except OSError:
                continue
            f.write(f"\n===== section {name}: {log.name} =====\n{text}")


def parent(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    work = Path(args.work_dir).resolve()
    fresh_dir(work)
    adopt_orphans()
    started = time.monotonic()
    mode = {
        "cpu": args.cpu,
        "tiny": args.tiny,
        "argv": sys.argv[1:],
        "total_budget_s": args.budget_s,
        "plan": (TINY_PLAN if args.tiny else GPU_PLAN).__dict__,
    }
    report = Report(out, mode)
    report.data["environment"].update(
        {
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "hostname": platform.node(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        }
    )
    if args.wheels_record:
        try:
            report.data["environment"]["carried_wheels"] = json.loads(Path(args.wheels_record).read_text())
        except (OSError, ValueError) as exc:
            report.data["environment"]["carried_wheels"] = f"unreadable: {exc}"
    report.write()
    combined = out / "gpu-check.log"
    combined.write_text("")
    for name in RUN_ORDER:
        left = args.budget_s - (time.monotonic() - started)
        if left < MIN_SECTION_S:
            report.section(
                name,
                {
                    "status": "skipped",
                    "skipped": f"the check's total budget ({args.budget_s:.0f} s, "
                    f"--budget-s) was used up before this section",
                },
            )
            continue
        budget = min(BUDGET_S[name] * (CPU_BUDGET_FACTOR if args.cpu else 1), left)
        print(f"[gpu-check] {name}: running (budget {budget:.0f} s)", flush=True)
        record = run_section(name, args, work, budget, work / f"{name}.log")
        append_logs(combined, work, name)
        report.section(name, record)
        print(
            f"[gpu-check] {name}: {record['status']} in {record['elapsed_s']:.1f} s"
            + (f": {record.get('error')}" if record["status"] != "ok" else ""),
            flush=True,
        )
        if (
            name == "environment"
            and record["status"] == "ok"
            and not args.cpu
            and not record["results"].get("cuda_available")
        ):
            reason = (
                f"no GPU is visible to torch {record['results'].get('torch')} here; run on the GPU machine, "
                "or pass --cpu --tiny to rehearse on CPU"
            )
            for rest in RUN_ORDER[1:]:
                report.data["sections"][rest] = {"status": "skipped", "skipped": reason}
            report.data["status"] = "error: " + reason
            report.write()
            print(f"error: {reason}", file=sys.stderr)
            return 2
    statuses = [s["status"] for s in report.data["sections"].values()]
    report.data["status"] = "ok" if all(s == "ok" for s in statuses) else "some sections failed"
    report.data["elapsed_s"] = round(time.monotonic() - started, 1)
    report.write()
    print(markdown(report.data))
    print(f"[gpu-check] results: {out / 'gpu-check.json'}, {out / 'gpu-check.md'}, log {combined}", flush=True)
    return 0 if report.data["status"] == "ok" else 1


# ---- the Markdown report -----------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".3g", unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)):
        return f"{value:{spec}}{unit}"
    return str(value)


def _size(nbytes: Optional[int]) -> str:
    if not nbytes:
        return "n/a"
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _measured(name: str, r: dict) -> tuple[str, str, str]:
    """(measured, target, verdict) for one section's row."""
    if name == "environment":
        c = r.get("ceilings") or {}
        return (
            f"bf16 matmul {_fmt(c.get('bf16_matmul_tflops'), '.0f')} TFLOP/s, pinned D2H "
            f"{_fmt(c.get('d2h_pinned_gb_per_s'), '.1f')} GB/s"
            if c
            else "no GPU ceilings (CPU)",
            "",
            "",
        )
    if name == "throughput":
        mfu = r.get("mfu")
        peak = f" of {r['peak_flops'] / 1e12:.1f} TFLOP/s" if r.get("peak_flops") else ""
        return (
            f"{_fmt(r.get('steps_per_s'))} steps/s, {_fmt(r.get('tokens_per_s'), ',.0f')} tok/s, "
            f"{_fmt(r.get('achieved_tflops'))} TFLOP/s, MFU "
            + (f"{mfu:.1%}{peak}" if mfu is not None else "n/a")
            + f" ({r.get('preset')}, {_fmt(r.get('steps_measured'))} steps)",
            "",
            "",
        )
    if name == "checkpoint":
        sync, asy = r.get("sync") or {}, r.get("async") or {}
        ratio = r.get("async_stall_over_sync")
        floor = f"; copy floor {r['copy_floor_s']:.3f} s" if r.get("copy_floor_s") else ""
        during = r.get("step_time_during_write_over_idle")
        text = (
            (f"{r['preset']}: " if r.get("preset") else "")
            + f"stall: sync {_fmt(sync.get('stall_s'), '.3f')} s, async "
            f"{_fmt(asy.get('stall_s'), '.3f')} s" + (f" ({ratio:.1%} of sync)" if ratio is not None else "")
        )
        for peer in ("dcp_process", "dcp_thread", "torch_async"):
            if peer in r:
                text += f", {peer} {_fmt(r[peer].get('stall_s'), '.3f')} s"
        text += (
            f"; async write {_fmt(asy.get('write_s'), '.2f')} s{floor}; step time during write "
            + (f"{during:.2f}x idle" if during else "n/a")
            + f"; state {_size(r.get('state_bytes'))}"
        )
        for preset, other in (r.get("other_presets") or {}).items():
            text += f"; {preset}: " + (
                other["skipped"]
                if "skipped" in other and "async" not in other
                else f"async stall {_fmt((other.get('async') or {}).get('stall_s'), '.3f')} s, "
                f"{_fmt(other.get('async_stall_over_sync'), '.1%')} of sync"
            )
        checks = [
            (k, r[k])
            for k in ("device_memory_flat_during_save", "stall_close_to_d2h_copy", "params_hash_bounded")
            if k in r
        ]
        if checks:
            text += "; " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checks)
        verdict = "" if "target_met" not in r else ("met" if r["target_met"] else "missed")
        return text, "async stall ≤ 2% of sync", verdict
    if name in ("in_process", "in_job"):
        eq = r.get("equal_to_fault_free")
        memory = (
            ""
            if "restored_from_memory" not in r
            else (
                f"from memory {'yes' if r['restored_from_memory'] else 'NO'}, "
                f"load phase {_fmt(r.get('load_s'), '.2f')} s, "
            )
        )
        if "memory_slots_pinned" in r:
            memory += f"memory slots page-locked {'yes' if r['memory_slots_pinned'] else 'NO'}, "
        return (
            f"recovery {_fmt(r.get('recovery_s'), '.2f')} s, {_fmt(r.get('lost_steps'))} step(s) redone, {memory}"
            f"layer {r.get('layer_seen', 'n/a')}, final parameters "
            + ({True: "bitwise equal to", False: "DIFFERENT from", None: "not compared with"}[eq])
            + " the fault-free run",
            "recovered by this layer",
            "met" if r.get("layer_seen") else "",
        )
    if name == "exact_resume":
        if "bitwise_equal" not in r:
            return "", "", ""
        met = r["bitwise_equal"] and r["losses_equal"] or bool(r.get("within_tolerance"))
        return (
            str(r.get("verdict", "")) + f" ({r.get('steps_compared')} steps, resumed at step "
            f"{r.get('resumed_from_step')})",
            "bitwise, else within the measured tolerance",
            "met" if met else "missed",
        )
    if name == "local_checkpoints":
        mem, nv = r.get("memory") or {}, r.get("nvrx_local") or {}
        if not mem:
            return "", "", ""
        bitwise = {True: "bitwise", False: "NOT bitwise", None: "not checked"}
        text = (
            f"{r.get('preset')}, {_size(r.get('state_bytes'))}: save stall memory tier "
            f"{_fmt(mem.get('stall_s'), '.3f')} s, NVRx LocalCheckpointManager {_fmt(nv.get('stall_s'), '.3f')} s "
            f"({_fmt(r.get('nvrx_local_stall_over_memory'), '.2f')}x); complete after "
            f"{_fmt(mem.get('write_s'), '.2f')} s / {_fmt(nv.get('write_s'), '.2f')} s; load "
            f"{_fmt(r.get('memory_load_s'), '.3f')} s ({bitwise[r.get('memory_load_bitwise')]}) / "
            f"{_fmt(r.get('nvrx_local_load_s'), '.3f')} s ({bitwise[r.get('nvrx_local_load_bitwise')]})"
        )
        met = bool(r.get("memory_load_bitwise") and r.get("nvrx_local_load_bitwise"))
        return text, "both measured on one state, loads bitwise", "met" if met else ""
    return "", "", ""


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    mode = data.get("mode", {})
    where = ("CPU rehearsal (--cpu)" if mode.get("cpu") else env.get("gpu_name", "GPU")) + (
        ", --tiny" if mode.get("tiny") else ""
    )
    lines = [
        f"# resilient-fsdp GPU check: {where}",
        "",
        f"- date (UTC): {env.get('date_utc')}; host {env.get('hostname')}; {env.get('cpu_count')} CPUs; "
        f"status: {data.get('status')}",
        f"- GPU: {env.get('gpu_name', 'none')}"
        + (
            f", {env.get('gpu_memory_gib')} GiB, compute capability {env.get('compute_capability')}, driver "
            f"{env.get('driver')}"
            if env.get("gpu_name")
            else ""
        ),
        f"- software: Python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
        f"NCCL {env.get('nccl', 'n/a')}, NVRx {env.get('nvrx')}",
        "",
        "| section | status | measured | target | verdict |",
        "|---|---|---|---|---|",
    ]
    sections = data.get("sections", {})
    for name in REPORT_ORDER:
        rec = sections.get(name)
        if rec is None:
            lines.append(f"| {TITLES[name]} | pending | | | |")
            continue
        r = rec.get("results") or {}
        try:
            measured, target, verdict = _measured(name, r)
        except (KeyError, TypeError, ValueError) as exc:
            measured, target, verdict = f"(incomplete: {exc})", "", ""
        status = rec.get("status", "?")
        if status == "skipped":
            measured = rec.get("skipped", "")
        cells = [TITLES[name], status, measured, target, verdict]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    notes = []
    for name in REPORT_ORDER:
        rec = sections.get(name) or {}
        r = rec.get("results") or {}
        if rec.get("error"):
            notes.append(f"- **{name}** error: {rec['error']}")
        for what, why in (r.get("skipped") or {}).items():
            notes.append(f"- {name}: skipped {what}: {why}")
        for item in r.get("not_exercised") or []:
            notes.append(f"- {name}: not exercised: {item}")
    if notes:
        lines += ["", "Errors, skips and limits:", ""] + notes
    return "\n".join(lines) + "\n"


# ---- command line ------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu-check", help="folder for gpu-check.json, gpu-check.md and gpu-check.log")
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU (gloo); CUDA-only items are skipped")
    p.add_argument("--tiny", action="store_true", help="the tiny preset and few steps instead of 1b / 125m")
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"time for the whole check (default {TOTAL_BUDGET_S} s, x{CPU_BUDGET_FACTOR} with --cpu); "
        "sections left without time are skipped",
    )
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak for MFU on a GPU this check does not know")
    p.add_argument("--work-dir", default="runs/gpu-check-work", help="scratch folder (checkpoints: ~30 GB on a GPU)")
    p.add_argument("--wheels-record", help=argparse.SUPPRESS)  # written by scripts/gpu-check's wheel install
    p.add_argument("--in-job-manifests", help=argparse.SUPPRESS)  # rendered ahead by scripts/gpu-wheels
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # a child process runs one section
    args = p.parse_args(argv)
    if args.cpu and not args.tiny and not args.section:
        p.error("--cpu needs --tiny: the GPU sizes (1b, 125m) would take hours on CPU; use --cpu --tiny")
    if args.budget_s is None:
        args.budget_s = TOTAL_BUDGET_S * (CPU_BUDGET_FACTOR if args.cpu else 1)
    if args.budget_s <= 0:
        p.error(f"--budget-s {args.budget_s:g}: must be positive")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops {args.peak_tflops:g}: must be positive (dense bf16 TFLOP/s of the GPU)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out}: is a file; name a folder")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.section:
        return run_child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
