"""GPU check sections 3 to 5: in-process restart, in-job restart under ``ft_launcher``, and the exact
resume they are compared with. Each runs the trainer in processes of its own."""

from __future__ import annotations

import json
import time
from typing import Optional

from ..recovery import fresh_dir
from .section import Section, run_logged, step_losses, tail, train_run


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
    from ...local.launcher import free_port

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
    from ..recovery import COMMON
    from ...config import load_config
    from ...local.launcher import LocalJob, agent_command, free_port, write_ft_config
    from ...checkpoint.nvrx import NVRX_VERSION
    from ...resilience.accounting import JOB_START_ENV
    from ...resilience.nvrx import QUIET_WARNINGS, RDZV_STORE_IN_NODE, RDZV_STORE_OUTSIDE

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
    r["exercised"] = [f"ft_launcher (NVRx {NVRX_VERSION}) under the node wrapper (resilient_fsdp.resilience.agent), "
                      "as a pod runs "
                      "it, hosting its own rendezvous store, with " + ("CPU (gloo)" if s.cpu else "CUDA (NCCL)")
                      + " workers", "the rank's death detected, the node's workers respawned after a new "
                      "rendezvous, training resumed from the newest committed async checkpoint"]
    r["not_exercised"] = ["several nodes (one machine, one GPU), and the local launcher's external rendezvous "
                          "store (NVRx 0.4 only)", "hang detection by section timeouts (a crash only)"]
