"""The advisor's output: :class:`~.settings.Advice` as the printed table or as a chart values snippet.

Each row of :func:`render_table` shows a setting with the rule and the inputs that gave it;
:func:`render_values` is the ``--values`` output, keys limited to those that act under the chart's
``workload.kind``. Used by ``resilient-fsdp advise`` (:mod:`.advise`) and the values profiles.
"""

from __future__ import annotations

from dataclasses import asdict

import yaml

from ..config import DUMP_MARGIN_S
from . import costs as gc
from . import model as gm
from .settings import (
    BACKOFF_LIMIT_MEANING,
    CHECKPOINT_TIMEOUT_FLOOR_S,
    INIT_TIMEOUT_FLOOR_S,
    MAX_INTERVAL_S,
    RESTART_LIMIT_FLOOR,
    RESTART_QUANTILE,
    SAFETY,
    SHM_MARGIN_GIB,
    SPARE_MISS_TARGET,
    STEP_TIMEOUT_FLOOR_S,
    Advice,
)


def render_table(a: Advice, kind: str = "PyTorchJob") -> str:
    i = a.inputs
    g = a.goodput
    source = dict(i.cost_sources) or {"ckpt_stall_s": "given", "ckpt_write_s": "given", "restart_s": "given"}
    rows = [
        ("cluster", f"{i.nodes} x {i.instance} ({i.nodes * i.gpus_per_node} GPUs)"),
        ("node MTBF", f"{i.node_mtbf_hours:,.0f} h ({i.mtbf_source})"),
        ("job MTBF M", f"{a.job_mtbf_s / gm.HOUR:,.1f} h = node MTBF / {i.nodes} nodes"),
        ("expected failures", f"{a.expected_failures:.2f} over {i.job_hours:g} h"),
        (
            "checkpoint costs",
            f"stall delta {i.ckpt_stall_s:.3g} s ({source['ckpt_stall_s']}), write W "
            f"{i.ckpt_write_s:.4g} s ({source['ckpt_write_s']}); restart R {i.restart_s:g} s "
            f"({source['restart_s']})",
        ),
        *(("  estimate", line) for line in (i.estimate.explain() if i.estimate else [])),
        *((("  storage", slow),) if (slow := _slow_storage_note(a)) else ()),
        *((("dist.shard_group_size", hsdp),) if (hsdp := _shard_group_note(a)) else ()),
        ("Young sqrt(2 delta M)", f"{a.young_s:,.0f} s"),
        ("Daly", f"{a.daly_s:,.0f} s"),
        ("checkpoint.interval_s", f"{a.interval_s} (Daly, rounded down, at most {MAX_INTERVAL_S}; never below W)"),
        (
            "expected goodput",
            f"{g['productive']:.4f}: stalls {g['checkpoint_stalls']:.4f}, lost work "
            f"{g['lost_work']:.4f}, restarts {g['restarts']:.4f}",
        ),
        ("step_timeout_s", f"{a.step_timeout_s} = max({STEP_TIMEOUT_FLOOR_S:g}, {SAFETY:g} x step {i.step_s:g} s)"),
        (
            "checkpoint_timeout_s",
            f"{a.checkpoint_timeout_s} = max({CHECKPOINT_TIMEOUT_FLOOR_S:g}, {SAFETY:g} x (delta + W))",
        ),
        (
            "init_timeout_s",
            f"{a.init_timeout_s} = max({INIT_TIMEOUT_FLOOR_S:g}, {SAFETY:g} x (start-up {i.startup_s:g} s + load ~W))",
        ),
        (
            "out_of_section_timeout_s",
            f"{a.out_of_section_timeout_s} = step_timeout_s (heartbeats are off: sections cover the loop)",
        ),
        (
            "dist.timeout_s",
            f"{a.dist_timeout_s} = step_timeout_s - {DUMP_MARGIN_S:g} (NCCL times a hung collective "
            "out and dumps its flight recorder before ft_launcher kills the rank)",
        ),
        (
            "max_restarts / backoffLimit",
            f"{a.max_restarts} / {a.backoff_limit} = max({RESTART_LIMIT_FLOOR}, "
            f"Poisson({a.expected_failures:.2f}) {RESTART_QUANTILE:.0%} quantile)",
        ),
        (f"backoffLimit ({kind})", BACKOFF_LIMIT_MEANING[kind]),
        (
            "workload.jobSet.maxRestarts",
            f"{a.jobset_max_restarts}: whole-JobSet restarts after backoffLimit, "
            f"{(1 + a.jobset_max_restarts) * (1 + a.backoff_limit)} counted failures in all "
            "(JobSet and TrainJob)",
        ),
    ]
    if a.memory is not None:
        m, mi = a.memory, i.memory
        gm_ = m["goodput"]
        rows += [
            (
                "memory tier costs",
                f"stall {mi.stall_s:.3g} s, restart from memory {mi.restart_s:.3g} s, covering "
                f"{mi.coverage:.0%} of failures ({mi.coverage_source})",
            ),
            (
                "checkpoint.interval_s with it",
                f"{m['durable_interval_s']} (Daly for delta and the failures it leaves to "
                f"the durable checkpoint, M / (1 - coverage): {m['durable_daly_s']:,.0f} s, "
                f"rounded down, at most {MAX_INTERVAL_S}; never below the durable-only "
                f"{a.interval_s})",
            ),
            (
                "checkpoint.memory.interval_steps",
                f"{m['interval_steps']} ({m['interval_s']:g} s; Daly for the memory "
                f"stall and M / coverage: {m['daly_s']:,.0f} s, in whole steps, at "
                "most the durable interval)",
            ),
            (
                "goodput with memory",
                f"{gm_['productive']:.4f} (without: {g['productive']:.4f}): stalls "
                f"{gm_['checkpoint_stalls']:.4f}, lost work {gm_['lost_work']:.4f}, restarts "
                f"{gm_['restarts']:.4f}",
            ),
            (
                "shm.sizeLimit",
                f"{m['shm_gib']}Gi = ({2 * (1 + mi.replicas)} slots (own{' and a peer' if mi.replicas else ''}"
                f"'s) + the durable staging copy) x shard x {i.gpus_per_node} GPUs + {SHM_MARGIN_GIB}Gi"
                if m["shm_gib"] is not None
                else "n/a (no model size: pass --preset or --params)",
            ),
        ]
    rows += _slow_and_silent_rows(a)
    if a.spares is not None:
        rows += _spare_rows(a)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# resilience.sdc: a check every 100 steps.
SDC_INTERVAL_STEPS = 100
SDC_CHECK_COST = 0.001  # of a step: assumed, the order docs/benchmarks.md measures


def _slow_and_silent_rows(a: Advice) -> list[tuple[str, str]]:
    """Stragglers and silent corruption, the classes no restart sees, at published rates: what
    they cost unmitigated and with ``resilience.stragglers`` (replace) and ``resilience.sdc``."""
    i = a.inputs
    check_s = SDC_INTERVAL_STEPS * i.step_s
    c = gm.slow_and_silent(
        a.job_mtbf_s,
        find_s=gm.STRAGGLER_FIND_S,
        replace_s=i.restart_s + gm.SPARE_JOIN_S,
        check_interval_s=check_s,
        check_cost=SDC_CHECK_COST,
        rollback_s=check_s + i.restart_s,
        job_restart_s=i.restart_s,
    )
    hsdp = "" if i.shard_group else " (needs HSDP: --shard-group-size)"
    return [
        (
            "stragglers",
            f"{c.stragglers_unmitigated:.1%} of wall time unmitigated ({gm.STRAGGLER_SOURCE}; "
            f"assumed {gm.STRAGGLER_EPISODE_H:g} h episodes at {gm.STRAGGLER_SLOWDOWN:g}x) -> "
            f"{c.stragglers_replaced:.1%} with resilience.stragglers.action=replace and a standby pod "
            f"(found in {gm.STRAGGLER_FIND_S:g} s)",
        ),
        (
            "silent data corruption",
            f"{c.sdc_unchecked:.2%} unchecked ({gm.SDC_SOURCE}; assumed "
            f"{gm.SDC_UNNOTICED_H:g} h trained on it before it shows) -> {c.sdc_checked:.2%} "
            f"with resilience.sdc.interval_steps={SDC_INTERVAL_STEPS}{hsdp}",
        ),
    ]


def _spare_rows(a: Advice) -> list[tuple[str, str]]:
    s, n = a.spares, a.inputs.nodes
    why = (
        "given"
        if not s["recommended"]
        else "none: at this size a spare costs more node-hours than it saves"
        if not s["count"]
        else f"the fewest leaving <= {SPARE_MISS_TARGET:.0%} of node losses without one"
    )
    b = s["breakdown"]
    rows = [
        ("spares", f"{s['count']} ({why}; P(a node loss finds none free) = {s['p_no_spare']:.2g})"),
        *(("  spares", line) for line in s["explain"]),
        (
            "goodput with spares",
            f"{s['goodput']:.4f} (without: {s['goodput_without']:.4f}, node losses "
            f"{s['node_loss_share']:.0%} of failures at the job-level {s['job_restart_s']:g} s; "
            f"the expected goodput above charges every failure R {a.inputs.restart_s:g} s)",
        ),
    ]
    if s["goodput_memory"] is not None:
        rows.append(
            (
                "goodput with memory and spares",
                f"{s['goodput_memory']:.4f} (without spares: {s['goodput_memory_without']:.4f})",
            )
        )
    rows.append(
        (
            "goodput per paid node-hour",
            f"{s['goodput_per_paid_node_hour']:.4f} (x {n} / {n + s['count']} "
            f"nodes paid); the training nodes' time lost: stalls "
            f"{b['checkpoint_stalls']:.4f}, lost work {b['lost_work']:.4f}, "
            f"restarts {b['restarts']:.4f}",
        )
    )
    return rows


def _shard_group_note(a: Advice) -> str:
    """The shard group given, or the one suggested when FSDP's commit is long."""
    i = a.inputs
    if i.shard_group:
        return f"{i.shard_group} (given: HSDP, {i.nodes * i.gpus_per_node // i.shard_group} replicas of the state)"
    if i.suggested_shard_group is None:
        return ""
    e, group = i.estimate, i.suggested_shard_group
    hsdp = gc.estimate(e.params, e.gpus, i.instance, e.storage, group)
    return (
        f"0 (FSDP over all {e.gpus} GPUs: rank 0's commit takes {e.commit_s:,.0f} s before each checkpoint is "
        f"durable); HSDP over {group} GPUs ({group // i.gpus_per_node} pods, the fewest whose share of the state "
        f"fits in {gc.STATE_SHARE_OF_GPU:.0%} of a GPU) commits in {hsdp.commit_s:.3g} s: "
        f"--shard-group-size {group}"
    )


def _slow_storage_note(a: Advice) -> str:
    """What the estimated storage needs when its write time, not Daly, sets the interval."""
    e = a.inputs.estimate
    if e is None or a.inputs.ckpt_write_s <= a.daly_s or dict(a.inputs.cost_sources).get("ckpt_write_s") != "estimated":
        return ""
    need = gc.capacity_for(e.state_gb, a.daly_s, e.storage.mb_s_per_tib)
    return (
        f"W is longer than Daly's interval, so the interval waits for the write: storage.size {need}Gi at "
        f"{e.storage.mb_s_per_tib:g} MB/s/TiB writes it within {a.daly_s:,.0f} s (--storage-size, "
        "--storage-throughput)"
    )


def values_for_kind(values: dict, kind: str) -> dict:
    """``values`` (every key the advisor derives) with only the keys that act under ``kind``: a
    PyTorchJob has no JobSet to restart (``workload.jobSet``); another kind is named, so that the
    snippet selects it."""
    out = {k: v for k, v in values.items() if k != "workload"}
    if kind != "PyTorchJob":
        out["workload"] = {"kind": kind, **values.get("workload", {})}
    return out


def render_values(a: Advice, kind: str = "PyTorchJob") -> str:
    i = a.inputs
    header = (
        f"# resilient-fsdp advise --instance {i.instance} --nodes {i.nodes} --job-hours {i.job_hours:g} "
        f"--ckpt-stall-s {i.ckpt_stall_s:.3g} --ckpt-write-s {i.ckpt_write_s:.4g} --restart-s {i.restart_s:g} "
        f"--step-s {i.step_s:g} --startup-s {i.startup_s:g}"
        + (
            f" --spares {a.spares['count']} --replacement-s {a.spares['replacement_s']:g} --job-restart-s "
            f"{a.spares['job_restart_s']:g} --node-loss-share {a.spares['node_loss_share']:g}"
            if a.spares is not None
            else ""
        )
        + "\n"
        + "".join(f"#   spares: {line}\n" for line in (a.spares["explain"] if a.spares is not None else []))
        + "".join(f"#   estimated {line}\n" for line in (i.estimate.explain() if i.estimate else []))
        + f"# job.backoffLimit with workload.kind={kind}: {BACKOFF_LIMIT_MEANING[kind]}\n"
    )
    return header + yaml.safe_dump(values_for_kind(a.values(), kind), sort_keys=False)


def as_json(a: Advice) -> dict:
    return {**asdict(a), "values": a.values()}
