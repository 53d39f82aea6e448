"""The values profiles' restart settings, from the advisor, and the docs' table of profiles.

Each GPU profile in ``values/`` carries one ``# advise: FLAGS`` line: the advisor's inputs, all of
them facts of the profile (instance type, nodes, model, storage) or of the planned run (hours,
step and restart times). The comment block above it is the advisor's arithmetic for those
inputs, generated here, and the profile's values are the advisor's values; the tests hold both
to the advisor. ``python -m resilient_fsdp.goodput.profiles`` rewrites the blocks after the
advisor's rules change (the values themselves are edited by hand, where the tests point), and the
table of profiles in docs/eks-helm.md from the profiles themselves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from . import advise as adv
from . import model as gm
from . import settings

VALUES_DIR = Path(__file__).resolve().parents[3] / "values"
BLOCK_START = "# Restart settings:"
ADVISE_PREFIX = "# advise:"


def advise_line(text: str) -> str:
    """The profile's one ``# advise:`` line; raises ValueError when there is not exactly one."""
    lines = [ln for ln in text.splitlines() if ln.startswith(ADVISE_PREFIX)]
    if len(lines) != 1:
        raise ValueError(f"needs exactly one '{ADVISE_PREFIX} ...' line with the advisor's inputs, found {len(lines)}")
    return lines[0]


def advice_for(line: str) -> settings.Advice:
    """The advisor's answer for an ``# advise:`` line."""
    args = adv.parse_advise_line(line)
    if args is None:
        raise ValueError(f"not an advise line: {line!r}")
    return settings.advise(adv.inputs_from_args(args))


def header_block(line: str) -> list[str]:
    """The comment block that explains the settings of ``line``'s inputs, ending with ``line``."""
    a = advice_for(line)
    i, g = a.inputs, a.goodput
    gpus = i.nodes * i.gpus_per_node
    if i.mtbf_source.startswith("given"):
        rate = [
            f"#   failure rate: node MTBF {i.node_mtbf_hours:,.0f} h (given);",
            f"#     job MTBF M = {i.node_mtbf_hours:,.0f} h / {i.nodes} nodes = {a.job_mtbf_s / gm.HOUR:,.0f} h.",
        ]
    else:
        per_gpu_hour = _scientific(1 / gm.llama3_gpu_mtbf_hours())
        rate = [
            f"#   failure rate: Llama 3's {gm.LLAMA3_INTERRUPTIONS} interruptions on {gm.LLAMA3_GPUS:,} GPUs in "
            f"{gm.LLAMA3_DAYS} days = {per_gpu_hour} per GPU-hour;",
            f"#     job MTBF M = 1 / ({per_gpu_hour} x {gpus:,} GPUs) = {a.job_mtbf_s / gm.HOUR:,.0f} h.",
        ]
    if i.estimate is not None:
        first, *rest = i.estimate.explain()
        checkpoint = [f"#   checkpoint: {first};", *(f"#     {r};" for r in rest)]
        checkpoint[-1] = checkpoint[-1][:-1] + "."
    else:
        sources = dict(i.cost_sources)
        checkpoint = [
            f"#   checkpoint: stall delta {i.ckpt_stall_s:.3g} s ({sources['ckpt_stall_s']}), write W "
            f"{i.ckpt_write_s:.4g} s ({sources['ckpt_write_s']})."
        ]
    return [
        f"{BLOCK_START} the advisor's for the inputs on the `{ADVISE_PREFIX}` line below",
        "# (`resilient-fsdp advise FLAGS --values` prints them; python -m resilient_fsdp.goodput.profiles",
        "# rewrites this block, and the tests fail when it or the values drift from the advisor):",
        *rate,
        f"#   planned run {i.job_hours:g} h -> expected failures F = {i.job_hours:g} / "
        f"{a.job_mtbf_s / gm.HOUR:,.0f} = {a.expected_failures:.2f}.",
        *checkpoint,
        f"#   -> Daly interval {a.daly_s:,.0f} s -> checkpoint.interval_s {a.interval_s} (rounded down, "
        f"<= {settings.MAX_INTERVAL_S:,} s, >= W);",
        f"#     max_restarts = backoffLimit = max({settings.RESTART_LIMIT_FLOOR}, {settings.RESTART_QUANTILE:.0%} Poisson "
        f"quantile of F) = {a.max_restarts} (one event spends at most one of each);",
        f"#     workload.jobSet.maxRestarts {a.jobset_max_restarts}: (1 + {a.jobset_max_restarts}) x (1 + "
        f"{a.backoff_limit}) = {(1 + a.jobset_max_restarts) * (1 + a.backoff_limit)} counted failures in all;",
        f"#     step/out-of-section {a.step_timeout_s} s, checkpoint {a.checkpoint_timeout_s} s, init "
        f"{a.init_timeout_s} s ({settings.SAFETY:g} x what each covers, floors);",
        f"#     dist.timeout_s {a.dist_timeout_s} = step - {settings.DUMP_MARGIN_S:g} s (NCCL dumps before a kill);",
        f"#     expected goodput {g['productive']:.4f} (restart R {i.restart_s:g} s, step {i.step_s:g} s, "
        f"start-up {i.startup_s:g} s).",
        *_memory_lines(a),
        *_spare_lines(a),
        line,
    ]


def _memory_lines(a: settings.Advice) -> list[str]:
    """With ``--memory`` on the advise line: the memory tier's interval and ``/dev/shm``."""
    m, mi = a.memory, a.inputs.memory
    if m is None:
        return []
    slots = 2 * (1 + mi.replicas)
    shm = (
        f"shm.sizeLimit {m['shm_gib']}Gi = ({slots} slots + the durable staging copy) x shard "
        f"{mi.shard_gb:.3g} GB x {a.inputs.gpus_per_node} ranks + {settings.SHM_MARGIN_GIB}Gi"
        if m["shm_gib"] is not None
        else "shm.sizeLimit: no model size to size it"
    )
    return [
        f"#   memory tier, covering {mi.coverage:.0%} of failures: the durable checkpoint serves the rest, "
        f"M / (1 - coverage) -> Daly",
        f"#     {m['durable_daly_s']:,.0f} s -> checkpoint.interval_s {m['durable_interval_s']} (rounded as above); its "
        f"stall {mi.stall_s:.3g} s and M / coverage -> Daly",
        f"#     {m['daly_s']:,.0f} s -> checkpoint.memory.interval_steps {m['interval_steps']} "
        f"(whole steps, at most the durable interval), replicas {mi.replicas};",
        f"#     {shm}; expected goodput {m['goodput']['productive']:.4f}.",
    ]


def _spare_lines(a: settings.Advice) -> list[str]:
    """With ``--spares`` on the advise line: the hot spares, their arithmetic and what they cost."""
    s = a.spares
    if s is None:
        return []
    return [
        f"#   hot spares -> spares {s['count']}:",
        *(f"#     {line};" for line in s["explain"][:-1]),
        f"#     {s['explain'][-1]}.",
    ]


def _scientific(x: float) -> str:
    """``2.19e-5``: three significant digits, the exponent without padding."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def block_span(lines: list[str]) -> tuple[int, int]:
    """(first, last) line index of the generated block in a profile's lines."""
    end = next(n for n, ln in enumerate(lines) if ln.startswith(ADVISE_PREFIX))
    start = next((n for n in range(end, -1, -1) if lines[n].startswith(BLOCK_START)), None)
    if start is None:
        raise ValueError(f"no '{BLOCK_START}' line above the advise line")
    return start, end


def rewrite(path: Path) -> bool:
    """Regenerate ``path``'s block; True when the file changed."""
    text = path.read_text()
    lines = text.splitlines()
    start, end = block_span(lines)
    new = lines[:start] + header_block(lines[end]) + lines[end + 1 :]
    updated = "\n".join(new) + ("\n" if text.endswith("\n") else "")
    if updated != text:
        path.write_text(updated)
    return updated != text


def profile_row(path: Path) -> str:
    """One profile as the docs' table shows it, read from the profile over the chart's defaults."""
    import yaml

    from ..deploy.chart import chart_dir, deep_merge

    values = deep_merge(yaml.safe_load((chart_dir() / "values.yaml").read_text()), yaml.safe_load(path.read_text()))
    instance = values["instanceType"]
    kind = values["instanceTypes"][instance]
    trainer = values.get("trainer", {})
    pods = f"{values['nodes']} + {values['spares']} spare" if values["spares"] else str(values["nodes"])
    if kind["gpus"]:
        efa = values["efa"]["enabled"]
        efa_on = efa is True or (efa == "auto" and kind["efa"] > 0 and values["nodes"] > 1)
        per_pod = f"{values.get('gpusPerNode') or kind['gpus']} GPUs" + (f", {kind['efa']} EFA" if efa_on else "")
    else:
        per_pod = f"{values['cpuRanksPerNode']} CPU ranks"
    checkpoint = trainer.get("checkpoint", {})
    every = (
        f"{checkpoint['interval_s']:,} s"
        if checkpoint.get("interval_s")
        else f"{checkpoint.get('interval_steps', 0)} steps"
    )
    storage = values["storage"]
    if storage["type"] == "fsx":
        fsx = storage["fsx"]
        rate = "200" if fsx["deploymentType"] == "SCRATCH_2" else f"{fsx['perUnitStorageThroughput']}"
        where = f"FSx {fsx['deploymentType']} {storage['size']} ({rate} MB/s/TiB)"
    else:
        where = storage["type"]
    budget = (
        f"{trainer['resilience']['launcher']['max_restarts']} / {values['job']['backoffLimit']} / "
        f"{values['workload']['jobSet']['maxRestarts']}"
    )
    return (
        f"| `{path.stem}` | {pods} x {instance} ({per_pod} each) | {trainer['model']['preset']} | {every} | "
        f"{budget} | {where} |"
    )


TABLE_START = "<!-- profiles: python -m resilient_fsdp.goodput.profiles writes this table -->"
TABLE_END = "<!-- end of profiles -->"
TABLE_HEAD = [
    "| profile | pods x instance | model | checkpoint every | `max_restarts` / `backoffLimit` / "
    "`jobSet.maxRestarts` | storage |",
    "|---|---|---|---|---|---|",
]


def profile_table(values_dir: Path = VALUES_DIR) -> list[str]:
    """The table of every profile in ``values_dir``, between its markers."""
    rows = [profile_row(p) for p in sorted(values_dir.glob("*.yaml"))]
    return [TABLE_START, *TABLE_HEAD, *rows, TABLE_END]


def rewrite_table(page: Path) -> bool:
    """Regenerate the profile table in ``page``; True when it changed."""
    text = page.read_text()
    lines = text.splitlines()
    start, end = lines.index(TABLE_START), lines.index(TABLE_END)
    updated = "\n".join(lines[:start] + profile_table() + lines[end + 1 :]) + "\n"
    if updated != text:
        page.write_text(updated)
    return updated != text


DOCS_PAGE = VALUES_DIR.parent / "docs" / "eks-helm.md"


def advised_profiles(values_dir: Path = VALUES_DIR) -> list[Path]:
    """The profiles set by the advisor: every values file with an advise line."""
    return sorted(p for p in values_dir.glob("*.yaml") if ADVISE_PREFIX in p.read_text())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m resilient_fsdp.goodput.profiles",
        description="Rewrite each values profile's restart-settings block.",
    )
    parser.parse_args(argv)
    for path in advised_profiles():
        print(f"{'rewrote' if rewrite(path) else 'unchanged'} {path}")
    print(f"{'rewrote' if rewrite_table(DOCS_PAGE) else 'unchanged'} the profile table in {DOCS_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
