"""The trainer's command line, ``[--config FILE] [--set k=v]... [--run-dir DIR] [--inject SPEC]...``,
and the configuration it resolves to.

Importable without torch: what must be set before torch loads is read from it
(:mod:`resilient_fsdp.resilience.nccl_env`), and the node agent reads the run directory from the
command it starts (:mod:`resilient_fsdp.resilience.metrics_endpoint`).
"""

from __future__ import annotations

import argparse
from typing import Optional

from ..config import Config, load_config, parse_faults
from ..config.loading import check_injected_faults

DESCRIPTION = "The trainer every pod runs: ``python -m resilient_fsdp.train [--config FILE] [--set k=v]...``."


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    """The trainer's flags; ``quiet``: no ``--help`` and errors raised, not printed."""
    p = argparse.ArgumentParser(
        prog="python -m resilient_fsdp.train", description=DESCRIPTION, add_help=not quiet, exit_on_error=not quiet
    )
    add_config_arguments(p)
    add_run_arguments(p)
    p.add_argument("--describe-config", action="store_true", help="print every config key and exit")
    return p


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--set``: the trainer's configuration, as every command that reads it takes it."""
    p.add_argument("--config", help="YAML configuration file (overrides the defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set train.steps=50 (repeatable; applied last)",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """``--run-dir`` and ``--inject``: where one trainer run writes, and the faults it injects."""
    p.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP[:rank=R|:node=N]",
        help="inject a fault once per job (repeatable; adds to resilience.inject)",
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def resolve_config(args: argparse.Namespace) -> Config:
    """Defaults < ``--config`` file < ``--set`` (``--run-dir`` last among them); ``--inject``
    adds to ``resilience.inject``."""
    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(args.config, overrides)
    if args.inject:
        parse_faults(args.inject)  # names the bad --inject value
        cfg.resilience.inject = list(cfg.resilience.inject) + list(args.inject)
        check_injected_faults(cfg)  # what the added faults act on is there
    return cfg
