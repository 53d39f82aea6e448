"""The sections of the GPU check (:mod:`.check`), each run in its own process: the registry.

``python -m resilient_fsdp.bench.gpu.check --section NAME`` runs one: it writes its results to
``<work>/<NAME>.json`` as it goes (a section killed at its budget still reports what it measured)
and ends with ``status`` ``ok`` or ``error``. Sizes come from a :class:`Plan`: the GPU one
(``1b`` for throughput and checkpoints, ``125m`` for the restart and resume runs) or the tiny one
of the CPU rehearsal. Module level uses the standard library only; torch and the project's
trainer are imported inside the sections.
"""

from __future__ import annotations

import argparse
import shutil
import traceback
from typing import Callable

from .checkpoint import section_checkpoint
from .local_checkpoints import section_local_checkpoints
from .measure import section_environment, section_throughput
from .restarts import section_exact_resume, section_in_job, section_in_process
from .section import Section


SECTIONS: dict[str, Callable[[Section], None]] = {
    "environment": section_environment,
    "throughput": section_throughput,
    "checkpoint": section_checkpoint,
    "in_process": section_in_process,
    "in_job": section_in_job,
    "exact_resume": section_exact_resume,
    "local_checkpoints": section_local_checkpoints,
}


def run_child(args: argparse.Namespace) -> int:
    """Run the section ``args.section`` names; 0 when it finished, 1 when it failed."""
    s = Section(args.section, args)
    s.dir.mkdir(parents=True, exist_ok=True)
    status = 0
    try:
        SECTIONS[args.section](s)
        s.save("ok")
    except BaseException as exc:  # noqa: BLE001 - recorded for the report, then a non-zero exit
        s.save("error", error=f"{type(exc).__name__}: {exc}".strip()[:2000], traceback=traceback.format_exc())
        traceback.print_exc()
        status = 1
    finally:
        # Checkpoints are not reported, and on a GPU each run's weigh gigabytes: free the disk.
        for folder in sorted(s.dir.rglob("checkpoints"), reverse=True):
            shutil.rmtree(folder, ignore_errors=True)
        try:
            from ...train.entrypoint import stop_helper_processes

            stop_helper_processes()
        except Exception:  # noqa: BLE001 - cleanup only; the parent sweeps what is left
            pass
    return status
