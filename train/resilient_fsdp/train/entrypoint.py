"""The trainer every pod runs: ``python -m resilient_fsdp.train [--config FILE] [--set k=v]...``.

Launched by ``ft_launcher`` (or ``torchrun``) once per rank; without a launcher it is a world of
one. One process: the arguments, the configuration, one attempt at training (or several under
in-process restart), and the exit code of its ending, by
:data:`resilient_fsdp.resilience.exit_codes.TABLE`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from ..checkpoint.shared_volume import require_writable
from ..config import Config, check_collective_timeouts, describe
from ..resilience import exit_codes, faults, nccl_env
from ..resilience.deterministic import RepeatedFailure
from ..resilience.graceful_stop import StopRequested
from ..resilience.inprocess import InProcessAttempt, NotRetried, run_in_process
from ..resilience.non_finite import NonFiniteLoss
from ..resilience.sdc import SilentCorruption
from ..resilience.stragglers import StragglerReplaced
from . import distributed
from .arguments import parse_args, resolve_config
from .resources import ProcessResources
from .trainer import Trainer


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
        if failed:
            # First: peers blocked on this rank in a collective fail at once, rather than after
            # this rank has closed its checkpointer (a write in flight takes seconds).
            distributed.shutdown(clean=False)
        if trainer is not None:
            trainer.close(failed)
        if not failed:
            distributed.shutdown(clean=True)


def run(args: argparse.Namespace) -> dict:
    cfg = resolve_config(args)
    require_writable(Path(cfg.run_dir), "run_dir")
    nccl = distributed.uses_nccl(cfg.dist)
    if nccl:
        check_collective_timeouts(cfg)  # dist.device=auto on a GPU node: the loader could not tell
    # Before any process group: NCCL and torch read these when it is made.
    nccl_env.apply(cfg, nccl=nccl)
    resources = ProcessResources(cfg)
    failed = True
    try:
        if cfg.resilience.in_process.enabled:
            summary = run_in_process(cfg.resilience.in_process, lambda in_process: attempt(cfg, resources, in_process))
        else:
            summary = attempt(cfg, resources)
        failed = False
        return summary
    except StopRequested:
        failed = False
        raise
    finally:
        with resources.monitor.draining():  # its writes may still be finishing: the drain budget
            resources.close(failed)


@record
def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):  # argparse: bad flags, already explained on stderr
            exit_codes.report_configuration_failure(
                f"rank {os.environ.get('RANK', '0')}: invalid trainer arguments (the usage message is in its log)"
            )
        raise
    if args.describe_config:
        print(describe(), end="")
        return 0
    try:
        run(args)
        exit_codes.report_finished()
        faults.delay_exit()
    except NotRetried as exc:
        return configuration_failure(exc.error)
    except NonFiniteLoss as exc:
        return non_finite_loss(exc)
    except (StragglerReplaced, SilentCorruption) as exc:
        code = exit_codes.STRAGGLER_REPLACED if isinstance(exc, StragglerReplaced) else exit_codes.SILENT_CORRUPTION
        print(
            f"[resilient-fsdp] rank {os.environ.get('RANK', '0')}: {exc}; exiting {code} for the in-job restart",
            file=sys.stderr,
            flush=True,
        )
        return code
    except StopRequested as stop:
        return stop.exit_code
    except Exception as exc:
        if exit_codes.is_configuration_failure(exc):
            return configuration_failure(exc)
        raise
    finally:
        stop_helper_processes()
    return 0


def configuration_failure(exc: BaseException) -> int:
    """A failure no restart can fix: recorded for the launcher's root-cause report, reported to
    the node agent (which stops ft_launcher instead of letting it restart the rank), a clean
    message, and the fail-fast code."""
    get_error_handler().record_exception(exc)
    rank = os.environ.get("RANK", "0")
    message = f"error (rank {rank}): {exc}"
    if isinstance(exc, RepeatedFailure) and exc.__cause__ is not None:
        # The failure itself, as this attempt met it: where in the user's or the trainer's code.
        print(
            f"error (rank {rank}): the repeated failure's traceback:\n"
            + "".join(traceback.format_exception(exc.__cause__)).rstrip(),
            file=sys.stderr,
            flush=True,
        )
    print(message, file=sys.stderr, flush=True)
    exit_codes.report_configuration_failure(message)
    return exit_codes.CONFIG


def non_finite_loss(exc: NonFiniteLoss) -> int:
    """The job's first non-finite loss at a step: recorded for the launcher's root-cause report,
    and the code the in-job restart retries (the record is already on shared storage)."""
    get_error_handler().record_exception(exc)
    print(f"error (rank {os.environ.get('RANK', '0')}): {exc}", file=sys.stderr, flush=True)
    return exit_codes.NON_FINITE_LOSS


def stop_helper_processes() -> None:
    """End multiprocessing helpers still running when the rank exits (the manager NVRx's writer
    reports through, helpers left by in-process restarts): the interpreter would wait for them
    at exit. The checkpoint writer itself was closed before; these hold no data. They were
    started with SIGTERM blocked (see :class:`resilient_fsdp.checkpoint.writer.process.WriterProcess`), hence SIGKILL."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=2)
