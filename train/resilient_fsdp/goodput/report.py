"""``resilient-fsdp report --run-dir DIR``: a run as a picture, and where its wall time went.

Reads what every run writes (``metrics.jsonl``, ``summary.json``, ``faults/``) and draws a PNG
timeline (steps, checkpoint stalls, each fault and the layer that recovered it, work trained
twice) beside a breakdown of the job's wall time: productive (``summary.json``'s ``productive_s``),
checkpoint stalls, lost work (from the step a recovery resumed from to the fault), recovery (from
the fault to the first step after the restore) and other (start-up, bookkeeping, shutdown).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ..config.errors import UsageError, writable_file
from ..resilience.ledger import FaultLedger
from ..resilience.accounting import read_records

LAYER_COLOURS = {"in_process": "tab:green", "in_job": "tab:orange", "job": "tab:red"}


# What the breakdown reads of summary.json; every finished run writes them.
SUMMARY_KEYS = ("job_wall_s", "productive_s", "goodput")


class ReportError(UsageError):
    """A run directory or an output path the report cannot use; the message names the flag."""


@dataclass
class RunData:
    run_dir: Path
    summary: dict
    records: list
    faults: list  # fired faults (ledger records, with t_fault)
    recoveries: dict  # fault key -> recovery record

    @property
    def t0(self) -> float:
        """The job's launch: ``summary.json``'s wall time counts from it up to the finish."""
        finishes = [r["t"] for r in self.records if r.get("event") == "finish"]
        if finishes and "job_wall_s" in self.summary:
            return finishes[-1] - float(self.summary["job_wall_s"])
        return min(r["t"] for r in self.records if "t" in r)


def load_run(run_dir: Path) -> RunData:
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    for path in (summary_path, metrics_path):
        if not path.exists():
            raise ReportError(
                f"--run-dir {run_dir}: {path.name} not found; give a finished run's directory "
                f"(the --run-dir given to `resilient-fsdp local` or `train`)"
            )
    try:
        summary = json.loads(summary_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(
            f"--run-dir {run_dir}: summary.json is not valid JSON ({exc}); the run did not finish "
            "writing it, or the file was edited: give a finished run's directory"
        ) from None
    if not isinstance(summary, dict):
        raise ReportError(
            f"--run-dir {run_dir}: summary.json holds {type(summary).__name__}, not the run's summary "
            "object; give a finished run's directory"
        )
    missing = [k for k in SUMMARY_KEYS if not isinstance(summary.get(k), (int, float))]
    if missing:
        raise ReportError(
            f"--run-dir {run_dir}: summary.json has no number for {', '.join(missing)}; give the "
            "directory of a run that finished (every finished run writes them)"
        )
    records = read_records(metrics_path)
    if not any(isinstance(r, dict) and isinstance(r.get("t"), (int, float)) for r in records):
        raise ReportError(f"--run-dir {run_dir}: metrics.jsonl holds no timed records; give a finished run's directory")
    ledger = FaultLedger(run_dir)
    return RunData(
        run_dir=run_dir, summary=summary, records=records, faults=ledger.fired(), recoveries=ledger.recoveries()
    )


def _step_end_time(records: list, step: int) -> float | None:
    """Wall time the given step completed in the timeline that counts (the kept records)."""
    times = [r["t"] for r in records if r.get("event") == "step" and r.get("step") == step]
    return times[0] if times else None


def breakdown(run: RunData) -> dict:
    """Seconds of the job's wall time per category (they add up to ``job_wall_s``)."""
    s = run.summary
    wall = float(s["job_wall_s"])
    productive = float(s["productive_s"])
    stalls = sum(float(r.get("stall_s", 0.0)) for r in run.records if r.get("event") == "checkpoint")
    lost = recovery = 0.0
    for fault in run.faults:
        rec = run.recoveries.get(fault["key"])
        if rec is None:
            continue
        recovery += float(rec["recovery_s"])
        resumed_at = _step_end_time(run.records, rec["resumed_from_step"]) if rec.get("resumed_from_step") else None
        if resumed_at is not None:
            lost += max(0.0, fault["t_fault"] - resumed_at)
    other = wall - productive - stalls - lost - recovery
    # The run's own goodput (resilience.accounting computed it): the report explains it, it
    # does not compute another.
    return {
        "wall_s": wall,
        "productive_s": productive,
        "checkpoint_stalls_s": stalls,
        "lost_work_s": lost,
        "recovery_s": recovery,
        "other_s": other,
        "goodput": float(s["goodput"]),
    }


def render_table(run: RunData, parts: dict) -> str:
    wall = parts["wall_s"] or 1.0
    rows = [
        ("productive", parts["productive_s"]),
        ("checkpoint stalls", parts["checkpoint_stalls_s"]),
        ("lost work", parts["lost_work_s"]),
        ("recovery", parts["recovery_s"]),
        ("other", parts["other_s"]),
    ]
    lines = [
        f"run {run.run_dir}: {run.summary.get('final_step')} steps, world size {run.summary.get('world_size')}, "
        f"{len(run.faults)} fault(s), restarts {run.summary.get('restarts')}",
        f"{'':<18} {'seconds':>9} {'share':>7}",
    ]
    lines += [f"{name:<18} {value:>9.2f} {value / wall:>7.1%}" for name, value in rows]
    lines.append(f"{'wall':<18} {parts['wall_s']:>9.2f} {'':>7}")
    lines.append(f"goodput {parts['goodput']:.4f} (summary.json's: productive / wall)")
    for fault in run.faults:
        rec = run.recoveries.get(fault["key"])
        if rec:
            lines.append(
                f"  {fault['fault']:<32} {rec['layer']:<10} recovery {rec['recovery_s']:.2f} s, "
                f"{rec['lost_steps']} step(s) trained again"
            )
        else:
            lines.append(f"  {fault['fault']:<32} not recovered")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display here or in a pod)."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError(
            "plots need matplotlib: pip install 'resilient-fsdp[report]' "
            "(with -c constraints.txt for the pinned version)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(run: RunData, parts: dict, path: Path) -> None:
    plt = pyplot()

    t0 = run.t0
    steps = [r for r in run.records if r.get("event") == "step"]
    ckpts = [r for r in run.records if r.get("event") == "checkpoint"]
    fig, (ax, bar) = plt.subplots(2, 1, figsize=(10, 6.5), gridspec_kw={"height_ratios": [4, 1]})
    ax.plot(
        [r["t"] - t0 for r in steps],
        [r["step"] for r in steps],
        ".",
        markersize=2,
        color="tab:blue",
        label="step completed",
    )
    if ckpts:
        ax.plot(
            [r["t"] - t0 for r in ckpts],
            [r["step"] for r in ckpts],
            "|",
            markersize=12,
            color="black",
            label="checkpoint committed",
        )
        for r in ckpts:  # the stall ends when the save returns; draw it before the commit mark
            ax.axvspan(r["t"] - t0 - r.get("stall_s", 0.0), r["t"] - t0, color="grey", alpha=0.25, lw=0)
    seen = set()
    for fault in run.faults:
        tf = fault["t_fault"] - t0
        ax.axvline(tf, color="crimson", ls="--", lw=1)
        ax.annotate(
            fault["fault"], (tf, ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=7, color="crimson"
        )
        rec = run.recoveries.get(fault["key"])
        if not rec:
            continue
        layer = rec["layer"]
        ax.axvspan(
            tf,
            tf + rec["recovery_s"],
            color=LAYER_COLOURS.get(layer, "tab:purple"),
            alpha=0.3,
            lw=0,
            label=None if layer in seen else f"recovery ({layer})",
        )
        seen.add(layer)
        resumed_at = _step_end_time(run.records, rec["resumed_from_step"]) if rec.get("resumed_from_step") else None
        if resumed_at is not None:
            ax.axvspan(
                resumed_at - t0,
                tf,
                ymin=0,
                ymax=0.05,
                color="crimson",
                alpha=0.6,
                lw=0,
                label=None if "lost" in seen else "work trained again",
            )
            seen.add("lost")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("step")
    ax.set_title(f"{run.run_dir.name}: goodput {parts['goodput']:.3f}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)

    names = ["productive", "checkpoint stalls", "lost work", "recovery", "other"]
    keys = ["productive_s", "checkpoint_stalls_s", "lost_work_s", "recovery_s", "other_s"]
    colours = ["tab:blue", "grey", "crimson", "tab:orange", "lightgrey"]
    left = 0.0
    wall = parts["wall_s"] or 1.0
    for name, key, colour in zip(names, keys, colours):
        share = max(parts[key], 0.0) / wall
        bar.barh(0, share, left=left, color=colour, label=f"{name} {share:.1%}")
        left += share
    bar.set_xlim(0, max(1.0, left))
    bar.set_yticks([])
    bar.set_xlabel("share of wall time")
    bar.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.6))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="a run's timeline (PNG) and goodput breakdown", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--run-dir", required=True, help="a finished run's directory")
    p.add_argument("--out", help="PNG path (default RUN_DIR/report.png)")
    p.add_argument("--json", help="also write the breakdown as JSON here")
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    run = load_run(run_dir)
    out = writable_file("--out", Path(args.out) if args.out else run_dir / "report.png")
    json_out = writable_file("--json", Path(args.json)) if args.json else None
    parts = breakdown(run)
    print(render_table(run, parts))
    plot(run, parts, out)
    print(f"timeline: {out}")
    if json_out:
        json_out.write_text(json.dumps(parts, indent=2, sort_keys=True) + "\n")
    return 0
