"""The ``resilient-fsdp`` command.

- ``resilient-fsdp local``: run the chart's job on this machine, one pod per simulated node.
- ``resilient-fsdp train``: run one trainer process directly (what each rank runs).
- ``resilient-fsdp config``: print the resolved configuration, or every key with ``--describe``.
- ``resilient-fsdp bench checkpoint``: checkpoint stall of every engine, torch DCP's included.
- ``resilient-fsdp bench recovery``: one fault recovered in-process, in-job and by a full relaunch.
- ``resilient-fsdp bench soak``: a fault a minute for ten minutes: goodput and exactness.
- ``resilient-fsdp bench campaign``: a long mixed schedule of faults, rewinds and resizes: what stays bounded.
- ``resilient-fsdp bench s3``: S3 upload and download throughput, managed transfer vs one stream.
- ``resilient-fsdp bench scale``: save planning, resume planning and start-up connections at 1,024 and 16,384 ranks.
- ``resilient-fsdp bench slow-and-silent``: what finding slow ranks and silent corruption costs, and how soon.
- ``resilient-fsdp data prepare``: text through a tokenizer into the token file a job trains on.
- ``resilient-fsdp checkpoints list|verify|export|pull|push``: local and S3 checkpoints, for
  operators, and the trained model out as a Hugging Face directory.
- ``resilient-fsdp render``: the Helm chart's manifests for some values files (no helm binary).
- ``resilient-fsdp validate``: render, lint, and check them against the Kubernetes and CRD schemas.
- ``resilient-fsdp advise``: checkpoint interval, timeouts and restart limits for a cluster size.
- ``resilient-fsdp report``: a run's timeline and goodput breakdown.
- ``resilient-fsdp simulate``: Monte Carlo goodput per cluster size and restart strategy.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional

from .config import ConfigError, describe, dump_yaml, load_config

def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML configuration file (overrides the defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set train.steps=50 (repeatable; applied last)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilient-fsdp", description="Fault-tolerant FSDP2 training with NVRx.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    local = sub.add_parser("local", help="run the chart's job on this machine: one pod per simulated node",
                           description="Render the Helm chart (values/dev-cpu.yaml unless -f) and run its pods on "
                                       "this machine: each a network namespace (root) or processes on loopback, "
                                       "running the rendered command, with the operator's variables and restart "
                                       "policy (docs/local-runs.md).")
    from .local.job import add_arguments as add_local_arguments

    add_local_arguments(local)

    train = sub.add_parser("train", help="run one trainer process (a world of one without a launcher)")
    train.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    train.add_argument("--inject", action="append", default=[], metavar="KIND@STEP[:rank=R]",
                       help="inject a fault once per job (repeatable)")
    _add_config_args(train)

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

    add_checkpoints(sub, _add_config_args)

    from .data.commands import add_parser as add_data_parser

    add_data_parser(sub)

    config = sub.add_parser("config", help="print the resolved configuration")
    config.add_argument("--describe", action="store_true", help="list every key with its default and meaning")
    _add_config_args(config)

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
    args = build_parser().parse_args(argv)
    from .checkpoint.commands import run as cmd_checkpoints

    handler = {"local": cmd_local, "train": cmd_train, "config": cmd_config,
               "bench": lambda a: a.bench(a), "checkpoints": cmd_checkpoints,
               "data": lambda a: a.run(a), "render": lambda a: a.run(a), "validate": lambda a: a.run(a),
               "advise": lambda a: a.run(a), "report": lambda a: a.run(a), "simulate": lambda a: a.run(a)}[args.command]
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
