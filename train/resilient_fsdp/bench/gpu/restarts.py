"""GPU check sections 3 to 5: in-process restart, in-job restart under ``ft_launcher``, and the exact
resume they are compared with. Each runs the trainer in processes of its own."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Optional

from ..recovery import fresh_dir
from .section import GPU_PLAN, Section, run_logged, step_losses, tail, train_run


# ---- section 5: exact resume (runs first of the three job sections: it is their reference) -----


def section_exact_resume(s: Section) -> None:
    p, r = s.plan, s.results
    fresh_dir(s.dir)
    straight = s.dir / "straight"
    resumed = s.dir / "resumed"
    a = train_run(s, straight, s.run_overrides(straight))
    (s.work / "reference.json").write_text(json.dumps({"params_sha256": a["params_sha256"]}))
    r.update(
        {
            "preset": p.small_preset,
            "steps": p.run_steps,
            "stopped_at": p.stop_step,
            "checkpoint_interval_steps": p.interval_steps,
            "checkpoint_mode": "async (NVRx)",
            "reference_params_sha256": a["params_sha256"],
        }
    )
    s.save()
    train_run(s, resumed, s.run_overrides(resumed) + [f"train.stop_at_step={p.stop_step}"])
    b = train_run(s, resumed, s.run_overrides(resumed))
    la, lb = step_losses(straight), step_losses(resumed)
    steps = sorted(set(la) & set(lb))
    diff = max(abs(la[k] - lb[k]) for k in steps)
    r.update(
        {
            "resumed_from_step": b["resumed_from_step"],
            "steps_compared": len(steps),
            "resumed_params_sha256": b["params_sha256"],
            "bitwise_equal": a["params_sha256"] == b["params_sha256"],
            "losses_equal": all(la[k] == lb[k] for k in steps),
            "max_abs_loss_diff": diff,
        }
    )
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
    r.update(
        {
            "repeat_bitwise_equal": c["params_sha256"] == a["params_sha256"],
            "run_to_run_max_abs_loss_diff": noise,
            "tolerance": 3 * noise,
            "tolerance_basis": "3x the largest loss difference between two uninterrupted runs of the same "
            "configuration on this machine (the non-determinism floor); resuming may add "
            "no more than that kind of rounding noise",
        }
    )
    r["within_tolerance"] = noise > 0 and diff <= 3 * noise
    r["verdict"] = (
        f"not bitwise; largest loss difference {diff:.3g} "
        + ("within" if r["within_tolerance"] else "OUTSIDE")
        + f" the tolerance {3 * noise:.3g}"
    )


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
    r.update(
        {
            "recovery_s": round(rec["recovery_s"], 3),
            "lost_steps": rec["lost_steps"],
            "layer_seen": rec["layer"],
            "load_s": (rec.get("phases_s") or {}).get("load_s"),
            "resumed_from_step": rec["resumed_from_step"],
            "restarts": summary.get("restarts"),
            "final_step": summary["final_step"],
            "params_sha256": summary["params_sha256"],
            "equal_to_fault_free": (summary["params_sha256"] == reference) if reference else None,
        }
    )
    if reference is None:
        r.setdefault("skipped", {})["equal_to_fault_free"] = "no reference: the exact_resume section did not finish"


def section_in_process(s: Section) -> None:
    from ...local.cluster.launcher import free_port

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
    r["exercised"] = [
        "NVRx inprocess.Wrapper caught the exception and restarted the training function in the same process",
        "the process group was aborted and destroyed, and a new one created in a fresh key space of NVRx's store",
        "the FSDP2 model was rebuilt and the newest committed checkpoint reloaded",
    ]
    r["not_exercised"] = [
        "a peer rank blocked in a collective being released by the abort: that needs a world "
        "of at least 2 (NCCL allows one rank per GPU)",
        "hang detection (soft/hard timeouts) and the health checks this project turns off",
    ]
    if s.cpu:
        r.setdefault("skipped", {})["nccl_abort"] = (
            "needs CUDA: gloo's abort was exercised instead; on a GPU the NCCL communicator is aborted"
        )
    else:
        r["exercised"].append("NCCL communicator abort (ProcessGroupNCCL.abort) and re-creation on the GPU")


def memory_restore_line(logs: Path) -> Optional[str]:
    """What the restarted rank's log says of its restore from memory, or None when it restored
    from elsewhere."""
    for log in sorted(logs.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "resumed from memory:" in line:
                return line[line.index("resumed from memory:") :]
    return None


def memory_slots_pinned(metrics: Path) -> Optional[bool]:
    """Whether every memory save of the run copied into page-locked slots (None: no memory save)."""
    seen = set()
    for line in metrics.read_text(errors="replace").splitlines() if metrics.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "memory_checkpoint" and record.get("error") is None:
            seen.add(record.get("pinned"))
    return None if not seen else seen == {True}


IN_JOB_MANIFESTS = "gpu-check-in-job.yaml"
"""The in-job section's job rendered ahead (``scripts/gpu-wheels``) for a GPU machine without the
chart extra: it travels beside the wheels."""


def in_job_flags(s_plan, cpu: bool, run_overrides: list[str]) -> list[str]:
    """``resilient-fsdp local`` flags of the in-job section: one pod of one rank, a SIGKILL of rank 0,
    memory checkpoints every step (the restart restores from the pod's memory)."""
    from ..recovery import COMMON

    memory = ["checkpoint.memory.interval_steps=1", "checkpoint.memory.replicas=0"]
    overrides = [
        o
        for o in run_overrides + COMMON + ["resilience.in_process.enabled=false", *memory]
        if not o.startswith("run_dir=")
    ]
    # values/dev-cpu.yaml's pod, on a one-GPU-per-rank instance type when on a GPU (the chart refuses
    # dist.device=cuda on instanceType=cpu); the trainer settings stay the other sections'.
    gpu = [] if cpu else ["--value=instanceType=g5.12xlarge"]
    return ["--nodes=1", "--nproc-per-node=1", f"--inject=sigkill@{s_plan.fault_step}:rank=0", *gpu] + [
        a for o in overrides for a in ("--set", o)
    ]


def section_in_job(s: Section) -> None:
    from ...checkpoint.writer.process import NVRX_VERSION

    p, r = s.plan, s.results
    fresh_dir(s.dir)
    fault = f"sigkill@{p.fault_step}:rank=0"
    r.update({"fault": fault, "nodes": 1, "nproc_per_node": 1, "preset": p.small_preset, "nvrx": NVRX_VERSION})
    # The pod the chart renders, run by the local cluster (processes on loopback: no root needed),
    # so ft_launcher, the node agent and their flags are exactly a pod's. Without the chart extra
    # (a GPU machine), the same job rendered ahead by scripts/gpu-wheels.
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        "--isolation=loopback",
        f"--run-dir={s.dir}",
        "--max-pod-recreations=0",
    ]
    carried = Path(s.args.in_job_manifests) if getattr(s.args, "in_job_manifests", None) else None
    if importlib.util.find_spec("helm_python") is None and carried is not None and carried.is_file():
        cmd += [f"--manifests={carried}"]
        r["rendered"] = f"ahead, by scripts/gpu-wheels ({carried.name})"
    else:
        cmd += in_job_flags(p, s.cpu, s.run_overrides(s.dir))
        r["rendered"] = "here, from charts/resilient-fsdp with values/dev-cpu.yaml"
    log = s.work / f"{s.name}-runs.log"
    code = run_logged(cmd, log, s.remaining() - 5)
    if code != 0:
        raise RuntimeError(f"the local job exited with code {code}: " + " | ".join(tail(log, 3)))
    _recovery_results(s, json.loads((s.dir / "summary.json").read_text()))
    if r["layer_seen"] != "in_job":
        raise RuntimeError(f"the fault was recovered by the {r['layer_seen']} layer, not in-job")
    restored = memory_restore_line(s.dir / "logs")
    r["restored_from_memory"] = restored is not None
    pinned = memory_slots_pinned(s.dir / "metrics.jsonl")
    if s.cpu:
        r.setdefault("skipped", {})["memory_slots_pinned"] = (
            "no CUDA: the slots are host memory the copy writes directly"
        )
    else:
        r["memory_slots_pinned"] = pinned
    if restored is not None:
        r["memory_restore"] = restored  # each phase of the load, its CPU time and the read-ahead's
    r["exercised"] = [
        f"the chart's pod command: the node agent (resilient_fsdp.resilience.agent) around ft_launcher "
        f"(NVRx {NVRX_VERSION}), hosting the rendezvous store as pod 0 does, with "
        + ("CPU (gloo)" if s.cpu else "CUDA (NCCL)")
        + " workers",
        "the rank's death detected, the "
        "node's workers respawned after a new rendezvous, training resumed from the pod's memory "
        "checkpoint, its optimizer state read ahead onto the "
        + ("CPU" if s.cpu else "GPU")
        + " while the new process built its model",
    ]
    r["not_exercised"] = [
        "several pods (one machine, one GPU): the local cluster's tests run them on CPU",
        "hang detection by section timeouts (a crash only)",
    ]


def render_in_job(dest: Path) -> Path:
    """Render the GPU in-job section's job for a machine without the chart extra (scripts/gpu-wheels)."""
    import argparse as _argparse

    from ...local import job as local_job
    from ...deploy.chart import render

    gpu = Section("in_job", _argparse.Namespace(cpu=False, tiny=False, work_dir="/fsx", budget_s=0.0))
    flags = in_job_flags(GPU_PLAN, False, gpu.run_overrides(Path("/fsx")))
    parser = _argparse.ArgumentParser()
    local_job.add_arguments(parser)
    args = parser.parse_args(flags + ["--run-dir", "/fsx"])
    values = local_job.chart_values(args, Path("/fsx"), "loopback", mount_path="/fsx")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(render(values, release=args.release).text())
    return dest


if __name__ == "__main__":  # scripts/gpu-wheels: python -m resilient_fsdp.bench.gpu.restarts DEST
    print(f"rendered the in-job section's job into {render_in_job(Path(sys.argv[1]))}")
