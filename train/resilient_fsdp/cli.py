"""The ``resilient-fsdp`` command: one parser over every subcommand, and its error handling.

Each subcommand's parser comes from the module that runs it (``add_parser``); ``resilient-fsdp
--help`` lists them. A usage or configuration mistake prints ``error: ...`` naming the flag or key,
and the subcommand's usage for a parse error, and exits 2; a bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional

from .config import ConfigError, describe, dump_yaml, load_config
from .train.arguments import add_config_arguments, add_run_arguments

CHART_YAML = Path(__file__).resolve().parents[2] / "charts" / "resilient-fsdp" / "Chart.yaml"


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, with a mistake reported by the (sub)command it belongs to.

    argparse reports arguments no subcommand took with the top-level usage; here the innermost
    parser that ran reports them, with its own usage (exit 2 either way)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_parser"):  # the innermost parser returns first
            setattr(namespace, "_parser", self)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            getattr(namespace, "_parser", self).error(f"unrecognized arguments: {' '.join(extras)}")
        vars(namespace).pop("_parser", None)
        return namespace


def versions() -> str:
    """This package's, NVRx's, torch's and the chart's versions, one line each."""
    from importlib import metadata

    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    chart = "not found"
    if CHART_YAML.is_file():
        import yaml

        meta = yaml.safe_load(CHART_YAML.read_text())
        chart = f"{meta.get('version')} (appVersion {meta.get('appVersion')})"
    return (
        f"resilient-fsdp {installed('resilient-fsdp')}\nnvidia-resiliency-ext {installed('nvidia-resiliency-ext')}\n"
        f"torch {installed('torch')}\nchart {chart}"
    )


class _VersionAction(argparse.Action):
    """``--version``: reads the versions only when asked (no torch import for other commands)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="resilient-fsdp", description="Fault-tolerant FSDP2 training with NVRx.")
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the versions of resilient-fsdp, NVRx, torch and the chart, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    local = sub.add_parser(
        "local",
        help="run the chart's job on this machine: one pod per simulated node",
        description="Render the Helm chart (values/dev-cpu.yaml unless -f) and run its pods on "
        "this machine: each a network namespace (root) or processes on loopback, "
        "running the rendered command, with the operator's variables and restart "
        "policy (docs/local-runs.md).",
    )
    from .local.job import add_arguments as add_local_arguments

    add_local_arguments(local)

    train = sub.add_parser("train", help="run one trainer process (a world of one without a launcher)")
    add_config_arguments(train)
    add_run_arguments(train)

    bench = sub.add_parser("bench", help="benchmarks (results go in docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_name", required=True, metavar="BENCHMARK")
    from .bench.checkpoint import add_parser as add_checkpoint_bench
    from .bench.recovery import add_parser as add_recovery_bench
    from .bench.s3 import add_parser as add_s3_bench
    from .bench.campaign import add_parser as add_campaign_bench
    from .bench.soak import add_parser as add_soak_bench
    from .bench.scale import add_parser as add_scale_bench
    from .bench.slow_and_silent import add_parser as add_slow_and_silent_bench
    from .checkpoint.commands import add_parser as add_checkpoints

    add_checkpoint_bench(bench_sub)
    add_recovery_bench(bench_sub)
    add_soak_bench(bench_sub)
    add_campaign_bench(bench_sub)
    add_s3_bench(bench_sub)
    add_scale_bench(bench_sub)
    add_slow_and_silent_bench(bench_sub)

    add_checkpoints(sub, add_config_arguments)

    from .data.commands import add_parser as add_data_parser

    add_data_parser(sub)

    config = sub.add_parser("config", help="print the resolved configuration")
    config.add_argument("--describe", action="store_true", help="list every key with its default and meaning")
    add_config_arguments(config)

    from .deploy.chart import add_parser as add_render_parser
    from .deploy.validate import add_parser as add_validate_parser

    add_render_parser(sub)
    add_validate_parser(sub)

    from .goodput.advise import add_parser as add_advise_parser
    from .goodput.report import add_parser as add_report_parser
    from .goodput.simulate import add_parser as add_simulate_parser

    add_advise_parser(sub)
    add_report_parser(sub)
    add_simulate_parser(sub)
    return parser


def cmd_local(args: argparse.Namespace) -> int:
    from .local.job import main as run_local

    return run_local(args)


def cmd_train(args: argparse.Namespace) -> int:
    from .train import entrypoint

    argv = (["--config", args.config] if args.config else []) + [a for o in args.overrides for a in ("--set", o)]
    argv += ["--run-dir", args.run_dir] if args.run_dir else []
    argv += [a for spec in args.inject for a in ("--inject", spec)]
    return entrypoint.main(argv)


def cmd_config(args: argparse.Namespace) -> int:
    if args.describe:
        print(describe(), end="")
    else:
        print(dump_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    # torch prints this deprecation notice on import when NVRx's pynvml dependency is present.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has printed
        return exc.code if isinstance(exc.code, int) else 2
    from .checkpoint.commands import run as cmd_checkpoints

    handler = {
        "local": cmd_local,
        "train": cmd_train,
        "config": cmd_config,
        "bench": lambda a: a.bench(a),
        "checkpoints": cmd_checkpoints,
        "data": lambda a: a.run(a),
        "render": lambda a: a.run(a),
        "validate": lambda a: a.run(a),
        "advise": lambda a: a.run(a),
        "report": lambda a: a.run(a),
        "simulate": lambda a: a.run(a),
    }[args.command]
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
