"""The trainer every pod runs: ``python -m resilient_fsdp.train [--config FILE] [--set k=v]...``.

Launched by ``ft_launcher`` (or ``torchrun``) once per rank; without a launcher it is a world of
one. One process: the arguments, the configuration, one attempt at training (or several under
in-process restart), and the exit code the restart layers read (0 done, 2 a configuration error,
``resilience.stop_exit_code`` after a graceful stop).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from ..config import Config, ConfigError, describe, load_config, parse_faults
from ..resilience.graceful_stop import StopRequested
from ..resilience.inprocess import InProcessAttempt, run_in_process
from . import distributed
from .resources import ProcessResources
from .trainer import Trainer


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_fsdp.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML configuration file (overrides the defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set train.steps=50 (repeatable; applied last)")
    p.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@STEP[:rank=R|:node=N]",
                   help="inject a fault once per job (repeatable; adds to resilience.inject)")
    p.add_argument("--describe-config", action="store_true", help="print every config key and exit")
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(args.config, overrides)
    if args.inject:
        parse_faults(args.inject)  # names the bad --inject value
        cfg.resilience.inject = list(cfg.resilience.inject) + list(args.inject)
    return cfg


def attempt(cfg: Config, resources: ProcessResources, in_process: Optional[InProcessAttempt] = None) -> dict:
    """One attempt at the training function: build everything, resume, train. In-process restart
    calls it again after a fault; the process group and model are rebuilt each time."""
    trainer = None
    failed = True
    try:
        trainer = Trainer(cfg, resources, in_process)
        summary = trainer.train()
        failed = False
        return summary
    except StopRequested:
        failed = False  # a clean, checkpointed stop: tear down in order
        raise
    finally:
        if trainer is not None:
            trainer.close(failed)
        distributed.shutdown(clean=not failed)


def run(args: argparse.Namespace) -> dict:
    cfg = resolve_config(args)
    resources = ProcessResources(cfg)
    failed = True
    try:
        if cfg.resilience.in_process:
            summary = run_in_process(cfg.resilience, lambda in_process: attempt(cfg, resources, in_process))
        else:
            summary = attempt(cfg, resources)
        failed = False
        return summary
    except StopRequested:
        failed = False
        raise
    finally:
        resources.close(failed)


@record
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.describe_config:
        print(describe(), end="")
        return 0
    try:
        run(args)
    except ConfigError as exc:
        # Recorded for the launcher's root-cause report, then a clean message and a fail-fast code.
        get_error_handler().record_exception(exc)
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    except StopRequested as stop:
        return stop.exit_code
    finally:
        stop_helper_processes()
    return 0


def stop_helper_processes() -> None:
    """End multiprocessing helpers still running when the rank exits (the manager NVRx's writer
    reports through, helpers left by in-process restarts): the interpreter would wait for them
    at exit. The checkpoint writer itself was closed before; these hold no data. They were
    started with SIGTERM ignored (see :class:`ProcessResources`), hence SIGKILL."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=2)
